"""Which layers share one re-run: the key of :func:`_rerun_key`, equal for an identical layer called alike.

:class:`~lightning_ckpt.core.measure.layer_costs.LayerCostRecorder` re-runs a layer to measure it
(:mod:`~lightning_ckpt.core.measure.rerun`); what the re-run measures depends on the layer's forward and class, each
submodule's class, training flag, configuration, parameters and buffers, and on its call's arguments, not on which of
the model's layers it is. Layers with equal keys (a transformer's blocks) are re-run once per step. Configuration no
code of the layer reads outside ``__init__`` (:func:`_names_read`: a block's index) is left out of the key. Plain
PyTorch.

Example::

    >>> from torch import nn
    >>> a, b, x = nn.Linear(4, 4), nn.Linear(4, 4), torch.randn(2, 4)
    >>> _rerun_key(a, (x,), {}, set()) == _rerun_key(b, (x,), {}, set())  # the same shapes: one re-run
    True
    >>> _rerun_key(a, (x,), {}, set()) == _rerun_key(nn.Linear(4, 8), (x,), {}, set())
    False
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Hashable
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils._pytree import tree_flatten

from lightning_ckpt.core.checkpoint.selection import class_path
from lightning_ckpt.core.checkpoint.tiling import TRANSFORMERS_FAMILIES, TiledForward, is_tiled
from lightning_ckpt.core.measure.profiling import storage_key
from lightning_ckpt.core.measure.rerun import _plain_forward


#: What every module keeps in its ``__dict__`` (parameters, buffers, submodules, hooks, the training flag): the rest
#: of a module's ``__dict__`` is its own configuration.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
#: Transformers' attention classes that read their ``layer_idx`` in forward only to index the KV cache
#: (``cache.update(key, value, self.layer_idx)``, read in transformers 4.57 and 5.25): with no cache in the call it
#: cannot change what the forward does, so decoder layers differing only in it share one re-run. (A call with a cache
#: gets no key at all: a cache is an argument that is neither a tensor nor a plain value.)
_CACHE_INDEX = frozenset(f"transformers.models.{m}.modeling_{m}.{c}Attention"
                         for m, c in TRANSFORMERS_FAMILIES)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
#: Values compared by value in a key; any other object in a layer's configuration is compared by identity, and in
#: its call's arguments it is not compared at all (no reuse).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum)


def _rerun_key(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               resident: set[tuple[Any, int]]) -> Optional[Hashable]:
    """What a re-run of ``layer`` on ``args`` and ``kwargs`` measures depends on: equal keys measure the same
    (:class:`~lightning_ckpt.core.measure.rerun._Rerun`), so a transformer's identical blocks are re-run once per step, not once each.

    The layer's forward and class, and for it and each submodule its class, training flag, configuration (the rest of
    its ``__dict__``: plain values by value, other objects by identity), parameters and buffers; the arguments'
    structure, plain values and tensors; autocast. A tensor counts by its metadata and storage (shape, strides,
    offset, dtype, device, ``requires_grad``, the storage's size, which tensors share it, whether it is a parameter
    of the model's). ``None`` (measure it on its own) when a submodule or the module globals have hooks, or an
    argument is another object or a tensor not strided and plain (sparse, a DTensor).
    """
    if any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS):
        return None
    seen: dict[tuple[Any, int], int] = {}  # storage -> the order in which it was first met
    forward = _plain_forward(layer)
    parts: list[Any] = [forward.__func__ if getattr(forward, "__self__", None) is layer else _Same(forward)]
    read = frozenset().union(*(_names_read(type(sub)) for sub in layer.modules()))
    for name, sub in layer.named_modules(remove_duplicate=False):
        if sub is not layer and any(getattr(sub, hooks) for hooks in _HOOKS):
            return None
        # Plain data no code of the layer's modules reads outside __init__ (litgpt's `block_idx`, the qualified name
        # PEFT keeps in each adapter's `kwargs`) cannot change what the forward does: left out, so that blocks
        # differing only in it share one re-run.
        reads = read - {"layer_idx"} if class_path(type(sub)) in _CACHE_INDEX else read
        config = {k: v for k, v in sub.__dict__.items()
                  if k not in _MODULE_INTERNALS and (sub is not layer or k != "forward")
                  and not (k not in reads and _plain_data(v))}
        if is_tiled(sub):  # tiled alike in every block: the same tiles, whatever module they belong to
            tiled = config["forward"]
            config["forward"] = (TiledForward, tiled.tile_tokens, tiled.original)
        values = _values_key((config, sub._parameters, sub._buffers), seen, resident, by_identity=True)
        if values is None:
            return None
        parts.append((name, type(sub), sub.training, values))
    call = _values_key((args, kwargs), seen, resident, by_identity=False)
    if call is None:
        return None
    devices = sorted({device.type for device, _ in seen})
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices
                if torch.amp.is_autocast_available(d)]
    return tuple(parts), call, tuple(autocast)


@functools.lru_cache(maxsize=None)
def _names_read(cls: type) -> frozenset[str]:
    """The names the code of ``cls``'s own methods and properties reads (``co_names``, functions nested in them
    included), ``__init__`` left out; ``nn.Module``'s and ``object``'s are not looked at.

    Example::

        >>> class Attention(nn.Module):
        ...     def __init__(self, index: int) -> None:
        ...         super().__init__()
        ...         self.index, self.heads = index, 4
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return x * self.heads
        >>> sorted(_names_read(Attention))
        ['heads']
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for attr, value in vars(klass).items():
            if attr == "__init__":
                continue
            functions = [value.fget, value.fset] if isinstance(value, property) else [getattr(value, "__func__", value)]
            for function in functions:
                names |= _function_names(function, set())
    return frozenset(names)


