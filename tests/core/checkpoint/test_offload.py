"""Side-stream offload: the engine's scheduling on the CPU fake backend, and the real thing on an accelerator."""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ckpt.core.checkpoint.host_pool as host_pool
import lightning_ckpt.core.checkpoint.offload as offload
import lightning_ckpt.core.checkpoint.wrapping as wrapping
from helpers import BATCH, SEQ, VOCAB, WIDTH, LiveStorages, loss_and_grads, tiny_transformer, tokens
from lightning_ckpt import apply_checkpointing
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreamError, FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, OffloadToHost, pinned_size, use_engine
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, count_flops
from lightning_ckpt.demos import Block

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
    gc.collect()
    assert not engine._groups and not engine._previous and not engine._shared  # nothing kept per step
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
    """The recompute runs on an input whose copy has not landed: the fake hands out NaN, and autograd then frees that
    input while the copy would still be writing into it, which the fake reports."""
    streams = SkipOneWait("to_device", seed=0, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=1)), pytest.raises(FakeStreamError, match="destination"):
        loss_and_grads(offloaded_model(), tokens())
    assert streams.skipped == 1


def test_a_missing_wait_before_freeing_a_copied_input_is_detected():
    """The engine drops its reference to a device tensor after waiting for its copy: without the wait, the fake sees
    the copy's source freed, or its memory already handed to another copy (nothing else holds the input: the
    allocator reuses it at once, as a device's would), and fails."""
    streams = SkipOneWait("to_host", seed=0, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=1)), pytest.raises(FakeStreamError,
                                                                               match="freed|still uses"):
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


def test_views_of_parameters_stay_put():
    layer = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine, OffloadToHost():
        out = layer(x)  # saves x and weight.t(), a view of the parameter
    assert engine.stats.offloaded_bytes == x.numel() * 4
    assert engine.stats.kept_bytes == layer.weight.numel() * 4
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, out.new_ones(32, 64).t() @ x, rtol=0, atol=0)


def test_each_hooks_object_files_what_it_saves_under_its_own_group():
    """Nested hooks: what is saved inside the inner one is the inner layer call's, and what is saved after it exits is
    the outer one's again; each group is the one drawn when its hooks were built."""
    a, b, c = (torch.randn(64, requires_grad=True) for _ in range(3))
    outer, inner = OffloadToHost(), OffloadToHost()
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
        with outer:
            out = a.exp()
            with inner:
                out = out + b.exp()
            out = out + c.exp()
        filed = {group: {id(ref().host) for ref in refs} for group, refs in engine._groups.items()}
        assert sorted(filed) == [outer.group, inner.group] and outer.group < inner.group
        assert len(filed[outer.group]) == 2 and len(filed[inner.group]) == 1
        out.sum().backward()
    for t in (a, b, c):
        torch.testing.assert_close(t.grad, t.detach().exp(), rtol=0, atol=0)


def test_round_trip_through_the_hooks_copies_and_restores_the_values():
    """The real `pack_saved`/`unpack_saved`, with the copy path forced: what comes back is a new tensor with the same values."""
    tensor = torch.randn(BATCH, SEQ, WIDTH)
    hooks = OffloadToHost()
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
        packed = hooks.pack_hook(tensor)
    assert packed is not tensor
    engine.release()  # the forward copy is done and the engine let go of the original
    restored = hooks.unpack_hook(packed)
    assert engine.stats.to_device_copies == 1 and engine.stats.reused_sources == 0
    assert restored.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert torch.equal(restored, tensor) and restored.dtype == tensor.dtype


def test_an_unpack_that_loses_the_values_fails_the_gradient_check(monkeypatch):
    """Guards the guard: an `unpack_saved` that returns zeros (as one once did) must not pass the bit-equality test."""
    idx = tokens()
    want = reference(idx)
    real_unpack = offload.unpack_saved
    monkeypatch.setattr(offload, "unpack_saved", lambda packed: torch.zeros_like(real_unpack(packed)))
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
# A backward that stops early, or another graph: no device tensor is freed while a copy still writes into it.


class RaisesInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises while ``armed``: an out-of-memory in the middle of backward."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if RaisesInBackward.armed:
            raise RuntimeError("out of memory (simulated)")
        return grad


class FailingBlock(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return RaisesInBackward.apply(self.block(x))


def held_device_tensors(engine: OffloadEngine) -> int:
    return sum(f.source is not None for f in engine._in_flight) + len(engine._landing)


def test_an_exception_in_backward_after_a_prefetch_holds_the_copy_destination():
    """Layer 3's backward starts bringing back layer 2's inputs, then fails: layer 2's handles die with their copies
    in flight. The engine must hold those destinations until the copies land (the fake raises otherwise)."""
    idx = tokens()
    model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    model.blocks[3] = FailingBlock(model.blocks[3])
    apply_checkpointing(model, layer_cls=Block, offload=True)
    streams = FakeStreams(seed=0, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=0)) as engine:  # lag=0: inputs come back by copies
        RaisesInBackward.armed = True
        try:
            with pytest.raises(RuntimeError, match="simulated"):
                loss_and_grads(model, idx)
        finally:
            RaisesInBackward.armed = False
        gc.collect()
        assert engine.stats.to_device_copies >= 1  # a prefetch was in flight when the graph died
        streams.synchronize()  # the destinations are alive: the copies land
        got = loss_and_grads(model, idx)  # and the engine works on
    want_model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    want_model.blocks[3] = FailingBlock(want_model.blocks[3])
    apply_checkpointing(want_model, layer_cls=Block)
    assert_bit_equal(got, loss_and_grads(want_model, idx))


def test_autograd_grad_over_part_of_the_graph_holds_the_copy_destination():
    """Gradients for the output of block 2 only: the backward of blocks 5 to 3 runs, block 3's prefetches block 2's
    inputs, which no backward then uses; dropping the graph must not free them under their copies."""
    idx = tokens()

    def partial(model: nn.Module) -> torch.Tensor:
        torch.manual_seed(0)
        outs = []
        hook = model.blocks[2].register_forward_hook(lambda m, i, o: outs.append(o))
        loss = model(idx).logsumexp(-1).mean()
        hook.remove()
        return torch.autograd.grad(loss, outs[0])[0]

    want = partial(reference_model())
    streams = FakeStreams(seed=1, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=0)) as engine:
        got = partial(offloaded_model())
        gc.collect()
        assert engine.stats.to_device_copies == 3  # blocks 4, 3 and 2 came back; block 2's were never used
        streams.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_backward_prefetches_only_its_own_graph():
    """Forward A, forward B, backward B, drop A: B's first block must not bring back A's inputs."""
    idx = tokens()
    want = reference(idx)
    model = offloaded_model()
    streams = FakeStreams(seed=2, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=N_LAYER)) as engine:
        torch.manual_seed(7)
        loss_a = model(idx).logsumexp(-1).mean()
        got = loss_and_grads(model, idx)
        stats = engine.stats
        assert stats.to_device_copies + stats.reused_sources == N_LAYER  # B's inputs, none of A's
        assert stats.prefetched == N_LAYER - 1
        del loss_a
        gc.collect()
        streams.synchronize()
    assert_bit_equal(got, want)


def reference_model() -> nn.Module:
    model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    apply_checkpointing(model, layer_cls=Block)
    return model


# ----------------------------------------------------------------------------------------------------------------
# Fewer copies: the newest layer's inputs, and a storage saved by every layer


