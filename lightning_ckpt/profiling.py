"""Measure what checkpointing trades: bytes held for backward and FLOPs.

Both are exact and machine-independent: bytes are counted with saved-tensor hooks, FLOPs with
``torch.utils.flop_counter.FlopCounterMode``. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(8, 8)
    >>> with SavedTensorCounter(exclude=layer.parameters()) as saved:
    ...     loss = layer(torch.randn(4, 8)).sum()
    >>> saved.bytes  # the input, 4 * 8 float32
    128
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

HeldKind = Literal["offloaded", "kept"]
_held_observers: list[Callable[[torch.Tensor, HeldKind], None]] = []


def report_held(tensor: torch.Tensor, kind: HeldKind) -> None:
    """Tell active counters about a tensor held for backward that saved-tensor hooks cannot see.

    ``"offloaded"``: moved to host memory by offload's own saved-tensor hooks (hooks do not stack:
    the innermost pair wins). ``"kept"``: an op output that selective checkpointing keeps in its cache.
    """
    for observer in _held_observers:
        observer(tensor, kind)


def _storage_key(tensor: torch.Tensor) -> tuple[Any, int]:
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr()


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views and shared buffers count once).

    Example::

        >>> x = torch.zeros(10)
        >>> tensor_bytes([x, x[:5], None])
        40
    """
    seen: set[tuple[Any, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta" or _storage_key(tensor) in seen:
            continue
        seen.add(_storage_key(tensor))
        total += tensor.untyped_storage().nbytes()
    return total


class SavedTensorCounter(saved_tensors_hooks):
    """Count the bytes of tensors saved for backward while active, each storage once.

    ``bytes`` stay on the tensors' own devices (outputs kept by ``mode="selective"`` included);
    ``offloaded_bytes`` were moved to host memory by ``offload=True``. Both reach this counter through
    :func:`report_held` where saved-tensor hooks cannot see them. Storages of ``exclude`` (usually the
    model's parameters, which stay resident whatever is saved) are not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: set[tuple[Any, int]] = set()
        self._offloaded_seen: set[tuple[Any, int]] = set()
        self.bytes = 0
        self.offloaded_bytes = 0
        super().__init__(self._pack, lambda tensor: tensor)

    def _count(self, tensor: torch.Tensor, seen: set[tuple[Any, int]]) -> int:
        key = _storage_key(tensor)
        if key in self._excluded or key in seen or tensor.device.type == "meta":
            return 0
        seen.add(key)
        return tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += self._count(tensor, self._seen)
        # Not `tensor` itself: a saved output would then hold its own grad_fn, a cycle that is never freed.
        return tensor.detach()

    def _held(self, tensor: torch.Tensor, kind: HeldKind) -> None:
        if kind == "offloaded":
            self.offloaded_bytes += self._count(tensor, self._offloaded_seen)
        else:
            self.bytes += self._count(tensor, self._seen)

    def __enter__(self) -> SavedTensorCounter:
        _held_observers.append(self._held)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _held_observers.remove(self._held)


def count_flops(fn: Callable[[], Any]) -> int:
    """Total FLOPs that ``fn()`` runs (forward, backward and any recomputation inside it).

    Example::

        >>> layer = torch.nn.Linear(8, 8)
        >>> count_flops(lambda: layer(torch.randn(4, 8)))
        512
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
