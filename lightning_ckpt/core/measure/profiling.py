"""Measure what checkpointing trades: bytes held for backward and FLOPs.

Both are exact and machine-independent: bytes are counted with saved-tensor hooks, FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` (:func:`count_flops`) or, for the recompute cost of a plan,
:class:`OpCostMode` (which also charges element-wise ops). Both work on fake tensors
(``torch._subclasses.FakeTensorMode``) exactly as on real ones, so a model too large for this machine
can be measured without allocating its memory. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(8, 8)
    >>> with SavedTensorCounter(exclude=layer.parameters()) as saved:
    ...     loss = layer(torch.randn(4, 8)).sum()
    >>> saved.bytes  # the input, 4 * 8 float32
    128
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

# Moved down to core/checkpoint (offload, policies and compress use them), re-exported here as before.
from lightning_ckpt.core.checkpoint.storages import (HeldKind, _held_observers, local_shard, report_held, storage_key,
                                                     tensor_bytes)

__all__ = ["SAC_HOOKS_WARNING", "HeldKind", "LiveBytes", "OpCostMode", "OpRecordMode", "OpRun", "SavedTensorCounter",
           "binary_unit", "count_cost", "count_flops", "format_bytes", "format_flops", "hidden_from_counters",
           "local_shard", "op_cost", "optimizer_state_bytes", "report_held", "storage_key", "tensor_bytes"]

_aten = torch.ops.aten


@contextmanager
def hidden_from_counters() -> Iterator[None]:
    """Counters active outside this block do not hear :func:`report_held` inside it; those entered inside do.

    For work whose saved tensors are not the step's (the planner's measuring re-runs): the innermost
    saved-tensor hooks already hide them from outer counters, and this hides what those hooks report.

    Example::

        >>> with SavedTensorCounter() as outer:
        ...     with hidden_from_counters(), SavedTensorCounter() as inner:
        ...         y = torch.randn(4, requires_grad=True).exp()
        >>> inner.bytes, outer.bytes  # exp saves its output, 4 float32
        (16, 0)
    """
    outer = list(_held_observers)
    _held_observers.clear()
    try:
        yield
    finally:
        _held_observers[:0] = outer  # before any counter entered inside and still active


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of all tensors in the optimizers' state (e.g. Adam's two moments per parameter)."""
    return tensor_bytes(t for optimizer in optimizers for state in optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor))


SAC_HOOKS_WARNING = r"A saved_tensors_hooks context .* is active around a selective activation checkpoint region"
"""The start of torch's FutureWarning (torch >= 2.14) for saved-tensor hooks around a selective-checkpoint region."""


