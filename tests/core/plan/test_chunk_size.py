"""The planner picks the chunk size of the chunked LM head + loss (issue 32): the largest chunk whose plan fits the
budget, a smaller one measured only when the larger misses; the head's bytes per chunk token against a count by
hand; a chunk's launches priced on a device profile."""

from __future__ import annotations

import pytest
import torch

from helpers import counted_peak
from lightning_ckpt import plan_checkpointing
from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss, chunk_loss_of
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan import planner
from lightning_ckpt.core.plan.planner import ChunkedHead, make_plan, measure_chunked_head
from lightning_ckpt.demos import Transformer

VOCAB, WIDTH, LENGTH, BATCH = 2048, 32, 64, 16
TOKENS = BATCH * LENGTH  # 1024
IDX = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))


def gpt(chunk=None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(VOCAB, LENGTH, n_layer=4, n_embd=WIDTH, n_head=4, dropout=0.0)
    if chunk is not None:
        chunk_causal_lm_loss(model, chunk)
    return model


def step(model: Transformer):
    return lambda: model(IDX[:, :-1], IDX[:, 1:])


def test_the_heads_peak_grows_by_its_bytes_per_chunk_token_counted_by_hand():
    # The backward of the first chunk (the last one run) holds three fp32 [chunk, vocab] tensors at once: the
    # log-softmax's output, its gradient and the logits' gradient; the other chunks' hidden-state gradients, fp32
    # [tokens - chunk, width], wait for the split's backward. So each token more in a chunk: 3 x 4 x vocab - 4 x width.
    per_token = 3 * 4 * VOCAB - 4 * WIDTH
    assert per_token == 24448
    model = gpt()
    peaks = {c: measure_chunked_head(model, step(model), None, ("full",), c)[1] for c in (128, 256, 512)}
    assert peaks[256].head_peak_bytes - peaks[128].head_peak_bytes == 128 * per_token
    assert peaks[512].head_peak_bytes - peaks[256].head_peak_bytes == 256 * per_token
    assert [(h.chunks, h.tokens) for h in peaks.values()] == [(8, TOKENS), (4, TOKENS), (2, TOKENS)]


@pytest.fixture
def smallest_128(monkeypatch):
    monkeypatch.setattr(planner, "MIN_CHUNK_TOKENS", 128)


def planned(budget, chunk_loss=None, chunk=512, calls=None):
    model = gpt(chunk)
    if calls is not None:
        original = planner.measure_chunked_head

        def counting(module, step_, layer_cls, modes, size, *rest):
            calls.append(size)
            return original(module, step_, layer_cls, modes, size, *rest)

        planner.measure_chunked_head = counting
    try:
        plan = plan_checkpointing(model, step(model), budget, chunk_loss=chunk_loss, tile_mlp=False)  # chunks alone
    finally:
        if calls is not None:
            planner.measure_chunked_head = original
    assert chunk_loss_of(model) == chunk  # left as it was
    return plan


@pytest.mark.usefixtures("smallest_128")
@pytest.mark.parametrize("chunk_loss", [None, True])
def test_a_budget_only_a_smaller_chunk_reaches_gets_the_largest_that_fits_and_the_count_holds_it(chunk_loss):
    budget = 8 * 2**20  # every layer checkpointed: 13.1 MiB at 512 tokens a chunk, 7.1 MiB at 256, 4.1 MiB at 128
    calls: list[int] = []
    plan = planned(budget, chunk_loss, calls=calls)
    assert plan.chunk_tokens == 256 and calls == [512, 256]  # 128 never measured
    model = gpt()
    plan.apply(model)
    seen = counted_peak(model, step(model))
    assert plan.peak_bytes <= budget and seen <= budget
    assert seen == pytest.approx(plan.peak_bytes, rel=0.05)


@pytest.mark.usefixtures("smallest_128")
def test_a_budget_the_largest_chunk_meets_keeps_it_and_measures_no_other():
    calls: list[int] = []
    plan = planned(15 * 2**20, True, calls=calls)
    assert plan.chunk_tokens == 512 and calls == [512]


@pytest.mark.usefixtures("smallest_128")
def test_out_of_reach_at_every_chunk_size_names_the_smallest():
    calls: list[int] = []
    with pytest.raises(ValueError, match=r"(?s)least reachable is 4\.1 MiB.*128 tokens a chunk"):
        planned(2 * 2**20, None, calls=calls)
    assert calls == [512, 256, 128]


def test_chunks_of_every_token_are_measured_once():
    calls: list[int] = []
    with pytest.raises(ValueError, match="tokens a chunk"):
        planned(2 * 2**20, None, chunk=4096, calls=calls)  # 4096, 2048: one chunk of the 1024 tokens; then 512, 256
    assert calls == [4096, 512, 256]


def test_more_chunks_cost_their_launches_on_a_profile():
    profile = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e10, op_overhead=1e-5)
    few, many = ChunkedHead(512, 0, 0, 0, 10**9, chunks=2), ChunkedHead(128, 0, 0, 0, 10**9, chunks=8)
    assert many.seconds(profile) - few.seconds(profile) == pytest.approx(6 * planner.OPS_PER_CHUNK * 1e-5)
    costs = [planner.LayerCost("l0", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                               full_flops=50, selective_flops=5)]
    plan = make_plan(costs, 10, 1.0, device=profile, chunked=many, chunk_loss=True)
    assert plan.predicted_step_seconds == pytest.approx(make_plan(costs, 10, 1.0, device=profile)
                                                        .predicted_step_seconds + many.seconds(profile))


def test_out_of_reach_names_the_outside_bytes_by_part():
    from lightning_ckpt.core.measure.layer_costs import measure_step
    from lightning_ckpt.core.measure.profiling import format_bytes

    model = gpt()
    measured = measure_step(model, step(model), None, ("full", "selective"))
    # after the layers: the log-softmax (tokens x vocab fp32), the inputs of the final norm and of the head
    # (tokens x width fp32 each), the norm's mean and rstd, the labels (int64) and a 4-byte count
    after = 4 * TOKENS * VOCAB + 2 * 4 * TOKENS * WIDTH + 2 * 4 * TOKENS + 8 * TOKENS + 4
    backward = 2 * 4 * TOKENS * VOCAB + 4  # the gradients of the log-softmax and of the logits, and of the loss
    assert (measured.head_bytes, measured.head_peak_bytes) == (after, backward) == (8667140, 16777220)
    with pytest.raises(ValueError) as caught:
        planned(2**20, False, chunk=512)
    floor = next(line for line in str(caught.value).splitlines() if "Floor" in line)
    assert (f": {format_bytes(measured.outside_bytes - after)} saved before them (embeddings), {format_bytes(after)}"
            f" after them (final norm, head, loss), and {format_bytes(backward)} made alive at once by the backward"
            " of the head and loss") in floor, floor
