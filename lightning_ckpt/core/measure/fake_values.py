"""A fake-tensor step that takes the branches a real step takes: the batch's integer values kept beside the fakes.

A step measured on fake tensors must hold what the same step holds on real tensors. Two things make a library take
another path there:

- **It asks whether it is traced.** Transformers takes a ``FakeTensor`` for tracing (``is_tracing``) and then
  builds the ``[B, 1, T, T]`` causal mask that a real step leaves to SDPA's ``is_causal``: about 3 bytes per T²,
  which at long lengths is more than the model's activations.
- **It reads a value.** Whether the padding mask is all ones, whether position ids restart (packed sequences): a
  fake tensor has no values, so such a branch cannot be taken at all.

:class:`BatchValues` answers both. It is a dispatch mode that runs beside ``FakeTensorMode``: every integer or bool
tensor computed only from the batch's integer tensors (ids, masks, position ids) and from factory ops (``arange``)
gets a small real twin, computed on the CPU, and a value read from such a tensor (``.item()``, ``bool()``) is
answered from its twin. Floating-point tensors never get one, and neither does a tensor larger than a few times the
batch's largest integer tensor, so the real memory it uses stays that of the batch. While it runs, Transformers'
tracing check no longer counts fake tensors (:func:`untraced_fakes`): with values to read, the real path can be
taken.

Example::

    >>> from torch._subclasses import FakeTensorMode
    >>> mask = torch.ones(2, 5, dtype=torch.long)
    >>> fake_mode = FakeTensorMode()
    >>> with fake_mode:
    ...     fake_mask = fake_mode.from_tensor(mask)
    >>> with fake_mode, BatchValues({fake_mask: mask}):
    ...     bool((fake_mask.sum() == fake_mask.numel()).item()), int(torch.arange(4).sum())
    (True, 6)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
from torch._subclasses import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["BatchValues", "real_branches", "untraced_fakes"]

#: Ops whose value is read on the host: answered from the twin instead of raising on a fake tensor.
_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
          torch.ops.aten.equal.default}
#: A twin is kept for tensors up to this many times the batch's largest integer tensor (never a T x T mask).
_SIZE_FACTOR = 4


def _exact(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())


def _written(func: Any, args: tuple[Any, ...], kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (``add_``'s self, an ``out=``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


class BatchValues(TorchDispatchMode):
    """Keep real twins of the integer tensors computed from ``twins`` (fake tensor -> its real value) and from
    factory ops, and answer value reads (``.item()``, ``bool()``, ``torch.equal``) from them. Enter it inside the
    ``FakeTensorMode`` it serves (see the module's example)."""

    def __init__(self, twins: Mapping[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self._twins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        with _disable_current_modes():  # it may be made inside the fake mode
            for fake, real in twins.items():
                self._twins[fake] = real.detach().cpu()
        largest = max((t.numel() for t in twins.values() if _exact(t)), default=0)
        self._max_numel = max(_SIZE_FACTOR * largest, 1024)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        known = all(t in self._twins for t in tensors) and torch.Tag.nondeterministic_seeded not in func.tags
        if known and tensors and func in _READS:
            return self._on_twins(func, args, kwargs)
        out = func(*args, **kwargs)
        if known and all(_exact(t) and t.numel() <= self._max_numel for t in tree_flatten(out)[0]
                         if isinstance(t, torch.Tensor)):
            self._pair(out, self._on_twins(func, args, kwargs))
        else:  # an op that writes into a twinned tensor from what has no twin: that twin no longer holds
            for t in _written(func, args, kwargs):
                self._twins.pop(t, None)
        return out

    def _on_twins(self, func: Any, args: tuple[Any, ...], kwargs: dict) -> Any:
        """``func`` run on the twins, on the CPU, outside every mode."""
        def twin(x: Any) -> Any:
            return self._twins[x] if isinstance(x, torch.Tensor) else x

        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        with _disable_current_modes():
            return func(*tree_map(twin, args), **tree_map(twin, kwargs))

    def _pair(self, out: Any, real: Any) -> None:
        for fake, twin in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, torch.Tensor) and isinstance(twin, torch.Tensor):
                self._twins[fake] = twin


@contextlib.contextmanager
def untraced_fakes() -> Iterator[None]:
    """While inside, Transformers' tracing check (``is_tracing``) does not take a fake tensor for tracing, so a
    model takes the branches it takes on real tensors (with :class:`BatchValues` to read their values). Nothing
    happens where Transformers has not been imported.

    Example::

        >>> with untraced_fakes():
        ...     pass
    """
    # Not imported here: a model of Transformers has imported it already, and without one nothing is to be patched.
    import_utils = sys.modules.get("transformers.utils.import_utils")
    if import_utils is None or not hasattr(import_utils, "is_fake_tensor"):  # the 4.x line checks no fake tensors
        yield
        return
    original = import_utils.is_fake_tensor
    import_utils.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


@contextlib.contextmanager
def real_branches(reals: Mapping[Any, Any]) -> Iterator[None]:
    """Enter inside a ``FakeTensorMode``: the step takes the branches a real step takes (:func:`untraced_fakes`),
    reading values from the real integer tensors of ``reals`` (fake -> real; other entries are passed over) and
    what is computed from them (:class:`BatchValues`)."""
    twins = {fake: real for fake, real in reals.items()
             if isinstance(fake, torch.Tensor) and _exact(real) and not isinstance(real, FakeTensor)}
    with untraced_fakes(), BatchValues(twins):
        yield