class SavedTensorCounter(saved_tensors_hooks):
    """Count the bytes of tensors saved for backward while active, each storage once.

    ``bytes`` stay on the tensors' own devices (outputs kept by ``mode="selective"`` included);
    ``offloaded_bytes`` were moved to host memory by ``offload=True``. Both reach this counter through
    :func:`report_held` where saved-tensor hooks cannot see them. Storages of ``exclude`` (usually the
    model's parameters, which stay resident whatever is saved) are not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(t) for t in exclude}
        self._seen: set[tuple[Any, int]] = set()
        self._offloaded_seen: set[tuple[Any, int]] = set()
        self.bytes = 0
        self.offloaded_bytes = 0
        super().__init__(self._pack, lambda tensor: tensor)

    def _count(self, tensor: torch.Tensor, seen: set[tuple[Any, int]]) -> int:
        key = storage_key(tensor)
        if key in self._excluded or key in seen or tensor.device.type == "meta":
            return 0
        seen.add(key)
        return tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += self._count(tensor, self._seen)
        report_held(tensor, "kept")  # saved-tensor hooks do not nest: counters entered before this one see it here
        # Not `tensor` itself: a saved output would then hold its own grad_fn, a cycle that is never freed.
        return tensor.detach()

    def _held(self, tensor: torch.Tensor, kind: HeldKind) -> None:
        if kind == "offloaded":
            self.offloaded_bytes += self._count(tensor, self._offloaded_seen)
        else:
            self.bytes += self._count(tensor, self._seen)

    def __enter__(self) -> SavedTensorCounter:
        # torch >= 2.14 warns on every selective-checkpoint region under any saved-tensor hooks that their outputs
        # bypass the hooks. Here that is known and right: kept outputs reach this counter through `report_held`,
        # and a storage routed through `_pack` as well is counted once. Only that warning, only while counting.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=SAC_HOOKS_WARNING, category=FutureWarning)
        _held_observers.append(self._held)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _held_observers.remove(self._held)
        self._quiet.__exit__(*exc)


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


def _cpu_flash_attention_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch's registry has no formula for the CPU attention kernel; the math is the same as the GPU one's.
_EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {}
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_attention_flops
    _EXTRA_FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_attention_backward_flops


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one ATen op call: torch's formula where it has one, else one per output element (views: 0)."""
    packet = func.overloadpacket
    if packet in _EXTRA_FORMULAS:
        return int(_EXTRA_FORMULAS[packet](*args, **kwargs))
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if func.is_view:
        return 0
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class OpCostMode(TorchDispatchMode):
    """Count the FLOPs (see :func:`op_cost`) of every op run while active, in order.

    ``log`` holds ``(flops, op)`` per op call (``op`` the ATen overload, e.g. ``aten.addmm.default``);
    ``total`` their sum. Under ``FakeTensorMode`` (entered first) it counts the same as on real tensors.

    Example::

        >>> layer = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8)
        >>> with OpCostMode() as cost:
        ...     _ = torch.relu(layer(x))
        >>> cost.total  # addmm: 2 * 4 * 8 * 8; relu: one per output element
        544
    """

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, Any]] = []
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_cost(func, args, kwargs, out)
        self.log.append((flops, func))
        self.total += flops
        return out


@dataclass(frozen=True)
class OpRun:
    """One ATen op call as :class:`OpRecordMode` saw it: what it cost, read, wrote and created."""

    op: Any  # the ATen overload
    flops: int  # as :func:`op_cost` counts them
    io_bytes: int  # bytes of its tensor arguments and outputs: what a memory-bound kernel reads and writes
    created: dict[tuple[Any, int], int]  # storages new in its outputs (not an input's): key -> bytes
    read: frozenset[tuple[Any, int]]  # storages of its tensor arguments
    written: frozenset[tuple[Any, int]]  # storages it writes in place (its schema's ``Tensor(a!)`` arguments)
    position: int  # its index in the mode's ``log`` plus one: the log ends with this op when it has run


