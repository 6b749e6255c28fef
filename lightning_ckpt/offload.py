"""Where saved tensors live: hooks that keep tensors saved for backward in host memory.

Around a checkpointed layer the only tensors saved for backward are the layer's inputs (torch's
checkpoint saves them through the active saved-tensor hooks), so wrapping the checkpoint call in
:class:`OffloadToHost` moves exactly those inputs to pinned host memory in forward and back to their
device in backward. The copies run on a side stream so that they overlap compute:

- forward: the device->host copy starts on the side stream after an event on the compute stream; the
  engine holds the device tensor until that copy is known to be done (see :meth:`OffloadEngine._retire`);
- backward: layers run in reverse, so unpacking layer ``i``'s inputs starts the host->device copy of
  layer ``i-1``'s; the compute stream waits on that copy's event only when it needs the tensor;
- host buffers come from a :class:`HostPool` that is reused across steps and grows to the largest step;
- tensors under ``min_bytes`` (default 1 MiB), parameters and tensors on other devices stay where they are.

Scheduling talks to a small stream/event interface (:class:`Streams`): :class:`DeviceStreams` for CUDA
(or any device module with streams and events) and :class:`FakeStreams`, which runs copies on the CPU
late and in a shuffled order, so the same logic is tested on machines without an accelerator.
One engine is shared per device and thread (:func:`default_engine`); :func:`use_engine` puts another in
charge, and :func:`release_all` drops every pooled host buffer (call it at teardown). Plain PyTorch;
nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> layer = torch.nn.Linear(8, 8)
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
    ...     with OffloadToHost():
    ...         y = checkpoint(layer, x, use_reentrant=False)
    ...     y.sum().backward()
    >>> engine.stats.to_host_copies, engine.stats.offloaded_bytes
    (1, 64)
    >>> torch.equal(layer.weight.grad, x.detach().sum(0).expand(8, 8))
    True
"""

from __future__ import annotations

import itertools
import random
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt.profiling import report_held

DEFAULT_MIN_BYTES = 1 << 20
"""Tensors smaller than this stay on the device: copying them costs more than it saves."""

DEFAULT_LAG = 2
"""A forward copy may still run while this many later checkpointed layers start; then the compute stream waits."""

_warned_cpu = False


def _warn_cpu_once() -> None:
    global _warned_cpu
    if not _warned_cpu:
        _warned_cpu = True
        warnings.warn(
            "lightning_ckpt: `offload=True` has no effect here: the saved layer inputs are already in host (CPU)"
            " memory. Offload moves them off an accelerator.",
            stacklevel=3,
        )


# ----------------------------------------------------------------------------------------------------------------
# The stream/event interface


