"""Side-stream offload: the engine's scheduling on the CPU fake backend, and the real thing on an accelerator."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ckpt.offload as offload
from helpers import BATCH, SEQ, WIDTH, loss_and_grads, tiny_transformer, tokens
from lightning_ckpt import apply_checkpointing
from lightning_ckpt.demos import Block
from lightning_ckpt.offload import FakeStreamError, FakeStreams, OffloadEngine, OffloadToHost, use_engine
from lightning_ckpt.profiling import SavedTensorCounter

N_LAYER = 6
INPUT_BYTES = BATCH * SEQ * WIDTH * 4  # one block's input, float32


def reference(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    apply_checkpointing(model, layer_cls=Block)
    return loss_and_grads(model, idx)


def offloaded_model() -> nn.Module:
    model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    apply_checkpointing(model, layer_cls=Block, offload=True)
    return model


def assert_bit_equal(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=0, atol=0, msg=name)


def grads_equal(got: dict, want: dict) -> bool:
    return all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_out_of_order_copies_give_bit_equal_loss_and_grads(seed):
    idx = tokens()
    want = reference(idx)
    model = offloaded_model()
    streams = FakeStreams(seed=seed)
    with use_engine(OffloadEngine(streams, min_bytes=0)) as engine:
        for _ in range(2):  # the second step runs on reused host buffers
            assert_bit_equal(loss_and_grads(model, idx), want)
    stats = engine.stats
    assert stats.to_host_copies == 2 * N_LAYER
    assert stats.offloaded_bytes == 2 * N_LAYER * INPUT_BYTES
    # every input came back either by a copy from host or, its forward copy still in flight, from the device
    assert stats.to_device_copies + stats.reused_sources == 2 * N_LAYER
    assert stats.to_device_copies >= N_LAYER  # the copy path really ran
    assert streams.out_of_order > 0  # and copies really ran out of order
    # backward's first layer waits for its inputs; every later one's were started during the layer after it
    assert stats.prefetched == 2 * (N_LAYER - 1)


def test_every_copy_path_taken_when_nothing_completes_early():
    """With no copy finishing on its own, forward copies are retired only by the compute stream's waits (`lag`)."""
    idx = tokens()
    model = offloaded_model()
    with use_engine(OffloadEngine(FakeStreams(seed=3, complete_probability=0.0), min_bytes=0, lag=1)) as engine:
        got = loss_and_grads(model, idx)
    assert_bit_equal(got, reference(idx))
    # lag=1: the last layer's and the one before's copies were still in flight at backward, so their device
    # tensors served directly; every other input came back through a copy
    assert engine.stats.reused_sources == 2
    assert engine.stats.to_device_copies == N_LAYER - 2


class SkipOneWait(FakeStreams):
    """A fake device on which the engine's first wait for a host->device copy is lost."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.skipped = 0

    def wait(self, event) -> None:
        if self.skipped == 0 and event is not None and not event.performed and event.kind == self.kind:
            self.skipped += 1
            return
        super().wait(event)


def test_a_missing_wait_before_using_a_copied_input_is_detected():
    idx = tokens()
    want = reference(idx)
    streams = SkipOneWait("to_device", seed=0, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=1)):
        loss, grads = loss_and_grads(offloaded_model(), idx)
    assert streams.skipped == 1
    assert not grads_equal(grads, want[1])  # the recompute ran on an input that had not arrived


def test_a_missing_wait_before_freeing_a_copied_input_is_detected():
    """The engine drops its reference to a device tensor after waiting for its copy: without the wait, the fake sees
    the copy's source freed (on a device its memory would have been reused) and fails."""
    streams = SkipOneWait("to_host", seed=0, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=1)), pytest.raises(FakeStreamError, match="freed"):
        loss_and_grads(offloaded_model(), tokens())
    assert streams.skipped == 1


def test_the_fake_refuses_a_copy_that_does_not_wait_for_one_on_the_same_memory():
    streams = FakeStreams()
    src, buffer = torch.ones(4), streams.host_buffer(16).view(torch.float32)
    first = streams.to_host(src, buffer, after=[])
    with pytest.raises(FakeStreamError, match="without waiting"):
        streams.to_device(buffer, torch.empty(4), after=[])
    out = torch.empty(4)
    streams.wait(streams.to_device(buffer, out, after=[first]))
    assert torch.equal(out, src)


