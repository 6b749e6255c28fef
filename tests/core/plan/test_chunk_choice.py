"""The callback with ``chunk_loss=None`` and a budget lets the plan choose the chunked LM head + loss (issue 32):
one measuring step (the head chunked in it), the unchunked head priced apart on fake tensors; a budget only the
chunked head reaches is held on every step (``benchmarks/_peak.py``'s count); a loose one keeps the head as the
model computes it; both train as the unchunked run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

import helpers
from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.chunked_loss import DEFAULT_CHUNK_TOKENS, chunk_causal_lm_loss, chunk_loss_of
from lightning_ckpt.demos import GPT

VOCAB, WIDTH, LENGTH, BATCH, STEPS = 2048, 32, 64, 32, 3  # 2048 tokens: two chunks of 1024


class StepPeaks(helpers.StepPeaks):
    """Each step's activation peak, forward through backward, counted by ``_peak.py``; and the chunk it ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[int | None] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.chunks.append(chunk_loss_of(pl_module.model))
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class OwnLoss(GPT):
    """The loss computed by the step from the logits, as litgpt's own scripts do: chunking the model's loss changes
    nothing of it."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return torch.nn.functional.cross_entropy(self(idx).flatten(0, 1), targets.flatten())


def fit(*callbacks, lengths: tuple[int, ...] = (LENGTH,) * STEPS, model_cls: type[GPT] = GPT) -> GPT:
    seed_everything(0)
    model = model_cls(vocab_size=VOCAB, block_size=LENGTH, n_layer=4, n_embd=WIDTH, n_head=2, dropout=0.0)
    data = torch.randint(0, VOCAB, (len(lengths), BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    batches = [(seq[:, :length], seq[:, 1:length + 1]) for seq, length in zip(data, lengths)]
    trainer = Trainer(max_steps=len(lengths), accelerator="cpu", devices=1, callbacks=list(callbacks), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return model


@pytest.fixture(scope="module")
def reference() -> tuple[GPT, StepPeaks, StepPeaks]:
    """The plain run; and every layer fully checkpointed, unchunked and chunked, with their counted peaks."""
    full, chunked = StepPeaks(), StepPeaks()
    fit(GradientCheckpointing(), full)
    fit(GradientCheckpointing(chunk_loss=True), chunked)
    return fit(), full, chunked


def assert_trains_the_same(model: GPT, reference: GPT) -> None:
    # The chunked loss sums its chunks in another order: fp32 rounding, which AdamW (lr 3e-3) turns into steps of up
    # to 1e-5 on gradients near 0 (attention's key bias); 2e-5 is under 1% of one step. A dropped chunk moves 1e-3.
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5, msg=name)


def test_a_budget_only_the_chunked_head_reaches_is_held_on_every_step(reference):
    plain, full, chunked = reference
    least_unchunked, least_chunked = max(full.peaks), max(chunked.peaks)
    assert least_chunked < least_unchunked * 0.7  # the logits, 2048 x 2048 fp32, gone from the forward and backward
    budget = (least_chunked + least_unchunked) // 2
    with pytest.raises(ValueError, match="least reachable"):
        fit(GradientCheckpointing(memory_budget=budget, chunk_loss=False))
    callback, peaks = GradientCheckpointing(memory_budget=budget), StepPeaks()
    model = fit(callback, peaks)
    assert callback.plan.chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert peaks.chunks == [DEFAULT_CHUNK_TOKENS] * STEPS  # measuring step chunked, then the plan's
    print(f"full {least_unchunked} B, chunked {least_chunked} B, budget {budget} B, counted {peaks.peaks},"
          f" planned {callback.plan.peak_bytes} B")
    assert max(peaks.peaks) <= budget, (peaks.peaks, budget)
    assert peaks.peaks[0] <= least_chunked  # the measuring step: no more than full checkpointing with the head chunked
    assert callback.plan.peak_bytes == pytest.approx(max(peaks.peaks[1:]), rel=0.05)
    assert chunk_loss_of(model.model) is None  # undone at teardown
    assert_trains_the_same(model, plain)


def test_a_step_that_computes_its_loss_itself_is_not_offered_the_chunked_head(reference):
    """Its head runs outside lm_loss: the budget only the chunked head reaches is refused, before the first step too.
    The callback took the head's call for a chunked one, priced chunks from a step that ran the head whole and
    planned chunks of 512 that changed nothing: litgpt's own loss peaked at 1.26-1.64x such budgets."""
    _, full, chunked = reference
    budget = (max(chunked.peaks) + max(full.peaks)) // 2
    for lengths in ((LENGTH,) * STEPS, (32, LENGTH, 48)):  # the first batch the longest, or planned before it
        with pytest.raises(ValueError, match="least reachable"):
            fit(GradientCheckpointing(memory_budget=budget), lengths=lengths, model_cls=OwnLoss)
    loose = int(1.02 * max(full.peaks))  # a budget the whole head reaches (2% for the prediction): held, no chunk
    callback, peaks = GradientCheckpointing(memory_budget=loose), StepPeaks()
    fit(callback, peaks, model_cls=OwnLoss)
    assert callback.plan.chunk_tokens is None and max(peaks.peaks) <= loose


