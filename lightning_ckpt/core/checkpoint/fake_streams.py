"""A CPU stand-in for an accelerator's streams, so the offload engine's scheduling is tested without one.

:class:`FakeStreams` implements :class:`~lightning_ckpt.core.checkpoint.streams.Streams` on the CPU: "device" tensors are CPU
tensors and every copy runs late, in a shuffled order, wherever the stream rules allow. A rule the engine breaks that
real hardware would not report (a missing wait, a tensor freed under its copy) raises :class:`FakeStreamError`. The
offload tests and ``benchmarks/bench_offload.py --cpu-smoke`` run the engine on it.

Example::

    >>> import torch
    >>> streams = FakeStreams(seed=0)
    >>> src, dst = torch.arange(4.0), streams.host_buffer(16).view(torch.float32)
    >>> event = streams.to_host(src, dst, after=[])
    >>> del src  # freed before its copy ran: on a device the copy would read a block handed to other kernels
    >>> streams.wait(event)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_ckpt.core.checkpoint.fake_streams.FakeStreamError: the source of a to_host copy was freed before the copy ran: ...
"""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.core.checkpoint.host_pool import pinned_size

__all__ = ["FakeStreamError", "FakeStreams"]


class FakeStreamError(RuntimeError):
    """The engine broke a stream rule that real hardware would not have reported (the fake backend's finding)."""


@dataclass(eq=False)
class _FakeCopy:
    source: Any  # () -> Tensor | None: weak for a device->host copy (the engine must keep the tensor alive)
    dst: Any  # () -> Tensor | None: weak for a host->device copy (the engine must keep its destination alive)
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
    visible:

    - fresh host buffers and device tensors are filled with NaN bytes (a missing ``wait`` hands out NaN);
    - a device->host copy only holds a weak reference to its source, a host->device copy to its destination: freeing
      either before the copy ran (on a device the caching allocator would hand that block to other kernels) raises
      :class:`FakeStreamError`, at the copy or at the next call into the fake;
    - queuing a copy that touches memory a queued copy still uses, without waiting for it, raises it too;
    - host buffers model torch's caching host allocator: a dropped buffer stays pinned (``pinned_bytes``) until
      ``empty_host_cache``, and sizes are rounded up as :func:`~lightning_ckpt.core.checkpoint.host_pool.pinned_size` says.

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
        self._broken: list[str] = []
        self.performed = 0
        self.out_of_order = 0  # copies performed before one queued earlier
        self._last_order = -1
        self.live_host_bytes = 0  # pinned buffers alive
        self.cached_host_bytes = 0  # pinned buffers dropped, still held by the (modelled) caching allocator

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned by this fake device: live buffers and the allocator's cache."""
        return self.live_host_bytes + self.cached_host_bytes

    def offloadable(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def host_size(self, nbytes: int) -> int:
        return pinned_size(nbytes)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self._check()
        buffer = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        size = self.host_size(nbytes)
        self.live_host_bytes += size
        weakref.finalize(buffer, self._host_buffer_dropped, size)
        return buffer

    def _host_buffer_dropped(self, size: int) -> None:
        self.live_host_bytes -= size
        self.cached_host_bytes += size

    def empty_host_cache(self) -> None:
        self.cached_host_bytes = 0

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
        out.untyped_storage().fill_(0xFF)
        return out

    def record(self) -> Any:
        self._check()
        return None  # compute "runs" eagerly here: whatever it issued is already done

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> _FakeCopy:
        return self._queue(weakref.ref(src), lambda: dst, src, dst, after, "to_host")

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> _FakeCopy:
        copy = self._queue(lambda: src, weakref.ref(dst), src, dst, after, "to_device")
        weakref.finalize(dst, self._destination_dropped, copy)
        return copy

    def _destination_dropped(self, copy: _FakeCopy) -> None:
        if not copy.performed:
            self._broken.append("the destination of a to_device copy was freed before the copy landed: on a device"
                                " its block would be reused while the copy still writes into it")

    def _check(self) -> None:
        if self._broken:
            raise FakeStreamError(self._broken[0])

    def wait(self, event: Any) -> None:
        self._check()
        if event is None or event.performed:
            return
        others = [c for c in self._pending if c is not event and self._rng.random() < 0.5]
        batch = [event, *others]
        self._rng.shuffle(batch)
        for copy in batch:
            self._perform(copy)

    def done(self, event: Any) -> bool:
        self._check()
        if event is None or event.performed:
            return True
        if self._rng.random() < self.complete_probability:
            self._perform(event)
            return True
        return False

    def synchronize(self) -> None:
        self._check()
        for copy in list(self._pending):
            self._perform(copy)

    def _queue(self, source: Any, dst_ref: Any, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any],
               kind: str) -> _FakeCopy:
        self._check()
        copy = _FakeCopy(source, dst_ref, tuple(e for e in after if e is not None), kind, next(self._orders),
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
        src, dst = copy.source(), copy.dst()
        if src is None:
            raise FakeStreamError(f"the source of a {copy.kind} copy was freed before the copy ran: hold it until the"
                                  " copy's event is done")
        if dst is None:
            raise FakeStreamError(f"the destination of a {copy.kind} copy was freed before the copy landed: hold it"
                                  " until the copy's event is done")
        dst.copy_(src)
        copy.performed = True
        self._pending.remove(copy)
        self.performed += 1
        if copy.order < self._last_order:
            self.out_of_order += 1
        self._last_order = max(self._last_order, copy.order)
