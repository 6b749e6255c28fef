"""Measuring what each matched layer holds for backward and costs to recompute, in one fully checkpointed step.

:class:`LayerCostRecorder` re-runs each layer right before its own checkpointed forward and backpropagates it to its
inputs, its output dropped before that backward, so a measuring step has alive at most what full checkpointing has
in that layer's backward (the layers' inputs so far, the layer's activations and gradients); a layer identical to one already re-run in the step and called alike (a transformer's
blocks) reuses that one's figures instead (:func:`_rerun_key`). :func:`measure_step` and :func:`measure_layer_costs`
run a step under it and return the :class:`~lightning_ckpt.core.measure.costs.LayerCost` records the solver plans from
(:class:`StepCosts`). The module, its buffers and the RNG are left as they were. Plain PyTorch.

Example::

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> measured = measure_step(model, lambda: model(torch.randn(2, 4)).sum(), layer_cls=nn.Tanh)
    >>> [(c.name, c.full_bytes) for c in measured.costs], measured.outside_bytes
    ([('1', 64)], 96)
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules import module as torch_module
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt.core.checkpoint.compress import held_bytes, layer_compress
from lightning_ckpt.core.checkpoint.layer_state import buffers_restored
from lightning_ckpt.core.checkpoint.placement import fsdp2
from lightning_ckpt.core.checkpoint.policies import COMPUTE_HEAVY_OPS
from lightning_ckpt.core.measure.costs import PLAN_MODES, LayerCost, validate_modes
from lightning_ckpt.core.measure.layer_timing import time_modes
from lightning_ckpt.core.measure.op_curve import OpRecord, add_records, forward_peak, op_records
from lightning_ckpt.core.measure.profiling import (
    LiveBytes,
    OpCostMode,
    OpRecordMode,
    SavedTensorCounter,
    hidden_from_counters,
    local_shard,
    report_held,
    storage_key,
    tensor_bytes,
)
from lightning_ckpt.core.checkpoint.selection import LayerClassArg, class_path, is_inside, layer_classes, select_layers
from lightning_ckpt.core.checkpoint.tiling import TRANSFORMERS_FAMILIES, TiledForward, is_tiled, restore_tiles, tiles_of
from lightning_ckpt.core.checkpoint.wrapping import (
    CheckpointedForward,
    CheckpointOptions,
    apply_checkpointing,
    check_no_nesting,
    is_checkpointed,
    remove_checkpointing,
    restore_caches,
    turn_off_caches,
)

__all__ = ["LayerCostRecorder", "StepCosts", "check_module_and_step", "cuda_devices", "measure_layer_costs",
           "measure_step"]

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


@dataclass
class _LayerTotals:
    """One layer's figures summed over its calls as the recorder measures them: :class:`LayerCost`'s number fields,
    under their names (``transient_bytes``: the largest over the calls)."""

    none_bytes: int = 0
    full_bytes: int = 0
    selective_bytes: int = 0
    offloadable_bytes: int = 0
    full_flops: int = 0
    selective_flops: int = 0
    calls: int = 0
    transient_bytes: int = 0
    bf16_bytes: int = 0
    fp8_bytes: int = 0
    shared_bytes: int = 0  # the largest over the calls
    selective_forward_bytes: int = 0  # the largest over the calls
    plain_ns: int = 0
    full_ns: int = 0
    selective_ns: int = 0


@dataclass(frozen=True)
class _HeldInput:
    """One storage among a call's held inputs: its bytes (exact, on an accelerator, under bf16 and fp8), whether
    the layer saves it un-checkpointed, and whether compressing changes it."""

    nbytes: int
    on_device: bool
    bf16: int
    fp8: int
    saved: bool
    compressible: bool = False


@dataclass(frozen=True)
class _Call:
    """One measured call of a layer: its held inputs by storage, the outputs it saves un-checkpointed (storage,
    bytes), its inputs' bytes and its backward's peak beyond them; selectively checkpointed, the bytes of the outputs
    it keeps and its forward's peak beyond its inputs (0: not measured)."""

    name: str
    inputs: dict[tuple[Any, int], _HeldInput]
    saved_outputs: tuple[tuple[tuple[Any, int], int], ...]
    full: int
    backward: int
    kept: int = 0
    selective_forward: int = 0


