"""The memory-budget plan: per-layer costs in, the cheapest checkpointing that fits a budget out.

:func:`plan_checkpointing` measures, for every matched layer, the activation bytes it holds for backward
un-checkpointed (``"none"``) and fully checkpointed (``"full"``: its inputs), and records its forward op by op:
what each op's output would hold if kept and what the op costs to recompute. From that record come the other
choices: ``"selective"`` (keep the outputs of matmul/attention/convolution ops) and ``"ops"``, any point of the
layer's curve of (bytes held, recompute cost) from keeping chosen op outputs (:mod:`lightning_ckpt.core.op_curve`:
in-place and random ops stay with their group). It then picks one choice per layer so that the predicted bytes
fit the budget at the least cost: a multiple-choice knapsack, solved exactly up to a fine quantisation of bytes
(rounded towards safety, so a plan never exceeds its budget). What a plan keeps: the layers (or op outputs) that
hold few bytes per unit of recompute; what it recomputes: those that free most bytes per unit.

The cost is recompute FLOPs by default: exact and the same on every machine. Matmuls, convolutions and attention
count as torch's ``FlopCounterMode`` counts them; every other op counts one FLOP per output element (torch counts
those as zero, which would make element-wise recomputation look free). See :class:`OpCostMode`.

Measuring is safe when memory is short: the step runs once with every matched layer fully
checkpointed, and each layer is re-run alone right after its own checkpointed forward and backpropagated
to its inputs (what its backward has alive at once), its result dropped at once. So planning never holds more
activations than full checkpointing plus one layer's forward and backward, and never runs the whole model
un-checkpointed. The budget bounds the step's activation peak, the backward's included (:func:`held_peak`). The RNG and every buffer are left as they were.
Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Block(nn.Sequential):
    ...     pass
    >>> torch.manual_seed(0) and None
    >>> model = nn.Sequential(*[Block(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
    >>> x = torch.randn(8, 16, requires_grad=True)
    >>> plan = plan_checkpointing(model, lambda: model(x).sum(), 0.6, layer_cls=Block)
    >>> plan.planned_bytes <= plan.peak_bytes <= plan.budget_bytes < plan.baseline_bytes
    True
    >>> plan.layers
    {'0': 'ops', '1': 'full', '2': 'full', '3': 'none'}
    >>> print(plan)  # doctest: +NORMALIZE_WHITESPACE
    layer  class     none   full  selective  FLOPs full  FLOPs selective  choice
    0      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP     ops
    1      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    full
    2      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    full
    3      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    none
      0 (ops): 2.5 KiB, 512 FLOP; keeps addmm; recomputes gelu
    outside the layers: 0 B (in every figure below)
    plan: 3 of 4 layers checkpointed; activations 8.0 KiB (44% of 18.0 KiB without checkpointing), peak 10.5 KiB (budget 12.3 KiB, 20.5 KiB without checkpointing); recompute 34.3 KFLOP per step

The last layer is left plain although it is the one whose inputs are the cheapest to keep: its backward comes
first, while every other layer still holds what it chose, so the step's peak is the 3.5 KiB the first three hold
plus the 7.0 KiB the last one's backward has alive at once.

    >>> plan.apply(model)
    ['0', '1', '2']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Optional, Union

import numpy
import psutil
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_ckpt.core.device_profile import DeviceProfile, resolve_device
from lightning_ckpt.core.layer_state import buffers_restored
from lightning_ckpt.core.offload import DEFAULT_MIN_BYTES
from lightning_ckpt.core.op_curve import OpRecord, add_records, describe, op_curve, op_records, spread
from lightning_ckpt.core.placement import fsdp2
from lightning_ckpt.core.policies import COMPUTE_HEAVY_OPS, keep_ops_context_fn
from lightning_ckpt.core.profiling import (
    OpCostMode,
    LiveBytes,
    OpRecordMode,
    SavedTensorCounter,
    count_cost,
    format_bytes,
    format_flops,
    hidden_from_counters,
    local_shard,
    report_held,
    storage_key,
    tensor_bytes,
)
from lightning_ckpt.core.selection import LayerClassArg, is_inside, layer_classes, parse_memory_budget, select_layers
from lightning_ckpt.core.wrapping import (
    CheckpointOptions,
    apply_checkpointing,
    check_no_nesting,
    is_checkpointed,
    remove_checkpointing,
    restore_caches,
    turn_off_caches,
)

Choice = Literal["none", "full", "selective", "ops"]
#: What a layer may get besides "none": full or selective checkpointing, or an op-level choice of what to keep.
PLAN_MODES = ("full", "selective", "ops")


# ---------------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class LayerCost:
    """What one matched layer holds for backward and costs to recompute, summed over its calls in a step."""

    name: str
    cls: str
    none_bytes: int  # held un-checkpointed
    full_bytes: int  # held fully checkpointed: the layer's tensor inputs
    selective_bytes: int  # held selectively checkpointed: inputs and kept matmul/attention outputs
    offloadable_bytes: int  # the part of the inputs on an accelerator: what offload moves to host memory
    full_flops: int  # recomputed in backward, fully checkpointed
    selective_flops: int  # recomputed in backward, selectively checkpointed (the cheap ops only)
    calls: int = 1
    ops: tuple[OpRecord, ...] = ()  # its forward op by op, for op-level choices (empty: none possible)
    input_sizes: tuple[int, ...] = ()  # bytes of each storage in its held inputs (empty: not recorded)
    saved_sizes: tuple[int, ...] = ()  # bytes of each storage it saves un-checkpointed (empty: not recorded)
    #: The most bytes its backward has alive at once, recompute or not: its inputs, what it saves, the gradients it
    #: makes (the largest over its calls; 0: not measured, taken as ``none_bytes``). See :meth:`backward_peak`.
    transient_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.ops, tuple) or any(isinstance(r, Mapping) for r in self.ops):  # from a state_dict
            object.__setattr__(self, "ops", tuple(OpRecord(**r) if isinstance(r, Mapping) else r for r in self.ops))
        for name in ("input_sizes", "saved_sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def movable_bytes(self, choice: Choice, min_bytes: int = DEFAULT_MIN_BYTES) -> int:
        """Bytes the offload engine would move to host memory for ``choice``: for ``"none"`` what the layer saves,
        else its inputs; storages under ``min_bytes`` stay on the device (without recorded sizes: all of it).

        Example::

            >>> cost = LayerCost("a", "Block", 3000, 1000, 2000, 1000, 10, 1, input_sizes=(1000,),
            ...                  saved_sizes=(1000, 1500, 500))
            >>> cost.movable_bytes("none", min_bytes=1000), cost.movable_bytes("full", min_bytes=1000)
            (2500, 1000)
        """
        if choice == "none":
            sizes, whole = self.saved_sizes, self.none_bytes
        else:
            sizes, whole = self.input_sizes, self.offloadable_bytes
        moved = sum(s for s in sizes if s >= min_bytes) if sizes else whole
        return moved if choice == "none" else min(moved, self.offloadable_bytes)

    def device_bytes(self, choice: Choice, offload: bool = False, keep: Sequence[int] = ()) -> int:
        """Bytes held on the device for ``choice`` (``"ops"``: keeping the op outputs at positions ``keep``);
        with ``offload`` the checkpointed inputs live on the host."""
        if choice == "none":
            return self.none_bytes
        held = {"full": self.full_bytes, "selective": self.selective_bytes}.get(choice)
        if held is None:
            held = self.full_bytes + sum(self.ops[i].bytes for i in keep)
        return held - self.offloadable_bytes if offload else held

    @property
    def backward_peak(self) -> int:
        """The most bytes the layer has alive at once in backward, whatever its choice: a checkpointed layer
        recomputes what an un-checkpointed one kept, so both reach their inputs, what they save and the gradients
        their backward makes (``transient_bytes``; ``none_bytes`` where that was not measured)."""
        return max(self.transient_bytes, self.none_bytes)

    def flops(self, choice: Choice, keep: Sequence[int] = ()) -> int:
        if choice == "ops":
            return self.full_flops - sum(self.ops[i].flops for i in keep)
        return {"none": 0, "full": self.full_flops, "selective": self.selective_flops}[choice]


class _StepCounter(SavedTensorCounter):
    """A saved-tensor counter that reports what it sees to counters outside it.

    Saved-tensor hooks do not stack (the innermost pair wins), so like offload's hooks these report every
    tensor through :func:`report_held`: an outer counter still sees what the planner holds.

    ``resident``, when set, gives the parameters as they are now: FSDP2 gathers a unit's parameters into new
    storages at each forward, so the storages to leave out are looked up again before counting a new one.
    """

    resident: Optional[Callable[[], Iterable[torch.Tensor]]] = None

    def _count(self, tensor: torch.Tensor, seen: set[tuple[Any, int]]) -> int:
        key = storage_key(tensor)
        if self.resident is not None and key not in self._excluded and key not in seen:
            # Replaced, not extended: a freed gathered storage's address may now hold an activation.
            self._excluded = {storage_key(t) for t in self.resident()}
        return super()._count(tensor, seen)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += self._count(tensor, self._seen)
        # A detached alias: returning a saved *output* itself would tie it to its own grad_fn, a reference
        # cycle that outlives the graph (the activations would never be freed).
        held = tensor.detach()
        report_held(held, "kept")
        return held


class _LayerRunCounter(_StepCounter):
    """Counts one isolated layer run, and where in its op log the last tensor was saved."""

    def __init__(self, cost: OpCostMode, exclude: Sequence[torch.Tensor]) -> None:
        super().__init__(exclude=exclude)
        self.cost = cost
        self.last_save = 0
        self.sizes: list[int] = []  # bytes of each new storage saved, in order

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A pack hook runs after the op that saves has been dispatched, so the log ends with that op.
        self.last_save = len(self.cost.log)
        before = self.bytes
        held = super()._pack(tensor)
        if self.bytes > before:
            self.sizes.append(self.bytes - before)
        return held


def _plain_forward(layer: nn.Module) -> Callable[..., Any]:
    """The layer's forward without our checkpoint around it."""
    forward = layer.forward
    if is_checkpointed(layer):
        forward = forward.original if forward.original is not None else type(layer).forward.__get__(layer)
    return forward