def test_backward_starts_on_the_newest_layers_device_tensors():
    """Every forward copy finished at once; the last block's inputs are still held on the device when backward starts,
    so only the other blocks' come back through copies, and nothing is held after the step."""
    idx = tokens()
    model = offloaded_model()
    with use_engine(OffloadEngine(FakeStreams(seed=0, complete_probability=1.0), min_bytes=0)) as engine:
        for step in range(1, 3):
            got = loss_and_grads(model, idx)
            assert engine.stats.reused_sources == step
            assert engine.stats.reused_bytes == step * INPUT_BYTES
            assert engine.stats.to_device_copies == step * (N_LAYER - 1)
            assert engine.stats.to_device_bytes == step * (N_LAYER - 1) * INPUT_BYTES
            assert held_device_tensors(engine) == 0
        model(idx)  # a forward whose graph is dropped: its newest inputs are let go with it
        gc.collect()
        assert held_device_tensors(engine) == 0
    assert_bit_equal(got, reference(idx))


class SharedBiasBlock(nn.Module):
    """A block that takes the hidden state and a tensor shared by every layer (a mask, rotary embeddings)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x, bias):
        return x + torch.tanh(self.lin(x) * bias)


class SharedBiasModel(nn.Module):
    def __init__(self, n_layer: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("bias", torch.randn(width))
        self.blocks = nn.ModuleList(SharedBiasBlock(width) for _ in range(n_layer))

    def forward(self, x):
        shared = (self.bias * 2).expand(x.shape).contiguous()  # one storage, saved by every block
        for block in self.blocks:
            x = block(x, shared)
        return x.square().mean()


def test_a_storage_saved_by_every_layer_is_copied_once_each_way():
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    plain = SharedBiasModel(N_LAYER, WIDTH)
    plain(x).backward()
    want = {n: p.grad.clone() for n, p in plain.named_parameters()} | {"x": x.grad.clone()}
    x.grad = None
    model = SharedBiasModel(N_LAYER, WIDTH)
    apply_checkpointing(model, layer_cls=SharedBiasBlock, offload=True)
    with use_engine(OffloadEngine(FakeStreams(seed=4, complete_probability=0.0), min_bytes=0)) as engine:
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            loss = model(x)
        stats = engine.stats
        assert stats.to_host_copies == N_LAYER + 1  # each block's hidden state, and the shared tensor once
        assert stats.shared == N_LAYER - 1 and stats.shared_bytes == (N_LAYER - 1) * INPUT_BYTES
        assert stats.offloaded_bytes == saved.offloaded_bytes == (N_LAYER + 1) * INPUT_BYTES  # what MemoryMonitor logs
        loss.backward()
        assert stats.to_device_copies + stats.reused_sources == N_LAYER + 1  # and it came back once
    got = {n: p.grad for n, p in model.named_parameters()} | {"x": x.grad}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_a_storage_changed_in_place_is_copied_again():
    engine = OffloadEngine(FakeStreams(), min_bytes=0)
    tensor = torch.arange(16.0)
    first = engine.pack(tensor, group=1)
    assert engine.pack(tensor, group=2) is first
    engine.streams.synchronize()  # the first copy has landed before the change
    tensor.add_(1)
    second = engine.pack(tensor, group=3)
    assert second is not first
    engine.release()
    assert torch.equal(engine.unpack(second), tensor) and torch.equal(engine.unpack(first), tensor - 1)


# ----------------------------------------------------------------------------------------------------------------
# Layouts, pinned memory and the engine registry


@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
                                  lambda: torch.randn(8, 6).t(), lambda: torch.randn(4, 8)[:, ::2]],
                         ids=["channels_last", "transposed", "strided_slice"])
def test_tensors_come_back_with_their_layout(make):
    tensor = make()
    engine = OffloadEngine(FakeStreams(), min_bytes=0)
    packed = engine.pack(tensor, group=1)
    engine.release()  # the forward copy is done and the engine let go of the original: the copy path runs
    restored = engine.unpack(packed)
    assert engine.stats.to_device_copies == 1
    assert torch.equal(restored, tensor)
    assert restored.stride() == torch.empty_like(tensor).stride()  # dense layouts kept; gaps closed
    if tensor.is_contiguous(memory_format=torch.channels_last) or tensor.t().is_contiguous():
        assert restored.stride() == tensor.stride()


def test_pinned_memory_is_counted_as_pinned_and_unpinned_when_released():
    """The fake models torch's caching host allocator: power-of-two sizes, and dropped buffers stay pinned until its
    cache is emptied. The pool counts what is really pinned, and dropping or releasing buffers unpins them."""
    streams = FakeStreams(seed=0)
    engine = OffloadEngine(streams, min_bytes=0)
    model = offloaded_model()
    # 4 KiB inputs, then 8 KiB ones: the small buffers (4 KiB pinned) cannot serve the large inputs and are dropped.
    # (Not `[:3]`: 6 KiB is pinned as 8 KiB, the same buffer as the full batch's, and nothing would be dropped.)
    small, large = tokens()[:2], tokens()
    assert pinned_size(2 * SEQ * WIDTH * 4) < pinned_size(INPUT_BYTES)
    with use_engine(engine):
        loss_and_grads(model, small)
        gc.collect()
        assert engine.pool.allocated_bytes == streams.pinned_bytes >= N_LAYER * pinned_size(2 * SEQ * WIDTH * 4)
        allocations = engine.pool.allocations
        loss_and_grads(model, large)  # larger inputs: the small buffers are dropped, and unpinned
        gc.collect()
        assert engine.pool.allocations > allocations  # new, larger buffers were pinned
        assert engine.pool.allocated_bytes == streams.pinned_bytes
        assert streams.cached_host_bytes == 0
    engine.release()
    gc.collect()
    assert streams.pinned_bytes == 0


def test_threads_share_one_engine_per_device(monkeypatch):
    monkeypatch.setattr(offload, "_engines", {})  # a registry of this test's own: a CPU engine must not outlive it
    engines = []
    threads = [threading.Thread(target=lambda: engines.append(offload.default_engine("cpu"))) for _ in range(3)]
    for thread in threads:
        thread.start()
        thread.join()
    assert len(engines) == 3 and all(e is engines[0] for e in engines)
    assert engines[0] is offload.default_engine("cpu")


# ----------------------------------------------------------------------------------------------------------------
# On a CPU-only machine offload does nothing, and says so once, at setup


NO_EFFECT = "`offload=True` has no effect here"


def said_no_effect(caught: list) -> list:
    return [w for w in caught if NO_EFFECT in str(w.message)]


def test_offload_on_a_cpu_only_machine_is_said_once_at_the_line_that_applies_it(monkeypatch):
    monkeypatch.setattr(wrapping, "_warned_offload_on_cpu", False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # CPU-only, also on an accelerator runner
    model = tiny_transformer(n_layer=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # only the package's own once-flag may hold back a repeat
        line = inspect.currentframe().f_lineno + 1
        apply_checkpointing(model, layer_cls=Block, offload=True)
        apply_checkpointing(model, layer_cls=Block, offload=True, mode="selective")  # applied again: not said again
        loss_and_grads(model, tokens())  # nor by the forward and backward
        loss_and_grads(model, tokens())
    said = said_no_effect(caught)
    assert len(said) == 1
    assert not said[0].filename.startswith(os.path.dirname(torch.__file__))  # not torch's checkpoint
    assert (said[0].filename, said[0].lineno) == (__file__, line)  # the caller of apply_checkpointing


@pytest.mark.parametrize("case", ["accelerator present", "fake device in charge", "no offload"])
def test_offload_that_may_take_effect_is_not_warned_about(monkeypatch, case):
    """With an accelerator the model may still be moved there after setup (Lightning moves it after the callbacks'
    setup); a fake device offloads CPU tensors."""
    monkeypatch.setattr(wrapping, "_warned_offload_on_cpu", False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: case == "accelerator present")
    model = tiny_transformer(n_layer=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) if case == "fake device in charge" else (
                contextlib.nullcontext()):
            apply_checkpointing(model, layer_cls=Block, offload=case != "no offload")
            loss_and_grads(model, tokens())
    assert said_no_effect(caught) == []


# ----------------------------------------------------------------------------------------------------------------
# Accelerator tests: `python benchmarks/accelerator_check.py` runs them (and the benchmark) in one command.


ACC_SEQ, ACC_WIDTH, ACC_BATCH = 256, 512, 8
ACC_INPUT_BYTES = ACC_BATCH * ACC_SEQ * ACC_WIDTH * 4  # 4 MiB per block input: above the 1 MiB threshold


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def accelerator_model(offloaded: bool) -> nn.Module:
    from lightning_ckpt.demos import Transformer

    torch.manual_seed(0)
    model = Transformer(VOCAB, ACC_SEQ, N_LAYER, ACC_WIDTH, n_head=8, dropout=0.1).to(_device())
    apply_checkpointing(model, layer_cls=Block, offload=offloaded)
    return model


def accelerator_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ACC_BATCH, ACC_SEQ), generator=torch.Generator().manual_seed(1)).to(_device())


class DelayedStreams(offload.DeviceStreams):
    """A device control: every side-stream copy starts after the GPU sleeps (about 25 ms on an H100-class clock), so
    copies are still running when their results are wanted; only the engine's waits make the results right."""

    def __init__(self, device: torch.device, cycles: int = 50_000_000) -> None:
        super().__init__(device)
        self.cycles = cycles

    def _delayed(self, src: torch.Tensor, dst: torch.Tensor, after) -> object:
        for event in after:
            if event is not None:
                self._side.wait_event(event)
        with torch.cuda.stream(self._side):
            torch.cuda._sleep(self.cycles)
        return self._copy(src, dst, ())

    def to_host(self, src, dst, after):
        return self._delayed(src, dst, after)

    def to_device(self, src, dst, after):
        return self._delayed(src, dst, after)


