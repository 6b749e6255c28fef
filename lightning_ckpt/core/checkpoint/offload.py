"""Where saved tensors live: hooks that keep tensors saved for backward in host memory.

Around a checkpointed layer the only tensors saved for backward are the layer's inputs (torch's
checkpoint saves them through the active saved-tensor hooks), so wrapping the checkpoint call in
:class:`OffloadToHost` moves exactly those inputs to pinned host memory in forward and back to their
device in backward. The copies run on a side stream so that they overlap compute:

- forward: the device->host copy starts on the side stream after an event on the compute stream; the
  engine holds the device tensor until that copy is known to be done (see :meth:`OffloadEngine._retire`),
  and holds the newest layer's past it, since a backward that follows at once needs it first;
- backward: layers run in reverse, so unpacking layer ``i``'s inputs starts the host->device copy of the
  inputs of the checkpointed layer before it in the same graph; the compute stream waits on that copy's
  event only when it needs the tensor, and the engine holds the copy's destination until the copy is done,
  even when backward stops early (an exception, ``autograd.grad`` over part of the graph);
- a storage that several layers save (a mask, Transformers' ``position_embeddings``) is copied once each way
  (:class:`SavedCopies` finds the first copy while the tensor is alive and unchanged);
- tensors come back with their own strides (channels-last stays channels-last);
- host buffers come from a :class:`HostPool` that is reused across steps and grows to the largest step; what it
  drops, and what :func:`release_all` frees, is unpinned (not left in torch's caching host allocator);
- tensors under ``min_bytes`` (default 1 MiB), parameters and tensors on other devices stay where they are.

Scheduling talks to a small stream/event interface (:class:`Streams`): :class:`DeviceStreams` for CUDA
(or any device module with streams and events) and :class:`~lightning_ckpt.core.checkpoint.fake_streams.FakeStreams`,
which runs copies on the CPU late and in a shuffled order, so the same logic is tested on machines without an
accelerator.
One engine is shared per device (:func:`default_engine`); :func:`use_engine` puts another in
charge, and :func:`release_all` drops every pooled host buffer (call it at teardown). Plain PyTorch;
nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
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

import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Optional, Protocol, TypeVar, Union

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ckpt.core.checkpoint.storages import report_held

__all__ = ["DEFAULT_LAG", "DEFAULT_MIN_BYTES", "DeviceStreams", "HostPool", "OffloadEngine", "OffloadStats",
           "OffloadToHost", "SavedCopies", "Streams", "default_engine", "engine_for", "is_parameter", "next_group",
           "pack_saved", "pinned_size", "release_all", "unpack_saved", "use_engine", "view_key"]

DEFAULT_MIN_BYTES = 1 << 20
"""Tensors smaller than this stay on the device: copying them costs more than it saves."""

DEFAULT_LAG = 2
"""A forward copy may still run while this many later checkpointed layers start; then the compute stream waits."""

# ----------------------------------------------------------------------------------------------------------------
# The stream/event interface


class Streams(Protocol):
    """What the engine needs from a device: a compute stream, one side stream for copies, and events.

    ``after`` lists events the side stream must reach before it starts a copy; the returned event marks the copy's
    end. ``wait`` makes the compute stream wait for an event (the host does not block); ``done`` asks without waiting.
    ``host_size`` is what pinning ``nbytes`` really takes (the allocator's rounding), and ``empty_host_cache`` gives
    pinned memory that nothing uses back to the system.
    """

    def offloadable(self, tensor: torch.Tensor) -> bool: ...

    def host_size(self, nbytes: int) -> int: ...

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...

    def empty_host_cache(self) -> None: ...

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def record(self) -> Any: ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self) -> None: ...


def pinned_size(nbytes: int) -> int:
    """Bytes that torch's caching host allocator pins for ``nbytes``: it rounds every request up to a power of two.

    Example::

        >>> pinned_size(1000), pinned_size(1024), pinned_size(1025)
        (1024, 1024, 2048)
    """
    return 1 << max(nbytes - 1, 0).bit_length()


def _empty_host_cache() -> None:
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()
    elif hasattr(torch._C, "_host_emptyCache"):  # torch < 2.8
        torch._C._host_emptyCache()


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

    def host_size(self, nbytes: int) -> int:
        return pinned_size(nbytes)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty_host_cache(self) -> None:
        # A pinned tensor that dies goes back to torch's caching host allocator and stays pinned until this call
        # (blocks whose copies are still running are kept by the allocator until their events complete).
        _empty_host_cache()

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Allocated on the compute stream: the tensor is the compute stream's once the copy is done, so autograd may
        # free it there without `record_stream`. The side stream waits for an event recorded after this allocation
        # (see `OffloadEngine._start_to_device`), so kernels still using the recycled block finish before the copy.
        # The engine holds it until the copy's event is done, even if its handle dies first (`_landing`).
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)

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


# ----------------------------------------------------------------------------------------------------------------
# The host buffer pool


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # uint8, at least the requested bytes
    size: int  # what it really pins (the allocator's rounding)
    last_event: Any = None  # the end of the last copy that touched it


class HostPool:
    """Reusable host buffers: a buffer freed in one step serves the same-sized tensor in the next.

    The pool never holds more bytes than the most it ever had in use at once (the largest step): when a request fits
    no free buffer, free buffers are dropped, oldest first, until the new one fits under that bound. Sizes are counted
    as ``round_size`` says the allocator really pins them; after dropping buffers the pool calls ``empty_cache`` so
    that the dropped memory is unpinned, not kept by the allocator's cache.

    Example::

        >>> pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        >>> a = pool.take(1000); pool.give(a); b = pool.take(1000)
        >>> a is b, pool.allocated_bytes, pool.allocations
        (True, 1024, 1)
    """

    GRANULE = 512

    def __init__(self, allocate: Callable[[int], torch.Tensor], round_size: Optional[Callable[[int], int]] = None,
                 empty_cache: Optional[Callable[[], None]] = None) -> None:
        self._allocate = allocate
        self._round = round_size or (lambda n: -(-n // self.GRANULE) * self.GRANULE)
        self._empty_cache = empty_cache or (lambda: None)
        self._free: list[_Buffer] = []
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self._all: list[weakref.ref[torch.Tensor]] = []

    def take(self, nbytes: int) -> _Buffer:
        size = self._round(max(nbytes, 1))
        fits = [b for b in self._free if size <= b.size <= 2 * size]
        if fits:
            buffer = min(fits, key=lambda b: b.size)
            self._free.remove(buffer)
        else:
            bound = max(self.peak_in_use_bytes, self.in_use_bytes + size)
            dropped = False
            while self._free and self.allocated_bytes + size > bound:
                self.allocated_bytes -= self._free.pop(0).size
                dropped = True
            if dropped:
                self._empty_cache()
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
        """Drop and unpin the free buffers (buffers still held for a backward return here when it is done with them)."""
        self.allocated_bytes -= sum(b.size for b in self._free)
        self._free.clear()
        self.peak_in_use_bytes = self.in_use_bytes
        self._empty_cache()

    def live_buffers(self) -> int:
        """How many buffers this pool ever allocated are still alive anywhere."""
        return sum(ref() is not None for ref in self._all)


# ----------------------------------------------------------------------------------------------------------------
# The engine


@dataclass
class OffloadStats:
    """What an engine did, cumulatively: bytes moved or kept, copies issued, and how backward found its inputs.

    Bytes moved in one step are the difference of ``offloaded_bytes`` (device->host) and ``to_device_bytes``
    (host->device) across it.
    """

    offloaded_bytes: int = 0  # copied to host memory (a storage saved by several layers: once)
    kept_bytes: int = 0
    to_host_copies: int = 0
    to_device_copies: int = 0
    to_device_bytes: int = 0
    prefetched: int = 0  # inputs whose device copy was started (or found) before their own unpack
    reused_sources: int = 0  # inputs whose device tensor was still held (copy in flight, or the newest layer's)
    reused_bytes: int = 0  # the bytes of those: they needed no copy back
    shared: int = 0  # saved tensors whose storage another layer had already offloaded: no second copy either way
    shared_bytes: int = 0


@dataclass(eq=False)
class _InFlight:
    """A device->host copy and the device tensor it reads (see :class:`OffloadEngine` for when each field changes)."""

    source: Optional[torch.Tensor]
    event: Any
    group: int
    keep: bool = True


_GROUP_TAG = "lightning_ckpt.offload_group"
_WALK_LIMIT = 10_000


class _Handle:
    """What autograd holds instead of an offloaded tensor (one per view; layers that save the same one share it).

    ``ready`` and ``users`` change as :class:`OffloadEngine` says.
    """

    def __init__(self, engine: OffloadEngine, group: int, like: torch.Tensor, buffer: _Buffer, flight: _InFlight):
        self.engine = engine
        self.groups = [group]
        self.device = like.device
        self.buffer = buffer
        # The source's own layout (channels-last, transposed): the recompute then runs the same kernels.
        stride = torch.empty_like(like, device="meta").stride()
        nbytes = like.numel() * like.element_size()
        self.host = buffer.data[:nbytes].view(like.dtype).as_strided(like.shape, stride)
        self.flight = flight
        self.ready: Optional[tuple[torch.Tensor, Any]] = None
        self.users = 1

    def __del__(self) -> None:
        try:
            self.engine._forget(self)
        except Exception:  # interpreter shutdown
            pass


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()``, which a linear layer saves for backward): it stays put."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class OffloadEngine:
    """Offloads the tensors saved inside :class:`OffloadToHost` to host memory and brings them back, overlapped.

    Backward brings back the inputs of the checkpointed layer that ran before the current one in the same graph (found
    by walking the autograd graph from each layer's inputs to the previous layer's), never another graph's. A device
    tensor that a copy still writes into is held until that copy's event is done, whatever happens to its handle
    (an exception in backward, a partial ``autograd.grad``, a graph dropped after its prefetch started).

    State (changed only under ``_lock``: backward, and so unpacks and handle deaths, may run on autograd's threads).
    A *group* is one :class:`OffloadToHost`, i.e. one layer call; later calls have larger groups.

    - ``_in_flight``: one :class:`_InFlight` per device->host copy whose device tensor (``source``) the engine may
      still hold, because the copy is not known to be done or the tensor is the newest layer's. The engine lets go of
      ``source`` when the copy is done and ``keep`` is off, when a group more than ``lag`` after its own packs (the
      compute stream then waits for the copy), when the handle dies after its copy is done, or at :meth:`release`; each
      ``_retire`` (at every pack and unpack) drops the entries let go of. Empty after :meth:`release`.
    - ``flight.keep``: on from the pack while its group is the newest (the backward that follows at once needs it
      first); off once a later group packs, or when its handle is unpacked or dies.
    - ``_landing``: ``(device tensor, event)`` of host->device copies whose handle died before the copy was known to
      be done (a backward that stopped early): held until the event is done, checked at each ``_retire``; emptied by
      :meth:`release`.
    - ``_groups``: group -> weak references to the live handles that the group saved (a shared handle is listed under
      each group that saved it); what a prefetch brings back. A group's entry goes when its last handle dies, so the
      dict is empty once no graph holds a handle.
    - ``_previous``: group -> the latest earlier group whose inputs lie behind its own in the autograd graph, i.e. the
      layer backward reaches next in the same graph; set at pack, it goes with the group's ``_groups`` entry.
    - ``_shared``: the handle of each view packed (:class:`SavedCopies`), so that a later save of the same view,
      still alive and unchanged, shares that handle's host copy. An entry goes when its handle dies, or is replaced by
      a later pack of the same view. Empty once no graph holds a handle.
    - ``_newest``: the largest group packed so far (``-1`` before any); it only grows.
    - ``handle.ready``: ``None``, or ``(device tensor, event)`` once bringing it back has started (a host->device
      copy, or the still-held ``source`` with no event), by a prefetch or by its own unpack. Unpack hands it out
      and clears it after the last user; if the handle dies first with the copy still running, it moves to
      ``_landing``.
    - ``handle.users``: saved slots holding the handle that have not unpacked it: 1 at its pack, one more per later
      save of the same view, one less per unpack.

    Args:
        streams: the device's streams (:class:`DeviceStreams`) or the CPU fake
            (:class:`~lightning_ckpt.core.checkpoint.fake_streams.FakeStreams`).
        min_bytes: tensors smaller than this stay on the device.
        lag: how many later checkpointed layers may start before the compute stream waits for a forward copy.
            The engine holds each device tensor until its copy is done, so this bounds the extra device memory.

    Example::

        >>> from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
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
        self.pool = HostPool(streams.host_buffer, streams.host_size, streams.empty_host_cache)
        self.stats = OffloadStats()
        self._lock = threading.RLock()
        self._in_flight: list[_InFlight] = []
        self._landing: list[tuple[torch.Tensor, Any]] = []
        self._groups: dict[int, list[weakref.ref[_Handle]]] = {}
        self._previous: dict[int, int] = {}
        self._shared: SavedCopies[_Handle] = SavedCopies()
        self._newest = -1

    def pack(self, tensor: torch.Tensor, group: int, origin: Optional[torch.Tensor] = None) -> Union[torch.Tensor, _Handle]:
        """Start copying ``tensor`` to host memory and return a handle, or return ``tensor`` if it stays put.

        ``origin``: the tensor the layer saved, when ``tensor`` is made from it (a compressed copy, which has no place
        in the autograd graph): its graph tells which layer's inputs to bring back next."""
        nbytes = tensor.numel() * tensor.element_size()
        if (is_parameter(tensor) or type(tensor) is not torch.Tensor or tensor.layout != torch.strided
                or nbytes < max(self.min_bytes, 1) or not self.streams.offloadable(tensor)):
            report_held(tensor, "kept")  # still held where it is; these hooks hide it from outer counters
            self.stats.kept_bytes += nbytes
            return tensor
        report_held(tensor, "offloaded")
        with self._lock:
            self._link(tensor if origin is None else origin, group)
            shared = self._shared.get(tensor)
            if shared is not None:
                self._share(shared, group)
                return shared
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
            self._shared.put(tensor, handle)
            self.stats.offloaded_bytes += nbytes
            self.stats.to_host_copies += 1
        return handle

    def share(self, handle: _Handle, group: int) -> None:
        """Let the layer call ``group`` use ``handle`` too: its tensor is the one another layer saved."""
        with self._lock:
            self._share(handle, group)

    def _share(self, handle: _Handle, group: int) -> None:
        handle.users += 1
        if group not in handle.groups:
            handle.groups.append(group)
            self._groups.setdefault(group, []).append(weakref.ref(handle))
        self.stats.shared += 1
        self.stats.shared_bytes += handle.host.numel() * handle.host.element_size()

    def unpack(self, handle: _Handle) -> torch.Tensor:
        """The device tensor for ``handle``; starts bringing back the inputs of the layer backward needs next."""
        with self._lock:
            self._retire(force_before=None)
            shared = len(handle.groups) > 1
            if handle.ready is not None:
                self.stats.prefetched += 1
            elif shared:  # which layer asks is unknown: bring back this tensor alone
                self._start_to_device(handle)
            else:
                self._prepare_group(handle.groups[0])
            tensor, event = handle.ready
            handle.flight.keep = False
            handle.users -= 1
            # Layers that saved the same storage get this device tensor too; a second backward through the graph
            # (retain_graph) copies again.
            handle.ready = (tensor, None) if handle.users > 0 else None
            if not shared:
                self._prefetch_before(handle.groups[0])
            if event is not None:
                self.streams.wait(event)
            return tensor

    def release(self) -> None:
        """Finish every copy, drop held device tensors and free and unpin the pooled host buffers (e.g. at teardown)."""
        with self._lock:
            self.streams.synchronize()
            for flight in self._in_flight:
                flight.source = None
            self._in_flight.clear()
            self._landing.clear()
            self.pool.clear()

    def _retire(self, force_before: Optional[int]) -> None:
        """Let go of device tensors whose copy is done; make the compute stream wait for the forward copies of layers
        before ``force_before`` first (no host sync: the block is then reused only after the copy)."""
        keep = []
        for flight in self._in_flight:
            if flight.source is None:
                continue
            if self.streams.done(flight.event):
                if flight.keep:
                    keep.append(flight)
                    continue
            elif force_before is not None and flight.group < force_before:
                self.streams.wait(flight.event)
            else:
                keep.append(flight)
                continue
            flight.source = None
        self._in_flight = keep
        # A handle that dies meanwhile (garbage collection can run here) appends to the new list, not the old one.
        landing, self._landing = self._landing, []
        self._landing.extend((t, e) for t, e in landing if not self.streams.done(e))

    def _link(self, tensor: torch.Tensor, group: int) -> None:
        """Note which earlier checkpointed layer of this graph ``tensor`` (an input of ``group``) comes from, and keep
        ``group``'s device tensors as the newest layer's."""
        if group > self._newest:
            self._newest = group
            for flight in self._in_flight:
                flight.keep = False
        node = tensor.grad_fn
        if node is None:
            return
        found = _latest_tagged(node, group)
        if found is not None:
            self._previous[group] = max(found, self._previous.get(group, found))
        node.metadata[_GROUP_TAG] = group

    def _prepare_group(self, group: int) -> None:
        for ref in self._groups.get(group, []):
            handle = ref()
            if handle is not None and handle.ready is None:
                self._start_to_device(handle)

    def _start_to_device(self, handle: _Handle) -> None:
        nbytes = handle.host.numel() * handle.host.element_size()
        source = handle.flight.source
        if source is not None:  # its copy to host is in flight, or it is the newest layer's: it is right here
            handle.ready = (source, None)
            self.stats.reused_sources += 1
            self.stats.reused_bytes += nbytes
            return
        dst = self.streams.empty_device(handle.host, handle.device)
        event = self.streams.to_device(handle.host, dst, [self.streams.record(), handle.buffer.last_event])
        handle.buffer.last_event = event
        handle.ready = (dst, event)
        self.stats.to_device_copies += 1
        self.stats.to_device_bytes += nbytes

    def _prefetch_before(self, group: int) -> None:
        """Backward runs layers in reverse: the next inputs it needs are those of the layer before, in this graph."""
        previous = self._previous.get(group)
        if previous is not None:
            self._prepare_group(previous)

    def _forget(self, handle: _Handle) -> None:
        with self._lock:
            for group in handle.groups:
                refs = self._groups.get(group)
                if refs is not None:
                    refs[:] = [r for r in refs if r() is not None and r() is not handle]
                    if not refs:
                        del self._groups[group]
                        self._previous.pop(group, None)
            flight = handle.flight
            flight.keep = False
            if flight.source is not None and self.streams.done(flight.event):
                flight.source = None
            if handle.ready is not None and not self.streams.done(handle.ready[1]):
                self._landing.append(handle.ready)  # a prefetch still writes into it: held until it lands
            self.pool.give(handle.buffer)


def view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the view ``tensor`` is of its storage: the same elements in the same layout. Unlike
    :func:`~lightning_ckpt.core.checkpoint.storages.storage_key`, which all views of a storage share, two views with other
    offsets, shapes, strides or dtypes get two keys: each is copied on its own.

    Example::

        >>> x = torch.zeros(4, 4)
        >>> view_key(x) == view_key(x.view(4, 4)) != view_key(x[1:])
        True
    """
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


_V = TypeVar("_V")


class SavedCopies(Generic[_V]):
    """The copy made of each saved view (:func:`view_key`), found again while the tensor is alive and unchanged, so
    that a tensor saved by several layers (a mask, a rotary table) is copied and held once.

    Entries hold their copies weakly; a copy's entry goes when the copy dies (unless a newer one replaced it). A view
    whose storage was freed (its address may be reused) or changed in place since (its version) gets nothing.
    Thread-safe: backward may run on autograd's threads.

    Example::

        >>> copies = SavedCopies()
        >>> x = torch.zeros(4)
        >>> copy = x.clone()
        >>> copies.put(x, copy)
        >>> copies.get(x) is copy, copies.get(x[1:])
        (True, None)
        >>> _ = x.add_(1)  # changed in place: the copy is stale
        >>> copies.get(x), len(copies)
        (None, 1)
        >>> del copy
        >>> len(copies)
        0
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[StorageWeakRef, int, weakref.ref[_V]]] = {}
        # Reentrant: a copy's death (and so `_drop`) can come from garbage collection while the lock is held.
        self._lock = threading.RLock()

    def get(self, tensor: torch.Tensor) -> Optional[_V]:
        """The copy put for ``tensor``'s view, if it is alive and the view's storage alive and unchanged since."""
        with self._lock:
            entry = self._entries.get(view_key(tensor))
        if entry is None:
            return None
        storage, version, ref = entry
        copy = ref()
        return None if copy is None or storage.expired() or version != tensor._version else copy

    def put(self, tensor: torch.Tensor, copy: _V) -> None:
        """Remember ``copy`` (weakly) as ``tensor``'s, as the tensor is now."""
        key = view_key(tensor)
        ref = weakref.ref(copy, functools.partial(self._drop, key))
        with self._lock:
            self._entries[key] = (StorageWeakRef(tensor.untyped_storage()), tensor._version, ref)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[Any, ...], ref: weakref.ref[_V]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[2] is ref:  # not a newer copy put under the same key since
                del self._entries[key]


def _latest_tagged(start: Any, group: int) -> Optional[int]:
    """The latest group before ``group`` whose input node lies behind ``start`` in the autograd graph, if any."""
    latest, stack, seen = None, [start], {start}
    for _ in range(_WALK_LIMIT):
        if not stack:
            break
        node = stack.pop()
        tag = node.metadata.get(_GROUP_TAG)
        if tag is not None and tag <= group:
            if tag < group:
                latest = tag if latest is None else max(latest, tag)
            continue  # behind an earlier layer's input lies nothing later; behind this layer's, the walk has been
        for parent, _ in node.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return latest


# ----------------------------------------------------------------------------------------------------------------
# Which engine, and the hooks


_this_thread = threading.local()  # `.engine`: the engine `use_engine` put in charge in this thread
_engines: dict[torch.device, OffloadEngine] = {}  # one per device, shared by threads (the engine has its own lock)
_engines_lock = threading.Lock()
_group_ids = itertools.count(1)  # one per OffloadToHost, increasing: the newest layer call has the largest


def default_engine(device: Union[str, torch.device]) -> OffloadEngine:
    """The engine for tensors on ``device``, created on first use (tune it through its attributes).

    Example::

        default_engine("cuda:0").min_bytes = 4 << 20  # keep tensors under 4 MiB on the GPU
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _engines_lock:
        if device not in _engines:
            _engines[device] = OffloadEngine(DeviceStreams(device))
        return _engines[device]


def engine_for(device: Union[str, torch.device]) -> Optional[OffloadEngine]:
    """The engine that would offload this thread's tensors on ``device`` (its :func:`use_engine` one, else the
    device's default); ``None`` on the CPU, where nothing is offloaded."""
    engine = getattr(_this_thread, "engine", None)
    if engine is not None:
        return engine
    return None if torch.device(device).type == "cpu" else default_engine(device)


@contextmanager
def use_engine(engine: OffloadEngine) -> Iterator[OffloadEngine]:
    """Offload every tensor saved inside :class:`OffloadToHost` in this thread through ``engine``, on any device."""
    if not isinstance(engine, OffloadEngine):
        raise TypeError(f"`use_engine` takes an `OffloadEngine`, got {type(engine).__name__}. Build one with"
                        " `OffloadEngine(DeviceStreams('cuda'))` or `OffloadEngine(FakeStreams())`.")
    previous = getattr(_this_thread, "engine", None)
    _this_thread.engine = engine
    try:
        yield engine
    finally:
        _this_thread.engine = previous


def release_all() -> None:
    """Release every default engine's held tensors and host buffers (for a trainer's teardown)."""
    with _engines_lock:
        engines = list(_engines.values())
    for engine in engines:
        engine.release()


def next_group() -> int:
    """A new layer call's group: larger than every group drawn before (see :class:`OffloadToHost`)."""
    return next(_group_ids)


def pack_saved(tensor: torch.Tensor, group: int, origin: Optional[torch.Tensor] = None) -> Any:
    """What offload's pack hook holds for ``tensor``, saved by the layer call ``group`` (see
    :meth:`OffloadEngine.pack` for ``origin``); :func:`unpack_saved` turns it back into the tensor."""
    engine = getattr(_this_thread, "engine", None)
    if engine is None:
        if tensor.device.type == "cpu" or isinstance(tensor, torch.nn.Parameter):
            report_held(tensor, "kept")  # still held where it is; these hooks hide it from outer counters
            return tensor
        engine = default_engine(tensor.device)
    return engine.pack(tensor, group, origin)


def unpack_saved(packed: Any) -> torch.Tensor:
    """The tensor that :func:`pack_saved` returned ``packed`` for."""
    if isinstance(packed, torch.Tensor):
        return packed
    return packed.engine.unpack(packed)


class OffloadToHost(saved_tensors_hooks):
    """Saved-tensor hooks that keep accelerator tensors saved for backward in pinned host memory.

    Build one per checkpointed layer call: its ``group``, drawn when it is built and bound into its pack hook, is what
    tells the engine where one layer's inputs end and the next one's begin, so that backward can bring back the next
    layer's inputs while the current one runs. Parameters are never moved (they stay resident anyway). CPU tensors are
    left where they are, unless :func:`use_engine` put a fake device in charge (on a CPU-only machine
    :func:`~lightning_ckpt.core.checkpoint.wrapping.apply_checkpointing` says once that ``offload=True`` does nothing).

    Example::

        >>> first, second = OffloadToHost(), OffloadToHost()
        >>> first.group < second.group  # the later layer call: backward needs its inputs first
        True
    """

    def __init__(self) -> None:
        self.group = next_group()
        super().__init__(functools.partial(pack_saved, group=self.group), unpack_saved)
