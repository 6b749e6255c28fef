"""The step's activation peak: what a plan predicts, what its budget bounds, and an independent count of it.

The count is ``benchmarks/_peak.py``: a dispatch mode that sees every op of the forward, the backward and the
recompute, and adds up the storages made during the step that are alive after each op. It uses none of the
package's counters.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from lightning_ckpt.core.plan.planner import (LayerCost, Option, held_peak, make_plan, measure_step, plan_checkpointing,
                                         predict_peak, solve)
from lightning_ckpt import apply_checkpointing, remove_checkpointing
from lightning_ckpt.demos import Transformer
from helpers import counted_peak as step_peak

VOCAB, LENGTH, BATCH = 64, 64, 4


def gpt() -> Transformer:
    torch.manual_seed(0)
    return Transformer(VOCAB, LENGTH, n_layer=6, n_embd=64, n_head=4, dropout=0.1)


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))


def loss_of(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def counted_peak(layers: dict[str, str], kept_ops: dict[str, list[int]] | None = None) -> int:
    """The step's activation peak counted by ``_peak.py``, with ``layers`` checkpointed as planned."""
    model, idx = gpt(), batch()
    plan = make_plan(COSTS, OUTSIDE, 1.0)  # a plan object to apply: its choices are replaced below
    plan.layers, plan.kept_ops, plan.offloaded = layers, kept_ops or {}, []
    plan.apply(model)
    return step_peak(model, lambda: loss_of(model, idx))


_model = gpt()
_measured = measure_step(_model, lambda: loss_of(_model, batch()), modes=("full", "selective", "ops"))
COSTS, OUTSIDE, HEAD = _measured.costs, _measured.outside_bytes, _measured.head_bytes


@pytest.mark.parametrize("share", [0.05, 0.35, 0.7, 1.0])
def test_a_byte_budget_bounds_the_counted_peak_and_the_plan_predicts_it_within_2_percent(share):
    full = counted_peak({c.name: "full" for c in COSTS})
    none = counted_peak({c.name: "none" for c in COSTS})
    budget = int(full + share * (none - full))
    plan = make_plan(COSTS, OUTSIDE, budget, head_bytes=HEAD)
    counted = counted_peak(plan.layers, plan.kept_ops)
    assert counted <= budget, (share, counted, budget)
    assert plan.peak_bytes == pytest.approx(counted, rel=0.02)
    assert plan.planned_bytes < plan.peak_bytes  # the backward, not the end of the forward, is the peak here


def test_full_checkpointing_peaks_in_the_last_layer_s_backward_not_at_the_end_of_the_forward():
    full = counted_peak({c.name: "full" for c in COSTS})
    held = OUTSIDE + sum(c.full_bytes for c in COSTS)
    # The last layer's backward: the embeddings' bytes, the first five layers' inputs, and the last layer's backward.
    by_hand = (OUTSIDE - HEAD) + sum(c.full_bytes for c in COSTS[:-1]) + COSTS[-1].transient_bytes
    assert full > 2 * held
    assert by_hand == pytest.approx(full, rel=0.01)


def test_plan_checkpointing_bounds_the_peak_and_a_fraction_is_of_the_peak_without_checkpointing():
    model = gpt()
    plan = plan_checkpointing(model, lambda: loss_of(model, batch()), 0.5)
    none = counted_peak({c.name: "none" for c in COSTS})
    assert plan.baseline_peak_bytes == pytest.approx(none, rel=0.02)
    assert plan.budget_bytes == int(0.5 * plan.baseline_peak_bytes)
    assert counted_peak(plan.layers, plan.kept_ops) <= plan.budget_bytes


def _brute_force(options, need, transients):
    allowed = sum(o[0].device_bytes for o in options) - need
    fits = [c for c in itertools.product(*options)
            if held_peak([o.device_bytes for o in c], transients) <= allowed]
    return min((sum(o.flops for o in c) for c in fits), default=None)


def test_solve_with_the_backward_s_bounds_is_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(300):
        options = []
        for _ in range(4):
            none = rng.randint(50, 200)
            options.append([Option("none", none, 0)] + [Option("full", rng.randint(0, none - 1), rng.randint(1, 100))
                                                        for _ in range(2)])
        transients = [o[0].device_bytes + rng.randint(0, 150) for o in options]
        need = rng.randint(-50, 500)
        best = _brute_force(options, need, transients)
        try:
            chosen = solve(options, need, transients=transients)
        except ValueError:
            assert best is None
            continue
        assert best is not None
        assert held_peak([o.device_bytes for o in chosen], transients) <= sum(o[0].device_bytes for o in options) - need
        assert sum(o.flops for o in chosen) == best