def _held_once(calls: Sequence[_Call], step_saved: set[tuple[Any, int]],
               totals: dict[str, _LayerTotals]) -> tuple[dict[str, _LayerTotals], set[tuple[Any, int]]]:
    """Each layer's totals with every storage held by the step counted once, and the storages several calls take.

    A storage several calls take as input (a 4-D attention mask, the rotary ``cos``/``sin``) is held once whatever
    the layers choose: it is left to the bytes outside the layers (the step counted it once) and taken off every
    call's figures. An output a layer saves un-checkpointed that is held anyway (a later call saves it as its input,
    whatever that call chooses it holds it; or the step saved it outside the layers) is taken off that layer's
    un-checkpointed bytes: a block whose last ReLU saves its output, which the next block saves as its input.

    Example::

        >>> a, b = _HeldInput(100, False, 50, 26, saved=True), _HeldInput(8, False, 8, 8, saved=True)
        >>> calls = [_Call("l0", {"x": a, "mask": b}, (("y", 100),), full=108, backward=300),
        ...          _Call("l1", {"y": a, "mask": b}, (), full=108, backward=300)]
        >>> totals = {n: _LayerTotals(none_bytes=208, full_bytes=108, selective_bytes=108, transient_bytes=408)
        ...           for n in ("l0", "l1")}
        >>> fixed, shared = _held_once(calls, set(), totals)
        >>> [(t.full_bytes, t.none_bytes, t.transient_bytes) for t in fixed.values()], shared
        ([(100, 100, 400), (100, 200, 400)], {'mask'})
    """
    takers: dict[tuple[Any, int], int] = {}
    for call in calls:
        for key in call.inputs:
            takers[key] = takers.get(key, 0) + 1
    shared = {key for key, n in takers.items() if n > 1}
    out = {name: replace(t, transient_bytes=0, selective_forward_bytes=0) for name, t in totals.items()}
    before: dict[str, int] = {}  # what a layer's earlier calls hold selectively checkpointed, during its next call
    for i, call in enumerate(calls):
        t = out[call.name]
        gone = [held for key, held in call.inputs.items() if key in shared]
        common = sum(h.nbytes for h in gone)
        if call.selective_forward:
            held_before = before.get(call.name, 0)
            t.selective_forward_bytes = max(t.selective_forward_bytes,
                                            held_before + call.full - common + call.selective_forward)
            before[call.name] = held_before + call.full - common + call.kept
        t.full_bytes -= common
        t.selective_bytes -= common
        t.offloadable_bytes -= sum(h.nbytes for h in gone if h.on_device)
        t.bf16_bytes -= sum(h.bf16 for h in gone)
        t.fp8_bytes -= sum(h.fp8 for h in gone)
        t.none_bytes -= sum(h.nbytes for h in gone if h.saved)
        later = {key for c in calls[i + 1:] for key, held in c.inputs.items() if held.saved}
        t.none_bytes -= sum(nbytes for key, nbytes in call.saved_outputs
                            if key in shared or key in later or (key in step_saved and key not in takers))
        t.transient_bytes = max(t.transient_bytes, call.full - common + call.backward)
        t.shared_bytes = max(t.shared_bytes, sum(h.nbytes for h in gone if h.compressible))
    return out, shared


@dataclass(frozen=True)
class _Rerun:
    """What one plain re-run of a layer (its forward, then its backward to its inputs) measured: the figures that
    depend on the layer's code, configuration and weights' shapes and on its call's arguments' shapes, not on which
    of the model's layers it is, so an identical layer called alike reuses them (:func:`_rerun_key`)."""

    saved_bytes: int  # what it saved for backward (``none_bytes``)
    saved_sizes: tuple[int, ...]  # each new storage saved, in order
    full_flops: int  # of the ops up to the last saved tensor (what a full recompute runs)
    selective_flops: int  # of those, the ops selective checkpointing recomputes
    heavy_bytes: int  # what the matmul/attention/convolution outputs hold (kept by selective checkpointing)
    records: tuple[OpRecord, ...]
    backward_bytes: int  # the backward's peak beyond the inputs (:func:`_backward_bytes`)
    saved_inputs: tuple[int, ...]  # the positions (among the call's tensors) of the inputs it saved
    saved_outputs: tuple[tuple[int, int], ...]  # (position among the output's tensors, bytes) of the outputs it saved
    #: No op of the forward had an output whose shape or value depends on the data (``nonzero``, ``.item()``: a
    #: mixture of experts' routing): only then can the same shapes be taken to measure the same.
    reusable: bool
    #: Selectively checkpointed, its forward's peak beyond the inputs (:meth:`LayerCostRecorder._forward_lives`;
    #: 0: not measured).
    selective_forward: int = 0
    #: Its forward and backward timed on the device (:func:`_timed`): plainly, and what full and selective
    #: checkpointing add (0: not timed).
    plain_ns: int = 0
    full_ns: int = 0
    selective_ns: int = 0


