"""Copies of saved tensors found again: a storage that several layers save is copied (offloaded, compressed) once.

:func:`view_key` identifies the view a tensor is of its storage; :class:`SavedCopies` maps it, weakly, to the copy
made of it, while the tensor is alive and unchanged. :class:`~lightning_ckpt.core.checkpoint.offload.OffloadEngine`
finds a host copy there (a mask, Transformers' ``position_embeddings``), and
:mod:`~lightning_ckpt.core.checkpoint.compress` a compressed one. Plain PyTorch.

Example::

    >>> copies = SavedCopies()
    >>> mask, copy = torch.ones(4), torch.ones(4)
    >>> copies.put(mask, copy)
    >>> copies.get(mask) is copy  # a second layer saving the same mask finds the first copy
    True
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Generic, Optional, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SavedCopies", "view_key"]


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
