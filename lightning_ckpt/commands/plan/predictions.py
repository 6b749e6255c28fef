"""What ``lightning-ckpt plan`` predicts from its measurements: the layer modes of each standard setting, each
setting's activations, peak, recompute FLOPs and step time, the fit of the peak over the batch size, the largest
batch that fits, the fit of the peak over the sequence length and the largest length that fits, the least peak the
plan's own settings reach (:class:`PlanSettings`), and the planner's front over budgets. Arithmetic only, on
:class:`~lightning_ckpt.commands.plan.measure.Measurement`: nothing here builds or runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.measure.cost_fit import fit_peak  # noqa: F401 (plan --lengths fits with it; it lives in core)
from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import (
    CheckpointPlan,
    ChunkedHead,
    LayerCost,
    Offload,
    _least_peak,
    make_option,
    make_plan,
    predict,
    predict_peak,
    predict_seconds,
)

if TYPE_CHECKING:
    from lightning_ckpt.commands.plan.measure import Measurement

#: Standard setting -> description, in the order they are reported; each maps to layer modes in :func:`setting_choices`.
SETTINGS = {
    "none": "no checkpointing",
    "every_4th": "every 4th layer, full",
    "every_2nd": "every 2nd layer, full",
    "every_layer": "every layer, full",
    "selective": "every layer, selective",
    "every_layer_chunked": "every layer, full, with the LM head and loss in chunks",
    "plan": "the plan for the budget",
}
#: The settings whose LM head and loss run in chunks (the measurement's ``chunked``), besides a chunked plan.
CHUNKED_SETTINGS = ("every_layer_chunked",)
#: The modes the callback's plans choose from (with ``use_reentrant``: ``("full",)``), and so the command's: its plans
#: are what ``GradientCheckpointing(memory_budget=...)`` applies. Op-level choices (``"ops"``) are
#: ``plan_checkpointing``'s only: the callback combines its costs over ranks without the op records.
CALLBACK_MODES = ("full", "selective")


def setting_choices(names: Sequence[str], plan: Optional[CheckpointPlan], chunked: bool = False,
                    ) -> dict[str, dict[str, str]]:
    """Layer modes of each standard setting (``"plan"`` only when there is one, ``"every_layer_chunked"`` only when
    the LM head and loss were measured ``chunked`` too).

    Example::

        >>> setting_choices(["a", "b", "c"], None)["every_2nd"]
        {'a': 'full', 'c': 'full'}
        >>> list(setting_choices(["a"], None, chunked=True))[-1]
        'every_layer_chunked'
    """
    out: dict[str, dict[str, str]] = {
        "none": {},
        "every_4th": {n: "full" for i, n in enumerate(names) if i % 4 == 0},
        "every_2nd": {n: "full" for i, n in enumerate(names) if i % 2 == 0},
        "every_layer": dict.fromkeys(names, "full"),
        "selective": dict.fromkeys(names, "selective"),
    }
    if chunked:
        out["every_layer_chunked"] = dict.fromkeys(names, "full")
    if plan is not None:
        out["plan"] = dict(plan.layers)
    return out


@dataclass
class SettingRow:
    name: str
    layers: int
    activation_bytes: int
    recompute_flops: int
    fixed_bytes: Optional[float] = None  # activations = fixed_bytes + per_sample_bytes * batch
    per_sample_bytes: Optional[float] = None
    largest_batch: Optional[int] = None  # from the peak's fit: static + peak_fixed + peak_per_sample * batch fits
    predicted_step_seconds: Optional[float] = None  # with a device profile
    peak_bytes: int = 0  # the step's activation peak, forward and backward
    host_bytes: int = 0  # held in host memory by offloaded layers: in neither activation_bytes nor peak_bytes
    peak_fixed_bytes: Optional[float] = None  # peak = peak_fixed_bytes + peak_per_sample_bytes * batch
    peak_per_sample_bytes: Optional[float] = None


def as_planned(costs: Sequence[LayerCost], device: Optional[DeviceProfile]) -> list[LayerCost]:
    """``costs`` as :func:`~lightning_ckpt.core.plan.planner.make_plan` plans them: with a device profile, measured on
    the CPU or on fake tensors but planned for the profile's device, every layer's inputs can move to host memory
    (``offloadable_bytes`` is ``full_bytes``). Every setting's figures use them, so the plan's row is the plan's.

    Example::

        >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                  full_flops=50, selective_flops=5)
        >>> as_planned([cost], None)[0].offloadable_bytes, as_planned([cost], "h100-sxm")[0].offloadable_bytes
        (0, 10)
    """
    return [replace(c, offloadable_bytes=c.full_bytes) for c in costs] if device is not None else list(costs)


@dataclass(frozen=True)
class PlanSettings:
    """The plan's own settings: every plan the command makes (for the budget, at each length, at the longest
    length) is made with them, and the plan's longest length is the longest at which they reach the device.
    The one place they are passed to the planner: a setting the planner gains (a chunked head and loss) is added
    here.

    Example::

        >>> from lightning_ckpt.commands.plan.measure import Measurement
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
        ...                    offloadable_bytes=10, full_flops=50, selective_flops=5) for i in range(4)]
        >>> PlanSettings().least_peak(Measurement(8, costs, 100))  # l3's backward: 100 outside, 3 x 10 held, its 100
        230
        >>> PlanSettings(offload=True).least_peak(Measurement(8, costs, 100))  # l0-l2 hold nothing on the device
        210
        >>> chunked = Measurement(8, costs, 100, chunked=ChunkedHead(64, outside_bytes=40, head_bytes=0,
        ...                                                        head_peak_bytes=0, flops=8))
        >>> [PlanSettings(chunk_loss=c).least_peak(chunked) for c in (None, True, False)]  # 40 outside, not 100
        [170, 170, 230]
    """

    offload: Offload = False
    device: Optional[DeviceProfile] = None
    compress: Optional[Compress] = None
    #: The LM head and loss in chunks (``measured.chunked``): ``True`` always, ``False`` never, ``None`` where the
    #: plan is cheaper or only reaches the budget with them (:func:`~lightning_ckpt.core.plan.planner.make_plan`).
    chunk_loss: Optional[bool] = None
    #: Bytes of host memory offloaded activations may take (the planner's ``host_memory``; ``None``: half of this
    #: machine's available memory): ``--host-memory`` less what CPU offload keeps there.
    host_memory: Optional[int] = None
    #: The steps were measured with the layers' MLPs over tiles of tokens (``--tile-mlp``): every plan is tiled.
    tile_mlp: bool = False
    #: What a layer may get besides ``"none"``: the callback's (:data:`CALLBACK_MODES`), so that every plan of the
    #: command is one the callback applies.
    modes: tuple[str, ...] = CALLBACK_MODES

    def plan(self, measured: Measurement, budget: object) -> tuple[Optional[CheckpointPlan], Optional[str]]:
        """``(plan, None)``: the planner's plan for ``budget`` on ``measured``; ``(None, why)`` when it cannot be
        met."""
        try:
            plan = make_plan(measured.costs, measured.outside_bytes, budget, modes=self.modes, offload=self.offload,
                             device=self.device, outside_ops=measured.outside_ops, head_bytes=measured.head_bytes,
                             head_peak_bytes=measured.head_peak_bytes, compress=self.compress,
                             chunked=measured.chunked, chunk_loss=self.chunk_loss, host_memory=self.host_memory)
            return (replace(plan, tile_mlp=True) if self.tile_mlp else plan), None
        except ValueError as err:
            return None, str(err)

    def least_peak(self, measured: Measurement) -> int:
        """The least activation peak a plan with these settings reaches on ``measured``: every layer at the option
        that holds the least (checkpointed, compressed, offloaded), as the planner's "least reachable" says; with
        ``measured.chunked`` and ``chunk_loss`` not ``False``, the chunked head's bytes outside the layers (the least of
        both ways under ``None``)."""
        costs = [c.compressed(self.compress) for c in as_planned(measured.costs, self.device)]
        plain = _least_peak(costs, measured.outside_bytes, self.modes, self.offload, DEFAULT_MIN_BYTES,
                            measured.head_bytes, measured.head_peak_bytes)
        head = measured.chunked
        if head is None or self.chunk_loss is False:
            return plain
        chunked = _least_peak(costs, head.outside_bytes, self.modes, self.offload, DEFAULT_MIN_BYTES, head.head_bytes,
                              head.head_peak_bytes)
        return chunked if self.chunk_loss else min(plain, chunked)


#: The planner's words when the device could hold a plan but host memory cannot hold what it would offload
#: (:func:`~lightning_ckpt.core.plan.planner.make_plan`'s error).
HOST_MEMORY_SHORT = "needs more than `host_memory="


def host_memory_short(plan_error: Optional[str]) -> bool:
    """Whether the planner found no plan because what it would offload does not fit its ``host_memory`` (the device
    could hold the plan): ``plan --host-memory`` is then what to raise, not the device memory.

    Example::

        >>> host_memory_short("`memory_budget=100` (100 B of activations) needs more than `host_memory=50` (50 B)")
        True
        >>> host_memory_short("the least reachable is 3.9 MiB"), host_memory_short(None)
        (False, False)
    """
    return plan_error is not None and HOST_MEMORY_SHORT in plan_error


def host_bytes(costs: Sequence[LayerCost], layers: Mapping[str, str], moved: Union[bool, Sequence[str]],
               kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({})) -> int:
    """Bytes the layer modes ``layers`` keep in host memory: ``moved`` is ``True`` (every checkpointed layer's
    inputs offloaded), ``False``, or the names of the offloaded layers (as :func:`~lightning_ckpt.core.plan.planner.predict`
    takes it). What moves is what the offload engine moves (tensors of its ``min_bytes`` or more).

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=2**20, full_bytes=2**16, selective_bytes=2**18,
        ...                    offloadable_bytes=2**16, full_flops=50, selective_flops=5) for i in range(4)]
        >>> host_bytes(costs, {"l0": "full", "l2": "full"}, True), host_bytes(costs, {}, ["l1"])  # inputs; all l1 saves
        (131072, 1048576)
    """
    total = 0
    for c in costs:
        mode = layers.get(c.name, "none")
        offloaded = c.name in moved if not isinstance(moved, bool) else moved and mode != "none"
        total += make_option(c, mode, kept_ops.get(c.name, ()), offloaded).host_bytes  # type: ignore[arg-type]
    return total


def fit_line(x1: int, y1: int, x2: int, y2: int) -> tuple[float, float]:
    """``(intercept, slope)`` of the line through two points.

    Example::

        >>> fit_line(4, 140, 8, 260)
        (20.0, 30.0)
    """
    slope = (y2 - y1) / (x2 - x1)
    return y1 - slope * x1, slope


def largest_batch(fixed: float, per_sample: float, room: float) -> Optional[int]:
    """The largest batch ``b >= 0`` with ``fixed + per_sample * b <= room``; ``None`` when unbounded.

    Example::

        >>> largest_batch(20, 30, 1000), largest_batch(20, 30, 10), largest_batch(20, 0, 1000)
        (32, 0, None)
    """
    if per_sample <= 0:
        return None if fixed <= room else 0
    return max(0, math.floor((room - fixed) / per_sample + 1e-9))


def largest_length(coeffs: tuple[float, float, float], room: float) -> Optional[int]:
    """The largest length ``T >= 0`` with ``c0 + c1 * T + c2 * T**2 <= room`` (``coeffs`` from :func:`fit_peak`);
    ``None`` when the peak does not grow with the length. A fit that bends down (``c2 < 0``, noise on a line) is
    read as its line, which never promises more than the measurements.

    Example::

        >>> largest_length((1, 2, 3), 321), largest_length((1, 2, 3), 320), largest_length((20, 30, 0), 1000)
        (10, 9, 32)
    """
    c0, c1, c2 = coeffs
    c2 = max(c2, 0.0)
    left = room - c0
    if left < 0:
        return 0
    if c2 == 0 and c1 <= 0:
        return None
    # The positive root of c2 T^2 + c1 T - left, in the form that stays exact as c2 goes to 0.
    return max(0, math.floor(2 * left / (c1 + math.sqrt(c1 * c1 + 4 * c2 * left)) + 1e-9))


def plan_for(measured: Measurement, budget: object, offload: Offload, device: Optional[DeviceProfile] = None,
             compress: Optional[Compress] = None) -> tuple[Optional[CheckpointPlan], Optional[str]]:
    """``(plan, None)``: the planner's plan for ``budget`` on ``measured``; ``(None, why)`` when it cannot be met
    (:meth:`PlanSettings.plan`)."""
    return PlanSettings(offload, device, compress).plan(measured, budget)


def outside_of(measured: Measurement, chunked: bool) -> tuple[int, int, int, int]:
    """``(outside_bytes, head_bytes, head_peak_bytes, head_flops)`` of ``measured``: as measured, or with ``chunked``
    (and a chunked measurement) the chunked LM head and loss's, whose backward runs the head's forward again
    (``head_flops``).

    Example::

        >>> from lightning_ckpt.commands.plan.measure import Measurement
        >>> m = Measurement(8, [], 100, head_bytes=60, head_peak_bytes=80, chunked=ChunkedHead(64, 40, 5, 7, 9))
        >>> outside_of(m, False), outside_of(m, True)
        ((100, 60, 80, 0), (40, 5, 7, 9))
    """
    head = measured.chunked if chunked else None
    if head is None:
        return measured.outside_bytes, measured.head_bytes, measured.head_peak_bytes, 0
    return head.outside_bytes, head.head_bytes, head.head_peak_bytes, head.flops


def setting_rows(main: Measurement, choices: Mapping[str, Mapping[str, str]], offload: Offload,
                 other: Optional[Measurement] = None, room: Optional[int] = None,
                 kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}),
                 device: Optional[DeviceProfile] = None, plan_offloaded: Sequence[str] = (),
                 plan_chunked: bool = False) -> list[SettingRow]:
    """Predicted bytes and FLOPs of each setting at ``main``'s batch size; with ``other`` (a second batch size)
    the linear fits of the activations and of the peak, with ``room`` (device memory minus static memory) the largest
    batch whose peak fits, and with ``device`` the predicted step time. An ``"ops"`` layer keeps the ops at positions
    ``kept_ops[name]``. The costs are counted as the planner plans them (:func:`as_planned`). The settings of
    :data:`CHUNKED_SETTINGS`, and the plan with ``plan_chunked``, count the chunked LM head and loss
    (:func:`outside_of`): its bytes outside the layers, and its recompute in FLOPs and time."""
    costs = as_planned(main.costs, device)
    other_costs = as_planned(other.costs, device) if other is not None else []
    rows = []
    for name, layers in choices.items():
        # "auto" is the plan's choice (its layers, in `plan_offloaded`); the standard settings then offload nothing
        moved: Union[bool, list[str]] = list(plan_offloaded) if name == "plan" else offload is True
        chunked = name in CHUNKED_SETTINGS or (name == "plan" and plan_chunked)
        outside, head, head_peak, head_flops = outside_of(main, chunked)
        act, flops = predict(costs, outside, layers, moved, kept_ops)
        row = SettingRow(name, sum(m != "none" for m in layers.values()), act, flops + head_flops,
                         host_bytes=host_bytes(costs, layers, moved, kept_ops))
        row.peak_bytes = predict_peak(costs, outside, layers, moved, kept_ops, head_bytes=head,
                                      head_peak_bytes=head_peak)
        if device is not None:
            seconds, _ = predict_seconds(costs, main.outside_ops, layers, device, moved, kept_ops)
            row.predicted_step_seconds = seconds + head_flops / device.matmul_flops
        if other is not None:
            outside2, head2, head_peak2, _ = outside_of(other, chunked)
            act2, _ = predict(other_costs, outside2, layers, moved, kept_ops)
            row.fixed_bytes, row.per_sample_bytes = fit_line(main.batch_size, act, other.batch_size, act2)
            peak2 = predict_peak(other_costs, outside2, layers, moved, kept_ops, head_bytes=head2,
                                 head_peak_bytes=head_peak2)
            row.peak_fixed_bytes, row.peak_per_sample_bytes = fit_line(main.batch_size, row.peak_bytes,
                                                                       other.batch_size, peak2)
            if room is not None:  # the step's peak, not the end of the forward: the backward must fit too
                row.largest_batch = largest_batch(row.peak_fixed_bytes, row.peak_per_sample_bytes, room)
        rows.append(row)
    return rows


def planner_front(main: Measurement, offload: Offload, lowest: int, points: int = 16,
                  include: Sequence[int] = (), device: Optional[DeviceProfile] = None,
                  host_memory: Optional[int] = None, modes: Sequence[str] = CALLBACK_MODES) -> list[dict[str, Any]]:
    """The planner's plans for ``points`` budgets from ``lowest`` bytes up to the activation peak without
    checkpointing, and for the budgets in ``include`` (the run's own), each ``{budget_bytes, activation_bytes,
    peak_bytes, host_bytes, recompute_flops, predicted_step_seconds}``, planned with ``offload`` (and at most
    ``host_memory`` bytes offloaded) and ``modes`` as the run's plan is; budgets it cannot meet are left out, equal
    plans kept once.

    Example::

        >>> from lightning_ckpt.commands.plan.measure import Measurement
        >>> from lightning_ckpt.core.plan.planner import LayerCost
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(4)]
        >>> front = planner_front(Measurement(8, costs, 100), False, 230, 4)  # peaks of 230, 320, 410 and 500 B
        >>> [(p["peak_bytes"], p["recompute_flops"]) for p in front]  # at 320: l0-l2 selective (3 x 40 B), l3 plain
        [(230, 150), (320, 15), (380, 10), (500, 0)]
    """
    baseline = make_plan(main.costs, main.outside_bytes, 1.0, head_bytes=main.head_bytes,
                         head_peak_bytes=main.head_peak_bytes).baseline_peak_bytes
    front: list[dict[str, int]] = []
    budgets = {round(lowest + (baseline - lowest) * i / max(1, points - 1)) for i in range(points)} | set(include)
    for budget in sorted(budgets):
        try:
            plan = make_plan(main.costs, main.outside_bytes, max(1, budget), modes=modes, offload=offload, device=device,
                             outside_ops=main.outside_ops, head_bytes=main.head_bytes,
                             head_peak_bytes=main.head_peak_bytes, host_memory=host_memory)
        except ValueError:
            continue
        point = {"budget_bytes": plan.budget_bytes, "activation_bytes": plan.planned_bytes, "peak_bytes": plan.peak_bytes,
                 "host_bytes": plan.planned_host_bytes, "recompute_flops": plan.recompute_flops,
                 "predicted_step_seconds": plan.predicted_step_seconds}
        if not front or (front[-1]["activation_bytes"], front[-1]["recompute_flops"]) != (plan.planned_bytes,
                                                                                         plan.recompute_flops):
            front.append(point)
    return front
