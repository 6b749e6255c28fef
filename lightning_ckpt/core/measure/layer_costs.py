"""Measuring what each matched layer holds for backward and costs to recompute, in one fully checkpointed step.

:class:`LayerCostRecorder` re-runs each layer right before its own checkpointed forward and backpropagates it to its
inputs, its output dropped before that backward, so a measuring step has alive at most what full checkpointing has
in that layer's backward (the layers' inputs so far, the layer's activations and gradients); a layer identical to one already re-run in the step and called alike (a transformer's
blocks) reuses that one's figures instead (:func:`~lightning_ckpt.core.measure.rerun_key._rerun_key`).
:func:`measure_step` and :func:`measure_layer_costs` run a step under it and return the
:class:`~lightning_ckpt.core.measure.costs.LayerCost` records the solver plans from (:class:`StepCosts`). The module,
its buffers and the RNG are left as they were. Plain PyTorch.

This module holds what is recorded: the recorder's hooks on the step, the totals per layer and the storages several
calls hold once (:func:`_held_once`). How a layer is re-run and what one re-run measures is
:mod:`~lightning_ckpt.core.measure.rerun`; which layers share a re-run, :mod:`~lightning_ckpt.core.measure.rerun_key`.
Over 500 lines: :class:`LayerCostRecorder` is one class of some 270 lines whose hooks share the step's state.

Example::

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> measured = measure_step(model, lambda: model(torch.randn(2, 4)).sum(), layer_cls=nn.Tanh)
    >>> [(c.name, c.full_bytes) for c in measured.costs], measured.outside_bytes
    ([('1', 64)], 96)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_ckpt.core.checkpoint.compress import held_bytes, layer_compress
from lightning_ckpt.core.checkpoint.layer_state import buffers_restored
from lightning_ckpt.core.checkpoint.placement import fsdp2
from lightning_ckpt.core.measure.costs import PLAN_MODES, LayerCost, validate_modes
from lightning_ckpt.core.measure.op_curve import OpRecord, add_records, op_records
from lightning_ckpt.core.measure.profiling import (
    LiveBytes,
    OpRecordMode,
    hidden_from_counters,
    local_shard,
    storage_key,
    tensor_bytes,
)
from lightning_ckpt.core.measure.rerun import _own_parameters, _Rerun, _rerun, _StepCounter
from lightning_ckpt.core.measure.rerun_key import _rerun_key
from lightning_ckpt.core.checkpoint.selection import LayerClassArg, is_inside, layer_classes, select_layers
from lightning_ckpt.core.checkpoint.tiling import restore_tiles, tiles_of
from lightning_ckpt.core.checkpoint.wrapping import (
    apply_checkpointing,
    check_no_nesting,
    remove_checkpointing,
    restore_caches,
    turn_off_caches,
)

__all__ = ["LayerCostRecorder", "StepCosts", "check_module_and_step", "cuda_devices", "measure_layer_costs",
           "measure_step"]


def _class_name(layer: nn.Module) -> str:
    """The layer's own class name (``Block``, not the ``FSDPBlock`` that ``fully_shard`` makes of it)."""
    fsdp_module = fsdp2().FSDPModule
    return next(c for c in type(layer).__mro__ if not issubclass(c, fsdp_module)).__qualname__


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
    (:func:`~lightning_ckpt.core.measure.rerun_key._rerun_key` says what counts; a layer whose ops depend on the data, or with hooks inside, is always
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
        alike (:func:`~lightning_ckpt.core.measure.rerun_key._rerun_key`), else a new one."""
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        excluded = {storage_key(p) for p in self._resident()}
        key = None if self._sharded else _rerun_key(layer, args, kwargs, excluded)
        rerun = self._reruns.get(key) if key is not None else None
        if rerun is None:
            rerun = _rerun(layer, args, kwargs, inputs, self._resident, self._outside, self.selective,
                           self.time_layers, self._sharded)
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
