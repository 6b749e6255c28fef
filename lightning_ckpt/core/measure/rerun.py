"""How :class:`~lightning_ckpt.core.measure.layer_costs.LayerCostRecorder` re-runs a layer and what it measures.

:func:`_rerun` runs a layer again on its call's arguments, plainly, under a saved-tensor counter
(:class:`_LayerRunCounter`) and :class:`~lightning_ckpt.core.measure.profiling.OpRecordMode`, with the RNG forked and
its buffers restored, then backpropagates it to its inputs (:func:`_backward_seed`, :func:`_backward_bytes`); selectively
checkpointed it runs its forward once more to learn when each op's outputs are freed (:func:`_forward_lives`), and it
times the layer on its device (:func:`_times`). What it measured is a :class:`_Rerun`, which an identical layer called
alike reuses (:mod:`~lightning_ckpt.core.measure.rerun_key`). What the recorder does with it (totals per layer, storages
held once) is :mod:`~lightning_ckpt.core.measure.layer_costs`. Plain PyTorch.

Example::

    >>> from torch import nn
    >>> layer, x = nn.Tanh(), torch.randn(2, 4, requires_grad=True)
    >>> measured = _rerun(layer, (x,), {}, [x], lambda: [], None, selective=False, time_layers=False, sharded=False)
    >>> measured.saved_bytes, measured.saved_outputs, measured.reusable  # tanh saves its output, 2 * 4 float32
    (32, ((0, 32),), True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt.core.checkpoint.layer_state import buffers_restored
from lightning_ckpt.core.checkpoint.placement import fsdp2
from lightning_ckpt.core.checkpoint.policies import COMPUTE_HEAVY_OPS
from lightning_ckpt.core.checkpoint.selection import is_inside
from lightning_ckpt.core.checkpoint.tiling import tiles_of
from lightning_ckpt.core.checkpoint.wrapping import CheckpointedForward, CheckpointOptions, is_checkpointed
from lightning_ckpt.core.measure.layer_timing import time_modes
from lightning_ckpt.core.measure.op_curve import OpRecord, forward_peak, op_records
from lightning_ckpt.core.measure.profiling import (
    LiveBytes,
    OpCostMode,
    OpRecordMode,
    SavedTensorCounter,
    hidden_from_counters,
    report_held,
    storage_key,
    tensor_bytes,
)


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


def _fork_rng(tensors: Sequence[torch.Tensor]) -> Any:
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


@dataclass(frozen=True)


class _Rerun:
    """What one plain re-run of a layer (its forward, then its backward to its inputs) measured: the figures that
    depend on the layer's code, configuration and weights' shapes and on its call's arguments' shapes, not on which
    of the model's layers it is, so an identical layer called alike reuses them (:func:`~lightning_ckpt.core.measure.rerun_key._rerun_key`)."""

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
    #: Selectively checkpointed, its forward's peak beyond the inputs (:func:`_forward_lives`;
    #: 0: not measured).
    selective_forward: int = 0
    #: Its forward and backward timed on the device (:func:`_times`): plainly, less the timing harness's own cost,
    #: and what full and selective checkpointing add (0: not timed).
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


