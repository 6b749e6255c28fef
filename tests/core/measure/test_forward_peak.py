"""Issue 42, item 1: a layer that keeps outputs (selective or op-level checkpointing) can peak in its forward.

On the CPU, SDPA with dropout runs its math path op by op (``bmm``, ``_safe_softmax``, a Bernoulli mask, ``bmm``), and
selective checkpointing keeps the scores' ``bmm`` (batch x heads x length x length): inside the layer's forward they
are alive next to the softmax, the mask and the dropped probabilities, more than the layer's backward ever has. The
recorder measures that forward (``LayerCost.selective_forward_bytes``, and per op when its outputs are freed, for
op-level choices), and plans bound it. Peaks are counted by ``benchmarks/_peak.py`` (no package counter).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from helpers import StepPeaks, counted_peak
from lightning_ckpt import GradientCheckpointing, apply_checkpointing
from lightning_ckpt.core.plan.planner import make_option, make_plan, measure_step, predict_peak

transformers = pytest.importorskip("transformers")

VOCAB, LONGEST, BATCH = 512, 256, 2
# Short first, the longest mid-run (planned before the first step, max_length), lengths that come back.
LENGTHS = [48, 256, 96, 200, 256, 64, 160, 256]


# --------------------------------------------------------------------------------------------- by hand


class Chain(nn.Module):
    """``((x @ w).exp() * 2) @ w2`` in one expression: no local keeps an intermediate alive."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.w2 = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.w).exp() * 2) @ self.w2


def test_a_layer_s_forward_peak_keeping_outputs_is_counted_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(Chain(), Chain())
    x = torch.randn(4, 8, requires_grad=True)
    cost = measure_step(model, lambda: model(x).sum(), layer_cls=Chain).costs[1]
    # Ops (float32, 4 rows): mm 4x16 = 256 B, exp 256 B, mul 256 B, mm 4x8 = 128 B; the input 128 B. Selective keeps
    # both mm outputs: while the mul runs, the first mm's (kept), the exp's (its input) and the mul's are alive.
    assert [(r.op, r.bytes, r.freed) for r in cost.ops] == [("aten.mm.default", 256, 2), ("aten.exp.default", 256, 3),
                                                            ("aten.mul.Tensor", 256, 4), ("aten.mm.default", 128, 4)]
    assert cost.selective_forward_bytes == 128 + 256 + 256 + 256
    # Keeping the mul's output instead: the first mm's is freed once the exp ran; at most exp's and mul's alive.
    assert cost.forward_bytes("ops", [2]) == 128 + 256 + 256
    assert cost.forward_bytes("full") is None and cost.forward_bytes("none") is None
    # What the plan adds to the layer's backward bound where its forward peaks higher (not here: 1,032 B backward).
    assert cost.backward_peak == 1032
    assert make_option(cost, "selective").backward_extra == cost.exact_input_bytes == 128


# --------------------------------------------------------------------------------------------- GPTNeoX, SDPA, dropout


def neox() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=LONGEST, attention_dropout=0.1,
                                        hidden_dropout=0.1, use_cache=False, attn_implementation="sdpa")
    return transformers.GPTNeoXForCausalLM(config).train()


def padded(length: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded batch: the second row's last third is padding (its labels -100)."""
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, length - length // 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def counted(layers: dict[str, str], kept_ops: dict[str, list[int]], batch: dict[str, torch.Tensor],
            compress: str | None = None) -> int:
    """The counted peak of one step of ``batch`` with ``layers`` checkpointed so."""
    model = neox()
    plan = make_plan(COSTS, OUTSIDE, 1.0)  # an object to apply: its choices are replaced below
    plan.layers, plan.kept_ops, plan.offloaded, plan.compress = layers, kept_ops, [], compress
    plan.apply(model)
    torch.manual_seed(0)
    return counted_peak(model, lambda: model(**batch).loss)


BATCH_256 = padded(LONGEST, seed=0)
_model = neox()
# priced by FLOPs: the op-level choices these tests are about; by this CPU's times full checkpointing wins outright
_measured = measure_step(_model, lambda: _model(**BATCH_256).loss, modes=("full", "selective", "ops"),
                         time_layers=False)
COSTS, OUTSIDE = _measured.costs, _measured.outside_bytes
HEAD = dict(head_bytes=_measured.head_bytes, head_peak_bytes=_measured.head_peak_bytes)
SELECTIVE = {c.name: "selective" for c in COSTS}


def test_every_layer_selective_with_sdpa_dropout_is_predicted_from_its_forward_peak():
    predicted = predict_peak(COSTS, OUTSIDE, SELECTIVE, **HEAD)
    count = counted(SELECTIVE, {}, BATCH_256)
    # Before: 19,679,240 B predicted against 20,195,328 B counted (2.6% short: the forward's peak was not counted).
    assert count <= predicted <= count + 8192, (predicted, count)
    assert all(c.selective_forward_bytes > c.backward_peak + c.exact_input_bytes for c in COSTS)


@pytest.mark.parametrize("share", [0.35, 0.65])
def test_op_level_plans_with_sdpa_dropout_hold_their_budget(share):
    full = counted({c.name: "full" for c in COSTS}, {}, BATCH_256)
    budget = int(full + share * (counted(SELECTIVE, {}, BATCH_256) - full))
    plan = make_plan(COSTS, OUTSIDE, budget, modes=("full", "selective", "ops"), **HEAD)
    assert "ops" in plan.layers.values()
    count = counted(plan.layers, plan.kept_ops, BATCH_256)
    # Before: op-level layers kept the scores and peaked 1.7-2.1% over their prediction, and their budget.
    assert count <= plan.peak_bytes <= budget, (count, plan.peak_bytes, budget)


class NeoX(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = neox()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit_peaks(callback: GradientCheckpointing, data: list) -> list[int]:
    peaks = StepPeaks()
    trainer = Trainer(max_steps=len(data), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, peaks])
    trainer.fit(NeoX(), DataLoader(data, batch_size=None))
    assert len(peaks.peaks) == len(data)
    return peaks.peaks


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("compress", [None, "fp8"])
def test_a_gptneox_budget_run_with_sdpa_dropout_and_padded_batches_holds_every_step(compress):
    # Just under every layer selective as counted, over it as the recorder had it: before, every step at length 256
    # peaked 1.0101x this budget (20,195,328 B) under 4 selective layers.
    budget = int(0.99 * counted(SELECTIVE, {}, BATCH_256))
    callback = GradientCheckpointing(memory_budget=budget, max_length=LONGEST, compress=compress)
    peaks = fit_peaks(callback, [padded(length, seed=i) for i, length in enumerate(LENGTHS)])
    longest = callback.plans[max(callback.plans)]
    assert "selective" in longest.layers.values() and longest.compress == compress
    over = [(length, peak, f"{peak / budget:.4f}x") for length, peak in zip(LENGTHS, peaks) if peak > budget]
    assert not over, (budget, over)
    assert max(peaks) >= 0.9 * budget  # the plan spends what it is given