class Streams(Protocol):
    """What the engine needs from a device: a compute stream, one side stream for copies, and events.

    ``after`` lists events the side stream must reach before it starts a copy; the returned event marks the copy's
    end. ``wait`` makes the compute stream wait for an event (the host does not block); ``done`` asks without waiting.
    """

    def offloadable(self, tensor: torch.Tensor) -> bool: ...

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def record(self) -> Any: ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceStreams:
    """Copies on a side stream of an accelerator that has streams and events (CUDA, or its peers in ``torch``).

    Example::

        streams = DeviceStreams("cuda:0")
    """

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._module = torch.get_device_module(self.device.type)
        # A device without streams (MPS) copies in line on its one queue, as offload did before side streams.
        self._side = self._module.Stream(self.device) if hasattr(self._module, "Stream") else None

    def offloadable(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Allocated on the compute stream: the tensor is the compute stream's once the copy is done, so autograd may
        # free it there without `record_stream`. The side stream waits for an event recorded after this allocation
        # (see `OffloadEngine._start_to_device`), so kernels still using the recycled block finish before the copy.
        return torch.empty(like.shape, dtype=like.dtype, device=device)

    def record(self) -> Any:
        if self._side is None:
            return None
        event = self._module.Event()
        event.record(self._module.current_stream(self.device))
        return event

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any:
        if self._side is None:
            dst.copy_(src)
            return None
        for event in after:
            if event is not None:
                self._side.wait_event(event)
        with self._module.stream(self._side):
            dst.copy_(src, non_blocking=True)
            event = self._module.Event()
            event.record(self._side)
        return event

    to_host = _copy
    to_device = _copy

    def wait(self, event: Any) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        if self._side is not None:
            self._side.synchronize()


class FakeStreamError(RuntimeError):
    """The engine broke a stream rule that real hardware would not have reported (the fake backend's finding)."""


@dataclass(eq=False)
class _FakeCopy:
    source: Any  # () -> Tensor | None: weak for a device->host copy (the engine must keep the tensor alive)
    dst: torch.Tensor
    after: tuple[Any, ...]
    kind: str
    order: int
    reads: int
    writes: int
    performed: bool = False


class FakeStreams:
    """A CPU stand-in for a device: "device" tensors are CPU tensors, copies are host-to-host and run late.

    A copy is queued and performed only when something forces it: a ``wait`` on its event (which also performs a
    random, shuffled subset of the other queued copies), a ``done`` query that decides, at random, that it has finished,
    or a later copy that lists it in ``after``. So copies run out of order wherever the rules allow. Breaking a rule is
    visible: fresh host buffers and device tensors are filled with NaN bytes (a missing ``wait`` hands out NaN),
    a device->host copy only holds a weak reference to its source (freeing it before the copy ran raises
    :class:`FakeStreamError`), and queuing a copy that touches memory a queued copy still uses, without waiting for
    it, raises :class:`FakeStreamError`.

    Example::

        >>> streams = FakeStreams(seed=0)
        >>> src, dst = torch.arange(4.0), streams.host_buffer(16).view(torch.float32)
        >>> event = streams.to_host(src, dst, after=[streams.record()])
        >>> bool(dst.isnan().all())  # not run yet
        True
        >>> streams.wait(event)
        >>> dst
        tensor([0., 1., 2., 3.])
    """

    def __init__(self, seed: int = 0, complete_probability: float = 0.3) -> None:
        self._rng = random.Random(seed)
        self.complete_probability = complete_probability
        self._pending: list[_FakeCopy] = []
        self._orders = itertools.count()
        self.performed = 0
        self.out_of_order = 0  # copies performed before one queued earlier
        self._last_order = -1

    def offloadable(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty(like.shape, dtype=like.dtype, device=device)
        out.untyped_storage().fill_(0xFF)
        return out

    def record(self) -> Any:
        return None  # compute "runs" eagerly here: whatever it issued is already done

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> _FakeCopy:
        return self._queue(weakref.ref(src), src, dst, after, "to_host")

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> _FakeCopy:
        return self._queue(lambda: src, src, dst, after, "to_device")

    def wait(self, event: Any) -> None:
        if event is None or event.performed:
            return
        others = [c for c in self._pending if c is not event and self._rng.random() < 0.5]
        batch = [event, *others]
        self._rng.shuffle(batch)
        for copy in batch:
            self._perform(copy)

    def done(self, event: Any) -> bool:
        if event is None or event.performed:
            return True
        if self._rng.random() < self.complete_probability:
            self._perform(event)
            return True
        return False

    def synchronize(self) -> None:
        for copy in list(self._pending):
            self._perform(copy)

    def _queue(self, source: Any, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any], kind: str) -> _FakeCopy:
        copy = _FakeCopy(source, dst, tuple(e for e in after if e is not None), kind, next(self._orders),
                         src.untyped_storage().data_ptr(), dst.untyped_storage().data_ptr())
        covered = self._closure(copy.after)
        for other in self._pending:
            touches = {other.reads, other.writes} & {copy.writes} or other.writes == copy.reads
            if touches and other not in covered:
                raise FakeStreamError(f"a {kind} copy was queued on memory that a queued {other.kind} copy still uses,"
                                      " without waiting for its event")
        self._pending.append(copy)
        return copy

    def _closure(self, events: Sequence[_FakeCopy]) -> set[_FakeCopy]:
        seen: set[_FakeCopy] = set()
        stack = list(events)
        while stack:
            copy = stack.pop()
            if copy not in seen:
                seen.add(copy)
                stack.extend(copy.after)
        return seen

    def _perform(self, copy: _FakeCopy) -> None:
        if copy.performed:
            return
        for dep in copy.after:
            self._perform(dep)
        src = copy.source()
        if src is None:
            raise FakeStreamError(f"the source of a {copy.kind} copy was freed before the copy ran: hold it until the"
                                  " copy's event is done")
        copy.dst.copy_(src)
        copy.performed = True
        self._pending.remove(copy)
        self.performed += 1
        if copy.order < self._last_order:
            self.out_of_order += 1
        self._last_order = max(self._last_order, copy.order)


# ----------------------------------------------------------------------------------------------------------------
# The host buffer pool


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # uint8, `size` bytes
    size: int
    last_event: Any = None  # the end of the last copy that touched it


class HostPool:
    """Reusable host buffers: a buffer freed in one step serves the same-sized tensor in the next.

    The pool never holds more bytes than the most it ever had in use at once (the largest step): when a request fits
    no free buffer, free buffers are dropped, oldest first, until the new one fits under that bound.

    Example::

        >>> pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        >>> a = pool.take(1000); pool.give(a); b = pool.take(1000)
        >>> a is b, pool.allocated_bytes, pool.allocations
        (True, 1024, 1)
    """

    GRANULE = 512

    def __init__(self, allocate: Any) -> None:
        self._allocate = allocate
        self._free: list[_Buffer] = []
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self._all: list[weakref.ref[torch.Tensor]] = []

    def take(self, nbytes: int) -> _Buffer:
        size = -(-max(nbytes, 1) // self.GRANULE) * self.GRANULE
        fits = [b for b in self._free if size <= b.size <= 2 * size]
        if fits:
            buffer = min(fits, key=lambda b: b.size)
            self._free.remove(buffer)
        else:
            bound = max(self.peak_in_use_bytes, self.in_use_bytes + size)
            while self._free and self.allocated_bytes + size > bound:
                self.allocated_bytes -= self._free.pop(0).size
            buffer = _Buffer(self._allocate(size), size)
            self._all.append(weakref.ref(buffer.data))
            self.allocated_bytes += size
            self.allocations += 1
        self.in_use_bytes += buffer.size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def give(self, buffer: _Buffer) -> None:
        self.in_use_bytes -= buffer.size
        self._free.append(buffer)

    def clear(self) -> None:
        """Drop the free buffers (buffers still held for a backward return here when it is done with them)."""
        self.allocated_bytes -= sum(b.size for b in self._free)
        self._free.clear()
        self.peak_in_use_bytes = self.in_use_bytes

    def live_buffers(self) -> int:
        """How many buffers this pool ever allocated are still alive anywhere."""
        return sum(ref() is not None for ref in self._all)


# ----------------------------------------------------------------------------------------------------------------
# The engine


@dataclass
class OffloadStats:
    """What an engine did, cumulatively: bytes moved or kept, copies issued, and how backward found its inputs."""

    offloaded_bytes: int = 0
    kept_bytes: int = 0
    to_host_copies: int = 0
    to_device_copies: int = 0
    prefetched: int = 0  # inputs whose device copy was started (or found) before their own unpack
    reused_sources: int = 0  # inputs whose device tensor was still held (forward copy in flight): no copy back needed


@dataclass(eq=False)
class _InFlight:
    source: Optional[torch.Tensor]
    event: Any
    group: int


class _Handle:
    """What autograd holds instead of an offloaded tensor."""

    def __init__(self, engine: OffloadEngine, group: int, like: torch.Tensor, buffer: _Buffer, flight: _InFlight):
        self.engine = engine
        self.group = group
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.buffer = buffer
        self.host = buffer.data[: like.numel() * like.element_size()].view(like.dtype).view(like.shape)
        self.flight = flight
        self.ready: Optional[tuple[torch.Tensor, Any]] = None  # the device tensor and the event to wait on

    def __del__(self) -> None:
        try:
            self.engine._forget(self)
        except Exception:  # interpreter shutdown
            pass


class OffloadEngine:
    """Offloads the tensors saved inside :class:`OffloadToHost` to host memory and brings them back, overlapped.

    Args:
        streams: the device's streams (:class:`DeviceStreams`) or the CPU fake (:class:`FakeStreams`).
        min_bytes: tensors smaller than this stay on the device.
        lag: how many later checkpointed layers may start before the compute stream waits for a forward copy.
            The engine holds each device tensor until its copy is done, so this bounds the extra device memory.

    Example::

        >>> engine = OffloadEngine(FakeStreams(), min_bytes=0)
        >>> packed = engine.pack(torch.ones(4), group=0)
        >>> engine.unpack(packed)
        tensor([1., 1., 1., 1.])
    """

    def __init__(self, streams: Streams, min_bytes: int = DEFAULT_MIN_BYTES, lag: int = DEFAULT_LAG) -> None:
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"`min_bytes` must be an int >= 0 (bytes below which a tensor stays on the device),"
                             f" got {min_bytes!r}. Pass e.g. {DEFAULT_MIN_BYTES} (1 MiB) or 0 to offload everything.")
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"`lag` must be an int >= 0 (checkpointed layers a forward copy may overlap), got {lag!r}."
                             f" Pass e.g. {DEFAULT_LAG}.")
        self.streams = streams
        self.min_bytes = min_bytes
        self.lag = lag
        self.pool = HostPool(streams.host_buffer)
        self.stats = OffloadStats()
        self._lock = threading.RLock()  # backward (and so unpack and handle deaths) may run on autograd's threads
        self._in_flight: list[_InFlight] = []
        self._groups: dict[int, list[weakref.ref[_Handle]]] = {}

    def pack(self, tensor: torch.Tensor, group: int) -> Union[torch.Tensor, _Handle]:
        """Start copying ``tensor`` to host memory and return a handle, or return ``tensor`` if it stays put."""
        nbytes = tensor.numel() * tensor.element_size()
        if (isinstance(tensor, torch.nn.Parameter) or type(tensor) is not torch.Tensor or tensor.layout != torch.strided
                or nbytes < max(self.min_bytes, 1) or not self.streams.offloadable(tensor)):
            report_held(tensor, "kept")  # still held where it is; these hooks hide it from outer counters
            self.stats.kept_bytes += nbytes
            return tensor
        report_held(tensor, "offloaded")
        with self._lock:
            self._retire(force_before=group - self.lag)
            buffer = self.pool.take(nbytes)
            # The data without the autograd graph: holding `tensor` itself would keep every earlier layer's graph alive.
            tensor = tensor.detach()
            flight = _InFlight(tensor, None, group)
            handle = _Handle(self, group, tensor, buffer, flight)
            # Only a position on the compute stream is needed: `tensor` is fully written by the kernels issued so far.
            after = [self.streams.record(), buffer.last_event]
            flight.event = buffer.last_event = self.streams.to_host(tensor, handle.host, after)
            # The device tensor must outlive its copy. We hold a reference (in `_in_flight`) until the copy's event is
            # done rather than `record_stream` it on the side stream: with `record_stream` the allocator would keep
            # the block until some later allocation happens to poll the event, so peak memory would depend on timing;
            # holding it makes the lifetime explicit, bounded by `lag`, and checkable on the fake backend.
            self._in_flight.append(flight)
            self._groups.setdefault(group, []).append(weakref.ref(handle))
            self.stats.offloaded_bytes += nbytes
            self.stats.to_host_copies += 1
        return handle

    def unpack(self, handle: _Handle) -> torch.Tensor:
        """The device tensor for ``handle``; starts bringing back the inputs of the layer backward needs next."""
        with self._lock:
            self._retire(force_before=None)
            if handle.ready is not None:
                self.stats.prefetched += 1
            else:
                self._prepare_group(handle.group)
            tensor, event = handle.ready
            handle.ready = None  # a second backward through the graph (retain_graph) copies again
            self._prefetch_before(handle.group)
            if event is not None:
                self.streams.wait(event)
            return tensor

    def release(self) -> None:
        """Finish every copy, drop held device tensors and free the pooled host buffers (e.g. at teardown)."""
        with self._lock:
            self.streams.synchronize()
            for flight in self._in_flight:
                flight.source = None
            self._in_flight.clear()
            self.pool.clear()

    def _retire(self, force_before: Optional[int]) -> None:
        """Let go of device tensors whose copy to host is done; make the compute stream wait for those of layers
        before ``force_before`` first (no host sync: the block is then reused only after the copy)."""
        keep = []
        for flight in self._in_flight:
            if self.streams.done(flight.event):
                pass
            elif force_before is not None and flight.group < force_before:
                self.streams.wait(flight.event)
            else:
                keep.append(flight)
                continue
            flight.source = None
        self._in_flight = keep

    def _prepare_group(self, group: int) -> None:
        for ref in self._groups.get(group, []):
            handle = ref()
            if handle is not None and handle.ready is None:
                self._start_to_device(handle)

    def _start_to_device(self, handle: _Handle) -> None:
        source = handle.flight.source
        if source is not None:  # its copy to host is still in flight: the device tensor is right here
            handle.ready = (source, None)
            self.stats.reused_sources += 1
            return
        dst = self.streams.empty_device(handle.host, handle.device)
        event = self.streams.to_device(handle.host, dst, [self.streams.record(), handle.buffer.last_event])
        handle.buffer.last_event = event
        handle.ready = (dst, event)
        self.stats.to_device_copies += 1

    def _prefetch_before(self, group: int) -> None:
        """Backward runs layers in reverse: the next inputs it needs are those of the latest earlier layer."""
        earlier = [g for g in self._groups if g < group]
        if earlier:
            self._prepare_group(max(earlier))

    def _forget(self, handle: _Handle) -> None:
        with self._lock:
            refs = self._groups.get(handle.group)
            if refs is not None:
                refs[:] = [r for r in refs if r() is not None and r() is not handle]
                if not refs:
                    del self._groups[handle.group]
            self.pool.give(handle.buffer)


