"""DeviceProfile and planning for the least predicted step time: known answers of the time model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt import DeviceProfile
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.plan.planner import (
    STEP_FORWARDS,
    LayerCost,
    exposed_transfer_seconds,
    extra_seconds,
    forward_seconds,
    layer_seconds,
    make_plan,
    measure_step,
    plan_checkpointing,
    predict_seconds,
    transfer_windows,
)
from lightning_ckpt.demos import Block, BlockStack

PRESETS = {"h100-sxm", "h100-pcie", "a100-80gb", "l4", "rtx-4090", "gh200", "h200"}


def test_presets_and_an_unknown_name() -> None:
    for name in PRESETS:
        profile = DeviceProfile.preset(name)
        assert profile.name == name
        assert profile.matmul_flops > 1e14 and profile.memory_bandwidth > 1e11 and profile.host_bandwidth > 1e10
        assert name in DeviceProfile.__doc__  # its figures and source are documented
    assert DeviceProfile.preset("h100-sxm").memory_bandwidth > DeviceProfile.preset("h100-pcie").memory_bandwidth
    with pytest.raises(ValueError) as err:
        DeviceProfile.preset("h200-nvl")
    assert all(name in str(err.value) for name in PRESETS)
    with pytest.raises(ValueError, match="matmul_flops"):
        DeviceProfile(matmul_flops=0, memory_bandwidth=1e9, host_bandwidth=1e9)


def test_measure_on_the_cpu() -> None:
    profile = DeviceProfile.measure("cpu", seconds=1.0)
    assert profile.name == "measured cpu"
    assert profile.layer_times  # measured here: a plan on it prices by the layers' measured times
    assert profile.op_overhead > 0 and profile.policy_overhead is not None and profile.policy_overhead >= 0
    # a matmul does far more FLOPs per byte than a copy moves: the rates say the same
    assert profile.matmul_flops > profile.memory_bandwidth / 8


def small_model() -> tuple[BlockStack, torch.Tensor]:
    torch.manual_seed(0)
    return BlockStack(32, 32, [Block(32, 4) for _ in range(4)]), torch.randint(0, 32, (4, 16))


def time_of(plan, measured, profile: DeviceProfile) -> float:
    """The extra seconds of ``plan``'s choices on ``profile``."""
    return sum(extra_seconds(c, plan.layers[c.name], plan.kept_ops.get(c.name, ()), profile) for c in measured.costs)


def test_a_plan_for_a_profile_is_never_slower_on_it_than_the_flops_plan() -> None:
    model, idx = small_model()
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    measured = measure_step(model, step, Block)
    for profile in (DeviceProfile.preset("h100-sxm"), DeviceProfile.preset("l4"),
                    DeviceProfile(1e12, 1e10, 1e9, op_overhead=0.0)):
        for budget in (0.4, 0.5, 0.7):
            by_flops = make_plan(measured.costs, measured.outside_bytes, budget)
            by_time = make_plan(measured.costs, measured.outside_bytes, budget, device=profile,
                                outside_ops=measured.outside_ops)
            assert by_time.planned_bytes <= by_time.peak_bytes <= by_time.budget_bytes
            assert by_time.predicted_step_seconds == pytest.approx(
                by_time.baseline_step_seconds + time_of(by_time, measured, profile))
            assert time_of(by_time, measured, profile) <= time_of(by_flops, measured, profile) * (1 + 1e-9)
            assert by_flops.predicted_step_seconds is None


def test_per_op_overhead_steers_small_layers_away_from_op_level_policies() -> None:
    """Small layers: when each op under a policy costs dispatch time, full checkpointing beats keeping outputs."""
    model, idx = small_model()
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    free = DeviceProfile(1e10, 1e10, 1e9, op_overhead=0.0, policy_overhead=0.0)
    dispatch = DeviceProfile(1e10, 1e10, 1e9, op_overhead=3e-6, policy_overhead=2e-5)
    cheap = plan_checkpointing(model, step, 0.6, layer_cls=Block, device=free)
    careful = plan_checkpointing(model, step, 0.6, layer_cls=Block, device=dispatch)
    assert {"ops", "selective"} & set(cheap.layers.values())
    assert set(careful.layers.values()) <= {"none", "full"}
    measured = measure_step(model, step, Block)
    assert time_of(careful, measured, dispatch) < time_of(cheap, measured, dispatch)