class _ForwardLives:
    """A selective-checkpoint policy that keeps nothing and records, per op it sees (the positions op-level choices
    count), its name, the bytes of the storages it creates and the position of the op before which they were all
    freed (storages are watched by weak references, looked at as each op comes)."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.created: list[int] = []
        self.freed: list[int] = []
        self._live: dict[tuple[Any, int], tuple[Any, int]] = {}  # storage -> (weak reference, the op that made it)
        self._alive: list[int] = []  # per op, how many of the storages it made are alive

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        position = len(self.ops)
        for key, (ref, made_by) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
                self._alive[made_by] -= 1
                if not self._alive[made_by]:  # the last of its storages
                    self.freed[made_by] = position
        read = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        created = alive = 0
        for tensor in tree_leaves(getattr(ctx, "op_output", None)):
            if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in read | set(self._live):
                storage = tensor.untyped_storage()
                self._live[storage_key(tensor)] = (storage._weak_ref(), position)
                created, alive = created + storage.nbytes(), alive + 1
        self.ops.append(str(op))
        self.created.append(created)
        self.freed.append(-1 if alive else position + 1)  # -1: not freed yet
        self._alive.append(alive)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def records(self) -> list[OpRecord]:
        """The ops as :class:`OpRecord` (bytes and ``freed``; what is alive at the end is freed after the last op)."""
        self.freed = [f if f >= 0 else len(self.ops) for f in self.freed]
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live.clear()
        return [OpRecord(op, nbytes, 0, 0, freed=f) for op, nbytes, f in zip(self.ops, self.created, self.freed)]

    def heavy(self) -> list[int]:
        """The positions of the ops ``mode="selective"`` keeps
        (:data:`~lightning_ckpt.core.checkpoint.policies.COMPUTE_HEAVY_OPS`)."""
        heavy = {str(op) for op in COMPUTE_HEAVY_OPS}
        return [i for i, op in enumerate(self.ops) if op in heavy]


class LayerCostRecorder:
    """Measure each layer's :class:`LayerCost` during a step in which every layer is fully checkpointed.

    After each layer's (checkpointed) forward, a hook runs the same layer again, plainly, with the same inputs,
    under a saved-tensor counter and :class:`~lightning_ckpt.core.measure.profiling.OpRecordMode`, with the RNG forked and the
    layer's buffers restored; its result is dropped at once. The op records give the selective point (inputs and
    the outputs of matmul/attention/convolution ops; with ``selective=False`` it is the un-checkpointed one) and
    the layer's op-level curve (:mod:`lightning_ckpt.core.measure.op_curve`); with ``outside_ops=True`` the step's ops outside
    the layers are recorded too (:attr:`outside_ops`, for a predicted step time). ``held_bytes`` is what the fully
    checkpointed step itself held for backward. The re-runs are hidden from counters outside (:func:`~lightning_ckpt.core.measure.profiling.hidden_from_counters`): a monitor counting the step
    sees the step's bytes only.

    With ``time_layers=True`` (the default) each re-run layer is also timed on its device, forward and backward,
    plainly, fully and (``selective=True``) selectively checkpointed (:mod:`~lightning_ckpt.core.measure.layer_timing`): the
    planner prices its choices by those times on this device (``LayerCost.plain_ns``, ``full_ns``,
    ``selective_ns``). Not on fake tensors, nor under FSDP2.

    With ``selective=True`` the re-run's forward runs once more, checkpointed and keeping nothing, to learn when what
    each op creates is freed: a layer that keeps outputs (selective, op-level) can peak in its forward, above its
    backward (``LayerCost.selective_forward_bytes``, ``OpRecord.freed``), with what the modules outside the layers
    returned still alive (an embedding's output a model's forward keeps in a local while its layers run).

    Layers identical to one re-run before in the step (class, configuration, weights, training flags) and called
    alike (the same arguments' shapes and plain values) are not re-run: they reuse its figures, which are the same
    (:func:`_rerun_key` says what counts; a layer whose ops depend on the data, or with hooks inside, is always
    re-run). Their own inputs are counted as they are.

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
                 outside_ops: bool = False, time_layers: bool = True) -> None:
        self.module = module
        self.layers = list(layers)
        self.selective = selective
        self.time_layers = time_layers
        # The step's ops outside the layers, recorded while neither inside a layer nor re-running one.
        self._outside: Optional[OpRecordMode] = OpRecordMode() if outside_ops else None
        self._inside = 0
        self._outside_mark = 0  # where in the outside records the layer being run began
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
        self._totals = {name: _LayerTotals() for name, _ in self.layers}
        self._ops: dict[str, Optional[tuple[OpRecord, ...]]] = {}
        self._reruns: dict[Hashable, _Rerun] = {}  # what each distinct layer and call measured (see _rerun_key)
        self._sizes: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name, _ in self.layers}
        self._calls: list[_Call] = []  # every measured call, in order (to count storages shared between calls once)
        self._handles: list[Any] = []
        self._after_layers = 0
        self._last_output: Any = None
        self._pending: list[_Rerun] = []  # the re-runs of the layers whose forward is running (see _enter_layer)
        # Storages the modules outside the layers returned (an embedding's output, which the model's forward may keep
        # in a local while the layers run): weak references and bytes; and, per layer whose forward is running, the
        # bytes of them alive at its start that nothing counts (neither saved for backward nor a layer's input).
        self._returned: dict[tuple[Any, int], tuple[Any, int]] = {}
        self._loose: list[int] = []
        self._inputs_seen: set[tuple[Any, int]] = set()
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
        mark = len(self._outside.runs) if self._outside is not None else 0
        with hidden_from_counters(), LiveBytes() as live:
            torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
        if self._outside is not None:
            del self._outside.runs[mark:]  # a backward, not the step's forward
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
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True, always_call=False))
        names = [name for name, _ in self.layers]
        for name, sub in self.module.named_modules():
            if name and not any(name == n or is_inside(name, n) for n in names):
                self._handles.append(sub.register_forward_hook(self._returned_outside))
        self._step.__enter__()
        if self._outside is not None:
            self._outside.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._last_output = None
        for ref, _ in self._returned.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._returned.clear()
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
                self._measure(name, layer, args, kwargs, output, self._pending.pop(), self._loose.pop())
        return hook

    def _returned_outside(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._inside:
            return
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and not hasattr(tensor, "to_local"):
                key = storage_key(tensor)
                if key not in self._returned:
                    storage = tensor.untyped_storage()
                    self._returned[key] = (storage._weak_ref(), storage.nbytes())

    def _loose_bytes(self, inputs: Iterable[torch.Tensor]) -> int:
        """Bytes alive now that a module outside the layers returned, neither saved for the backward nor a layer's
        input (those are counted): a model's forward that keeps its embeddings' output in a local while its layers
        run holds them through every layer's forward, and frees them before the backward."""
        self._inputs_seen.update(storage_key(t) for t in inputs)
        loose = 0
        for key, (ref, nbytes) in list(self._returned.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._returned[key]
            elif key not in self._inputs_seen and key not in self._step._seen:
                loose += nbytes
        return loose

    def _enter_layer(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._inside += 1
        if self._outside is not None and self._inside == 1:
            self._outside_mark = len(self._outside.runs)
        if module.training and torch.is_grad_enabled():
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self._loose.append(self._loose_bytes(inputs) if self.selective else 0)
            # Re-run before the layer's own forward, not after: then its output does not exist yet, and the
            # re-run's backward has alive what the step's backward of this layer will (its inputs and what the
            # layers before hold), not one output more. Dropout draws alike: the re-run forks the RNG.
            self._pending.append(self._rerun_once(module, args, kwargs))

    def _leave_layer(self) -> None:
        self._inside -= 1
        if self._inside == 0:
            self._after_layers = self._step.bytes
        if self._outside is not None and self._inside == 0:
            del self._outside.runs[self._outside_mark:]  # the layer's own ops: in its records

    def _rerun_once(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Rerun:
        """The re-run of ``layer`` on ``args`` and ``kwargs``: one measured before for an identical layer called
        alike (:func:`_rerun_key`), else a new one."""
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        excluded = {storage_key(p) for p in self._resident()}
        key = None if self._sharded else _rerun_key(layer, args, kwargs, excluded)
        rerun = self._reruns.get(key) if key is not None else None
        if rerun is None:
            rerun = self._rerun(layer, args, kwargs, inputs)
            if key is not None and rerun.reusable:
                self._reruns[key] = rerun
        return rerun

    def _measure(self, name: str, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any, rerun: _Rerun, loose: int = 0) -> None:
        totals = self._totals[name]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        excluded = {storage_key(p) for p in self._resident()}
        inputs_held = [t for t in inputs if storage_key(local_shard(t)) not in excluded]
        full = tensor_bytes(inputs_held)
        input_sizes, saved_sizes = self._sizes[name]
        input_sizes += [tensor_bytes([t]) for t in {storage_key(t): t for t in inputs_held}.values()]
        totals.full_bytes += full
        totals.offloadable_bytes += tensor_bytes(t for t in inputs_held if t.device.type != "cpu")
        totals.bf16_bytes += held_bytes(inputs_held, "bf16")
        totals.fp8_bytes += held_bytes(inputs_held, "fp8") if layer_compress(layer, "fp8") else full
        totals.calls += 1
        totals.transient_bytes = max(totals.transient_bytes, full + rerun.backward_bytes)
        held_keys = {storage_key(t) for t in inputs_held}
        saved_inputs = {storage_key(inputs[i]) for i in rerun.saved_inputs}
        out_tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        self._calls.append(_Call(
            name, {storage_key(t): _HeldInput(tensor_bytes([t]), t.device.type != "cpu", held_bytes([t], "bf16"),
                                               held_bytes([t], "fp8"), storage_key(t) in saved_inputs,
                                               held_bytes([t], "bf16") < tensor_bytes([t]))
                   for t in inputs_held},
            tuple((storage_key(out_tensors[i]), nbytes) for i, nbytes in rerun.saved_outputs
                  if i < len(out_tensors) and storage_key(out_tensors[i]) not in held_keys),
            full, rerun.backward_bytes, rerun.heavy_bytes,
            rerun.selective_forward + loose if rerun.selective_forward else 0))
        totals.none_bytes += rerun.saved_bytes
        saved_sizes += rerun.saved_sizes
        totals.full_flops += rerun.full_flops
        totals.selective_flops += rerun.selective_flops
        totals.selective_bytes += full + rerun.heavy_bytes
        totals.plain_ns += rerun.plain_ns
        totals.full_ns += rerun.full_ns
        totals.selective_ns += rerun.selective_ns
        self._ops[name] = rerun.records if totals.calls == 1 else add_records(self._ops[name], rerun.records)

    def _rerun(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               inputs: list[torch.Tensor]) -> _Rerun:
        """Run ``layer`` again on ``args`` and ``kwargs`` (``inputs``: their tensors), plainly, then backpropagate it to
        its inputs, under the counters; its result dropped."""
        forward = _plain_forward(layer)
        # What the re-run saves is not the step's: outer counters (a MemoryMonitor's) must not hear of it.
        mark = len(self._outside.runs) if self._outside is not None else 0
        with _gathered(layer), hidden_from_counters(), LiveBytes() as live:
            with OpRecordMode() as cost:
                saved, out = self._run(layer, inputs, cost, lambda: forward(*args, **kwargs))
            outputs = [storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            out_bytes = [tensor_bytes([t]) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            # The outputs go before the backward: the step's recompute keeps none either (the gradient of each
            # comes from the layer after). Held, they put a measuring step above full checkpointing (tests/core/plan/test_peak.py).
            seed, wrt = _backward_seed(layer, inputs, out)
            del out
            backward = _backward_bytes(seed, wrt, live)
            del seed  # and with it everything the re-run saved
            lives = self._forward_lives(layer, inputs, lambda: forward(*args, **kwargs)) if self.selective else None
        if self._outside is not None:
            del self._outside.runs[mark:]  # the re-run is not the step's
        log = cost.log[:saved.last_save]  # recompute stops after the last saved tensor (early stop)
        records = op_records(cost.runs, saved.last_save, outputs)
        times = self._times(layer, inputs, forward, args, kwargs) if self.time_layers else {}
        selective_forward = 0
        if lives is not None:
            lived = lives.records()
            if [r.op for r in lived] == [r.op for r in records]:  # the same ops as in the plain run: the same positions
                records = tuple(replace(r, freed=f.freed) for r, f in zip(records, lived))
            selective_forward = forward_peak(lived, lives.heavy()) or 0
        return _Rerun(saved_bytes=saved.bytes, saved_sizes=tuple(saved.sizes),
                      full_flops=sum(flops for flops, _ in log),
                      selective_flops=sum(flops for flops, op in log if op not in COMPUTE_HEAVY_OPS),
                      heavy_bytes=sum(r.bytes for r in records if r.heavy), records=records, backward_bytes=backward,
                      reusable=not _depends_on_data(cost.log),
                      saved_inputs=tuple(i for i, t in enumerate(inputs) if storage_key(t) in saved._seen),
                      saved_outputs=tuple((i, out_bytes[i]) for i, key in enumerate(outputs) if key in saved._seen),
                      selective_forward=selective_forward, **times)

    def _times(self, layer: nn.Module, inputs: list[torch.Tensor], forward: Callable[..., Any],
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
        """``layer``'s ``forward`` (its plain one) on ``args`` and ``kwargs`` and its backward, timed plainly, and
        fully and (where measured) selectively checkpointed as training runs it (:class:`CheckpointedForward`):
        ``_Rerun``'s time fields. None on fake or meta tensors, under FSDP2 (whose hooks expect one backward per
        forward), or where nothing needs a gradient."""
        wrt = [t for t in inputs if t.requires_grad] + [p for p in _own_parameters(layer) if p.requires_grad]
        if self._sharded or not wrt or any(is_fake(t) or t.is_meta for t in [*inputs, *wrt]):
            return {}
        modes = ("plain", "full", "selective") if self.selective else ("plain", "full")
        runs = {"plain": forward, **{mode: CheckpointedForward(layer, CheckpointOptions(mode=mode), forward)
                                     for mode in modes[1:]}}
        with hidden_from_counters():
            ns = time_modes(lambda mode: _forward_backward(layer, inputs, wrt, lambda: runs[mode](*args, **kwargs)),
                            modes, wrt[0].device)
        extra = {mode: max(1, ns[mode] - ns["plain"]) for mode in modes[1:]}
        return {"plain_ns": max(1, ns["plain"]), **{f"{mode}_ns": v for mode, v in extra.items()}}

    def _forward_lives(self, layer: nn.Module, inputs: list[torch.Tensor], fn: Callable[[], Any]) -> _ForwardLives:
        """When what each op of ``layer``'s forward creates is freed, checkpointed and keeping nothing (run here, its
        result dropped, no backward): each op's outputs alive until then, and kept ones to the end of the forward,
        give the forward's peak for every choice of kept outputs (:func:`~lightning_ckpt.core.measure.op_curve.forward_peak`).

        That can be more than its backward has: SDPA with dropout runs op by op on the CPU, and kept scores (batch x
        heads x length x length) are alive next to the softmax, the dropout mask and the dropped probabilities, which
        the backward recomputes only after the scores went into the softmax."""
        lives = _ForwardLives()
        with _fork_rng(inputs), buffers_restored(layer), torch.enable_grad():
            out = checkpoint(fn, use_reentrant=False, preserve_rng_state=False,
                             context_fn=lambda: create_selective_checkpoint_contexts(lives.policy))
            del out
        return lives

    def _run(self, layer: nn.Module, inputs: list[torch.Tensor], cost: OpCostMode,
             fn: Callable[[], Any]) -> tuple[_LayerRunCounter, Any]:
        """The counter of one re-run, and its output."""
        with _fork_rng(inputs), buffers_restored(layer), torch.enable_grad():
            with _LayerRunCounter(cost, self._resident()) as saved:
                return saved, fn()

    def costs(self) -> list[LayerCost]:
        """One :class:`LayerCost` per layer, in order (a layer not called in the step holds and costs nothing)."""
        out = []
        fixed, shared = _held_once(self._calls, self._step._seen, self._totals)
        sizes = {key: held.nbytes for call in self._calls for key, held in call.inputs.items()}
        #: Of the bytes outside the layers, the inputs several layers take (each once): what the offload engine may
        #: also move to host memory, once, where a plan counts them on the device.
        self.shared_bytes = sum(sizes[key] for key in shared)
        for name, layer in self.layers:
            totals = fixed[name]
            if not self.selective:  # not measured: the selective point is taken as the un-checkpointed one
                totals = replace(totals, selective_bytes=totals.none_bytes)
            _, saved_sizes = self._sizes[name]
            input_sizes = [held.nbytes for call in self._calls if call.name == name
                           for key, held in call.inputs.items() if key not in shared]
            out.append(LayerCost(name, _class_name(layer), **asdict(totals), ops=self._ops.get(name) or (),
                                 input_sizes=tuple(input_sizes), saved_sizes=tuple(saved_sizes)))
        return out


def _forward_backward(layer: nn.Module, inputs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor],
                      fn: Callable[[], Any]) -> None:
    """One forward of ``fn`` (``layer``'s, on ``inputs``) and its backward to ``wrt`` (inputs and weights), as a
    training step runs them: the RNG forked and the buffers restored, so the step's own forward is untouched; no
    ``.grad`` is written."""
    with _fork_rng(inputs), buffers_restored(layer), torch.enable_grad():
        out = fn()
        seed, _ = _backward_seed(layer, inputs, out)
        del out
        if seed is not None:
            torch.autograd.grad(seed, list(wrt), allow_unused=True)


class _OnesGrad(torch.autograd.Function):
    """A scalar whose backward hands each of its inputs a gradient of ones: a seed for a backward from several
    outputs whose gradients only the autograd engine holds."""

    @staticmethod
    def forward(ctx: Any, *outs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(t.shape, t.dtype, t.device) for t in outs]
        return outs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs)


def _backward_seed(layer: nn.Module, inputs: Sequence[torch.Tensor],
                   out: Any) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """What the backward of one plain re-run of ``layer`` (``out`` from ``inputs``) starts from: a scalar whose
    gradient hands each output a gradient of ones (``None`` when nothing needs a gradient), and the tensors it goes
    to: the inputs, or the layer's own trainable weights where no input needs a gradient (frozen inputs, PEFT).

    The seed keeps no output alive, only the graph (so what the layer saved): the caller drops ``out`` before the
    backward."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in inputs if t.requires_grad]
    if not wrt:  # frozen inputs (PEFT): the backward still runs for the layer's own trainable weights
        wrt = [p for p in _own_parameters(layer) if p.requires_grad and not hasattr(p, "to_local")]
    else:  # tiled submodules: each tile's weight gradients are alive until added up, which a step's peak sees
        wrt += [p for name in tiles_of(layer) for p in layer.get_submodule(name).parameters()
                if p.requires_grad and not hasattr(p, "to_local")]
    if not outs or not wrt:
        return None, wrt
    return _OnesGrad.apply(*outs), wrt


def _backward_bytes(seed: Optional[torch.Tensor], wrt: Sequence[torch.Tensor], live: LiveBytes) -> int:
    """The most activation bytes alive during the backward from ``seed`` (:func:`_backward_seed`) to ``wrt``, beyond
    the re-run's inputs: what the re-run saved, the gradient of its output, and the gradients its backward makes.

    The gradients go through :func:`torch.autograd.grad`, so no ``.grad`` is touched; the weights' own gradients do
    not count. Outputs the layer does not save itself are dead by now and do not count either: in the step they are
    the next layer's inputs, freed before this backward. 0 when nothing needs a gradient.
    """
    if seed is None:
        return 0
    live.mark()
    # The outputs' gradients are made inside the backward (_OnesGrad), so that, as in the step, each is freed once
    # the ops that take it have run; passed in as `grad_outputs` they would stay alive to the end.
    grads = torch.autograd.grad(seed, list(wrt), allow_unused=True)
    weights = [g for g, t in zip(grads, wrt) if g is not None and isinstance(t, nn.Parameter)]
    return live.peak(exclude=weights)


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
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _rerun_key(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               resident: set[tuple[Any, int]]) -> Optional[Hashable]:
    """What a re-run of ``layer`` on ``args`` and ``kwargs`` measures depends on: equal keys measure the same
    (:class:`_Rerun`), so a transformer's identical blocks are re-run once per step, not once each.

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


def _depends_on_data(log: Sequence[tuple[int, Any]]) -> bool:
    """Whether an op in ``log`` (an :class:`~lightning_ckpt.core.measure.profiling.OpCostMode`'s) made an output whose shape
    or value depends on the data: then two calls with the same shapes may measure differently."""
    return any(tag in op.tags for _, op in log for tag in _DATA_DEPENDENT)


@dataclass(frozen=True)
class StepCosts:
    """What :func:`measure_step` measured in one step: per-layer costs, the bytes held outside the layers, and the
    ops run outside them (for a predicted step time). ``planner.StepMeasurement`` names the same class."""

    costs: list[LayerCost]
    outside_bytes: int
    outside_ops: tuple[OpRecord, ...] = ()
    head_bytes: int = 0  # of outside_bytes, what is saved after the last layer (see LayerCostRecorder.head_bytes)
    head_peak_bytes: int = 0  # what the head's backward makes alive at once (LayerCostRecorder.head_peak_bytes)
    shared_bytes: int = 0  # of outside_bytes, the inputs several layers take (LayerCostRecorder.shared_bytes)


def measure_step(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg = None,
                 modes: Sequence[str] = PLAN_MODES, outside_ops: bool = True, time_layers: bool = True) -> StepCosts:
    """:func:`measure_layer_costs`, with the ops the step ran outside the layers recorded too (``outside_ops``: for
    the predicted step time; each op then goes through one more dispatch mode), and each distinct layer timed on its
    device (``time_layers``: see :class:`LayerCostRecorder`)."""
    return _measure(module, step, layer_cls, modes, outside_ops=outside_ops, time_layers=time_layers)


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
        >>> [(c.name, c.full_bytes, c.none_bytes, c.full_flops) for c in costs]  # its input; 0; 2 * 8 tanh
        [('1', 64, 0, 16)]
        >>> outside  # the inputs of the two Linears, 2 * 4 and 2 * 8 float32
        96

    Tanh saves its output, but the last Linear saves that same storage as its input: it is held once, outside the
    layer, so un-checkpointed the layer adds nothing.
    """
    measured = _measure(module, step, layer_cls, modes, outside_ops=False, time_layers=False)
    return measured.costs, measured.outside_bytes


def _measure(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg, modes: Sequence[str],
             outside_ops: bool, time_layers: bool) -> StepCosts:
    check_module_and_step(module, step)
    modes = validate_modes(modes)
    if not module.training:
        raise ValueError("`plan_checkpointing` measures a training step, but the module is in eval mode, where"
                         " nothing is saved for backward. Call `module.train()` first.")
    selected = select_layers(module, layer_classes(module, layer_cls))
    if not selected:
        raise ValueError(f"No submodule of {type(module).__name__} matches `layer_cls={layer_cls!r}`:"
                         " pass the class of the model's repeated block.")
    check_no_nesting(module, [name for name, _ in selected])

    with _fully_checkpointed(module, selected), torch.random.fork_rng(devices=cuda_devices(module)), buffers_restored(module):
        with LayerCostRecorder(module, selected, selective="selective" in modes, outside_ops=outside_ops,
                               time_layers=time_layers) as recorder:
            loss = step()
            recorder.measure_head(loss)
            del loss  # frees the step's graph
    costs = recorder.costs()
    if not any(c.calls for c in costs):
        raise ValueError(f"`step()` never called a matched layer ({', '.join(n for n, _ in selected[:3])}, ...) in"
                         " training mode with grad enabled: pass a step that runs the model's forward and returns the loss.")
    outside = max(0, recorder.held_bytes - sum(c.full_bytes for c in costs))
    return StepCosts(costs, outside, recorder.outside_ops, min(outside, recorder.head_bytes),
                     recorder.head_peak_bytes, recorder.shared_bytes)


def check_module_and_step(module: object, step: object) -> None:
    """``TypeError`` unless ``module`` is an ``nn.Module`` and ``step`` a callable."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"`plan_checkpointing` takes an `nn.Module`, got {type(module).__name__}.")
    if not callable(step):
        raise TypeError(f"`step` must be a callable with no arguments that returns the loss, got {step!r}.")


def cuda_devices(module: nn.Module) -> list[int]:
    """The indices of the CUDA devices ``module``'s parameters are on, sorted."""
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextmanager
def _fully_checkpointed(module: nn.Module, selected: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
    """Every selected layer fully checkpointed (no offload), model caches off, inside the block; each forward and
    cache as it was after."""
    before = [(layer, layer.__dict__.get("forward")) for _, layer in selected]
    tiles = tiles_of(module)  # measured as the module runs: its tiles kept inside the re-wrapped layers
    caches: list[nn.Module] = []
    try:
        for _, layer in selected:
            remove_checkpointing(layer)
            apply_checkpointing(layer, layer_cls=type(layer))
        restore_tiles(module, tiles)
        caches = turn_off_caches(module, [name for name, _ in selected])
        yield
    finally:
        restore_caches(caches)
        for layer, forward in before:
            remove_checkpointing(layer)
            if forward is not None:
                layer.forward = forward
        restore_tiles(module, tiles)