def test_the_head_count_sees_each_head_computed_once_inside_lm_loss_on_a_transformers_model():
    """Transformers' forward calls its head once more, swapped to hand the hidden states through: that call is not a
    head computed (it was counted: two calls, twice the tokens). Called without labels, the head runs outside
    lm_loss: not counted."""
    transformers = pytest.importorskip("transformers")
    from lightning_ckpt.core.plan.planner import HeadCount

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    chunk_causal_lm_loss(model, 1024)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with HeadCount(model) as count:
        model(input_ids=ids, labels=ids)
    assert (count.calls, count.tokens, count.flops) == (1, 128, 2 * 128 * WIDTH * VOCAB)
    with HeadCount(model) as count:
        model(input_ids=ids)
    assert (count.calls, count.tokens) == (0, 0)


def test_a_budget_only_the_chunked_head_reaches_at_the_longest_length_is_accepted_before_the_first_step(reference):
    """The first batch shorter than the model's 64 positions: the longest batch is planned on fake tensors before it,
    with the head chunked and the unchunked head priced apart, as a measuring step does. It was planned unchunked
    only, and this budget was refused before the first step ("least reachable is 49.5 MiB")."""
    _, full, chunked = reference
    budget = (max(chunked.peaks) + max(full.peaks)) // 2
    callback, peaks = GradientCheckpointing(memory_budget=budget), StepPeaks()
    fit(callback, peaks, lengths=(32, LENGTH, 48))
    assert callback.plans[BATCH * LENGTH].chunk_tokens == DEFAULT_CHUNK_TOKENS  # planned before the first step
    assert callback.driver.cycle.measured_steps == 2  # the fake step at 64, the real one at 32; 48 runs 64's plan
    assert peaks.chunks == [DEFAULT_CHUNK_TOKENS] * 3
    assert max(peaks.peaks) <= budget, (peaks.peaks, budget)
    # chunk_loss=True: the longest batch is measured with the head chunked, as the run computes it (it was measured
    # whole, and this budget refused before the first step)
    forced, forced_peaks = GradientCheckpointing(memory_budget=budget, chunk_loss=True), StepPeaks()
    fit(forced, forced_peaks, lengths=(32, LENGTH, 48))
    assert forced_peaks.chunks == [DEFAULT_CHUNK_TOKENS] * 3 and max(forced_peaks.peaks) <= budget