class OpRecordMode(OpCostMode):
    """:class:`OpCostMode` that also keeps an :class:`OpRun` per op, for the op-level planner.

    Ops that selective checkpointing does not show its policy (``detach`` and metadata queries, torch's
    ``SAC_IGNORED_OPS``) are in ``log`` but not in ``runs``, so ``runs[i]`` is the ``i``-th op a selective
    checkpoint policy sees when the same code runs under it.

    Example::

        >>> layer, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
        >>> with OpRecordMode() as mode:
        ...     _ = torch.relu(layer(x))
        >>> [(str(r.op), sum(r.created.values())) for r in mode.runs]  # t is a view: it creates nothing
        [('aten.t.default', 0), ('aten.addmm.default', 32), ('aten.relu.default', 32)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[OpRun] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func not in _sac_ignored_ops():
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            read = frozenset(storage_key(t) for t in inputs)
            created = {storage_key(t): t.untyped_storage().nbytes() for t in outputs if storage_key(t) not in read}
            io = sum(t.numel() * t.element_size() for t in inputs + outputs)
            self.runs.append(OpRun(func, self.log[-1][0], io, created, read, _written(func, args, kwargs or {}),
                                   len(self.log)))
        return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops made while active that are still alive, after every op (a view or an in-place
    result makes none); :meth:`peak` is the most alive at once since the last :meth:`mark`.

    A storage is remembered by a weak reference (this keeps nothing alive); its birth and death are kept as events,
    so that storages can be left out of the count after the fact (for example the gradients of weights, known only
    once the backward has returned them).

    Example::

        >>> x = torch.randn(1000)
        >>> with LiveBytes() as live:
        ...     y = x * 2        # 4000 B, kept
        ...     z = (y + 1) * 3  # 4000 B for y + 1, freed once the product exists: 12000 B at most
        ...     live.mark()
        ...     del z
        ...     w = y.exp()
        >>> live.peak(), live.peak(exclude=[y])  # since the mark: y and z, then y and w; without y
        (8000, 4000)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[Any, int], tuple[Any, int]] = {}  # storage key -> (weak reference, bytes)
        self._events: list[tuple[tuple[Any, int], int]] = []  # (storage key, +bytes when made, -bytes when freed)
        self._start = 0  # the events since the mark count
        self._at_mark: dict[tuple[Any, int], int] = {}  # what was alive at the mark

    def mark(self) -> None:
        """Count from here, starting from what is alive now."""
        self._forget_dead()
        self._start = len(self._events)
        self._at_mark = {key: nbytes for key, (_, nbytes) in self._live.items()}

    def peak(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """The most bytes alive at once since the mark, the storages of ``exclude`` left out (from their last birth
        on: an earlier storage at the same address still counts)."""
        left_out = {storage_key(t) for t in exclude}
        events = self._events[self._start:]
        born = {key: i for i, (key, nbytes) in enumerate(events) if nbytes > 0 and key in left_out}
        alive = sum(nbytes for key, nbytes in self._at_mark.items() if key not in left_out or key in born)
        most = alive
        for i, (key, nbytes) in enumerate(events):
            if key in left_out and (key not in born or i >= born[key]):
                continue
            alive += nbytes
            most = max(most, alive)
        return most

    def _forget_dead(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
                self._events.append((key, -nbytes))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._forget_dead()  # first: a storage freed by this op may have left its address to one of the outputs
        read = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                key = storage_key(tensor)  # a view or an in-place result (of a weight, say) makes no storage
                if key not in self._live and key not in read and tensor.untyped_storage().nbytes():
                    storage = tensor.untyped_storage()
                    self._live[key] = (storage._weak_ref(), storage.nbytes())
                    self._events.append((key, storage.nbytes()))
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._forget_dead()
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live.clear()


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[tuple[Any, int]]:
    """Storages of the arguments ``func``'s schema marks as written in place (``add_``'s self, an ``out=``)."""
    written = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written |= {storage_key(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)}
    return frozenset(written)


def _sac_ignored_ops() -> Any:
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    return SAC_IGNORED_OPS


def count_cost(fn: Callable[[], Any]) -> int:
    """FLOPs (as :class:`OpCostMode` counts them) that ``fn()`` runs, recomputation included."""
    with OpCostMode() as cost:
        fn()
    return cost.total


def format_bytes(n: float) -> str:
    """Bytes for people: ``format_bytes(3 * 2**20)`` is ``'3.0 MiB'``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def binary_unit(num_bytes: float) -> tuple[str, int]:
    """The unit that :func:`format_bytes` writes ``num_bytes`` in, and its size in bytes: for an axis whose largest
    figure is ``num_bytes``.

    Example::

        >>> binary_unit(3 * 2**20), binary_unit(1023), binary_unit(2**30)
        (('MiB', 1048576), ('B', 1), ('GiB', 1073741824))
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return unit, size
    return "B", 1


def format_flops(n: float) -> str:
    """FLOPs for people: ``format_flops(2.5e9)`` is ``'2.5 GFLOP'``."""
    for unit in ("", "K", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.0f} FLOP" if unit == "" else f"{n:.1f} {unit}FLOP"
        n /= 1000
    return f"{n:.1f} TFLOP"