class SkipOneDeviceWait(DelayedStreams):
    """Delayed copies, fresh device tensors filled with NaN, and the first wait for a host->device copy lost."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.device_events: list = []
        self.skipped = 0

    def empty_device(self, like, device):
        return super().empty_device(like, device).fill_(float("nan"))

    def to_device(self, src, dst, after):
        event = super().to_device(src, dst, after)
        self.device_events.append(event)
        return event

    def wait(self, event) -> None:
        if not self.skipped and any(event is e for e in self.device_events):
            self.skipped += 1
            return
        super().wait(event)


def accelerator_loss_and_grads(model: nn.Module, idx: torch.Tensor) -> tuple:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # deterministic kernels, so bit-equality is meaningful
        return loss_and_grads(model, idx)


@pytest.mark.accelerator
@pytest.mark.parametrize("lag", [0, 2])
def test_accelerator_delayed_copies_give_bit_equal_gradients(lag):
    idx = accelerator_tokens()
    want = accelerator_loss_and_grads(accelerator_model(offloaded=False), idx)
    model = accelerator_model(offloaded=True)
    with use_engine(OffloadEngine(DelayedStreams(_device()), lag=lag)) as engine:
        for _ in range(2):  # the second step runs on reused host buffers
            assert_bit_equal(accelerator_loss_and_grads(model, idx), want)
        torch.cuda.synchronize()
    stats = engine.stats
    assert stats.to_host_copies == 2 * N_LAYER and stats.offloaded_bytes == 2 * N_LAYER * ACC_INPUT_BYTES
    assert stats.to_device_copies + stats.reused_sources == 2 * N_LAYER
    if lag == 0:  # every forward copy waited for: all but the newest layer's inputs came back through copies
        assert stats.to_device_copies == 2 * (N_LAYER - 1)
    engine.release()


@pytest.mark.accelerator
def test_accelerator_a_skipped_wait_changes_the_gradients():
    """Guards the control: with delayed copies, one lost wait must show in the gradients."""
    idx = accelerator_tokens()
    want = accelerator_loss_and_grads(accelerator_model(offloaded=False), idx)
    streams = SkipOneDeviceWait(_device())
    with use_engine(OffloadEngine(streams, lag=0)) as engine:
        _, grads = accelerator_loss_and_grads(accelerator_model(offloaded=True), idx)
        torch.cuda.synchronize()
    assert streams.skipped == 1
    assert not grads_equal(grads, want[1])
    engine.release()


@pytest.mark.accelerator
def test_accelerator_released_pool_leaves_nothing_pinned():
    """What the pool pins is what torch's host allocator reports, and after release nothing of it is left pinned."""
    gc.collect()
    host_pool._empty_host_cache()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    idx = accelerator_tokens()
    model = accelerator_model(offloaded=True)
    engine = OffloadEngine(offload.DeviceStreams(_device()))
    with use_engine(engine):
        for batch in (idx[:2], idx):  # a larger batch drops the smaller buffers
            accelerator_loss_and_grads(model, batch)
    torch.cuda.synchronize()
    gc.collect()
    assert engine.pool.allocated_bytes >= N_LAYER * ACC_INPUT_BYTES
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] - before == engine.pool.allocated_bytes
    engine.release()
    gc.collect()
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == before


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
    offload.release_all()
    gc.collect()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    copies = engine.stats.to_host_copies
    engine.min_bytes = 0
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cuda", devices=1, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing(offload=True)])
    trainer.fit(GPT(), CountingDataModule())
    engine.min_bytes = offload.DEFAULT_MIN_BYTES
    assert engine.stats.to_host_copies > copies and engine.pool.allocations > 0
    gc.collect()  # the callback's teardown called release_all
    assert engine.pool.allocated_bytes == 0
    assert engine.pool.live_buffers() == 0
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == before


