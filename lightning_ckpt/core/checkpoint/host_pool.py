"""The pinned host memory offload copies into: :class:`HostPool`, reused across steps, and the allocator's rounding.

:class:`HostPool` hands out host buffers and takes them back, so that a buffer freed in one step serves the same-sized
tensor in the next; it never holds more than the most it had in use at once, and what it drops it unpins
(:func:`_empty_host_cache`). :func:`pinned_size` is what torch's caching host allocator really pins for a request.
:class:`~lightning_ckpt.core.checkpoint.offload.OffloadEngine` takes one pool per engine. Plain PyTorch.

Example::

    >>> pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8), round_size=pinned_size)
    >>> a = pool.take(1000); b = pool.take(3000)
    >>> pool.in_use_bytes, pool.allocated_bytes  # rounded up to powers of two
    (5120, 5120)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["HostPool", "pinned_size"]


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