def test_the_refusal_names_the_layer_whose_backward_sets_the_floor():
    a = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0, full_flops=50,
                  selective_flops=5)
    wide = LayerCost("wide", "Block", none_bytes=1000, full_bytes=10, selective_bytes=400, offloadable_bytes=0,
                     full_flops=500, selective_flops=50, transient_bytes=1500)
    c = LayerCost("c", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0, full_flops=50,
                  selective_flops=5)
    # Without checkpointing: the backward of `wide` has 1500 B alive while `a` holds 100 B: 1600 B.
    # At least: `a` holds its 10 B input: 1510 B.
    with pytest.raises(ValueError) as err:
        make_plan([a, wide, c], 0, 0.9)
    text = str(err.value)
    assert "at most 1.4 KiB (90.0% of the 1.6 KiB peak without checkpointing)" in text
    assert "the least reachable is 1.5 KiB (94.4%)" in text
    assert "the backward of `wide` sets that floor: it has 1.5 KiB alive at once" in text
    assert "pass a budget of at least 0.944 (or 1510 bytes)" in text
    plan = make_plan([a, wide, c], 0, 1510)
    assert plan.layers == {"a": "full", "wide": "none", "c": "none"}
    assert plan.peak_bytes == 1510


# ------------------------------------------------------------------------------ models nobody here wrote
# Small configs (no downloads) that still show what each family shares between layers: Transformers' Llama with a
# padding mask (a 4-D mask and rotary cos/sin every layer takes), with PEFT LoRA (frozen embeddings), litgpt (cos/sin
# from buffers), and a ResNet-style BatchNorm CNN (each block's last ReLU saves its output, the next block's input).
R_VOCAB, R_LEN, R_BATCH = 128, 128, 4


def _ids(length: int = R_LEN) -> torch.Tensor:
    return torch.randint(0, R_VOCAB, (R_BATCH, length), generator=torch.Generator().manual_seed(2))


def _llama(peft_lora: bool = False, layers: int = 4, length: int = R_LEN):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=R_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                                      use_cache=False)  # as checkpointing trains: a cache would hold k and v
    model = transformers.LlamaForCausalLM(config).train()
    if peft_lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False)).train()
    ids, mask = _ids(length), torch.ones(R_BATCH, length, dtype=torch.long)
    mask[1, 100:] = 0  # padding: the attention mask is a 4-D tensor every layer takes
    mask[3, 60:] = 0
    return model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss, None


def _litgpt():
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=4, n_embd=64, n_head=4, n_query_groups=2, block_size=R_LEN, vocab_size=R_VOCAB,
                           padded_vocab_size=R_VOCAB, bias=False)
    model, ids = litgpt.GPT(config).train(), _ids()
    return model, lambda: F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()), None


def _demo_gpt():
    model, idx = gpt(), batch()
    return model, lambda: loss_of(model, idx), None


class ResBlock(torch.nn.Module):
    """conv, BatchNorm, ReLU, conv, BatchNorm, add the input, ReLU: the last ReLU saves the output the next block
    takes (and its first conv saves)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _resnet():
    torch.manual_seed(0)
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    body = torch.nn.Sequential(*[ResBlock(8) for _ in range(6)])
    model = torch.nn.Sequential(stem, body, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    model.train()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    return model, lambda: F.cross_entropy(model(x), y), ResBlock


REAL = {"llama": lambda: _llama(), "peft lora": lambda: _llama(peft_lora=True), "litgpt": _litgpt,
        "demo gpt": _demo_gpt, "batchnorm resnet": _resnet}
REAL_CASES = [(name, "full", None) for name in REAL] + [(name, "none", None) for name in REAL] + [
    ("llama", "full", "fp8"), ("peft lora", "full", "fp8")]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name, mode, compress", REAL_CASES)
def test_the_predicted_peak_of_real_models_is_within_5_percent_of_the_counted_one(name, mode, compress):
    """Every layer fully checkpointed (exact or fp8) or none: the predicted step peak against the live storages
    counted, activation gradients included. Before each storage was counted once, the Llama's mask and cos/sin were
    counted once per layer (+6.6% exact, +7.9% fp8, PEFT +7.3% and +8.9% at full checkpointing) and the ResNet's
    block outputs twice (+22.8% without checkpointing, +10.5% with)."""
    model, loss_fn, layer_cls = REAL[name]()
    measured = measure_step(model, loss_fn, layer_cls=layer_cls, modes=("full",))
    costs = [c.compressed(compress) for c in measured.costs]
    choices = {c.name: mode for c in costs}
    predicted = predict_peak(costs, measured.outside_bytes, choices, head_bytes=measured.head_bytes,
                             head_peak_bytes=measured.head_peak_bytes)
    plan = make_plan(measured.costs, measured.outside_bytes, 1.0, modes=("full",), compress=compress)
    plan.layers, plan.kept_ops, plan.offloaded = choices, {}, []
    plan.apply(model)
    torch.manual_seed(0)
    counted = step_peak(model, loss_fn)
    assert predicted == pytest.approx(counted, rel=0.05), (predicted, counted)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_llama_s_measuring_step_holds_its_layers_inputs_and_more_so_no_outside_warning():
    """The callback warns that the bytes outside the layers could not be measured where the step held less than the
    layers' inputs: on a Llama, whose layers share the mask and cos/sin, it did with no other hooks (issue 31). Each
    storage counted once, the step holds its layers' inputs and the embeddings' and head's bytes besides."""
    from lightning_ckpt.core.checkpoint.selection import layer_classes, select_layers
    from lightning_ckpt.core.measure.layer_costs import LayerCostRecorder, _fully_checkpointed
    from lightning_ckpt.core.plan.budget import RankMeasurement

    model, loss_fn, _ = _llama(layers=6, length=256)  # 5 extra masks of 256 KiB: more than the head's bytes
    selected = select_layers(model, layer_classes(model, None))
    with _fully_checkpointed(model, selected), LayerCostRecorder(model, selected) as recorder:
        loss = loss_fn()
        recorder.measure_head(loss)
        del loss
    costs = recorder.costs()
    measured = RankMeasurement.from_held_bytes(costs, recorder.held_bytes, recorder.head_bytes, recorder.head_peak_bytes)
    assert recorder.held_bytes >= measured.layer_bytes  # the warning's condition is false
    # The mask (4 x 1 x 256 x 256 bool) and cos, sin (4 x 256 x 16 float32 each) once: in the bytes outside.
    assert measured.outside_bytes >= 4 * 256 * 256 + 2 * 4 * 256 * 16 * 4
    # Each layer holds its hidden-state input (4 x 256 x 64 float32) only: the mask, cos, sin and positions are shared.
    assert [c.full_bytes for c in costs] == [4 * 256 * 64 * 4] * 6