def test_baseline_is_three_forwards_of_compute_and_one_fixed_cost_per_op() -> None:
    """A single Linear layer: its forward is addmm (and a view); the loss's ops are outside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(8, 64)
    profile = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e8, host_bandwidth=1e8, op_overhead=1e-6)
    measured = measure_step(model, lambda: model(x).sum(), nn.Linear)
    [cost] = measured.costs
    assert [r.op for r in cost.ops] == ["aten.t.default", "aten.addmm.default"]
    assert [r.op for r in measured.outside_ops] == ["aten.tanh.default", "aten.sum.default"]
    addmm = 2 * 8 * 64 * 64 / 1e9
    t = cost.ops[0].io_bytes / 1e8  # a view: memory-bound by what it "reads"
    tanh = (2 * 8 * 64 * 4) / 1e8
    total = (8 * 64 * 4 + 4) / 1e8
    plan = make_plan(measured.costs, measured.outside_bytes, 1.0, device=profile, outside_ops=measured.outside_ops)
    # three forwards of compute; the per-op cost (dispatch, launch) once per op and step, not once per forward
    assert plan.baseline_step_seconds == pytest.approx(STEP_FORWARDS * (addmm + t + tanh + total) + 4 * 1e-6)
    assert plan.predicted_step_seconds == plan.baseline_step_seconds  # nothing checkpointed
    assert "+0% step time" in str(plan)


def test_cpu_measured_tensors_count_as_on_the_profiled_device() -> None:
    model, idx = small_model()
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    measured = measure_step(model, step, Block)
    assert all(c.offloadable_bytes == 0 for c in measured.costs)  # measured on the CPU
    on_cpu = make_plan(measured.costs, measured.outside_bytes, 0.5, modes=("full",), offload=True)
    on_h100 = make_plan(measured.costs, measured.outside_bytes, 0.5, modes=("full",), offload=True, device="h100-sxm",
                        min_bytes=0)  # these inputs are under the engine's default 1 MiB
    assert on_cpu.planned_host_bytes == 0
    full = [c for c in measured.costs if on_h100.layers[c.name] == "full"]
    assert on_h100.planned_host_bytes == sum(c.full_bytes for c in full) > 0
    default = make_plan(measured.costs, measured.outside_bytes, 0.5, modes=("full",), offload=True, device="h100-sxm")
    assert default.planned_host_bytes == 0  # the engine would keep them on the device


def test_a_layer_called_twice_pays_the_fixed_cost_per_op_twice() -> None:
    """Op records sum a layer's calls in a step; its recompute runs every op once per call, so each op's fixed cost
    (``op_overhead``, and under a policy ``policy_overhead``) counts once per call, its compute once in all."""
    ops = (OpRecord("aten.mm.default", 64, 10**6, 96), OpRecord("aten.gelu.default", 64, 16, 128))
    cost = LayerCost("a", "Block", none_bytes=128, full_bytes=32, selective_bytes=96, offloadable_bytes=0,
                     full_flops=10**6 + 16, selective_flops=16, calls=2, ops=ops)
    device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e9, host_bandwidth=1e9, op_overhead=1e-6)
    # full: mm 1 µs + gelu 128 ns of compute (both calls), and 2 ops x 2 calls x 1 µs fixed;
    # ops keeping the mm: gelu recomputed (128 ns + 2 x 1 µs), and 4 ops run under the policy (2 in forward, 2 in
    # the recompute) x 2 calls x 1 µs
    got = [round(1e9 * extra_seconds(cost, c, (0,), device)) for c in ("none", "full", "ops")]  # ns
    assert got == [0, 1000 + 128 + 4 * 1000, 128 + 2 * 1000 + 8 * 1000]
    assert round(1e9 * layer_seconds(cost, device)) == 1000 + 128 + 4 * 1000


def test_the_baseline_forward_of_a_layer_called_twice_counts_its_compute_once_and_its_fixed_cost_per_call() -> None:
    """The same records in the plain step's forward: compute 1 µs + 128 ns (both calls together), and each op's
    fixed cost once per call at a third of ``op_overhead`` (the step is ``STEP_FORWARDS`` = 3 forwards)."""
    ops = (OpRecord("aten.mm.default", 64, 10**6, 96), OpRecord("aten.gelu.default", 64, 16, 128))
    cost = LayerCost("a", "Block", none_bytes=128, full_bytes=32, selective_bytes=96, offloadable_bytes=0,
                     full_flops=10**6 + 16, selective_flops=16, calls=2, ops=ops)
    device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e9, host_bandwidth=1e9, op_overhead=3e-6)
    assert round(1e9 * forward_seconds([cost], (), device)) == 1000 + 128 + 2 * 2 * 1000


def test_an_offload_copy_hides_behind_one_forward_and_two_of_backward() -> None:
    """Layer 0's inputs take 2.5 ms each way; the next layer's forward takes 1 ms, its backward 2 ms (two forwards):
    1.5 ms of the copy to the host and 0.5 ms of the copy back cannot hide."""
    device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
    costs = [LayerCost(f"l{i}", "Block", none_bytes=10**7, full_bytes=2_500_000, selective_bytes=10**7,
                       offloadable_bytes=2_500_000, full_flops=10**6, selective_flops=0)
             for i in range(2)]
    windows = transfer_windows(costs, device)
    assert windows == [pytest.approx((0.001, 0.002)), (0.0, 0.0)]
    assert exposed_transfer_seconds(2_500_000, device, windows[0]) == pytest.approx(0.0015 + 0.0005)
    # layer 0 fully checkpointed and offloaded: 1 ms recomputed, 2 ms of copies exposed (layers without op
    # records: no forward time in the baseline)
    seconds, baseline = predict_seconds(costs, (), {"l0": "full"}, device, offload={"l0"}, min_bytes=0)
    assert (seconds, baseline) == (pytest.approx(0.001 + 0.002), 0.0)


def test_a_layers_copies_hide_behind_the_next_layer_not_the_one_before() -> None:
    """Layers of 1, 2 and 4 ms forward: layer 0's copies hide behind layer 1 (2 ms forward, 4 ms backward), layer 1's
    behind layer 2 (4 and 8 ms), the last layer's behind nothing."""
    device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
    costs = [LayerCost(f"l{i}", "Block", none_bytes=3_000_000, full_bytes=3_000_000, selective_bytes=3_000_000,
                       offloadable_bytes=3_000_000, full_flops=10**6 * 2**i,
                       selective_flops=0) for i in range(3)]
    assert transfer_windows(costs, device) == [pytest.approx((0.002, 0.004)), pytest.approx((0.004, 0.008)), (0.0, 0.0)]
    # layer 0 offloaded without recompute (all it saves, 3 MB): 3 ms each way, 1 ms of it exposed (to the host), none
    # on the way back
    seconds, _ = predict_seconds(costs, (), {}, device, offload={"l0"}, min_bytes=0)
    assert seconds == pytest.approx(0.001)


def test_a_layer_without_op_records_pays_its_codec_passes_too():
    # bf16 inputs of 1,000 B held as 500 B: compressing and decompressing read and write 2 x (1,000 + 500) = 3,000 B,
    # 3 µs at 1 GB/s, on top of the recompute's FLOPs at 1 GFLOP/s (1 ms full, 0.1 ms selective).
    cost = LayerCost("a", "Block", none_bytes=3000, full_bytes=1000, selective_bytes=2000, offloadable_bytes=0,
                     full_flops=10**6, selective_flops=10**5, bf16_bytes=500).compressed("bf16")
    assert cost.codec_bytes == 3000 and not cost.ops
    device = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9)
    assert [round(1e9 * extra_seconds(cost, c, (), device)) for c in ("none", "full", "selective")] == [0, 1003000, 103000]