class ChunkAt(Callback):
    """The LM head and loss in chunks of ``tokens`` from each batch on (after the checkpointing callback's own)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        chunk_causal_lm_loss(pl_module.model, self.tokens)


def test_a_budget_only_smaller_chunks_reach_takes_the_largest_chunk_that_fits(reference):
    """Every layer fully checkpointed peaks at 27.2 MB with chunks of 1024 tokens, 14.7 MB with 512, 8.4 MB with 256
    (the logits' chunk and its gradients halve). A budget between 256's and 1024's: the plan halves the chunk while
    the budget is missed, as `plan_checkpointing` does, and takes 512, priced from the measuring step (run in chunks of
    1024) and the head alone on fake tensors. It was refused (the callback tried 1024 only). The measuring step itself
    holds what chunks of 1024 do: over such a budget, as documented (offload's measuring step is alike)."""
    plain = reference[0]
    least = {}
    for tokens in (1024, 512, 256):
        peaks = StepPeaks()
        fit(GradientCheckpointing(), ChunkAt(tokens), peaks)
        least[tokens] = max(peaks.peaks)
    assert least[256] < least[512] < least[1024]
    budget = (least[256] + least[1024]) // 2
    assert least[512] < budget
    callback, peaks = GradientCheckpointing(memory_budget=budget), StepPeaks()
    model = fit(callback, peaks)
    assert callback.plan.chunk_tokens == 512 and peaks.chunks == [DEFAULT_CHUNK_TOKENS, 512, 512]
    assert max(peaks.peaks[1:]) <= budget, (peaks.peaks, budget)
    assert peaks.peaks[0] <= least[1024]  # the measuring step holds no more than chunks of 1024 do
    assert callback.plan.peak_bytes == pytest.approx(max(peaks.peaks[1:]), rel=0.05)
    assert_trains_the_same(model, plain)


def test_another_chunk_s_head_is_priced_from_the_measured_one_with_its_own_calls():
    """The measuring step ran 512 tokens in chunks of 256 (two calls; its head's backward peak, here 5,000 B). At
    1024 the 512 tokens are one chunk: the head and loss alone peak at three 512 x 2048 fp32 tensors (the logits,
    their log-softmax and its gradient) + the 4-byte loss, against three 256 x 2048 and the hidden chunk's gradient
    (256 x 32 fp32) at 256, by hand; and one call makes no weight gradient to add into ``.grad``, where two add one
    copy of the head's weight and bias ((2048 x 32 + 2048) x 4 B)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_ckpt.core.plan.budget_driver import _chunked_head, _HeadRun
    from lightning_ckpt.core.plan.budget import RankMeasurement
    from lightning_ckpt.core.plan.planner import HeadCount

    model = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=1, n_embd=WIDTH, n_head=2, dropout=0.0)
    chunk_causal_lm_loss(model, 256)
    ids = torch.randint(0, VOCAB, (8, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    with HeadCount(model) as count:
        model(ids[:, :-1], ids[:, 1:])
    assert (count.calls, count.tokens) == (2, 512)
    run = _HeadRun(RankMeasurement([], 1000, 100, 5000), count, 256)
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    one_chunk, two_chunks = 3 * 512 * VOCAB * 4 + 4, 3 * 256 * VOCAB * 4 + 256 * WIDTH * 4 + 4
    weight_grads = (VOCAB * WIDTH + VOCAB) * 4
    at_1024 = _chunked_head(strategy, run, 1024)
    assert (at_1024.chunks, at_1024.head_peak_bytes) == (1, 5000 + one_chunk - two_chunks)
    at_256 = _chunked_head(strategy, run, 256)
    assert (at_256.chunks, at_256.head_peak_bytes) == (2, 5000 + weight_grads)
    assert at_1024.flops == at_256.flops == 2 * 512 * WIDTH * VOCAB  # the head's forward, run again either way


def test_a_loose_budget_keeps_the_head_as_the_model_computes_it(reference):
    plain = reference[0]
    callback, peaks = GradientCheckpointing(memory_budget=1.0), StepPeaks()
    model = fit(callback, peaks)
    assert callback.plan.chunk_tokens is None and set(callback.plan.layers.values()) == {"none"}
    assert peaks.chunks == [DEFAULT_CHUNK_TOKENS, None, None]  # only the measuring step ran chunked
    assert_trains_the_same(model, plain)