# ----------------------------------------------------------------------------------------------------------------
# mode="none": nothing recomputed, every tensor a layer saves in host memory


def test_offload_without_recompute_moves_every_saved_tensor_and_keeps_training_exact():
    idx = tokens()
    plain = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    want = loss_and_grads(plain, idx)
    with SavedTensorCounter(exclude=plain.parameters()) as baseline:
        plain(idx)
    blocks_only = sum(saved_bytes_of(block, plain, idx) for block in plain.blocks)

    model = tiny_transformer(n_layer=N_LAYER, dropout=0.1)
    names = apply_checkpointing(model, layer_cls=Block, mode="none", offload=True)
    assert names == [f"blocks.{i}" for i in range(N_LAYER)]
    # The counter tells storages apart by address: a device tensor let go of during the counted forward could hand its
    # address to a later one, counted once for both. With no copy done early and `lag` over the layer count, the
    # engine holds every one of them until backward.
    streams = FakeStreams(seed=6, complete_probability=0.0)
    with use_engine(OffloadEngine(streams, min_bytes=0, lag=N_LAYER)) as engine:
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            model(idx)
        # on the device stays only what is saved outside the blocks (embeddings, head); the rest is in host memory
        assert saved.bytes == baseline.bytes - blocks_only and saved.offloaded_bytes > 0.8 * blocks_only
        # views of one storage with other shapes or strides (q, k, v of one projection) are copied each on its own
        assert engine.stats.offloaded_bytes >= saved.offloaded_bytes
        flops = count_flops(lambda: loss_and_grads(model, idx))
        got = loss_and_grads(model, idx)
    assert flops == count_flops(lambda: loss_and_grads(plain, idx))  # nothing recomputed
    assert engine.stats.to_host_copies > 2 * N_LAYER
    assert_bit_equal(got, want)  # dropout included: the forward ran once


