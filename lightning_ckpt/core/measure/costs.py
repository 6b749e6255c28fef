"""What one matched layer holds for backward and costs to recompute (:class:`LayerCost`), and the choices a plan
may give it: the checkpointing modes (:data:`PLAN_MODES`) and what ``offload`` takes (:data:`Offload`).

The vocabulary the planner's parts share: :mod:`lightning_ckpt.core.measure.layer_costs` makes :class:`LayerCost` records,
:mod:`lightning_ckpt.core.plan.solver` and :mod:`lightning_ckpt.core.measure.timing` read them. Plain PyTorch.

Example::

    >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
    ...                  full_flops=50, selective_flops=5)
    >>> cost.device_bytes("full"), cost.flops("full"), cost.flops("selective")
    (10, 50, 5)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Literal, Optional, Union

from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES
from lightning_ckpt.core.measure.op_curve import OpRecord, forward_peak

__all__ = ["PLAN_MODES", "Choice", "LayerCost", "Offload", "validate_modes", "validate_offload"]

Choice = Literal["none", "full", "selective", "ops"]
#: What a layer may get besides "none": full or selective checkpointing, or an op-level choice of what to keep.
PLAN_MODES = ("full", "selective", "ops")

#: What ``offload`` takes: never, every checkpointed layer's inputs, or the planner's choice per layer.
Offload = Union[bool, Literal["auto"]]


@dataclass(frozen=True)
class LayerCost:
    """What one matched layer holds for backward and costs to recompute, summed over its calls in a step.

    ``name`` and ``cls`` are positional; every field after them is keyword-only (eight integers in a row are easy
    to swap unseen)."""

    name: str
    cls: str
    _: KW_ONLY
    none_bytes: int  # held un-checkpointed
    full_bytes: int  # held fully checkpointed: the layer's tensor inputs
    #: Held selectively checkpointed: inputs and kept matmul/attention outputs. Measured only where ``"selective"``
    #: is among the modes measured for (``LayerCostRecorder(selective=True)``); else it is ``none_bytes`` (not
    #: measured: the selective mode was not asked for).
    selective_bytes: int
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
    #: ``full_bytes`` under ``compress="bf16"`` and ``"fp8"`` (:func:`~lightning_ckpt.core.checkpoint.compress.held_bytes`;
    #: 0: not measured, taken as ``full_bytes``).
    bf16_bytes: int = 0
    fp8_bytes: int = 0
    #: Bytes the compression passes read and write per step when the layer is checkpointed (0: exact inputs), set by
    #: :meth:`compressed`: compressing reads the inputs and writes the copy, the recompute reads it back and writes
    #: the inputs again.
    codec_bytes: int = 0
    #: Exact bytes of the compressible inputs it shares with other layers (a rotary ``cos``/``sin``): held once,
    #: outside the layers, so not in ``full_bytes``; under ``compress`` its backward decompresses them anew.
    shared_bytes: int = 0
    #: The most bytes its forward has alive at once selectively checkpointed: its inputs, the outputs it keeps so far
    #: and the intermediates alive then (the largest over its calls, with what its earlier calls keep; 0: not
    #: measured). Above :meth:`backward_peak` where a chain of cheap ops runs next to a large kept output (SDPA with
    #: dropout on the CPU: the scores, then the softmax, the mask and the dropped probabilities).
    selective_forward_bytes: int = 0
    #: Nanoseconds its forward and backward took plainly on the device it was measured on, and what full and
    #: selective checkpointing added to that (summed over its calls; at least 1 where timed, 0: not timed, as on fake
    #: tensors or for a mode not measured). See :mod:`~lightning_ckpt.core.measure.layer_timing`. Left out of comparisons:
    #: two measurements of the same layer hold alike but never take the same time.
    plain_ns: int = field(default=0, compare=False)
    full_ns: int = field(default=0, compare=False)
    selective_ns: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ops, tuple) or any(isinstance(r, Mapping) for r in self.ops):  # from a state_dict
            object.__setattr__(self, "ops", tuple(OpRecord(**r) if isinstance(r, Mapping) else r for r in self.ops))
        for name in ("input_sizes", "saved_sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def timed(self) -> bool:
        """Whether this layer was timed on the device it was measured on (its full checkpointing's extra known)."""
        return self.full_ns > 0

    def movable_bytes(self, choice: Choice, min_bytes: int = DEFAULT_MIN_BYTES) -> int:
        """Bytes the offload engine would move to host memory for ``choice``: for ``"none"`` what the layer saves,
        else its inputs; storages under ``min_bytes`` stay on the device (without recorded sizes: all of it).

        Example::

            >>> cost = LayerCost("a", "Block", none_bytes=3000, full_bytes=1000, selective_bytes=2000,
            ...                  offloadable_bytes=1000, full_flops=10, selective_flops=1, input_sizes=(1000,),
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

    @property
    def exact_input_bytes(self) -> int:
        """The layer's inputs at full width, compressed or not (:meth:`compressed` keeps them in ``codec_bytes``)."""
        return self.codec_bytes // 2 - self.full_bytes if self.codec_bytes else self.full_bytes

    def compressed(self, compress: Optional[Compress]) -> LayerCost:
        """The costs with the inputs held under ``compress``: what a checkpointed choice (full, selective, ops)
        holds, and offload moves, shrinks by what compressing the inputs saves; ``"none"`` is unchanged. The backward
        peak grows by the compressed copy, alive next to the decompressed inputs until the layer's backward ends
        (counted whatever the choice: the bound stays safe), and by the decompressed copies of the inputs it shares
        with other layers (``shared_bytes``). Costs already compressed (``codec_bytes`` set), and costs whose inputs
        compress to no fewer bytes (kept exact), come back as they are.

        Example::

            >>> cost = LayerCost("a", "Block", none_bytes=3000, full_bytes=1000, selective_bytes=2000,
            ...                  offloadable_bytes=1000, full_flops=10, selective_flops=1, bf16_bytes=500,
            ...                  fp8_bytes=258)
            >>> half = cost.compressed("bf16")
            >>> half.full_bytes, half.selective_bytes, half.offloadable_bytes, half.backward_peak, half.codec_bytes
            (500, 1500, 500, 3500, 3000)
            >>> exact = replace(cost, fp8_bytes=1000)  # inputs kept exact under fp8: no copy, no codec passes
            >>> exact.compressed("fp8") is exact
            True
        """
        if compress is None or self.codec_bytes:
            return self
        held = (self.bf16_bytes if compress == "bf16" else self.fp8_bytes) or self.full_bytes
        if held == self.full_bytes:  # nothing to compress (or kept exact: BatchNorm under fp8): no copy, no passes
            return self
        saved = self.full_bytes - held
        ratio = held / self.full_bytes if self.full_bytes else 1.0
        return replace(self, full_bytes=held, selective_bytes=self.selective_bytes - saved,
                       offloadable_bytes=round(self.offloadable_bytes * ratio),
                       input_sizes=tuple(round(size * ratio) for size in self.input_sizes),
                       transient_bytes=self.backward_peak + held + self.shared_bytes, bf16_bytes=0, fp8_bytes=0,
                       codec_bytes=2 * (self.full_bytes + held),
                       selective_forward_bytes=self.selective_forward_bytes + held + self.shared_bytes
                       if self.selective_forward_bytes else 0)

    def forward_bytes(self, choice: Choice, keep: Sequence[int] = ()) -> Optional[int]:
        """The most bytes its forward has alive at once as ``choice`` keeps outputs (``"selective"``, or ``"ops"``
        keeping those at ``keep``): :attr:`selective_forward_bytes`, and for ``"ops"`` the same with its kept outputs
        instead of the matmuls' (:func:`~lightning_ckpt.core.measure.op_curve.forward_peak`). ``None`` where not measured, and
        for ``"none"`` and ``"full"``, whose forward never has more alive than their backward.

        Example::

            >>> ops = (OpRecord("aten.mm.default", 400, 10, 0, freed=1),
            ...        OpRecord("aten.exp.default", 400, 1, 0, freed=2))
            >>> cost = LayerCost("a", "Block", none_bytes=800, full_bytes=100, selective_bytes=500, offloadable_bytes=0,
            ...                  full_flops=11, selective_flops=1, ops=ops, selective_forward_bytes=900)
            >>> cost.forward_bytes("selective"), cost.forward_bytes("ops", keep=[1]), cost.forward_bytes("full")
            (900, 500, None)
        """
        if choice == "selective":
            return self.selective_forward_bytes or None
        if choice != "ops" or not self.selective_forward_bytes:
            return None
        heavy = forward_peak(self.ops, [i for i, r in enumerate(self.ops) if r.heavy])
        kept = forward_peak(self.ops, keep)
        if heavy is None or kept is None:
            return None
        return self.selective_forward_bytes - heavy + kept

    def measured_seconds(self, choice: Choice, keep: Sequence[int] = ()) -> Optional[float]:
        """The extra step time of ``choice`` as measured on the device (``None`` where not timed).

        ``"ops"`` keeping the outputs at ``keep`` lies between selective checkpointing (which keeps every
        matmul's) and full, in proportion to the FLOPs it recomputes; without a selective time, between nothing and
        full.

        Example::

            >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
            ...                  full_flops=110, selective_flops=10, full_ns=3000, selective_ns=1000,
            ...                  ops=(OpRecord("aten.mm.default", 30, 100, 0), OpRecord("aten.relu.default", 10, 10, 0)))
            >>> cost.measured_seconds("full"), cost.measured_seconds("selective"), cost.measured_seconds("ops", keep=[1])
            (3e-06, 1e-06, 2.8e-06)
        """
        if choice == "none":
            return 0.0
        if choice == "selective":
            return self.selective_ns / 1e9 if self.selective_ns else None
        if not self.timed:
            return None
        low_flops, low_ns = (self.selective_flops, self.selective_ns) if self.selective_ns else (0, 0)
        span = self.full_flops - low_flops
        share = (self.flops(choice, keep) - low_flops) / span if span > 0 else 1.0
        return (low_ns + min(1.0, max(0.0, share)) * (self.full_ns - low_ns)) / 1e9

    def flops(self, choice: Choice, keep: Sequence[int] = ()) -> int:
        if choice == "ops":
            return self.full_flops - sum(self.ops[i].flops for i in keep)
        return {"none": 0, "full": self.full_flops, "selective": self.selective_flops}[choice]


def validate_modes(modes: Sequence[str]) -> tuple[str, ...]:
    """``modes`` without repeats, or ``ValueError`` when it is not a non-empty sequence of :data:`PLAN_MODES`."""
    if isinstance(modes, str) or not modes or any(m not in PLAN_MODES for m in modes):
        raise ValueError(f"`modes={modes!r}` is not understood. Pass a non-empty tuple of {PLAN_MODES}, such as"
                         " ('full',).")
    return tuple(dict.fromkeys(modes))


def validate_offload(offload: object) -> None:
    """``ValueError`` unless ``offload`` is ``False``, ``True`` or ``"auto"``."""
    if not (offload is True or offload is False or offload == "auto"):
        raise ValueError(f"`offload={offload!r}` is not understood. Pass False (nothing offloaded), True (every"
                         " checkpointed layer's inputs in host memory) or 'auto' (the planner chooses per layer; needs"
                         " a device profile).")