def _function_names(function: Any, seen: set[int]) -> set[str]:
    """The names ``function``'s code reads, and the code of what it wraps (a decorator's ``__wrapped__`` or the
    functions in its closure): a decorated ``forward``'s own body is there."""
    if id(function) in seen or not hasattr(function, "__code__"):
        return set()
    seen.add(id(function))
    names = _code_names(function.__code__)
    inner = [getattr(function, "__wrapped__", None)] + [cell.cell_contents for cell in function.__closure__ or ()
                                                         if _cell_filled(cell)]
    for other in inner:
        names |= _function_names(getattr(other, "__func__", other), seen)
    return names


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _code_names(code: Any) -> set[str]:
    """The names ``code`` reads as attributes or globals, and the identifiers it holds as strings (``getattr(self,
    "name")``), its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
        elif isinstance(const, str) and const.isidentifier():
            names.add(const)
    return names


def _plain_data(value: Any) -> bool:
    """Whether ``value`` is a plain value, or a dict, list or tuple of them (no object its code could call)."""
    if isinstance(value, dict):
        return all(_plain_data(k) and _plain_data(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain_data(v) for v in value)
    return isinstance(value, _PLAIN)


def _values_key(values: Any, seen: dict[tuple[Any, int], int], resident: set[tuple[Any, int]],
                by_identity: bool) -> Optional[Hashable]:
    """``values``' structure and leaves as :func:`_rerun_key` compares them; ``None`` when a leaf cannot be."""
    leaves, spec = tree_flatten(values)
    keys: list[Hashable] = []
    for leaf in leaves:
        key: Optional[Hashable]
        if isinstance(leaf, torch.Tensor):
            key = _tensor_key(leaf, seen, resident)
        elif isinstance(leaf, _PLAIN):
            key = type(leaf), leaf
        elif _stateless_module(leaf):
            key = type(leaf), leaf.training
        elif type(leaf) is functools.partial:  # one per instance (Transformers' GELUTanh): by what it calls
            key = _values_key((leaf.func, leaf.args, leaf.keywords), seen, resident, by_identity)
        else:
            key = _Same(leaf) if by_identity else None
        if key is None:
            return None
        keys.append(key)
    return spec, tuple(keys)


def _stateless_module(obj: object) -> bool:
    """Whether ``obj`` is a module with no state of its own: no parameters, buffers, submodules or attributes beyond a
    fresh module's. Such a module held as a plain attribute (the ``Func`` that kernels' ``use_kernelized_func`` puts
    on each of Transformers 5's attentions, wrapping its rotary function) computes what its class does; it is keyed
    by its class, so that layers holding one each still share a re-run."""
    return (isinstance(obj, nn.Module) and not (obj._parameters or obj._buffers or obj._modules)
            and obj.__dict__.keys() <= _MODULE_INTERNALS)


class _Same:
    """An object in a key, equal only to itself; held, so that no other object takes its ``id`` while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _tensor_key(tensor: torch.Tensor, seen: dict[tuple[Any, int], int],
                resident: set[tuple[Any, int]]) -> Optional[Hashable]:
    if tensor.layout != torch.strided or hasattr(tensor, "to_local"):
        return None
    storage = storage_key(tensor)
    return (type(tensor), tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device,
            tensor.requires_grad, tensor.is_leaf, tensor.untyped_storage().nbytes(),
            seen.setdefault(storage, len(seen)), storage in resident)