def test_a_graph_dropped_before_backward_returns_its_buffers_safely():
    """Buffers of a forward that never reaches backward are reused by the next one while their copies may still be
    queued; each reuse waits for the buffer's last copy (the fake raises if not), so gradients stay bit-equal."""
    idx = tokens()
    model = offloaded_model()
    with use_engine(OffloadEngine(FakeStreams(seed=5, complete_probability=0.0), min_bytes=0)) as engine:
        model(idx)  # graph dropped at once
        assert engine.pool.in_use_bytes == 0
        got = loss_and_grads(model, idx)
    assert_bit_equal(got, reference(idx))
    assert engine.pool.allocations == N_LAYER


def test_host_buffers_are_reused_across_steps():
    model = offloaded_model()
    idx = tokens()
    allocated = {}
    with use_engine(OffloadEngine(FakeStreams(seed=0), min_bytes=0)) as engine:
        for step in range(1, 11):
            loss_and_grads(model, idx)
            allocated[step] = (engine.pool.allocated_bytes, engine.pool.allocations)
    assert allocated[10] == allocated[2]
    assert allocated[2][0] >= N_LAYER * INPUT_BYTES
    assert allocated[2][1] <= N_LAYER + 2  # the in-flight window at most; not one allocation per tensor per step


def test_the_pool_grows_to_the_largest_step_and_no_further():
    model = offloaded_model()
    small, large = tokens()[:2], tokens()
    with use_engine(OffloadEngine(FakeStreams(seed=1), min_bytes=0)) as engine:
        loss_and_grads(model, small)
        after_small = engine.pool.allocated_bytes
        loss_and_grads(model, large)
        after_large = engine.pool.allocated_bytes
        for batch in (small, large, small, large):
            loss_and_grads(model, batch)
            assert engine.pool.allocated_bytes <= engine.pool.peak_in_use_bytes
        assert engine.pool.allocated_bytes == after_large > after_small
        engine.release()
        assert engine.pool.allocated_bytes == 0
    gc.collect()
    assert engine.pool.live_buffers() == 0


@pytest.mark.parametrize(("min_bytes", "offloaded"), [(INPUT_BYTES + 1, 0), (INPUT_BYTES, N_LAYER * INPUT_BYTES)])
def test_tensors_under_the_threshold_stay_put(min_bytes, offloaded):
    idx = tokens()
    plain = tiny_transformer(n_layer=N_LAYER)
    apply_checkpointing(plain, layer_cls=Block)
    with SavedTensorCounter(exclude=plain.parameters()) as want:
        plain(idx)
    model = offloaded_model()
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=min_bytes)) as engine:
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            model(idx)
    assert saved.offloaded_bytes == engine.stats.offloaded_bytes == offloaded
    assert saved.bytes + saved.offloaded_bytes == want.bytes
    assert engine.stats.kept_bytes == N_LAYER * INPUT_BYTES - offloaded


def test_parameters_and_small_inputs_stay_large_inputs_move():
    weight = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)  # 8 KiB
    scale = torch.randn(64, requires_grad=True)  # 256 B

    def layer(x, w, s):
        return (x @ w * s).tanh()

    with use_engine(OffloadEngine(FakeStreams(), min_bytes=1024)) as engine:
        with SavedTensorCounter() as saved, OffloadToHost():
            out = checkpoint(layer, x, weight, scale, use_reentrant=False)
    assert engine.stats.offloaded_bytes == saved.offloaded_bytes == x.numel() * 4
    assert engine.stats.kept_bytes == weight.numel() * 4 + scale.numel() * 4
    out.sum().backward()
    want = [t.grad.clone() for t in (x, weight, scale)]
    for t in (x, weight, scale):
        t.grad = None
    layer(x, weight, scale).sum().backward()
    for got, t in zip(want, (x, weight, scale)):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=0)


def test_round_trip_through_the_hooks_copies_and_restores_the_values():
    """The real `_pack`/`_unpack`, with the copy path forced: what comes back is a new tensor with the same values."""
    tensor = torch.randn(BATCH, SEQ, WIDTH)
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
        packed = offload._pack(tensor)
    assert packed is not tensor
    engine.release()  # the forward copy is done and the engine let go of the original
    restored = offload._unpack(packed)
    assert engine.stats.to_device_copies == 1 and engine.stats.reused_sources == 0
    assert restored.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert torch.equal(restored, tensor) and restored.dtype == tensor.dtype