# ----------------------------------------------------------------------------------------------------------------
# Which engine, and the hooks


_local = threading.local()
_engines: dict[tuple[int, torch.device], OffloadEngine] = {}
_engines_lock = threading.Lock()
_groups = itertools.count(1)


def default_engine(device: Union[str, torch.device]) -> OffloadEngine:
    """The engine this thread uses for tensors on ``device``, created on first use (tune it through its attributes).

    Example::

        default_engine("cuda:0").min_bytes = 4 << 20  # keep tensors under 4 MiB on the GPU
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (threading.get_ident(), device)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = OffloadEngine(DeviceStreams(device))
        return _engines[key]


@contextmanager
def use_engine(engine: OffloadEngine) -> Iterator[OffloadEngine]:
    """Offload every tensor saved inside :class:`OffloadToHost` in this thread through ``engine``, on any device."""
    if not isinstance(engine, OffloadEngine):
        raise TypeError(f"`use_engine` takes an `OffloadEngine`, got {type(engine).__name__}. Build one with"
                        " `OffloadEngine(DeviceStreams('cuda'))` or `OffloadEngine(FakeStreams())`.")
    previous = getattr(_local, "engine", None)
    _local.engine = engine
    try:
        yield engine
    finally:
        _local.engine = previous


def release_all() -> None:
    """Release every default engine's held tensors and host buffers (for a trainer's teardown)."""
    with _engines_lock:
        engines = list(_engines.values())
    for engine in engines:
        engine.release()


def _pack(tensor: torch.Tensor) -> Any:
    engine = getattr(_local, "engine", None)
    if engine is None:
        if tensor.device.type == "cpu" or isinstance(tensor, torch.nn.Parameter):
            if tensor.device.type == "cpu":
                _warn_cpu_once()
            report_held(tensor, "kept")  # still held where it is; these hooks hide it from outer counters
            return tensor
        engine = default_engine(tensor.device)
    return engine.pack(tensor, getattr(_local, "group", 0))


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    return packed.engine.unpack(packed)


class OffloadToHost(saved_tensors_hooks):
    """Saved-tensor hooks that keep accelerator tensors saved for backward in pinned host memory.

    One instance wraps one checkpointed layer call: it is what tells the engine where one layer's inputs end and the
    next one's begin, so that backward can bring back the next layer's inputs while the current one runs. Parameters
    are never moved (they stay resident anyway). CPU tensors are left where they are, with a one-time warning that
    offload does nothing on a CPU-only run (unless :func:`use_engine` put a fake device in charge).
    """

    def __init__(self) -> None:
        super().__init__(_pack, _unpack)

    def __enter__(self) -> None:
        self._outer_group = getattr(_local, "group", 0)
        _local.group = next(_groups)
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        _local.group = self._outer_group
