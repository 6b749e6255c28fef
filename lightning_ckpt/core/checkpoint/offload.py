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
  (:class:`~lightning_ckpt.core.checkpoint.saved_copies.SavedCopies` finds the first copy while the tensor is alive
  and unchanged);
- tensors come back with their own strides (channels-last stays channels-last);
- host buffers come from a :class:`~lightning_ckpt.core.checkpoint.host_pool.HostPool` that is reused across steps and grows to the largest step; what it
  drops, and what :func:`release_all` frees, is unpinned (not left in torch's caching host allocator);
- tensors under ``min_bytes`` (default 1 MiB), parameters and tensors on other devices stay where they are.

Scheduling talks to a small stream/event interface (:class:`~lightning_ckpt.core.checkpoint.streams.Streams`):
:class:`~lightning_ckpt.core.checkpoint.streams.DeviceStreams` for CUDA (or any device module with streams and events) and :class:`~lightning_ckpt.core.checkpoint.fake_streams.FakeStreams`,
which runs copies on the CPU late and in a shuffled order, so the same logic is tested on machines without an
accelerator.
One engine is shared per device (:func:`default_engine`); :func:`use_engine` puts another in
charge, and :func:`release_all` drops every pooled host buffer (call it at teardown). Plain PyTorch;
nothing here imports Lightning.

This module holds the engine and the hooks; the host pool (:mod:`~lightning_ckpt.core.checkpoint.host_pool`), the
streams (:mod:`~lightning_ckpt.core.checkpoint.streams`) and the copies found again
(:mod:`~lightning_ckpt.core.checkpoint.saved_copies`) have their own modules, their names importable from here too.
About 500 lines: :class:`OffloadEngine` (some 240) keeps packing, unpacking and retiring under one lock.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt.core.checkpoint.host_pool import HostPool, _Buffer, pinned_size
from lightning_ckpt.core.checkpoint.saved_copies import SavedCopies, view_key
from lightning_ckpt.core.checkpoint.storages import report_held
from lightning_ckpt.core.checkpoint.streams import DeviceStreams, Streams

# HostPool, pinned_size (host_pool.py), SavedCopies, view_key (saved_copies.py), DeviceStreams and Streams
# (streams.py) live in their own modules; they are named here too, where they were before issue 43.
__all__ = ["DEFAULT_LAG", "DEFAULT_MIN_BYTES", "DeviceStreams", "HostPool", "OffloadEngine", "OffloadStats",
           "OffloadToHost", "SavedCopies", "Streams", "default_engine", "engine_for", "is_parameter", "next_group",
           "pack_saved", "pinned_size", "release_all", "unpack_saved", "use_engine", "view_key"]

DEFAULT_MIN_BYTES = 1 << 20
"""Tensors smaller than this stay on the device: copying them costs more than it saves."""

DEFAULT_LAG = 2
"""A forward copy may still run while this many later checkpointed layers start; then the compute stream waits."""


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
    - ``_shared``: the handle of each view packed (:class:`~lightning_ckpt.core.checkpoint.saved_copies.SavedCopies`), so that a later save of the same view,
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
        streams: the device's streams (:class:`~lightning_ckpt.core.checkpoint.streams.DeviceStreams`) or the CPU fake
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
