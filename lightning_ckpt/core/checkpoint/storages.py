"""What identifies a tensor's storage, the bytes behind tensors, and the report of tensors held for backward.

The small helpers that checkpointing itself needs (offload, selective policies and compression report what they hold;
compression counts bytes) and that :mod:`lightning_ckpt.core.measure.profiling`'s counters build on; they live here,
below the measuring code, so that ``core/checkpoint`` imports nothing above it. ``profiling`` re-exports them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Literal, Optional

import torch

__all__ = ["HeldKind", "local_shard", "report_held", "storage_key", "tensor_bytes"]

HeldKind = Literal["offloaded", "kept"]
_held_observers: list[Callable[[torch.Tensor, HeldKind], None]] = []


def report_held(tensor: torch.Tensor, kind: HeldKind) -> None:
    """Tell active counters about a tensor held for backward that saved-tensor hooks cannot see.

    ``"offloaded"``: moved to host memory by offload's own saved-tensor hooks (hooks do not stack:
    the innermost pair wins). ``"kept"``: an op output that selective checkpointing keeps in its cache.
    """
    for observer in _held_observers:
        observer(tensor, kind)


def storage_key(tensor: torch.Tensor) -> tuple[Any, int]:
    """What identifies ``tensor``'s storage (views share it) for as long as it lives, for real and fake tensors alike.

    Not the data pointer: a counter that outlives a storage would take the next storage the allocator puts at that
    address for the same one (CUDA's caching allocator does so at once). The storage's Python object lives as long
    as the storage (torch keeps it), so a number given to it on first sight is never handed to another storage.

    Example::

        >>> x = torch.zeros(4)
        >>> storage_key(x) == storage_key(x[1:]) != storage_key(x.clone())
        True
    """
    storage = tensor.untyped_storage()
    try:
        number = storage._lightning_ckpt_key
    except AttributeError:
        number = storage._lightning_ckpt_key = next(_storage_numbers)
    return tensor.device, number


_storage_numbers = itertools.count()


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and their optimizer state), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views and shared buffers count once).

    A DTensor counts this rank's shard; fake tensors count what their real counterparts would hold; meta
    tensors count nothing.

    Example::

        >>> x = torch.zeros(10)
        >>> tensor_bytes([x, x[:5], None])
        40
    """
    seen: set[tuple[Any, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = local_shard(tensor)
        if tensor.device.type == "meta" or storage_key(tensor) in seen:
            continue
        seen.add(storage_key(tensor))
        total += tensor.untyped_storage().nbytes()
    return total
