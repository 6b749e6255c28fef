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

from lightning_ckpt.core.measure.costs import Choice, LayerCost
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.op_curve import OpRecord

__all__ = ["STEP_FORWARDS", "exposed_transfer_seconds", "extra_seconds", "forward_seconds", "layer_seconds",
           "transfer_windows"]

#: A step without checkpointing is predicted as this many forwards (the backward of a matmul is two matmuls of
#: its size; an element-wise op's backward reads and writes about twice what its forward does).
STEP_FORWARDS = 3


def extra_seconds(cost: LayerCost, choice: Choice, keep: Sequence[int], device: DeviceProfile) -> float:
    """Predicted extra step time of ``choice`` for one layer on ``device`` (see :mod:`lightning_ckpt.core.measure.device_profile`).

    Recomputed ops at their predicted time plus ``op_overhead`` each; under a policy (``"selective"``, ``"ops"``)
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
    codec = cost.codec_bytes / device.memory_bandwidth
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
