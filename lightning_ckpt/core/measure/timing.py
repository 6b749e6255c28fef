"""The planner's time model: a layer's forward, a step, and the extra seconds a checkpointing or offload choice
adds, predicted on a :class:`~lightning_ckpt.core.measure.device_profile.DeviceProfile` from measured
:class:`~lightning_ckpt.core.measure.costs.LayerCost` records. Plain PyTorch.

Example::

    >>> device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
    >>> layer_seconds(LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
    ...                         full_flops=10**6, selective_flops=0), device)
    0.001
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from lightning_ckpt.core.measure.costs import Choice, LayerCost
from lightning_ckpt.core.measure.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.core.measure.op_curve import OpRecord

__all__ = ["STEP_FORWARDS", "exposed_transfer_seconds", "extra_seconds", "forward_seconds", "layer_seconds",
           "price_source", "priced_by_time", "seconds_per_flop", "step_seconds", "transfer_windows"]

#: A step without checkpointing is predicted as this many forwards (the backward of a matmul is two matmuls of
#: its size; an element-wise op's backward reads and writes about twice what its forward does).
STEP_FORWARDS = 3


def priced_by_time(costs: Sequence[LayerCost], device: Optional[DeviceProfile]) -> bool:
    """Whether a plan for ``costs`` is priced in seconds: on a device profile, or, without one, where every layer the
    step called was timed on the device it ran on (else by FLOPs).

    Example::

        >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                  full_flops=50, selective_flops=5)
        >>> priced_by_time([cost], None), priced_by_time([replace(cost, full_ns=900)], None)
        (False, True)
    """
    called = [c for c in costs if c.calls]
    return device is not None or (bool(called) and all(c.timed for c in called))


def price_source(costs: Sequence[LayerCost], device: Optional[DeviceProfile]) -> str:
    """What a plan for ``costs`` on ``device`` is priced by, in words, for reports: the times measured here, a
    profile's rates (a preset's from its datasheet), or FLOPs.

    Example::

        >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                  full_flops=50, selective_flops=5, full_ns=900)
        >>> price_source([cost], None)
        'the times each layer took here in the measuring step'
        >>> price_source([cost], DeviceProfile.preset("h100-sxm"))
        "preset h100-sxm's datasheet rates (the layers' times here are not that device's)"
    """
    timed = priced_by_time(costs, None)
    if device is None:
        return "the times each layer took here in the measuring step" if timed else "recompute FLOPs"
    if device.layer_times and timed:
        return f"the times each layer took on {device.name} in the measuring step, {device.name}'s rates for the rest"
    rates = f"preset {device.name}'s datasheet rates" if device.name in PRESET_NAMES else f"{device.name}'s rates"
    return rates + (" (the layers' times here are not that device's)" if timed and not device.layer_times else "")


def seconds_per_flop(costs: Sequence[LayerCost]) -> float:
    """What a recomputed FLOP took in the layers' measured full recompute: the rate at which work measured nowhere
    else (the chunked head's extra forward) is priced without a device profile."""
    flops = sum(c.full_flops for c in costs if c.timed)
    return sum(c.full_ns for c in costs) / 1e9 / flops if flops else 0.0


def extra_seconds(cost: LayerCost, choice: Choice, keep: Sequence[int], device: Optional[DeviceProfile]) -> float:
    """Predicted extra step time of ``choice`` for one layer on ``device`` (see :mod:`lightning_ckpt.core.measure.device_profile`).

    Where ``device`` is the one the layer was measured on (``device.layer_times``) and the layer was timed there,
    the time measured (:meth:`LayerCost.measured_seconds`); without a ``device``, that alone (see
    :func:`priced_by_time`). Else recomputed ops at their predicted time plus
    ``op_overhead`` each; under a policy (``"selective"``, ``"ops"``)
    every op of the forward and of the recompute also pays ``policy_overhead`` (torch dispatches each through
    Python). A layer without op records is priced by its FLOPs at ``matmul_flops``. Compressed inputs add their
    passes' ``codec_bytes`` at ``memory_bandwidth``. Offload's copies are priced apart (:func:`exposed_transfer_seconds`).

    Example::

        >>> from lightning_ckpt.core.measure.op_curve import OpRecord
        >>> ops = (OpRecord("aten.mm.default", 64, 10**6, 96), OpRecord("aten.gelu.default", 64, 16, 128))
        >>> cost = LayerCost("a", "Block", none_bytes=128, full_bytes=32, selective_bytes=96, offloadable_bytes=0,
        ...                  full_flops=10**6 + 16, selective_flops=16, ops=ops)
        >>> device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e9, host_bandwidth=1e9, op_overhead=1e-6)
        >>> [round(1e9 * extra_seconds(cost, c, (0,), device)) for c in ("none", "full", "ops")]  # ns
        [0, 3128, 5128]
    """
    if choice == "none":
        return 0.0
    measured = cost.measured_seconds(choice, keep) if device is None or device.layer_times else None
    if device is None:  # timed here, priced without a profile: a choice not timed at full's rate per FLOP
        return measured if measured is not None else cost.full_ns / 1e9 * cost.flops(choice, keep) / max(1, cost.full_flops)
    codec = cost.codec_bytes / device.memory_bandwidth
    if measured is not None:
        return measured + codec
    if not cost.ops:
        return cost.flops(choice, keep) / device.matmul_flops + codec
    kept = {"ops": set(keep), "selective": {i for i, r in enumerate(cost.ops) if r.heavy}}.get(choice, set())
    recomputed = [r for i, r in enumerate(cost.ops) if r.recomputed_if_dropped and i not in kept]
    seconds = sum(device.record_seconds(r, cost.calls) for r in recomputed)
    if choice != "full":
        replayed = sum(r.recomputed_if_dropped for r in cost.ops)
        seconds += (len(cost.ops) + replayed) * cost.calls * device.per_op_under_policy
    return seconds + codec


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


def step_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], device: DeviceProfile) -> float:
    """Predicted step time without checkpointing on ``device``: ``STEP_FORWARDS`` times :func:`forward_seconds`; or,
    where ``device`` is the one measured on (``layer_times``) and every layer was timed there, the layers' measured
    forward and backward (``plain_ns``) and the ops outside them at ``device``'s rates scaled as the layers' measured
    time is to their rates' (the same device, the same kinds of ops).

    Example::

        >>> device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
        >>> costs = [LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=10**6, selective_flops=0, plain_ns=1_500_000,
        ...                    ops=(OpRecord("aten.mm.default", 0, 10**6, 0),))]
        >>> outside = [OpRecord("aten.mm.default", 0, 10**6, 0)]
        >>> round(step_seconds(costs, outside, device), 6)  # rated 3 + 3 ms; the layer took half its rate: 1.5 + 1.5
        0.003
    """
    rated = STEP_FORWARDS * forward_seconds(costs, outside_ops, device)
    if not (device.layer_times and costs and all(c.plain_ns for c in costs)):
        return rated
    layers_rated = STEP_FORWARDS * forward_seconds(costs, (), device)
    layers = sum(c.plain_ns for c in costs) / 1e9
    return layers + (rated - layers_rated) * (layers / layers_rated if layers_rated > 0 else 1.0)


def layer_seconds(cost: LayerCost, device: DeviceProfile) -> float:
    """Predicted time of one layer's forward (all its calls in a step) on ``device``: a ``STEP_FORWARDS``-th of its
    measured forward and backward where ``device`` is the one it was timed on."""
    if device.layer_times and cost.plain_ns:
        return cost.plain_ns / 1e9 / STEP_FORWARDS
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
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=10**6, selective_flops=0) for i in range(2)]
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
