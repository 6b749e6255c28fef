"""The activation peak of a step, measured without the package's counters: storages alive at each op.

A dispatch mode sees every op of the forward, the backward and any recompute. It remembers each output's
storage (a weak reference, so it keeps nothing alive) and, after each op, drops those that have died. Replaying
the births and deaths gives the bytes alive after every op; the peak leaves out the storages named in ``exclude``
(the parameters' gradients, which live on after the step). Storages made before the mode was entered (parameters,
the batch) are never counted, nor fake tensors' (they hold no memory).

    with LiveStorages() as live:
        loss_fn().backward()
    peak = live.peak(exclude=grad_storages(model))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorages(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[Any, int]] = {}  # data pointer -> (weak reference, bytes)
        self.events: list[tuple[int, int]] = []  # (data pointer, +bytes when made / -bytes when freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Deaths first: a storage freed by this op may have left its address to one of the outputs.
        for key, (ref, nbytes) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
                self.events.append((key, -nbytes))
        # A view or an in-place result makes no storage: a parameter's transpose is not an activation.
        read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)}
        for tensor in tree_leaves(out):
            # Fake tensors (the package prices a chunked head on them inside a step) hold no memory.
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and not isinstance(tensor, FakeTensor):
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live and key not in read:
                    self._live[key] = (storage._weak_ref(), nbytes)
                    self.events.append((key, nbytes))
        return out

    def alive(self) -> int:
        """Bytes of the storages made inside the mode that are still alive now."""
        return sum(nbytes for ref, nbytes in self._live.values() if not torch.UntypedStorage._expired(ref))

    def peak(self, exclude: set[int] = frozenset()) -> int:
        """The most bytes alive after any op, leaving out the storages still alive at the end whose data pointer is in
        ``exclude`` (an earlier storage at the same address, freed before, still counts)."""
        last_birth = {key: i for i, (key, nbytes) in enumerate(self.events) if nbytes > 0 and key in exclude}
        alive = most = 0
        for i, (key, nbytes) in enumerate(self.events):
            if last_birth.get(key) != i and not (nbytes < 0 and last_birth.get(key, len(self.events)) < i):
                alive += nbytes
                most = max(most, alive)
        return most


def grad_storages(module: nn.Module) -> set[int]:
    """The data pointers of ``module``'s parameter gradients."""
    return {p.grad.untyped_storage().data_ptr() for p in module.parameters() if p.grad is not None}


def counted_peak(model: nn.Module, loss_fn: Any) -> int:
    """The activation peak of one forward and backward of ``loss_fn()``: storages made during the step and alive after
    each op, the parameters' gradients left out (they start from None and are cleared after)."""
    model.zero_grad(set_to_none=True)
    with LiveStorages() as live:
        loss_fn().backward()
    peak = live.peak(exclude=grad_storages(model))
    model.zero_grad(set_to_none=True)
    return peak