def test_an_unpack_that_loses_the_values_fails_the_gradient_check(monkeypatch):
    """Guards the guard: an `_unpack` that returns zeros (as one once did) must not pass the bit-equality test."""
    idx = tokens()
    want = reference(idx)
    real_unpack = offload._unpack
    monkeypatch.setattr(offload, "_unpack", lambda packed: torch.zeros_like(real_unpack(packed)))
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)):
        loss, grads = loss_and_grads(offloaded_model(), idx)
    assert not grads_equal(grads, want[1])


@pytest.mark.parametrize(("kwargs", "match"), [({"min_bytes": -1}, "min_bytes"), ({"min_bytes": 0.5}, "min_bytes"),
                                               ({"lag": -1}, "lag")])
def test_bad_engine_settings_say_what_to_pass(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(FakeStreams(), **kwargs)


def test_use_engine_refuses_something_else():
    with pytest.raises(TypeError, match="OffloadEngine"):
        with use_engine(FakeStreams()):
            pass


# ----------------------------------------------------------------------------------------------------------------
# Accelerator tests: `python benchmarks/accelerator_check.py` runs them (and the benchmark) in one command.


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.accelerator
def test_accelerator_offload_gradients_are_bit_equal():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = _device()
    idx = tokens().to(device)
    results = []
    for offloaded in (False, True):
        model = tiny_transformer(n_layer=N_LAYER, dropout=0.1).to(device)
        apply_checkpointing(model, layer_cls=Block, offload=offloaded)
        engine = offload.default_engine(device)
        engine.min_bytes = 0  # the tiny model's inputs are 8 KiB: force every one through the copies
        with sdpa_kernel(SDPBackend.MATH):  # deterministic kernels, so bit-equality is meaningful
            results.append(loss_and_grads(model, idx))
            results.append(loss_and_grads(model, idx))  # reused buffers
        engine.min_bytes = offload.DEFAULT_MIN_BYTES
    assert offload.default_engine(device).stats.to_host_copies >= 2 * N_LAYER
    assert_bit_equal(results[2], results[0])
    assert_bit_equal(results[3], results[1])


@pytest.mark.accelerator
def test_accelerator_offload_lowers_peak_memory_by_the_offloaded_bytes():
    from lightning_ckpt.demos import Transformer

    device = _device()
    n_layer, width, seq, batch = 48, 256, 2048, 16  # 32 MiB per block input, 1.5 GiB offloaded
    idx = torch.randint(0, 32, (batch, seq), device=device)
    peaks, offloaded = {}, 0
    for offloaded_run in (False, True):
        torch.manual_seed(0)
        model = Transformer(32, seq, n_layer, width, n_head=8, dropout=0.0).to(device)
        # Only the embeddings train (as with frozen blocks in PEFT): weight gradients would otherwise take the memory
        # that offload frees late in backward, and the comparison would be about them, not about the saved inputs.
        model.requires_grad_(False).tok_emb.requires_grad_(True)
        apply_checkpointing(model, layer_cls=Block, offload=offloaded_run)
        for _ in range(2):  # the second step, on warm allocators and a warm host pool, is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with SavedTensorCounter(exclude=model.parameters()) as saved:
                loss = model(idx).logsumexp(-1).mean()
            loss.backward()
            torch.cuda.synchronize()
        peaks[offloaded_run] = torch.cuda.max_memory_allocated()
        if offloaded_run:
            offloaded = saved.offloaded_bytes
        del model, loss
        offload.release_all()
        torch.cuda.empty_cache()
    assert offloaded == n_layer * batch * seq * width * 4
    assert peaks[False] - peaks[True] >= 0.8 * offloaded, (peaks, offloaded)


@pytest.mark.accelerator
def test_accelerator_no_buffer_stays_pinned_after_fit(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_ckpt import GradientCheckpointing
    from lightning_ckpt.demos import GPT, CountingDataModule

    engine = offload.default_engine(_device())
    engine.min_bytes = 0
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cuda", devices=1, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing(offload=True)])
    trainer.fit(GPT(), CountingDataModule())
    engine.min_bytes = offload.DEFAULT_MIN_BYTES
    assert engine.stats.to_host_copies > 0 and engine.pool.allocations > 0
    offload.release_all()  # what the callback's teardown calls
    gc.collect()
    assert engine.pool.allocated_bytes == 0
    assert engine.pool.live_buffers() == 0