def _own_parameters(layer: nn.Module) -> list[torch.Tensor]:
    """The layer's parameters, less those of FSDP units nested inside it (their own hooks gather those)."""
    nested = [name for name, sub in layer.named_modules() if name and isinstance(sub, fsdp2().FSDPModule)]
    return [p for name, p in layer.named_parameters() if not any(is_inside(name, unit) for unit in nested)]


@contextmanager
def _gathered(layer: nn.Module) -> Iterator[None]:
    """The layer's FSDP2-sharded parameters gathered for a re-run of its forward, sharded again after.

    FSDP2's post-forward hook, which runs before the recorder's, has resharded them already. Only the
    measured step pays for this all-gather. A layer whose parameters are gathered (no FSDP, or
    ``reshard_after_forward=False``) is left as it is.
    """
    sharded = any(hasattr(p, "to_local") for p in _own_parameters(layer))
    if not sharded:
        yield
        return
    layer.unshard()  # type: ignore[operator]
    try:
        yield
    finally:
        layer.reshard()  # type: ignore[operator]


def _class_name(layer: nn.Module) -> str:
    """The layer's own class name (``Block``, not the ``FSDPBlock`` that ``fully_shard`` makes of it)."""
    fsdp_module = fsdp2().FSDPModule
    return next(c for c in type(layer).__mro__ if not issubclass(c, fsdp_module)).__qualname__


def _fork_rng(tensors: Sequence[torch.Tensor]) -> Any:
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