def saved_bytes_of(block: nn.Module, model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes ``block`` saves for backward in a plain forward of ``model`` (its storages only, parameters excluded)."""
    counter = SavedTensorCounter(exclude=model.parameters())

    def enter(module, args) -> None:
        counter.__enter__()

    def leave(module, args, output) -> None:
        counter.__exit__(None, None, None)

    handles = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    model(idx)
    for handle in handles:
        handle.remove()
    return counter.bytes


def test_mode_none_needs_offload():
    model = tiny_transformer(n_layer=2)
    with pytest.raises(ValueError, match="offload=True"):
        apply_checkpointing(model, layer_cls=Block, mode="none")
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing was changed


def test_an_offloaded_input_is_freed_on_its_device_once_its_copy_is_done():
    """Storages alive after the forward, counted without the package's counters: once the engine has let go of the
    device tensors (their copies done), only the host copies remain. The checkpointed forward's own closure once held
    every input until backward, so offload freed nothing on the device."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(WIDTH, 4) for _ in range(4)])
    apply_checkpointing(model, layer_cls=Block, offload=True)
    base = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine, LiveStorages() as live:
        x = base * 1.0
        y = model(x)
        del x
        engine.release()  # every copy done; the pool's idle buffers freed
        torch.zeros(1)  # one more op: the count notes the storages that died
        alive = live.alive() - y.untyped_storage().nbytes()
    assert engine.stats.offloaded_bytes == 4 * BATCH * SEQ * WIDTH * 4
    assert alive == engine.stats.offloaded_bytes  # the host copies, nothing on the "device"


def test_a_free_buffer_more_than_twice_the_size_asked_for_is_not_reused():
    # 4,096 B taken and given back; 512 B asked for next: the 4,096 B buffer would waste 3,584 B, so a new one is
    # allocated, and the free one dropped (4,096 + 512 is over the 4,096 B the pool ever had in use at once).
    pool = offload.HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
    big = pool.take(4096)
    pool.give(big)
    small = pool.take(512)
    assert (small is big, pool.allocations, pool.allocated_bytes) == (False, 2, 512)
    pool.give(small)
    assert pool.take(300) is small  # 512 B for 300 (rounded up to 512): within twice, reused


def test_a_view_of_the_same_elements_as_another_dtype_gets_its_own_copy():
    copies = offload.SavedCopies()
    x = torch.zeros(4)
    copy = x.clone()
    copies.put(x, copy)
    as_ints = x.view(torch.int32)  # same storage, offset, shape and strides: only the dtype differs
    assert copies.get(x) is copy and copies.get(as_ints) is None
    assert offload.view_key(as_ints) != offload.view_key(x)


def test_the_pool_drops_its_oldest_free_buffer_first():
    # 4,096 B then 512 B in use at once (the pool's bound: 4,608 B), both given back, oldest first. 1,024 B fits
    # neither (4,096 is over twice 1,024; 512 under it): 4,608 + 1,024 is over the bound, and dropping the oldest
    # (4,096 B) is enough, so the 512 B buffer stays to serve the next 512 B.
    pool = offload.HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
    old, new = pool.take(4096), pool.take(512)
    pool.give(old)
    pool.give(new)
    pool.take(1024)
    assert (pool.allocations, pool.allocated_bytes) == (3, 1536)
    assert pool.take(512) is new


def test_a_layer_fed_by_two_earlier_layers_prefetches_the_latest_ones_inputs():
    # Layer 3 saves the output of layer 2 and a skip from layer 1; backward reaches layer 2 next, so layer 3's backward
    # must bring back layer 2's inputs, whichever of its saved tensors was packed first.
    x = torch.randn(64, requires_grad=True)
    engine = OffloadEngine(FakeStreams(), min_bytes=0)
    t1 = x * 2
    h1 = engine.pack(t1, 1)
    t2 = t1 * 3
    h2 = engine.pack(t2, 2)
    h3 = [engine.pack(t2 * 4, 3), engine.pack(t1 * 5, 3)]  # the main path, then the skip
    h4 = [engine.pack(t1 * 6, 4), engine.pack(t2 * 7, 4)]  # the skip first
    assert engine._previous == {2: 1, 3: 2, 4: 2}
    engine._prefetch_before(3)  # what layer 3's first unpack does
    assert h2.ready is not None and h1.ready is None
    del h1, h2, h3, h4
    engine.release()