def _measuring_step_peak(model, loss_fn, layer_cls, compress=None) -> int:
    """The counted peak of a measuring step as the callback runs it: every layer fully checkpointed (its inputs held
    under ``compress``), each re-run and backpropagated by the recorder inside the forward, the head's backward
    measured, then the step's backward."""
    from lightning_ckpt.core.checkpoint.selection import layer_classes, select_layers
    from lightning_ckpt.core.measure.layer_costs import LayerCostRecorder
    from helpers import LiveStorages, grad_storages

    selected = select_layers(model, layer_classes(model, layer_cls))
    apply_checkpointing(model, layer_cls=layer_cls, compress=compress)
    model.zero_grad(set_to_none=True)
    with LiveStorages() as live:
        with LayerCostRecorder(model, selected, selective=True) as recorder:
            loss = loss_fn()
            recorder.measure_head(loss)
        loss.backward()
        del loss
    peak = live.peak(exclude=grad_storages(model))
    model.zero_grad(set_to_none=True)
    remove_checkpointing(model)
    return peak


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name, compress", [("llama", None), ("peft lora", None), ("litgpt", None), ("demo gpt", None),
                                            ("llama", "fp8"), ("peft lora", "fp8")])
def test_a_measuring_step_peaks_at_most_2_percent_over_plain_full_checkpointing(name, compress):
    """Issue 29 item 6. Each layer was re-run after its own forward, so the layer's output was alive beside the
    re-run, and the re-run held its own output through its backward: 7.0% (Llama), 7.7% (PEFT LoRA) and 8.3% (litgpt)
    over full checkpointing's peak here (the issue's 6-layer 256-hidden Llama at 4 x 512: 73.55 against 69.55 MiB;
    with fp8 85.6 against 76.6 MiB). Now the re-run comes before the layer's forward and drops its output before its
    backward.

    With ``compress="fp8"`` the measuring step holds the layers' inputs as fp8, as full checkpointing with fp8 does,
    but Transformers' forward keeps the embeddings' output (the first layer's input) in a local until it returns: alive
    through every re-run, gone by the backward, where full checkpointing peaks. Exact, the first layer holds that very
    tensor anyway; under fp8 it holds an fp8 copy, so the measuring step peaks higher by the exact input less its copy,
    by hand 4 x 128 x 64 x 4 B - (4 x 128 x 64 B + 512 rows x 2 B of scales) = 97,280 B (+2.8% Llama, +3.1% PEFT).
    That is the bound asserted; the docs say so."""
    model, loss_fn, layer_cls = REAL[name]()
    torch.manual_seed(0)
    measuring = _measuring_step_peak(model, loss_fn, layer_cls, compress)
    apply_checkpointing(model, layer_cls=layer_cls, compress=compress)
    torch.manual_seed(0)
    full = step_peak(model, loss_fn)
    kept_local = 0 if compress is None else R_BATCH * R_LEN * 64 * 4 - (R_BATCH * R_LEN * 64 + R_BATCH * R_LEN * 2)
    assert measuring <= max(1.02 * full, full + kept_local), (measuring, full, measuring / full)