class LayerCostRecorder:
    """Measure each layer's :class:`LayerCost` during a step in which every layer is fully checkpointed.

    After each layer's (checkpointed) forward, a hook runs the same layer again, plainly, with the same inputs,
    under a saved-tensor counter and :class:`~lightning_ckpt.core.profiling.OpRecordMode`, with the RNG forked and the
    layer's buffers restored; its result is dropped at once. The op records give the selective point (inputs and
    the outputs of matmul/attention/convolution ops; with ``selective=False`` it is the un-checkpointed one) and
    the layer's op-level curve (:mod:`lightning_ckpt.core.op_curve`); with ``outside_ops=True`` the step's ops outside
    the layers are recorded too (:attr:`outside_ops`, for a predicted step time). ``held_bytes`` is what the fully
    checkpointed step itself held for backward. The re-runs are hidden from counters outside (:func:`~lightning_ckpt.core.profiling.hidden_from_counters`): a monitor counting the step
    sees the step's bytes only.

    Under FSDP2 each layer must be its own unit (as ``fully_shard`` per layer, or the ``fsdp_ckpt`` strategy,
    shards it): the re-run gathers the layer's parameters again (``unshard``) and reshards them after. Each
    rank measures its own batch; parameters count as the storages they have on this rank.

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with LayerCostRecorder(model, [("0", model[0])]) as recorder:
        ...     _ = model(x)
        >>> cost = recorder.costs()[0]
        >>> cost.full_bytes, cost.none_bytes  # the input x: 2 * 4 float32 (the weights do not count)
        (32, 32)
    """

    def __init__(self, module: nn.Module, layers: Sequence[tuple[str, nn.Module]], selective: bool = False,
                 outside_ops: bool = False) -> None:
        self.module = module
        self.layers = list(layers)
        self.selective = selective
        # The step's ops outside the layers, recorded while neither inside a layer nor re-running one.
        self._outside: Optional[OpRecordMode] = OpRecordMode() if outside_ops else None
        self._inside = 0
        fsdp_module = fsdp2().FSDPModule
        for name, layer in self.layers:
            if not isinstance(layer, fsdp_module) and any(hasattr(p, "to_local") for p in _own_parameters(layer)):
                raise ValueError(
                    f"`{name}` has sharded (DTensor) parameters but is not an FSDP unit itself, so its forward cannot"
                    " be re-run to measure it. Shard each layer as its own unit (`strategy='fsdp_ckpt'` does, or call"
                    " `fully_shard` on every layer before the rest of the model), or pass `every_n_layers` instead."
                )
        self._params = list(module.parameters())
        self._sharded = any(hasattr(p, "to_local") for p in self._params)
        self._step = _StepCounter(exclude=self._resident())
        if self._sharded:
            self._step.resident = self._resident
        self._totals = {name: dict.fromkeys(("none", "full", "sel", "off", "fflops", "sflops", "calls", "transient"), 0)
                        for name, _ in self.layers}
        self._ops: dict[str, Optional[tuple[OpRecord, ...]]] = {}
        self._sizes: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name, _ in self.layers}
        self._handles: list[Any] = []
        self._after_layers = 0
        self._last_output: Any = None
        #: The most bytes the backward of the head and loss makes alive at once (the logits' gradient), set by
        #: :meth:`measure_head`; 0 when not measured.
        self.head_peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._step.bytes

    @property
    def head_bytes(self) -> int:
        """Of :attr:`held_bytes`, what the step saved after the last layer (head, loss): the backward frees it
        before it reaches the layers."""
        return self._step.bytes - self._after_layers

    def measure_head(self, loss: torch.Tensor) -> None:
        """Measure :attr:`head_peak_bytes` from the step's ``loss``: the gradients from it down to the last layer's
        output, through :func:`torch.autograd.grad` (the graph is kept, no ``.grad`` is touched).

        Not under FSDP2, whose hooks expect one backward per forward: there it stays 0.
        """
        outputs = [t for t in tree_leaves(self._last_output) if isinstance(t, torch.Tensor) and t.requires_grad]
        self._last_output = None
        if self._sharded or not outputs or not loss.requires_grad:
            return
        with hidden_from_counters(), LiveBytes() as live:
            torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
        self.head_peak_bytes = live.peak()

    def _resident(self) -> list[torch.Tensor]:
        """The parameters' storages on this rank now: shards, and whatever FSDP2 has gathered at the moment."""
        if not self._sharded:
            return self._params
        return [local_shard(p) for p in self.module.parameters()]

    @property
    def outside_ops(self) -> tuple[OpRecord, ...]:
        """The ops the step ran outside the layers (recorded when asked for with ``outside_ops=True``)."""
        if self._outside is None:
            return ()
        return op_records(self._outside.runs, len(self._outside.log), ())

    def __enter__(self) -> LayerCostRecorder:
        for name, layer in self.layers:
            hook = self._hook(name, layer)
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer))
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True, always_call=False))
        self._step.__enter__()
        if self._outside is not None:
            self._outside.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._last_output = None
        if self._outside is not None:
            self._outside.__exit__(*exc)
        self._step.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str, layer: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._leave_layer()
            if module.training and torch.is_grad_enabled():
                self._last_output = output
                self._measure(name, layer, args, kwargs)
        return hook

    def _enter_layer(self, module: nn.Module, args: Any) -> None:
        self._inside += 1
        if self._outside is not None and self._inside == 1:
            self._outside_mark = len(self._outside.runs)

    def _leave_layer(self) -> None:
        self._inside -= 1
        if self._inside == 0:
            self._after_layers = self._step.bytes
        if self._outside is not None and self._inside == 0:
            del self._outside.runs[self._outside_mark:]  # the layer's own ops: in its records

    def _measure(self, name: str, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        totals = self._totals[name]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        excluded = {storage_key(p) for p in self._resident()}
        inputs_held = [t for t in inputs if storage_key(local_shard(t)) not in excluded]
        full = tensor_bytes(inputs_held)
        input_sizes, saved_sizes = self._sizes[name]
        input_sizes += [tensor_bytes([t]) for t in {storage_key(t): t for t in inputs_held}.values()]
        totals["full"] += full
        totals["off"] += tensor_bytes(t for t in inputs_held if t.device.type != "cpu")
        totals["calls"] += 1
        forward = _plain_forward(layer)
        # What the re-run saves is not the step's: outer counters (a MemoryMonitor's) must not hear of it.
        mark = len(self._outside.runs) if self._outside is not None else 0
        with _gathered(layer), hidden_from_counters(), LiveBytes() as live:
            with OpRecordMode() as cost:
                saved, out = self._run(layer, inputs, cost, lambda: forward(*args, **kwargs))
            outputs = [storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            totals["transient"] = max(totals["transient"], full + _backward_bytes(layer, inputs, out, saved, live))
            del out  # and with it everything it saved
        if self._outside is not None:
            del self._outside.runs[mark:]  # the re-run is not the step's
        totals["none"] += saved.bytes
        saved_sizes += saved.sizes
        log = cost.log[:saved.last_save]  # recompute stops after the last saved tensor (early stop)
        totals["fflops"] += sum(flops for flops, _ in log)
        totals["sflops"] += sum(flops for flops, op in log if op not in COMPUTE_HEAVY_OPS)
        records = op_records(cost.runs, saved.last_save, outputs)
        totals["sel"] += full + sum(r.bytes for r in records if r.heavy)
        self._ops[name] = records if totals["calls"] == 1 else add_records(self._ops[name], records)

    def _run(self, layer: nn.Module, inputs: list[torch.Tensor], cost: OpCostMode,
             fn: Callable[[], Any]) -> tuple[_LayerRunCounter, Any]:
        """The counter of one re-run, and its output."""
        with _fork_rng(inputs), buffers_restored(layer), torch.enable_grad():
            with _LayerRunCounter(cost, self._resident()) as saved:
                return saved, fn()

    def costs(self) -> list[LayerCost]:
        """One :class:`LayerCost` per layer, in order (a layer not called in the step holds and costs nothing)."""
        out = []
        for name, layer in self.layers:
            t = self._totals[name]
            out.append(LayerCost(name, _class_name(layer), t["none"], t["full"],
                                 t["sel"] if self.selective else t["none"], t["off"], t["fflops"], t["sflops"],
                                 t["calls"], self._ops.get(name) or (), *map(tuple, self._sizes[name]),
                                 transient_bytes=t["transient"]))
        return out


def _backward_bytes(layer: nn.Module, inputs: Sequence[torch.Tensor], out: Any, saved: _LayerRunCounter,
                    live: LiveBytes) -> int:
    """The most activation bytes alive during the backward of one plain re-run of ``layer`` (``out`` from ``inputs``),
    beyond its inputs: what the re-run saved, the gradient of its output, and the gradients its backward makes.

    The gradients go to the inputs (to the layer's own parameters where no input needs one) through
    :func:`torch.autograd.grad`, so no ``.grad`` is touched; the weights' own gradients do not count. Outputs the
    layer does not save itself do not count either: in the step they are the next layer's inputs, freed before this
    backward. 0 when nothing needs a gradient.
    """
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in inputs if t.requires_grad]
    if not wrt:  # frozen inputs (PEFT): the backward still runs for the layer's own trainable weights
        wrt = [p for p in _own_parameters(layer) if p.requires_grad and not hasattr(p, "to_local")]
    if not outs or not wrt:
        return 0
    live.mark()
    grads = torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    unsaved = [t for t in outs if storage_key(t) not in saved._seen]
    weights = [g for g, t in zip(grads, wrt) if g is not None and isinstance(t, nn.Parameter)]
    return live.peak(exclude=[*unsaved, *weights])


# ------------------------------------------------------------------------------------------- solving


# Where the bytes' common divisor would make too many quanta, bytes are counted in quanta of the shortfall (the bytes
# to free): max(8192, 256 * layers) of them, fewer when the layers have many points (the work is layers x points x
# quanta). Rounding each option down costs at most one quantum per layer.
_UNITS = 1 << 13
_WORK = 4 * 10**8
_MIN_UNITS = 2048
#: Points of a layer's op-level curve offered to the solver (both ends and points evenly spaced in bytes between).
CURVE_POINTS = 24


@dataclass(frozen=True)
class Option:
    """One choice for one layer: its mode, what it holds on the device (and, offloaded, in host memory), what it
    costs, and (``"ops"``) the positions of the ops whose outputs it keeps."""

    choice: Choice
    device_bytes: int
    flops: int
    keep: tuple[int, ...] = ()
    seconds: float = 0.0  # predicted extra step time on a device profile (0 without one)
    host_bytes: int = 0  # moved to host memory by the offload engine (0: not offloaded)

    def cost(self, timed: bool) -> float:
        return self.seconds if timed else self.flops


#: What ``offload`` takes: never, every checkpointed layer's inputs, or the planner's choice per layer.
Offload = Union[bool, Literal["auto"]]


def make_option(cost: LayerCost, choice: Choice, keep: Sequence[int] = (), moved: bool = False,
                device: Optional[DeviceProfile] = None, window: tuple[float, float] = (0.0, 0.0),
                min_bytes: int = DEFAULT_MIN_BYTES) -> Option:
    """``cost``'s layer checkpointed as ``choice`` (keeping the ops at ``keep``), its held tensors offloaded when
    ``moved``: what that holds and costs (seconds on ``device``, see :func:`layer_options`)."""
    host = cost.movable_bytes(choice, min_bytes) if moved else 0
    seconds = 0.0
    if device is not None:
        seconds = extra_seconds(cost, choice, keep, device) + exposed_transfer_seconds(host, device, window)
    return Option(choice, cost.device_bytes(choice, False, keep) - host, cost.flops(choice, keep), tuple(keep), seconds,
                  host)


def layer_options(cost: LayerCost, modes: Sequence[str] = PLAN_MODES, offload: Offload = False,
                  points: int = CURVE_POINTS, device: Optional[DeviceProfile] = None,
                  window: tuple[float, float] = (0.0, 0.0), min_bytes: int = DEFAULT_MIN_BYTES) -> list[Option]:
    """``"none"`` first, then each mode in ``modes`` that frees device bytes; ``"ops"``: points of the layer's
    op-level curve (:func:`~lightning_ckpt.core.op_curve.op_curve`) other than keeping nothing.

    ``offload=True`` moves every checkpointed choice's inputs to host memory; ``"auto"`` offers each choice both
    ways, ``"none"`` included (all the layer saves goes to the host). What moves is what the engine moves
    (:meth:`LayerCost.movable_bytes`). With a ``device`` profile each option is priced in seconds
    (:func:`extra_seconds`, plus the part of its transfers that ``window`` cannot hide: see
    :func:`exposed_transfer_seconds`), and its cost is that; else its FLOPs. An option that holds (on the device
    and the host) and costs no less than another is left out (of equals, the first stays).

    Example::

        >>> cost = LayerCost("a", "Block", 100, 10, 40, 0, full_flops=50, selective_flops=5)
        >>> [(o.choice, o.device_bytes, o.flops) for o in layer_options(cost)]
        [('none', 100, 0), ('full', 10, 50), ('selective', 40, 5)]
    """
    def option(choice: Choice, keep: tuple[int, ...] = (), moved: bool = False) -> Option:
        return make_option(cost, choice, keep, moved, device, window, min_bytes)

    plain: list[tuple[Choice, tuple[int, ...]]] = [("none", ())] + [(m, ()) for m in ("full", "selective") if m in modes]  # type: ignore[misc]
    if "ops" in modes and cost.ops:
        plain += [("ops", p.keep) for p in spread(op_curve(cost.ops), points)[1:]]  # [0] keeps nothing: full
    if offload == "auto":
        options = [option(c, k) for c, k in plain] + [option(c, k, True) for c, k in plain if cost.movable_bytes(c, min_bytes)]
    else:
        options = [option(c, k, bool(offload) and c != "none") for c, k in plain]
    useful = [o for o in options if o.choice == "none" or o.device_bytes < cost.none_bytes]
    timed = device is not None

    def dominated(i: int, option: Option) -> bool:
        mine = (option.device_bytes, option.cost(timed), option.host_bytes)
        return any(all(a <= b for a, b in zip(theirs, mine)) and (j < i or theirs != mine)
                   for j, o in enumerate(useful) if j != i
                   for theirs in [(o.device_bytes, o.cost(timed), o.host_bytes)])

    return [option for i, option in enumerate(useful) if not dominated(i, option)]


def solve(options: Sequence[Sequence[Option]], need_bytes: int, timed: bool = False,
          host_price: float = 0.0, transients: Sequence[int] = (), head: int = 0) -> list[Option]:
    """One option per layer (``options[i][0]`` holding the most) that frees at least ``need_bytes`` of device memory
    with the least total cost (``timed``: predicted seconds, else FLOPs; plus ``host_price`` per host byte, the
    Lagrange multiplier :func:`choose` uses to keep host memory in bounds).

    With ``transients`` (each layer's :attr:`LayerCost.backward_peak`) the bound holds over the backward too: when
    layer ``i``'s backward runs, the layers before it still hold what they chose and layer ``i`` has
    ``transients[i]`` alive, and that must not exceed what the forward of all layers is allowed to end with. So
    the layers before ``i`` must free at least ``need_bytes - sum(options[j][0] for j >= i) + transients[i]``.
    With ``head``, what the head's backward makes at its start (all the forward holds still held), all layers
    together must free ``need_bytes + head``.

    A multiple-choice knapsack by dynamic programming over freed bytes, in quanta of the bytes' greatest common
    divisor (exact) where that makes few enough steps, else in at least 2048 steps; the backward's bounds are floors
    on what the layers before each one free. Each option's freed bytes are rounded down and each floor up, so the result always frees what is asked.
    Ties go to the earlier option: the result is deterministic. Raises ``ValueError`` when even the largest saving
    of every layer is not enough.

    Example::

        >>> a = [Option("none", 100, 0), Option("full", 10, 50)]
        >>> [o.choice for o in solve([a, a, a], 90)]  # the end of the forward alone: the first layer frees 90
        ['full', 'none', 'none']
        >>> [o.choice for o in solve([a, a, a], 90, transients=[120] * 3)]  # the last backward: 200 - 90 + 120
        ['full', 'full', 'none']
    """
    base = [opts[0] for opts in options]
    freed = [[opts[0].device_bytes - o.device_bytes for o in opts] for opts in options]
    floors = _backward_floors(base, need_bytes, transients)
    need_bytes += head
    hardest = max([need_bytes, *floors])
    if hardest <= 0:
        return base
    most = list(itertools.accumulate((max(f) for f in freed), initial=0))
    short = [(floor, most[i]) for i, floor in enumerate([*floors, need_bytes]) if most[i] < floor]
    if short:
        floor, reach = short[0]
        raise ValueError(f"at most {reach} bytes can be freed, {floor} are needed")
    points = sum(len(opts) for opts in options)
    most_units = max(_MIN_UNITS, min(max(_UNITS, 256 * len(options)), _WORK // max(points, 1)))
    # Byte counts share a divisor (element sizes, shapes): in quanta of it the knapsack is exact, where that fits.
    divisor = math.gcd(*(f for fs in freed for f in fs), *(f for f in [*floors, need_bytes] if f > 0))
    if hardest // divisor <= most_units:
        quantum, units = divisor, hardest // divisor
    else:
        quantum, units = hardest / most_units, most_units
    # The floor the layers before each one must reach, and the end's, in quanta (rounded up: towards safety).
    floor_units = [min(units, math.ceil(f / quantum)) if f > 0 else 0 for f in [*floors[1:], need_bytes]]
    # padded[units:] is best (best[j]: least cost freeing >= j quanta); padded[units - s + j] is best[j - s], or
    # best[0] where an option freeing s quanta alone frees j.
    padded = numpy.zeros(2 * units + 1)
    padded[units + 1:] = math.inf
    picks, steps = [], []
    for opts, layer_freed, floor in zip(options, freed, floor_units):
        step = [min(units, int(f // quantum)) for f in layer_freed]
        best, pick = padded[units:].copy(), numpy.zeros(units + 1, dtype=numpy.int16)
        for k in range(1, len(opts)):
            candidate = padded[units - step[k]:2 * units + 1 - step[k]] + _priced(opts[k], timed, host_price)
            better = candidate < best  # strict: ties keep the earlier option
            best[better] = candidate[better]
            pick[better] = k
        best[:floor] = best[floor]  # what frees less than the next layer's floor is no solution
        padded[units:] = best
        padded[:units] = best[0]  # freeing at least a negative amount: at least nothing
        picks.append(pick)
        steps.append(step)
    if math.isinf(float(padded[units + floor_units[-1]])):  # rounding lost the little slack there was
        return [opts[max(range(len(opts)), key=lambda k: (f[k], -_priced(opts[k], timed, host_price)))]
                for opts, f in zip(options, freed)]
    chosen, j = [], floor_units[-1]
    for opts, step, pick, floor in zip(reversed(options), reversed(steps), reversed(picks), reversed(floor_units)):
        k = int(pick[max(j, floor)])
        chosen.append(opts[k])
        j = max(0, max(j, floor) - int(step[k]))
    return chosen[::-1]


def _backward_floors(base: Sequence[Option], need_bytes: int, transients: Sequence[int]) -> list[int]:
    """What the layers before each layer must free for its backward to fit (see :func:`solve`); none without
    ``transients``."""
    if not transients:
        return [0] * len(base)
    after = list(itertools.accumulate((o.device_bytes for o in reversed(base)), initial=0))[::-1]
    return [need_bytes - after[i] + t for i, t in enumerate(transients)]


def held_peak(held: Sequence[int], transients: Sequence[int], host: Sequence[int] = (), head: int = 0) -> int:
    """The most bytes the layers hold at once in a step: at the start of the backward (all the forward holds, with
    the offload engine's newest offloaded layer still on the device, and the ``head`` bytes the head's backward
    makes), or during any layer's backward, where the layers before it still hold ``held`` and it has
    ``transients[i]`` alive (and the engine brings back the next offloaded layer's inputs).

    Example::

        >>> held_peak([10, 10, 100], [120, 120, 120])  # the last layer's backward: 10 + 10 + 120
        140
        >>> held_peak([10, 0, 0], [120, 120, 120], host=[0, 90, 90])  # one offloaded layer back, one kept
        220
    """
    def newest(upto: int) -> int:  # the host bytes of the newest offloaded layer before `upto`
        return next((b for b in reversed(host[:upto]) if b), 0)

    end = sum(held) + newest(len(held)) + head
    during = [sum(held[:i]) + t + newest(i) for i, t in enumerate(transients)]
    return max([end, *during])


def _priced(option: Option, timed: bool, host_price: float) -> float:
    return float(option.cost(timed)) + host_price * option.host_bytes


def choose(options: Sequence[Sequence[Option]], need_bytes: int, timed: bool = False,
           host_memory: Optional[int] = None, transients: Sequence[int] = (), head: int = 0) -> Optional[list[Option]]:
    """:func:`solve` with at most ``host_memory`` bytes offloaded (``None``: no limit), the engine's newest
    offloaded layer counted on the device, and (with ``transients`` and ``head``) the backward bounded as
    :func:`held_peak` predicts it; ``None`` when nothing fits.

    Host memory is a second constraint: each host byte is priced (a Lagrange multiplier, found by bisection) until
    the choice fits, so what no longer fits in host memory is recomputed instead. The offload engine keeps the newest
    offloaded layer's tensors on the device as well (backward needs them first), so those bytes are freed only on
    paper; when that breaks the budget the choice is made again, asked to free that much more.

    Example::

        >>> a = [Option("none", 100, 0), Option("full", 10, 50), Option("none", 0, 0, host_bytes=100)]
        >>> [(o.choice, o.host_bytes) for o in choose([a, a, a], 150)]  # the newest offloaded layer frees nothing
        [('none', 100), ('none', 100), ('none', 100)]
        >>> [(o.choice, o.host_bytes) for o in choose([a, a, a], 150, host_memory=100)]  # one offload would free 0
        [('full', 0), ('full', 0), ('none', 0)]

    The bisection is a Lagrangian relaxation: where host memory binds, its choice can cost up to about one layer's
    cost more than the best that fits.
    """
    allowed = sum(o[0].device_bytes for o in options) - need_bytes
    need = need_bytes
    for _ in range(8):  # `need` only grows, by the offloaded bytes still on the device: a few rounds settle it
        chosen = _within_host(options, need, timed, host_memory, transients, head)
        if chosen is None:
            return None
        over = held_peak([c.device_bytes for c in chosen], transients, [c.host_bytes for c in chosen], head) - allowed
        if over <= 0:
            return chosen
        need += over
    return None


def kept_on_device(chosen: Sequence[Option]) -> int:
    """Offloaded bytes the engine still holds on the device at the end of forward: those of the newest offloaded
    layer, which backward needs first (:mod:`lightning_ckpt.core.offload`)."""
    return next((o.host_bytes for o in reversed(chosen) if o.host_bytes), 0)


def _within_host(options: Sequence[Sequence[Option]], need: int, timed: bool,
                 host_memory: Optional[int], transients: Sequence[int] = (), head: int = 0) -> Optional[list[Option]]:
    def host(chosen: Sequence[Option]) -> int:
        return sum(o.host_bytes for o in chosen)

    try:
        chosen = solve(options, need, timed, transients=transients, head=head)
    except ValueError:
        return None
    if host_memory is None or host(chosen) <= host_memory:
        return chosen
    # A price above every cost there is makes host bytes the first thing to save; bisect down from there.
    high = 1.0 + sum(max(o.cost(timed) for o in opts) for opts in options)
    best = solve(options, need, timed, high, transients, head)
    if host(best) > host_memory:
        return None
    low = high * 1e-15
    for _ in range(40):
        price = math.sqrt(low * high)
        chosen = solve(options, need, timed, price, transients, head)
        if host(chosen) <= host_memory:
            best, high = chosen, price
        else:
            low = price
        if high / low < 1.01:
            break
    return best


def cheapest_choices(costs: Sequence[LayerCost], need_bytes: int, modes: Sequence[str] = PLAN_MODES,
                     offload: bool = False) -> list[Choice]:
    """The modes (one per layer) that free at least ``need_bytes`` of device memory with the fewest recompute FLOPs.

    :func:`solve` over :func:`layer_options`. Ties go to ``"none"``, then to the order of ``modes``.

    Example::

        >>> a = LayerCost("a", "Block", 100, 10, 40, 0, full_flops=50, selective_flops=5)
        >>> b = LayerCost("b", "Block", 100, 10, 40, 0, full_flops=80, selective_flops=8)
        >>> cheapest_choices([a, b], 120)  # 60 + 60 bytes for 5 + 8 FLOPs
        ['selective', 'selective']
        >>> cheapest_choices([a, b], 150)  # 90 + 60 for 50 + 8 is cheaper than 60 + 90 for 5 + 80
        ['full', 'selective']
    """
    return [o.choice for o in solve([layer_options(c, modes, offload) for c in costs], need_bytes)]


# ---------------------------------------------------------------------------------------------- time


def extra_seconds(cost: LayerCost, choice: Choice, keep: Sequence[int], device: DeviceProfile) -> float:
    """Predicted extra step time of ``choice`` for one layer on ``device`` (see :mod:`lightning_ckpt.core.device_profile`).

    Recomputed ops at their predicted time plus ``op_overhead`` each; under a policy (``"selective"``, ``"ops"``)
    every op of the forward and of the recompute also pays ``policy_overhead`` (torch dispatches each through
    Python). A layer without op records is priced by its FLOPs at ``matmul_flops``. Offload's copies are priced
    apart (:func:`exposed_transfer_seconds`).

    Example::

        >>> from lightning_ckpt.core.op_curve import OpRecord
        >>> ops = (OpRecord("aten.mm.default", 64, 10**6, 96), OpRecord("aten.gelu.default", 64, 16, 128))
        >>> cost = LayerCost("a", "Block", 128, 32, 96, 0, 10**6 + 16, 16, ops=ops)
        >>> device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e9, host_bandwidth=1e9, op_overhead=1e-6)
        >>> [round(1e9 * extra_seconds(cost, c, (0,), device)) for c in ("none", "full", "ops")]  # ns
        [0, 3128, 5128]
    """
    if choice == "none":
        return 0.0
    if not cost.ops:
        return cost.flops(choice, keep) / device.matmul_flops
    kept = {"ops": set(keep), "selective": {i for i, r in enumerate(cost.ops) if r.heavy}}.get(choice, set())
    recomputed = [r for i, r in enumerate(cost.ops) if r.recomputed_if_dropped and i not in kept]
    seconds = sum(device.record_seconds(r, cost.calls) for r in recomputed)
    if choice != "full":
        replayed = sum(r.recomputed_if_dropped for r in cost.ops)
        seconds += (len(cost.ops) + replayed) * cost.calls * device.per_op_under_policy
    return seconds


def forward_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], device: DeviceProfile) -> float:
    """Predicted time of the step's forward without checkpointing, as a share of the step (which is
    ``STEP_FORWARDS`` of these): every layer's ops and those outside them at their rates, and each op's fixed
    cost (``op_overhead``) once per step, so a third of it here: the fixed cost is dispatch and launch, paid by an
    op's forward and its backward node, not in proportion to the backward's FLOPs as ``STEP_FORWARDS`` is.
    (On a 2-core CPU, a plain forward and backward cost about 5 µs per op beyond compute, one ``op_overhead`` about
    8 µs: charging ``STEP_FORWARDS`` of them per op overstated the step without checkpointing about fivefold.)"""
    # A record's FLOPs and bytes already sum the layer's calls in the step; only the fixed cost is per call.
    ops = [(r, c.calls) for c in costs for r in c.ops] + [(r, 1) for r in outside_ops]
    return sum(device.op_seconds(r.op, r.flops, r.io_bytes) + calls * device.op_overhead / STEP_FORWARDS
               for r, calls in ops)


def layer_seconds(cost: LayerCost, device: DeviceProfile) -> float:
    """Predicted time of one layer's forward (all its calls in a step) on ``device``."""
    if not cost.ops:
        return cost.full_flops / device.matmul_flops
    return sum(device.record_seconds(r, cost.calls) for r in cost.ops)


def transfer_windows(costs: Sequence[LayerCost], device: DeviceProfile) -> list[tuple[float, float]]:
    """Per layer, the compute its offload copies can hide behind: ``(forward, backward)`` seconds.

    In forward a layer's copy to the host runs on a side stream while the next layer computes; in backward its copy
    back is started by the next layer's backward (the layer before it in backward order) and runs behind that.
    Counting only the next layer's time, and its backward as that of a plain layer (``STEP_FORWARDS - 1`` forwards,
    no recompute), keeps each layer's price its own and errs on the side of slow. The last layer has no next one.

    Example::

        >>> device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, full_flops=10**6, selective_flops=0) for i in range(2)]
        >>> transfer_windows(costs, device)  # 1 ms forward, 2 ms backward behind layer 0; nothing behind layer 1
        [(0.001, 0.002), (0.0, 0.0)]
    """
    after = [layer_seconds(c, device) for c in costs[1:]] + [0.0]
    return [(t, (STEP_FORWARDS - 1) * t) for t in after]


def exposed_transfer_seconds(nbytes: int, device: DeviceProfile, window: tuple[float, float]) -> float:
    """The part of moving ``nbytes`` to host memory and back that ``window`` (see :func:`transfer_windows`) cannot
    hide: each direction takes ``nbytes / host_bandwidth``.

    Example::

        >>> device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
        >>> exposed_transfer_seconds(3 * 10**6, device, (0.001, 0.002))  # 3 ms each way: 2 + 1 ms not hidden
        0.003
    """
    if not nbytes:
        return 0.0
    one_way = device.transfer_seconds(nbytes)
    return max(0.0, one_way - window[0]) + max(0.0, one_way - window[1])


#: A step without checkpointing is predicted as this many forwards (the backward of a matmul is two matmuls of
#: its size; an element-wise op's backward reads and writes about twice what its forward does).
STEP_FORWARDS = 3


# --------------------------------------------------------------------------------------------- plan


@dataclass
class CheckpointPlan:
    """Which mode each matched layer gets, and what that is predicted to hold and cost.

    ``layers`` maps every matched layer (in order) to ``"none"``, ``"full"``, ``"selective"`` or ``"ops"``; for an
    ``"ops"`` layer, ``kept_ops[name]`` lists the positions of the ops whose outputs it keeps (it recomputes the
    others, see :mod:`lightning_ckpt.core.op_curve`). Bytes are activation bytes held for backward on the device
    (``outside_bytes``: those of everything outside the matched layers, embeddings, head and loss, part of every
    figure). ``recompute_flops`` is the predicted extra FLOPs per step (see :class:`OpCostMode`). Planned for a
    device profile, ``predicted_step_seconds`` is the step's predicted time with the plan and
    ``baseline_step_seconds`` without checkpointing, on that profile (``device`` names it); else both are ``None``.
    ``offloaded`` lists the layers whose held tensors live in host memory (a checkpointed layer's inputs, or all
    an un-checkpointed layer saves); ``host_bytes`` is what they hold there.

    ``planned_bytes`` is what the forward leaves held; ``peak_bytes`` the step's activation peak, which the budget
    bounds: the end of the forward, or a layer's backward, when it recomputes what it did not keep and makes its
    gradients while the layers before it still hold theirs (:func:`held_peak`).
    """

    layers: dict[str, str]
    baseline_bytes: int
    planned_bytes: int
    budget_bytes: int
    recompute_flops: int
    outside_bytes: int
    planned_host_bytes: int = 0
    offload: Offload = False  # what was asked for; ``offloaded`` is what the plan does
    costs: list[LayerCost] = field(default_factory=list)
    kept_ops: dict[str, list[int]] = field(default_factory=dict)
    predicted_step_seconds: Optional[float] = None
    baseline_step_seconds: Optional[float] = None
    device: Optional[str] = None  # the name of the profile the times are predicted on
    offloaded: list[str] = field(default_factory=list)
    peak_bytes: int = 0  # the step's predicted activation peak (0 in a plan saved before it was predicted)
    baseline_peak_bytes: int = 0  # the same without checkpointing: what a fraction budget is a fraction of

    def __post_init__(self) -> None:
        self.peak_bytes = self.peak_bytes or self.planned_bytes
        self.baseline_peak_bytes = self.baseline_peak_bytes or self.baseline_bytes
        if self.offload is True and not self.offloaded:  # a plan saved before `offloaded` existed
            self.offloaded = [name for name, mode in self.layers.items() if mode != "none"]

    @property
    def host_bytes(self) -> int:
        """Bytes the plan keeps in host memory (``planned_host_bytes``)."""
        return self.planned_host_bytes

    def apply(self, module: nn.Module, **checkpoint_options: Any) -> list[str]:
        """Checkpoint ``module``'s layers as planned (layers planned ``"none"`` are left or made plain).

        ``checkpoint_options`` (``use_reentrant``, ``preserve_rng_state``, ``checkpoint_kwargs``) go to
        :func:`~lightning_ckpt.core.wrapping.apply_checkpointing`. Returns the checkpointed names, in order.
        Everything is checked before anything changes.
        """
        unknown = set(checkpoint_options) - {"use_reentrant", "preserve_rng_state", "checkpoint_kwargs"}
        if unknown:
            raise TypeError(f"`apply` takes use_reentrant, preserve_rng_state and checkpoint_kwargs; got {sorted(unknown)}."
                            " Layer selection, mode and offload come from the plan.")
        for name, mode in self.layers.items():
            if mode != "none" or name in self.offloaded:
                CheckpointOptions(offload=name in self.offloaded, **self._mode_options(name, mode, checkpoint_options))
        layers = {}
        for name in self.layers:
            try:
                layers[name] = module.get_submodule(name)
            except AttributeError as err:
                raise ValueError(f"The plan names layer `{name}`, which {type(module).__name__} does not have: apply"
                                 " a plan to the module it was made for (names are relative to it).") from err
        check_no_nesting(module, list(self.layers))
        for name, mode in self.layers.items():
            remove_checkpointing(layers[name])
            if mode != "none" or name in self.offloaded:  # "none", offloaded: kept in host memory, not recomputed
                apply_checkpointing(layers[name], layer_cls=type(layers[name]), offload=name in self.offloaded,
                                    **self._mode_options(name, mode, checkpoint_options))
        names = [name for name, mode in self.layers.items() if mode != "none"]
        turn_off_caches(module, names)
        return names

    def _mode_options(self, name: str, mode: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """``apply_checkpointing`` options for one layer: an ``"ops"`` layer is checkpointed with the policy that
        keeps its planned ops (a ``context_fn``, over one the caller may pass)."""
        if mode != "ops":
            return {**options, "mode": mode}
        ops = [r.op for r in next(c for c in self.costs if c.name == name).ops]
        context_fn = keep_ops_context_fn(self.kept_ops[name], ops)
        return {**options, "mode": "full", "checkpoint_kwargs": {**(options.get("checkpoint_kwargs") or {}),
                                                                  "context_fn": context_fn}}

    def state_dict(self) -> dict[str, Any]:
        """Plain data (for a Lightning checkpoint); :meth:`from_state_dict` rebuilds the plan."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CheckpointPlan:
        return cls(**{**state, "costs": [LayerCost(**c) for c in state.get("costs", [])]})

    def __str__(self) -> str:
        head = ("layer", "class", "none", "full", "selective", "FLOPs full", "FLOPs selective", "choice")
        rows = [head]
        for cost in self.costs:
            rows.append((cost.name, cost.cls, format_bytes(cost.none_bytes), format_bytes(cost.device_bytes("full", self.offload is True)),
                         format_bytes(cost.device_bytes("selective", self.offload is True)), format_flops(cost.full_flops),
                         format_flops(cost.selective_flops), self._choice_text(cost.name)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines += [self._ops_line(cost) for cost in self.costs if self.layers.get(cost.name) == "ops"]
        n = sum(mode != "none" for mode in self.layers.values())
        pct = 100 * self.planned_bytes / self.baseline_bytes if self.baseline_bytes else 0.0
        lines += [
            f"outside the layers: {format_bytes(self.outside_bytes)} (in every figure below)",
            f"plan: {n} of {len(self.layers)} layers checkpointed; activations {format_bytes(self.planned_bytes)}"
            f" ({pct:.0f}% of {format_bytes(self.baseline_bytes)} without checkpointing), peak"
            f" {format_bytes(self.peak_bytes)} (budget {format_bytes(self.budget_bytes)},"
            f" {format_bytes(self.baseline_peak_bytes)} without checkpointing); recompute"
            f" {format_flops(self.recompute_flops)} per step"
            + (f"; {format_bytes(self.planned_host_bytes)} offloaded to host ({len(self.offloaded)} layers)"
               if self.offload else "")
            + (f"; {self.step_time_text()}" if self.predicted_step_seconds is not None else ""),
        ]
        return "\n".join(lines)

    @property
    def step_time_increase(self) -> Optional[float]:
        """Predicted step time with the plan over without checkpointing, less one (``0.12``: 12% slower)."""
        if self.predicted_step_seconds is None or not self.baseline_step_seconds:
            return None
        return self.predicted_step_seconds / self.baseline_step_seconds - 1

    def step_time_text(self) -> str:
        """``'+12% step time (41.0 ms vs 36.6 ms on h100-sxm)'``."""
        plan, base = 1000 * (self.predicted_step_seconds or 0.0), 1000 * (self.baseline_step_seconds or 0.0)
        return (f"+{100 * (self.step_time_increase or 0.0):.0f}% step time ({plan:.1f} ms vs {base:.1f} ms without"
                f" checkpointing on {self.device})")

    def _choice_text(self, name: str) -> str:
        mode = self.layers.get(name, "?")
        return f"{mode} +offload" if self.offload == "auto" and name in self.offloaded else mode

    def _ops_line(self, cost: LayerCost) -> str:
        """What an op-level choice holds, costs, keeps and recomputes."""
        keep = self.kept_ops[cost.name]
        return (f"  {cost.name} (ops): {format_bytes(cost.device_bytes('ops', self.offload is True, keep))},"
                f" {format_flops(cost.flops('ops', keep))}; {describe(cost.ops, keep)}")


def make_plan(costs: Sequence[LayerCost], outside_bytes: int, memory_budget: object,
              modes: Sequence[str] = PLAN_MODES, offload: Offload = False,
              device: Union[None, str, DeviceProfile] = None, outside_ops: Sequence[OpRecord] = (),
              host_memory: Optional[int] = None, min_bytes: int = DEFAULT_MIN_BYTES,
              head_bytes: int = 0, head_peak_bytes: int = 0) -> CheckpointPlan:
    """Solve for the cheapest plan from measured costs (what :func:`plan_checkpointing` does after measuring).

    Args:
        costs: each matched layer's :class:`LayerCost`, in forward order.
        outside_bytes: activation bytes held outside the layers (embeddings, head, loss).
        memory_budget: a fraction of the bytes held without checkpointing, or bytes: the bound on the step's
            activation peak (:attr:`CheckpointPlan.peak_bytes`).
        modes, offload, device, host_memory: as :func:`plan_checkpointing` takes them.
        outside_ops: the ops of the step outside the layers (for the predicted step time).
        min_bytes: the offload engine's threshold (smaller tensors stay on the device).
        head_bytes: of ``outside_bytes``, what the step saves after the last layer (head, loss), which the backward
            frees before it reaches the layers; 0 counts all of ``outside_bytes`` as held through the layers' backward.
        head_peak_bytes: what the backward of the head and loss makes alive at once (the logits' gradient) while
            everything the forward holds is still there.

    Raises ``ValueError`` if the budget cannot be met.

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 50, 5) for i in range(4)]
        >>> plan = make_plan(costs, outside_bytes=100, memory_budget=0.5)
        >>> plan.layers, plan.planned_bytes, plan.peak_bytes, plan.recompute_flops
        ({'l0': 'full', 'l1': 'full', 'l2': 'full', 'l3': 'none'}, 230, 230, 150)

    The budget is 250 B; when ``l3``'s backward runs, the layers before it hold their choices and ``l3`` has its
    100 B alive (``backward_peak``), so ``l0``-``l2`` may hold 50 B at most: only ``"full"`` (10 B each) fits.
    """
    modes = _validate_modes(modes)
    _validate_offload(offload)
    profile = resolve_device(device)
    budget = parse_memory_budget(memory_budget)
    if budget is None:
        raise ValueError("`memory_budget=None` asks for no plan. Pass a fraction such as 0.5 or bytes such as '2GiB'.")
    if offload == "auto" and profile is None:
        raise ValueError("`offload='auto'` prices offload against recompute in time, so it needs a device profile: pass"
                         " `device=` a preset such as 'h100-sxm' or a `DeviceProfile` (`DeviceProfile.measure('cuda')`),"
                         " or offload=True / False.")
    if host_memory is not None and (not isinstance(host_memory, int) or host_memory < 0):
        raise ValueError(f"`host_memory` must be bytes (an int >= 0) or None (half of the free host memory), got"
                         f" {host_memory!r}.")
    if profile is not None:  # measured on the CPU or on fake tensors, planned for the profile's device
        costs = [replace(c, offloadable_bytes=c.full_bytes) for c in costs]
    if offload and host_memory is None:
        host_memory = psutil.virtual_memory().available // 2
    # While the layers' backward runs, the head's and the loss's saved tensors are gone already.
    transients = [c.backward_peak - head_bytes for c in costs]
    baseline = outside_bytes + sum(c.none_bytes for c in costs)
    baseline_peak = outside_bytes + held_peak([c.none_bytes for c in costs], transients, head=head_peak_bytes)
    budget_bytes = int(budget * baseline_peak) if isinstance(budget, float) else budget
    windows = transfer_windows(costs, profile) if profile is not None else [(0.0, 0.0)] * len(costs)
    timed = profile is not None

    def chosen_for(value: Offload) -> Optional[list[Option]]:
        options = [layer_options(c, modes, value, device=profile, window=w, min_bytes=min_bytes)
                   for c, w in zip(costs, windows)]
        return choose(options, baseline - budget_bytes, timed, host_memory if value else None, transients,
                      head_peak_bytes)

    # "auto" chooses among supersets of the other two; trying them as well makes "never worse than either" exact
    # whatever the quantisation and the host-memory bisection lose.
    tried = [chosen_for(v) for v in (("auto", False, True) if offload == "auto" else (offload,))]
    found = [chosen for chosen in tried if chosen is not None]
    if not found:
        raise ValueError(_impossible_message(costs, outside_bytes, baseline_peak, budget_bytes, memory_budget, modes, offload,
                                             host_memory, min_bytes, head_bytes, head_peak_bytes))
    chosen = min(found, key=lambda c: sum(o.cost(timed) for o in c))  # the first of equals: "auto"'s own
    newest = kept_on_device(chosen)
    return CheckpointPlan(
        layers={c.name: o.choice for c, o in zip(costs, chosen)},
        baseline_bytes=baseline,
        baseline_peak_bytes=baseline_peak,
        planned_bytes=outside_bytes + sum(o.device_bytes for o in chosen) + newest,
        peak_bytes=outside_bytes + held_peak([o.device_bytes for o in chosen], transients, [o.host_bytes for o in chosen],
                                             head_peak_bytes),
        budget_bytes=budget_bytes,
        recompute_flops=sum(o.flops for o in chosen),
        outside_bytes=outside_bytes,
        planned_host_bytes=sum(o.host_bytes for o in chosen),
        offload=offload,
        costs=list(costs),
        kept_ops={c.name: list(o.keep) for c, o in zip(costs, chosen) if o.choice == "ops"},
        offloaded=[c.name for c, o in zip(costs, chosen) if o.host_bytes or (offload is True and o.choice != "none")],
        **_step_seconds(costs, outside_ops, chosen, profile),
    )


def _step_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], chosen: Sequence[Option],
                  profile: Optional[DeviceProfile]) -> dict[str, Any]:
    if profile is None:
        return {}
    baseline = STEP_FORWARDS * forward_seconds(costs, outside_ops, profile)
    return {"baseline_step_seconds": baseline, "predicted_step_seconds": baseline + sum(o.seconds for o in chosen),
            "device": profile.name}


def plan_checkpointing(
    module: nn.Module,
    step: Callable[[], Any],
    memory_budget: object,
    layer_cls: LayerClassArg = None,
    modes: Sequence[str] = PLAN_MODES,
    offload: Offload = False,
    device: Union[None, str, DeviceProfile] = None,
    host_memory: Optional[int] = None,
) -> CheckpointPlan:
    """Measure one step and return the cheapest :class:`CheckpointPlan` whose activations fit ``memory_budget``.

    Args:
        module: the model (in training mode). It is left exactly as it was: apply the plan with ``plan.apply``.
        step: runs what a training step runs before backward and returns the loss; called once here, and
            not backpropagated (no gradient is touched).
        memory_budget: a fraction of the activation bytes held without checkpointing (``0.3``), or bytes
            (``"2GiB"``, ``500_000_000``). ``1.0``, or a budget already met, checkpoints nothing.
        layer_cls: the layers to choose among, as in :func:`~lightning_ckpt.core.wrapping.apply_checkpointing`.
        modes: the checkpointing modes a layer may get, besides ``"none"``.
        offload: ``False``; ``True``: every checkpointed layer's inputs live in host memory (they count as host
            bytes, not device bytes); ``"auto"``: per layer, the planner chooses whether its held tensors live in
            host memory (a checkpointed layer's inputs, or all an un-checkpointed layer saves), pricing the part of
            each transfer the device profile says cannot hide behind compute. ``"auto"`` needs a ``device``, or a
            module on a CUDA device (whose profile is then measured, a few seconds).
        device: ``None``, a :class:`~lightning_ckpt.core.device_profile.DeviceProfile` or a preset name
            (``"h100-sxm"``): plan for the least predicted step time on that device rather than the fewest FLOPs.
        host_memory: bytes of host memory offloaded tensors may take (default: half of the host memory free now).

    Without ``device`` the plan has the fewest recompute FLOPs among those whose predicted bytes fit: layers
    (and op outputs) that free most bytes per recomputed FLOP go first, whatever their position; FLOPs are exact
    and machine-independent. With ``device`` it has the least predicted step time: recomputed matmuls at the
    device's matmul rate, other ops at its memory bandwidth, and a fixed cost per op recomputed or run under an
    op-level policy, so on small layers full checkpointing can beat keeping matmul outputs. Tensors measured on
    the CPU or as fake tensors count as living on that device. With ``offload="auto"`` a layer may also keep its
    tensors in host memory: a transfer costs only what the compute of the next layer (forward) and its backward
    cannot hide at the device's host bandwidth, so offload wins where layers are big and bandwidth is ample, and
    recompute where it is not; what does not fit in ``host_memory`` is recomputed instead. Raises ``ValueError``
    (nothing changed) when even checkpointing (and offloading) every layer would not fit; the message gives the
    minimum and what else would help.
    """
    _check_module_and_step(module, step)
    modes = _validate_modes(modes)
    _validate_offload(offload)
    if parse_memory_budget(memory_budget) is None:
        raise ValueError("`memory_budget=None` asks for no plan. Pass a fraction such as 0.5 or bytes such as '2GiB'.")
    profile = resolve_device(device)
    cuda = _cuda_devices(module)
    if offload == "auto" and profile is None and cuda:
        profile = DeviceProfile.measure(torch.device("cuda", cuda[0]))
    measured = measure_step(module, step, layer_cls, modes)
    return make_plan(measured.costs, measured.outside_bytes, memory_budget, modes, offload, profile, measured.outside_ops,
                     host_memory, head_bytes=measured.head_bytes, head_peak_bytes=measured.head_peak_bytes)


@dataclass(frozen=True)
class StepMeasurement:
    """What :func:`measure_step` measured: per-layer costs, the bytes held outside the layers, and the ops run
    outside them (for a predicted step time)."""

    costs: list[LayerCost]
    outside_bytes: int
    outside_ops: tuple[OpRecord, ...] = ()
    head_bytes: int = 0  # of outside_bytes, what is saved after the last layer (see LayerCostRecorder.head_bytes)
    head_peak_bytes: int = 0  # what the head's backward makes alive at once (LayerCostRecorder.head_peak_bytes)


def measure_step(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg = None,
                 modes: Sequence[str] = PLAN_MODES) -> StepMeasurement:
    """:func:`measure_layer_costs`, with the ops the step ran outside the layers recorded too."""
    return _measure(module, step, layer_cls, modes, outside_ops=True)


def measure_layer_costs(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg = None,
                        modes: Sequence[str] = PLAN_MODES) -> tuple[list[LayerCost], int]:
    """Measure ``(costs, outside_bytes)`` in one fully checkpointed step: what :func:`plan_checkpointing` solves from.

    ``costs`` has one :class:`LayerCost` per matched layer, in order; ``outside_bytes`` is what everything
    outside the matched layers holds for backward. Works on real and on fake tensors
    (``torch._subclasses.FakeTensorMode``: build the module and run ``step`` under it) alike. The module,
    its buffers and the RNG are left as they were.

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> x = torch.randn(2, 4)
        >>> costs, outside = measure_layer_costs(model, lambda: model(x).sum(), layer_cls=nn.Tanh)
        >>> [(c.name, c.full_bytes, c.none_bytes, c.full_flops) for c in costs]  # its input; its output; 2 * 8 tanh
        [('1', 64, 64, 16)]
        >>> outside  # the inputs of the two Linears, 2 * 4 and 2 * 8 float32
        96
    """
    measured = _measure(module, step, layer_cls, modes, outside_ops=False)
    return measured.costs, measured.outside_bytes


def _measure(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg, modes: Sequence[str],
             outside_ops: bool) -> StepMeasurement:
    _check_module_and_step(module, step)
    modes = _validate_modes(modes)
    if not module.training:
        raise ValueError("`plan_checkpointing` measures a training step, but the module is in eval mode, where"
                         " nothing is saved for backward. Call `module.train()` first.")
    selected = select_layers(module, layer_classes(module, layer_cls))
    if not selected:
        raise ValueError(f"No submodule of {type(module).__name__} matches `layer_cls={layer_cls!r}`:"
                         " pass the class of the model's repeated block.")
    check_no_nesting(module, [name for name, _ in selected])

    with _fully_checkpointed(module, selected), torch.random.fork_rng(devices=_cuda_devices(module)), buffers_restored(module):
        with LayerCostRecorder(module, selected, selective="selective" in modes, outside_ops=outside_ops) as recorder:
            loss = step()
            recorder.measure_head(loss)
            del loss  # frees the step's graph
    costs = recorder.costs()
    if not any(c.calls for c in costs):
        raise ValueError(f"`step()` never called a matched layer ({', '.join(n for n, _ in selected[:3])}, ...) in"
                         " training mode with grad enabled: pass a step that runs the model's forward and returns the loss.")
    outside = max(0, recorder.held_bytes - sum(c.full_bytes for c in costs))
    return StepMeasurement(costs, outside, recorder.outside_ops, min(outside, recorder.head_bytes),
                           recorder.head_peak_bytes)


def predict(costs: Sequence[LayerCost], outside_bytes: int, choices: Mapping[str, str],
            offload: Union[bool, Collection[str]] = False,
            kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
            ) -> tuple[int, int]:
    """``(device bytes, recompute FLOPs)`` that the layer modes ``choices`` (name -> mode; missing: ``"none"``) hold
    and cost; an ``"ops"`` layer keeps the ops at positions ``kept_ops[name]`` (as in :class:`CheckpointPlan`).
    ``offload``: ``True`` for every checkpointed layer's inputs in host memory, or the names of the layers offloaded
    (``min_bytes``: the offload engine's threshold).

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 50, 5) for i in range(4)]
        >>> predict(costs, 100, {"l0": "full", "l2": "full"})  # every 2nd layer
        (320, 100)
    """
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes)
    newest = kept_on_device(chosen)
    return outside_bytes + sum(o.device_bytes for o in chosen) + newest, sum(o.flops for o in chosen)


def predict_peak(costs: Sequence[LayerCost], outside_bytes: int, choices: Mapping[str, str],
                 offload: Union[bool, Collection[str]] = False,
                 kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
                 head_bytes: int = 0, head_peak_bytes: int = 0) -> int:
    """The step's activation peak (:func:`held_peak`) for the layer modes ``choices``, as :func:`predict` takes them;
    ``head_bytes`` and ``head_peak_bytes`` as :func:`make_plan` takes them.

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 50, 5) for i in range(4)]
        >>> predict_peak(costs, 100, {"l0": "full", "l2": "full"})  # l3's backward: 100 + 10 + 100 + 10 held, its 100
        320
    """
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes)
    return outside_bytes + held_peak([o.device_bytes for o in chosen], [c.backward_peak - head_bytes for c in costs],
                                     [o.host_bytes for o in chosen], head_peak_bytes)


def predict_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], choices: Mapping[str, str],
                    device: Union[str, DeviceProfile], offload: Union[bool, Collection[str]] = False,
                    kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
                    ) -> tuple[float, float]:
    """``(step seconds, step seconds without checkpointing)`` predicted on ``device`` for the layer modes ``choices``
    (as :func:`predict` takes them); measured tensors count as living on ``device``.

    Example::

        >>> from lightning_ckpt.core.op_curve import OpRecord
        >>> ops = (OpRecord("aten.mm.default", 64, 10**9, 96),)
        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 10**9, 0, ops=ops) for i in range(2)]
        >>> device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e9)
        >>> predict_seconds(costs, (), {"l0": "full"}, device)  # 3 forwards of 2 ms, and 1 ms recomputed
        (0.007, 0.006)
    """
    profile = resolve_device(device)
    assert profile is not None
    costs = [replace(c, offloadable_bytes=c.full_bytes) for c in costs]
    baseline = STEP_FORWARDS * forward_seconds(costs, outside_ops, profile)
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes, profile)
    return baseline + sum(o.seconds for o in chosen), baseline


def _predicted_options(costs: Sequence[LayerCost], choices: Mapping[str, str], offload: Union[bool, Collection[str]],
                       kept_ops: Mapping[str, Sequence[int]], min_bytes: int,
                       device: Optional[DeviceProfile] = None) -> list[Option]:
    windows = transfer_windows(costs, device) if device is not None else [(0.0, 0.0)] * len(costs)
    out = []
    for cost, window in zip(costs, windows):
        mode = choices.get(cost.name, "none")
        moved = cost.name in offload if isinstance(offload, Collection) else offload and mode != "none"
        out.append(make_option(cost, mode, kept_ops.get(cost.name, ()), moved, device, window, min_bytes))  # type: ignore[arg-type]
    return out


# ------------------------------------------------------------------------------------------- helpers


def _check_module_and_step(module: object, step: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"`plan_checkpointing` takes an `nn.Module`, got {type(module).__name__}.")
    if not callable(step):
        raise TypeError(f"`step` must be a callable with no arguments that returns the loss, got {step!r}.")


def _validate_modes(modes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(modes, str) or not modes or any(m not in PLAN_MODES for m in modes):
        raise ValueError(f"`modes={modes!r}` is not understood. Pass a non-empty tuple of {PLAN_MODES}, such as"
                         " ('full',).")
    return tuple(dict.fromkeys(modes))


def _validate_offload(offload: object) -> None:
    if not (offload is True or offload is False or offload == "auto"):
        raise ValueError(f"`offload={offload!r}` is not understood. Pass False (nothing offloaded), True (every"
                         " checkpointed layer's inputs in host memory) or 'auto' (the planner chooses per layer; needs"
                         " a device profile).")


def _cuda_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextmanager
def _fully_checkpointed(module: nn.Module, selected: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
    """Every selected layer fully checkpointed (no offload), model caches off, inside the block; each forward and
    cache as it was after."""
    before = [(layer, layer.__dict__.get("forward")) for _, layer in selected]
    caches: list[nn.Module] = []
    try:
        for _, layer in selected:
            remove_checkpointing(layer)
            apply_checkpointing(layer, layer_cls=type(layer))
        caches = turn_off_caches(module, [name for name, _ in selected])
        yield
    finally:
        restore_caches(caches)
        for layer, forward in before:
            remove_checkpointing(layer)
            if forward is not None:
                layer.forward = forward


def _impossible_message(costs: Sequence[LayerCost], outside: int, baseline: int, budget_bytes: int,
                        memory_budget: object, modes: Sequence[str], offload: Offload,
                        host_memory: Optional[int] = None, min_bytes: int = DEFAULT_MIN_BYTES,
                        head_bytes: int = 0, head_peak_bytes: int = 0) -> str:
    transients = [c.backward_peak - head_bytes for c in costs]

    def smallest(value: Offload) -> list[Option]:
        # What an offloaded layer moves comes back to the device for its backward: count it too.
        return [min(layer_options(c, modes, value, min_bytes=min_bytes),
                    key=lambda o: (o.device_bytes + o.host_bytes, o.device_bytes)) for c in costs]

    def least(value: Offload) -> int:
        chosen = smallest(value)
        return outside + held_peak([o.device_bytes for o in chosen], transients, [o.host_bytes for o in chosen],
                                   head_peak_bytes)

    minimum = least(offload)
    text = (f"`memory_budget={memory_budget!r}` asks for an activation peak of at most {format_bytes(budget_bytes)}"
            f" ({_pct(budget_bytes, baseline)} of the {format_bytes(baseline)} peak without checkpointing), but the least"
            f" reachable is {format_bytes(minimum)} ({_pct(minimum, baseline)}), with every matched layer checkpointed"
            + (" or offloaded" if offload == "auto" else "")
            + f"; {format_bytes(outside)} of it is outside the matched layers (embeddings, head, loss)"
            + _floor_text(costs, [o.device_bytes for o in smallest(offload)], outside - head_bytes,
                          outside + head_peak_bytes)
            + ". Nothing was applied.")
    host_short = bool(offload) and minimum <= budget_bytes  # the device could hold it: host memory is what is short
    if host_short:
        text = (f"`memory_budget={memory_budget!r}` ({format_bytes(budget_bytes)} of activations) needs more than"
                f" `host_memory={host_memory}` ({format_bytes(host_memory or 0)}) of offloaded tensors. Nothing was applied."
                f" To fit: pass a larger `host_memory` (bytes of host memory the offloaded tensors may use)")
    else:
        text += f" To fit: pass a budget of at least {minimum / baseline:.3f} (or {minimum} bytes)"
    if offload is False:
        with_offload = least(True)
        if with_offload < minimum:
            text += f"; or offload=True, which reaches {format_bytes(with_offload)} ({_pct(with_offload, baseline)})"
        else:
            text += "; offload=True would not help here (the layer inputs are in host memory already)"
    if offload != "auto" and least("auto") < min(minimum, least(True)):
        text += f"; or offload='auto' with a device profile, which can reach {format_bytes(least('auto'))}"
    if "full" not in modes:
        text += "; or allow modes=('full', 'selective')"
    if host_short:  # a smaller batch or more checkpointed layers are about device memory, which is not short
        return text + "."
    text += (f"; or a smaller batch or shorter sequences (activations grow about linearly with them: about"
             f" {math.ceil(100 * budget_bytes / minimum)}% of the current size would fit); or checkpoint more of the"
             " model by adding the classes outside the layers to `layer_cls`.")
    return text


def _floor_text(costs: Sequence[LayerCost], held: Sequence[int], outside_during: int, at_start: int) -> str:
    """Which layer's backward sets the least reachable peak, when one does (not the start of the backward, where
    ``at_start`` is alive besides the layers' ``held``)."""
    during = [outside_during + sum(held[:i]) + c.backward_peak for i, c in enumerate(costs)]
    i = max(range(len(costs)), key=during.__getitem__)
    if during[i] <= at_start + sum(held):
        return ""
    return (f"; the backward of `{costs[i].name}` sets that floor: it has {format_bytes(costs[i].backward_peak)} alive"
            " at once (its recompute, what it saves and its gradients) while the layers before it hold their inputs")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


__all__ = ["CheckpointPlan", "LayerCost", "LayerCostRecorder", "OpCostMode", "cheapest_choices", "count_cost",
           "held_peak", "make_plan", "measure_layer_costs", "measure_step", "plan_checkpointing", "predict", "predict_peak",
           "predict_seconds"]