def _rerun(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor],
           resident: Callable[[], Sequence[torch.Tensor]], outside: Optional[OpRecordMode], selective: bool,
           time_layers: bool, sharded: bool) -> _Rerun:
    """Run ``layer`` again on ``args`` and ``kwargs`` (``inputs``: their tensors), plainly, then backpropagate it to
    its inputs, under the counters; its result dropped.

    As :class:`~lightning_ckpt.core.measure.layer_costs.LayerCostRecorder` runs it: ``resident`` gives the
    parameters' storages now (left out of what is saved), ``outside`` the step's records of the ops outside the layers
    (the re-run's are taken off them), ``selective`` and ``time_layers`` its settings, ``sharded`` whether the model
    is (FSDP2: no timing)."""
    forward = _plain_forward(layer)
    # What the re-run saves is not the step's: outer counters (a MemoryMonitor's) must not hear of it.
    mark = len(outside.runs) if outside is not None else 0
    with _gathered(layer), hidden_from_counters(), LiveBytes() as live:
        with OpRecordMode() as cost:
            saved, out = _run(layer, inputs, cost, resident, lambda: forward(*args, **kwargs))
        outputs = [storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_bytes = [tensor_bytes([t]) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # The outputs go before the backward: the step's recompute keeps none either (the gradient of each
        # comes from the layer after). Held, they put a measuring step above full checkpointing (tests/core/plan/test_peak.py).
        seed, wrt = _backward_seed(layer, inputs, out)
        del out
        backward = _backward_bytes(seed, wrt, live)
        del seed  # and with it everything the re-run saved
        lives = _forward_lives(layer, inputs, lambda: forward(*args, **kwargs)) if selective else None
    if outside is not None:
        del outside.runs[mark:]  # the re-run is not the step's
    log = cost.log[:saved.last_save]  # recompute stops after the last saved tensor (early stop)
    records = op_records(cost.runs, saved.last_save, outputs)
    times = _times(layer, inputs, forward, args, kwargs, selective, sharded) if time_layers else {}
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


def _times(layer: nn.Module, inputs: list[torch.Tensor], forward: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any], selective: bool, sharded: bool) -> dict[str, int]:
    """``layer``'s ``forward`` (its plain one) on ``args`` and ``kwargs`` and its backward, timed plainly, and
    fully and (where measured) selectively checkpointed as training runs it (:class:`CheckpointedForward`), beside
    the same harness around a layer that does nothing (:func:`_through`), whose time the plain run's excludes:
    ``_Rerun``'s time fields. None on fake or meta tensors, under FSDP2 (whose hooks expect one backward per
    forward), or where nothing needs a gradient."""
    wrt = [t for t in inputs if t.requires_grad] + [p for p in _own_parameters(layer) if p.requires_grad]
    if sharded or not wrt or any(is_fake(t) or t.is_meta for t in [*inputs, *wrt]):
        return {}
    checkpointed = ("full", "selective") if selective else ("full",)
    runs = {"plain": forward, "harness": lambda *_, **__: _through(inputs),
            **{mode: CheckpointedForward(layer, CheckpointOptions(mode=mode), forward) for mode in checkpointed}}
    with hidden_from_counters():
        ns = time_modes(lambda mode: _forward_backward(layer, inputs, wrt, lambda: runs[mode](*args, **kwargs)),
                        tuple(runs), wrt[0].device)
    # The harness's own cost (RNG forked, buffers restored, the seed, a backward call of its own) is not the
    # layer's: in a step the layer is a part of one forward and one backward. Its checkpointed runs pay it too.
    return {"plain_ns": max(1, ns["plain"] - ns["harness"]),
            **{f"{mode}_ns": max(1, ns[mode] - ns["plain"]) for mode in checkpointed}}


def _through(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A layer that does nothing: a view of each input that needs a gradient, so the harness's backward runs."""
    return [t.view_as(t) for t in inputs if t.requires_grad]


def _forward_lives(layer: nn.Module, inputs: list[torch.Tensor], fn: Callable[[], Any]) -> _ForwardLives:
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


def _run(layer: nn.Module, inputs: list[torch.Tensor], cost: OpCostMode,
         resident: Callable[[], Sequence[torch.Tensor]], fn: Callable[[], Any]) -> tuple[_LayerRunCounter, Any]:
    """The counter of one re-run, and its output."""
    with _fork_rng(inputs), buffers_restored(layer), torch.enable_grad():
        with _LayerRunCounter(cost, resident()) as saved:
            return saved, fn()


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


_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _depends_on_data(log: Sequence[tuple[int, Any]]) -> bool:
    """Whether an op in ``log`` (an :class:`~lightning_ckpt.core.measure.profiling.OpCostMode`'s) made an output whose shape
    or value depends on the data: then two calls with the same shapes may measure differently."""
    return any(tag in op.tags for _, op in log for tag in _DATA_DEPENDENT)
