"""Times from the device (issue 40): layers timed in the measuring step, and plans priced by those times.

Timings are never asserted as absolute figures: a fake clock gives known answers for the arithmetic, and real
timings are only checked to be there (or absent) where they must be.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_ckpt.core.measure.layer_timing as layer_timing
import lightning_ckpt.core.measure.rerun as measure_module  # where a re-run looks up time_modes
from lightning_ckpt import DeviceProfile
from lightning_ckpt.core.plan.budget import RankMeasurement
from lightning_ckpt.core.plan.budget_cycle import BatchSize, BudgetCycle
from lightning_ckpt.core.measure.cost_fit import CostFit
from lightning_ckpt.core.measure.costs import LayerCost
from lightning_ckpt.core.measure.layer_timing import time_modes
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.plan.planner import make_plan, measure_step, plan_checkpointing, predict_seconds
from lightning_ckpt.core.measure.timing import (
    extra_seconds,
    layer_seconds,
    price_source,
    priced_by_time,
    seconds_per_flop,
    step_seconds,
)
from lightning_ckpt.demos import Block, BlockStack

CPU = torch.device("cpu")


def cost(**times: int) -> LayerCost:
    """A layer of 100 B un-checkpointed, 10 B full, 40 B selective; 110 FLOPs recomputed full, 10 selective."""
    return LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                     full_flops=110, selective_flops=10, **times)


class FakeClock:
    """``time.perf_counter_ns`` for layer_timing: each ``run(mode)`` advances it by the next of that mode's
    durations, so medians are known answers."""

    def __init__(self, durations: dict[str, list[int]]) -> None:
        self.now = 0
        self.durations = {mode: list(ns) for mode, ns in durations.items()}
        self.calls: list[str] = []

    def perf_counter_ns(self) -> int:
        return self.now

    def run(self, mode: str) -> None:
        self.calls.append(mode)
        self.now += self.durations[mode].pop(0)


# ------------------------------------------------------------------------------------------------ time_modes


def test_each_mode_gets_the_median_of_its_timed_runs(monkeypatch):
    # 3 rounds; a median, not a mean: 900 is an outlier
    clock = FakeClock({"plain": [100, 900, 120], "full": [300, 310, 290]})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", clock.perf_counter_ns)
    assert time_modes(clock.run, ("plain", "full"), CPU) == {"plain": 120, "full": 300}
    # interleaved, each round in the reverse order of the one before
    assert clock.calls == ["plain", "full", "full", "plain", "plain", "full"]


def test_no_round_starts_once_the_timing_took_its_seconds(monkeypatch):
    # 0.03 s by default: a layer of 20 ms runs is timed once; one of 4 ms three times
    slow = FakeClock({"plain": [20_000_000] * 3, "full": [25_000_000] * 3})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", slow.perf_counter_ns)
    assert time_modes(slow.run, ("plain", "full"), CPU) == {"plain": 20_000_000, "full": 25_000_000}
    assert slow.calls == ["plain", "full"]
    fast = FakeClock({"plain": [4_000_000] * 3, "full": [5_000_000] * 3})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", fast.perf_counter_ns)
    time_modes(fast.run, ("plain", "full"), CPU)
    assert len(fast.calls) == 6  # 9 ms a round: the third starts at 18 ms
    # exactly at the limit: no further round (two rounds of 15 ms)
    edge = FakeClock({"plain": [6_000_000] * 3, "full": [9_000_000] * 3})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", edge.perf_counter_ns)
    time_modes(edge.run, ("plain", "full"), CPU)
    assert len(edge.calls) == 4
    # a limit passed in is the one kept: 0.1 s lets the 20 ms layer run three rounds
    longer = FakeClock({"plain": [20_000_000] * 3, "full": [25_000_000] * 3})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", longer.perf_counter_ns)
    time_modes(longer.run, ("plain", "full"), CPU, seconds=0.1)
    assert len(longer.calls) == 6


def test_a_warm_up_run_of_each_mode_is_not_counted(monkeypatch):
    clock = FakeClock({"plain": [10**9, 100, 900, 120], "full": [10**9, 300, 310, 290]})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", clock.perf_counter_ns)
    assert time_modes(clock.run, ("plain", "full"), CPU, rounds=3, warm_up=True) == {"plain": 120, "full": 300}
    assert clock.calls == ["plain", "full", "plain", "full", "full", "plain", "plain", "full"]


def test_one_round_is_one_timed_run_of_each_mode(monkeypatch):
    clock = FakeClock({"plain": [70], "full": [90]})
    monkeypatch.setattr(layer_timing.time, "perf_counter_ns", clock.perf_counter_ns)
    assert time_modes(clock.run, ("plain", "full"), CPU, rounds=1) == {"plain": 70, "full": 90}


def test_an_accelerator_is_synchronized_around_each_timed_run_and_the_cpu_never(monkeypatch):
    synced = []
    monkeypatch.setattr(layer_timing.torch.cuda, "synchronize", lambda device=None: synced.append(device))
    time_modes(lambda mode: None, ("plain", "full"), CPU, rounds=2)
    assert synced == []
    gpu = torch.device("cuda", 1)
    time_modes(lambda mode: None, ("plain", "full"), gpu, rounds=2)
    assert synced == [gpu] * 8  # before and after each of 2 x 2 runs, on the device the layer is on


def test_rounds_must_be_one_or_more():
    with pytest.raises(ValueError, match=r"`rounds=0` must be 1 or more"):
        time_modes(lambda mode: None, ("plain",), CPU, rounds=0)


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_runs_escape_outer_dispatch_modes_and_saved_tensor_hooks():
    """A measuring step runs under op recorders and byte counters; the timed runs must cost what a training step's
    layer costs, so neither sees them."""
    x = torch.randn(4, 4, requires_grad=True)
    packed = []

    def run(mode: str) -> None:
        torch.autograd.grad((x.sin() * x).sum(), [x])

    with _Counting() as counting, torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                                           lambda t: t):
        (x * 2).sum()  # seen: the mode and hooks work out here
        before_ops, before_packs = counting.ops, len(packed)
        time_modes(run, ("plain",), CPU, rounds=2)
    assert before_ops > 0 and counting.ops == before_ops
    assert len(packed) == before_packs



def test_a_timed_run_saves_through_no_hook_at_all_and_the_outer_ones_come_back_in_order(monkeypatch):
    """Not even an identity hook: each saved tensor would go through Python in a plain run and not in a
    checkpointed one (its own hooks innermost), which makes plain runs dearer and checkpointing look cheaper."""
    from lightning_ckpt.core.measure.layer_timing import _undisturbed

    top = torch._C._autograd._top_saved_tensors_default_hooks
    calls = []
    outer = [((lambda t, i=i: calls.append(("pack", i)) or t), (lambda t, i=i: calls.append(("unpack", i)) or t))
             for i in range(2)]
    with torch.autograd.graph.saved_tensors_hooks(*outer[0]), torch.autograd.graph.saved_tensors_hooks(*outer[1]):
        with _undisturbed():
            inside = top(True)
            x = torch.randn(3, requires_grad=True)
            (x.sin()).sum().backward()
        assert inside is None and calls == []
        assert top(True) == outer[1]  # the innermost is on top again, the other under it
        torch._C._autograd._pop_saved_tensors_default_hooks()
        assert top(True) == outer[0]
        torch._C._autograd._push_saved_tensors_default_hooks(*outer[1])
    assert top(True) is None
    # a torch that does not show the stack: identity hooks on top, nothing reaches the outer ones either
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    with torch.autograd.graph.saved_tensors_hooks(*outer[0]), _undisturbed():
        (torch.randn(3, requires_grad=True).sin()).sum().backward()
    assert calls == []


# ------------------------------------------------------------------------------------------------ LayerCost


def test_measured_seconds_of_each_choice():
    timed = cost(full_ns=3000, selective_ns=1000)
    assert timed.measured_seconds("none") == 0.0
    assert timed.measured_seconds("full") == 3e-6 and timed.measured_seconds("selective") == 1e-6
    ops = (OpRecord("aten.mm.default", 30, 100, 0), OpRecord("aten.relu.default", 10, 10, 0))
    timed = replace(timed, ops=ops)
    # keeping the mm (recomputing 10 FLOPs) is the selective point; keeping nothing is full
    assert timed.measured_seconds("ops", keep=[0]) == pytest.approx(1e-6)
    assert timed.measured_seconds("ops", keep=[]) == pytest.approx(3e-6)
    # without a selective time: between nothing and full, by FLOPs (keep relu: 100 of 110 FLOPs)
    assert replace(timed, selective_ns=0).measured_seconds("ops", keep=[1]) == pytest.approx(3e-6 * 100 / 110)
    untimed = cost()
    assert untimed.measured_seconds("full") is None and untimed.measured_seconds("selective") is None
    assert untimed.measured_seconds("ops", keep=[0]) is None
    assert cost(full_ns=3000).measured_seconds("selective") is None


def test_times_are_left_out_of_equality_but_kept_in_the_state():
    assert cost(full_ns=5, plain_ns=7, selective_ns=9) == cost()
    assert LayerCost(**dict(cost(full_ns=5).__dict__)).full_ns == 5  # as a state_dict restores it


# ------------------------------------------------------------------------------------------------ prices


def test_a_profile_measured_here_prices_by_the_times_a_preset_by_its_rates():
    timed = cost(plain_ns=9000, full_ns=3000, selective_ns=1000)
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    rates = replace(here, layer_times=False)
    assert extra_seconds(timed, "full", (), here) == 3e-6
    assert extra_seconds(timed, "selective", (), here) == 1e-6
    assert extra_seconds(timed, "full", (), rates) == pytest.approx(110 / 1e9)  # no ops: FLOPs at matmul_flops
    # a layer's forward: a third of its measured forward and backward here; its FLOPs at the rate elsewhere
    assert layer_seconds(timed, here) == pytest.approx(3e-6) and layer_seconds(timed, rates) == pytest.approx(110e-9)
    # compressed inputs add their passes to the measured time too
    assert extra_seconds(replace(timed, codec_bytes=2000), "full", (), here) == pytest.approx(3e-6 + 2e-6)


def test_without_a_profile_a_timed_layer_is_priced_by_its_times_alone():
    timed = cost(full_ns=3000, selective_ns=1000)
    assert extra_seconds(timed, "full", (), None) == 3e-6
    assert extra_seconds(timed, "none", (), None) == 0.0
    # selective not timed (not asked for): at full's measured rate per FLOP, 10 of 110
    assert extra_seconds(cost(full_ns=3300), "selective", (), None) == pytest.approx(3.3e-6 * 10 / 110)


def test_priced_by_time_needs_every_called_layer_timed_or_a_profile():
    timed, untimed = cost(full_ns=10), cost()
    assert priced_by_time([timed, replace(timed, name="b")], None)
    assert not priced_by_time([timed, replace(untimed, name="b")], None)
    assert priced_by_time([timed, replace(untimed, name="b", calls=0)], None)  # never called: holds nothing
    assert not priced_by_time([], None) and not priced_by_time([replace(timed, calls=0)], None)
    assert priced_by_time([untimed], DeviceProfile.preset("h100-sxm"))
    # the least a timed layer holds is 1 ns (checkpointing it measured no slower than plain): timed all the same
    least = cost(full_ns=1)
    assert least.timed and not untimed.timed and priced_by_time([least], None)
    assert least.measured_seconds("full") == 1e-9


def test_seconds_per_flop_is_the_layers_measured_recompute_rate():
    assert seconds_per_flop([cost(full_ns=2200), replace(cost(full_ns=0), name="b")]) == pytest.approx(2.2e-6 / 110)
    assert seconds_per_flop([cost()]) == 0.0


def test_step_seconds_scales_the_ops_outside_the_layers_as_the_layers_measured():
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    ops = (OpRecord("aten.mm.default", 0, 10**6, 0),)
    layer = replace(cost(), full_flops=10**6, ops=ops)
    outside = [OpRecord("aten.mm.default", 0, 2 * 10**6, 0)]
    # rated: the layer 3 ms a step, the outside 6 ms; the layer measured 6 ms, twice its rate: the outside 12 ms
    assert step_seconds([replace(layer, plain_ns=6_000_000)], outside, here) == pytest.approx(0.018)
    # a layer not timed, or a preset: the rates alone
    assert step_seconds([layer], outside, here) == pytest.approx(0.009)
    assert step_seconds([replace(layer, plain_ns=6_000_000)], outside, replace(here, layer_times=False)) == \
        pytest.approx(0.009)


def test_a_layer_whose_selective_option_measures_slower_than_full_is_planned_full():
    """The prices decide: by FLOPs (or rates) selective is cheaper (10 FLOPs against 110) and fits; measured slower
    than full on this device, the plan checkpoints the layer fully instead."""
    layers = [replace(cost(), name=f"l{i}", transient_bytes=100) for i in range(4)]
    budget = 250  # at most one "none" (100 B): with two, 100 + 100 + 40 + l3's backward peak of 100 is over
    def choices(plan) -> set[str]:
        return set(plan.layers.values())

    assert choices(make_plan(layers, 0, budget)) == {"selective", "none"}  # l3's own bytes are in its backward peak
    slow = [replace(c, full_ns=3000, selective_ns=8000) for c in layers]
    assert choices(make_plan(slow, 0, budget)) == {"full", "none"}
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    assert choices(make_plan(slow, 0, budget, device=here)) == {"full", "none"}
    # the same times on a preset are not this device's: its rates price them, and selective wins again
    assert "selective" in choices(make_plan(slow, 0, budget, device=replace(here, layer_times=False)))
    # and where selective measures faster, it is kept
    fast = [replace(c, full_ns=3000, selective_ns=1000) for c in layers]
    assert "selective" in choices(make_plan(fast, 0, budget))


# ------------------------------------------------------------------------------------------------ measuring


def small_model(dropout: float = 0.0) -> tuple[BlockStack, torch.Tensor]:
    torch.manual_seed(0)
    return BlockStack(32, 32, [Block(32, 4, dropout=dropout) for _ in range(3)]), torch.randint(0, 32, (4, 16))


def test_the_measuring_step_times_each_distinct_layer_as_its_extra_over_plain(monkeypatch):
    calls = []

    def fake_times(run, modes, device, rounds=3):
        calls.append(tuple(modes))
        return {"plain": 1000, "harness": 200, "full": 1500, "selective": 900}

    monkeypatch.setattr(measure_module, "time_modes", fake_times)
    model, x = small_model()
    measured = measure_step(model, lambda: model(x).sum(), Block)
    # identical blocks share one re-run, and its times; plain less the harness's own time; a selective run faster
    # than plain counts 1 ns, not 0
    assert calls == [("plain", "harness", "full", "selective")]
    assert [(c.plain_ns, c.full_ns, c.selective_ns) for c in measured.costs] == [(800, 500, 1)] * 3
    only_full = measure_step(model, lambda: model(x).sum(), Block, modes=("full",))
    assert calls[-1] == ("plain", "harness", "full") and only_full.costs[0].selective_ns == 0


def test_a_layer_called_twice_sums_its_times(monkeypatch):
    monkeypatch.setattr(measure_module, "time_modes",
                        lambda run, modes, device, rounds=3: {"plain": 1000, "harness": 0, "full": 1400,
                                                              "selective": 1200})
    torch.manual_seed(0)
    block = Block(32, 4)
    x = torch.randn(2, 8, 32, requires_grad=True)
    model = nn.Sequential(block)
    measured = measure_step(model, lambda: block(block(x)).sum(), Block)
    assert measured.costs[0].calls == 2
    assert (measured.costs[0].plain_ns, measured.costs[0].full_ns, measured.costs[0].selective_ns) == (2000, 800, 400)


def test_real_timings_are_there_and_change_nothing_else():
    model, x = small_model(dropout=0.1)
    torch.manual_seed(5)
    timed = measure_step(model, lambda: model(x).sum(), Block)
    rng_after = torch.get_rng_state()
    torch.manual_seed(5)
    untimed = measure_step(model, lambda: model(x).sum(), Block, time_layers=False)
    assert torch.equal(rng_after, torch.get_rng_state())  # the timed runs drew nothing from the step's RNG
    assert all(c.plain_ns > 0 and c.full_ns > 0 and c.selective_ns > 0 for c in timed.costs)
    assert all(c.plain_ns == c.full_ns == c.selective_ns == 0 for c in untimed.costs)
    # every byte, FLOP and op record the same, and the bytes outside the layers too
    assert [c.__dict__ | {"plain_ns": 0, "full_ns": 0, "selective_ns": 0} for c in timed.costs] == \
        [c.__dict__ for c in untimed.costs]
    assert (timed.outside_bytes, timed.head_bytes, timed.outside_ops) == \
        (untimed.outside_bytes, untimed.head_bytes, untimed.outside_ops)
    assert all(p.grad is None for p in model.parameters())


def test_fake_tensors_are_not_timed(monkeypatch):
    monkeypatch.setattr(measure_module, "time_modes", lambda *a, **k: pytest.fail("timed a fake tensor"))
    with FakeTensorMode():
        model, x = small_model()
        measured = measure_step(model, lambda: model(x).sum(), Block)
    assert all(c.full_ns == 0 for c in measured.costs) and measured.costs[0].full_bytes > 0


def test_plan_checkpointing_prices_by_the_times_unless_told_not_to(monkeypatch):
    """Selective measured slower than full: the timed plan checkpoints fully where the FLOPs plan keeps matmuls."""
    monkeypatch.setattr(measure_module, "time_modes",
                        lambda run, modes, device, rounds=3: {"plain": 1000, "harness": 0, "full": 1500,
                                                              "selective": 9000})
    model, x = small_model()
    by_flops = plan_checkpointing(model, lambda: model(x).sum(), 0.9, Block, modes=("full", "selective"),
                                  time_layers=False)
    by_time = plan_checkpointing(model, lambda: model(x).sum(), 0.9, Block, modes=("full", "selective"))
    assert "selective" in by_flops.layers.values() and "selective" not in by_time.layers.values()
    assert "full" in by_time.layers.values()
    assert all(c.full_ns == 500 for c in by_time.costs) and all(c.full_ns == 0 for c in by_flops.costs)


def test_predicted_step_time_on_the_profile_measured_here_adds_the_measured_extras(monkeypatch):
    monkeypatch.setattr(measure_module, "time_modes",
                        lambda run, modes, device, rounds=3: {"plain": 3_000_000, "harness": 0,
                                                              "full": 4_000_000, "selective": 5_000_000})
    model, x = small_model()
    measured = measure_step(model, lambda: model(x).sum(), Block)
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    names = [c.name for c in measured.costs]
    full, base = predict_seconds(measured.costs, measured.outside_ops, {names[0]: "full"}, here)
    selective, _ = predict_seconds(measured.costs, measured.outside_ops, dict.fromkeys(names, "selective"), here)
    assert full - base == pytest.approx(1e-3) and selective - base == pytest.approx(3 * 2e-3)
    assert base == pytest.approx(step_seconds(measured.costs, measured.outside_ops, here))
    assert base > 3 * 3e-3  # the three layers' 3 ms each, and the ops outside them


# ------------------------------------------------------------------------------------------------ fitting


def test_a_fit_is_trusted_whatever_its_loose_columns_do():
    sizes = [(64, 16), (128, 16), (256, 16)]
    rows = [[10 * t, noise] for (t, _), noise in zip(sizes, (5, 900, 40))]  # bytes linear; a time all over
    strict, loose = CostFit(), CostFit()
    for (t, n), row in zip(sizes, rows):
        strict.add(t, n, row)
        loose.add(t, n, row, loose=[1])
    assert not strict.trusted(200, 16) and loose.trusted(200, 16)
    assert loose.predict(128, 16, margin=0.0)[0] == 1280  # the bytes as measured
    predicted_time = loose.predict(200, 16, margin=0.0)[1]
    assert 5 <= predicted_time <= 900  # between the measured sizes' times: the monotone bounds hold for it too


def test_a_budget_cycle_fits_the_times_loosely():
    cycle = BudgetCycle()
    for i, tokens in enumerate((64, 128, 256)):
        size = BatchSize(tokens, 16)
        cycle.begin(size)
        layer = replace(cost(), none_bytes=tokens * 10, full_bytes=tokens, selective_bytes=tokens * 4,
                        full_flops=tokens * 100, selective_flops=tokens * 10,
                        full_ns=(7, 5000, 30)[i], plain_ns=tokens, selective_ns=tokens)
        cycle.planned(make_plan([layer], 0, 10**9), RankMeasurement([layer], 0))
    assert cycle.fit.trusted(200, 16)
    predicted = cycle.predict(BatchSize(200, 16))
    assert predicted is not None and predicted.costs[0].plain_ns >= 128


def test_a_budget_cycle_saved_before_the_times_measures_again():
    cycle = BudgetCycle()
    layer = cost(full_ns=10)
    for tokens in (64, 128, 256):
        cycle.begin(BatchSize(tokens, 16))
        cycle.planned(make_plan([layer], 0, 10**9), RankMeasurement([layer], 0))
    state = cycle.state_dict()
    state["fit"]["rows"] = [row[:12] + row[15:] for row in state["fit"]["rows"]]  # one layer's row without times
    for costs in [state["fit"]["template"]["costs"]]:
        for c in costs:
            del c["plain_ns"], c["full_ns"], c["selective_ns"]
    restored = BudgetCycle()
    restored.load_state_dict(state)
    assert restored.template is None and restored.fit.rows == []  # nothing misread: those sizes are measured anew
    assert restored.predict(BatchSize(200, 16)) is None and len(restored.plans) == 3  # the plans themselves kept


def test_without_a_profile_the_chunked_head_is_priced_at_the_layers_measured_rate():
    """The head's second forward (20 FLOPs) at the layers' measured recompute rate (5,000 ns for 50 FLOPs: 100 ns a
    FLOP) is 2,000 ns: cheaper than one selective layer measured at 9,000 ns, dearer than one at 1,000 ns. By FLOPs,
    the selective layer (5 FLOPs) always wins."""
    from lightning_ckpt.core.plan.planner import ChunkedHead

    layers = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                        full_flops=50, selective_flops=5) for i in range(4)]
    head = ChunkedHead(chunk_tokens=256, outside_bytes=300, head_bytes=100, head_peak_bytes=50, flops=20)

    def plan(costs):  # a budget one selective layer reaches (2,140 B of 2,200) and the chunked head does (750 B)
        return make_plan(costs, outside_bytes=1000, memory_budget=2150, head_bytes=600, head_peak_bytes=800,
                         chunked=head, chunk_loss=None)

    by_flops = plan(layers)
    assert by_flops.chunk_tokens is None and list(by_flops.layers.values()).count("selective") == 1
    slow = plan([replace(c, full_ns=5000, selective_ns=9000) for c in layers])
    assert slow.chunk_tokens == 256 and set(slow.layers.values()) == {"none"}
    fast = plan([replace(c, full_ns=5000, selective_ns=1000) for c in layers])
    assert fast.chunk_tokens is None and list(fast.layers.values()).count("selective") == 1


# ------------------------------------------------------------------------------------------------ the edges


def exactly(seconds: float):
    """Equal but for float rounding: a nanosecond is 1e-9 s exactly, not 1.000000001e-9 (pytest's default absolute
    tolerance, 1e-12 s, would take microseconds as equal)."""
    return pytest.approx(seconds, rel=1e-12, abs=0)


def test_prices_convert_nanoseconds_exactly():
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    assert seconds_per_flop([cost(full_ns=2200)]) == exactly(2.2e-6 / 110)
    assert layer_seconds(cost(plain_ns=9000), here) == exactly(3e-6)
    assert extra_seconds(cost(full_ns=3300), "selective", (), None) == exactly(3.3e-6 * 10 / 110)
    layer = replace(cost(plain_ns=6_000_000), full_flops=10**6, ops=(OpRecord("aten.mm.default", 0, 10**6, 0),))
    assert step_seconds([layer], [], here) == exactly(0.006)


def test_an_op_level_choice_is_priced_by_what_it_keeps():
    ops = (OpRecord("aten.mm.default", 30, 100, 0), OpRecord("aten.relu.default", 10, 10, 0))
    timed = replace(cost(full_ns=3000, selective_ns=1000), ops=ops)
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    assert extra_seconds(timed, "ops", [0], here) == pytest.approx(1e-6)  # keeps the mm: the selective point
    assert extra_seconds(timed, "ops", [1], here) == pytest.approx(1e-6 + 2e-6 * 90 / 100)  # keeps the relu


def test_a_single_flop_layer_untimed_selective_is_priced_at_full_rate():
    one = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                    full_flops=1, selective_flops=1, full_ns=1000)
    assert extra_seconds(one, "selective", (), None) == exactly(1e-6)


def test_rates_price_selective_by_the_cheap_ops_it_recomputes_and_compression_adds_its_passes():
    ops = (OpRecord("aten.mm.default", 64, 10**6, 96), OpRecord("aten.gelu.default", 64, 16, 128))
    layer = LayerCost("a", "Block", none_bytes=128, full_bytes=32, selective_bytes=96, offloadable_bytes=0,
                      full_flops=10**6 + 16, selective_flops=16, ops=ops)
    rates = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e9, host_bandwidth=1e9, op_overhead=1e-6)
    # the gelu again (128 B at 1 GB/s, 1 us launch), and 1 us for each op under the policy: the forward's two and
    # the two its recompute replays (both may be recomputed)
    assert round(1e9 * extra_seconds(layer, "selective", (), rates)) == 128 + 1000 + 4 * 1000
    # compressed inputs: both passes of 2,000 B at the memory bandwidth, on top
    assert round(1e9 * extra_seconds(replace(layer, codec_bytes=2000), "selective", (), rates)) == 5128 + 2000


def test_timed_layers_without_op_records_take_the_outside_at_its_rates():
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, layer_times=True)
    outside = [OpRecord("aten.mm.default", 0, 10**6, 0)]  # 3 ms rated; nothing to scale it by
    assert step_seconds([cost(plain_ns=2_000_000)], outside, here) == exactly(0.005)


def test_the_price_source_says_what_priced_the_plan():
    timed, untimed = [cost(full_ns=900)], [cost()]
    here = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, name="measured cpu",
                         layer_times=True)
    preset = DeviceProfile.preset("h100-sxm")
    assert price_source(timed, None) == "the times each layer took here in the measuring step"
    assert price_source(untimed, None) == "recompute FLOPs"
    assert price_source(timed, here) == ("the times each layer took on measured cpu in the measuring step,"
                                         " measured cpu's rates for the rest")
    assert price_source(untimed, here) == "measured cpu's rates"  # fake tensors: nothing timed
    assert price_source(untimed, preset) == "preset h100-sxm's datasheet rates"
    assert price_source(timed, preset) == ("preset h100-sxm's datasheet rates (the layers' times here are not that"
                                           " device's)")
    assert price_source(timed, replace(here, layer_times=False, name="custom")) == (
        "custom's rates (the layers' times here are not that device's)")


def test_measured_seconds_where_selective_recomputes_everything_or_one_flop_less():
    ops = (OpRecord("aten.mm.default", 30, 1, 0), OpRecord("aten.relu.default", 10, 10, 0))
    # selective recomputes every FLOP full does (the mm is 0 FLOPs away): an "ops" point is taken at full's time
    flat = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                     full_flops=10, selective_flops=10, full_ns=3000, selective_ns=1000,
                     ops=(OpRecord("aten.relu.default", 10, 10, 0),))
    assert flat.measured_seconds("ops", keep=[]) == exactly(3e-6)
    # one FLOP between the selective point and full: keeping the mm (1 FLOP) is the selective point exactly
    one = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                    full_flops=11, selective_flops=10, full_ns=3000, selective_ns=1000, ops=ops)
    assert one.measured_seconds("ops", keep=[0]) == exactly(1e-6)
    assert one.measured_seconds("ops", keep=[]) == exactly(3e-6)
    assert one.measured_seconds("full") == exactly(3e-6) and one.measured_seconds("selective") == exactly(1e-6)
    # keeping more than the matmul (its relu too) recomputes less than selective does: no cheaper than selective
    assert one.measured_seconds("ops", keep=[0, 1]) == exactly(1e-6)


def test_the_cycle_finds_each_layer_s_times_in_its_row():
    from lightning_ckpt.core.plan.budget_cycle import _row, _times

    layers = [cost(plain_ns=11, full_ns=12, selective_ns=13), replace(cost(plain_ns=21, full_ns=22, selective_ns=23),
                                                                      name="b")]
    measured = RankMeasurement(layers, 0)
    row = _row(measured)
    assert _times(measured) == [12, 13, 14, 29, 30, 31]  # 15 integers and 2 bytes to move per layer
    assert [row[i] for i in _times(measured)] == [11, 12, 13, 21, 22, 23]


def test_a_resumed_cycle_trusts_its_fit_whatever_the_times_did():
    cycle = BudgetCycle()
    for tokens, noise in ((64, 7), (128, 5000), (256, 30)):
        cycle.begin(BatchSize(tokens, 16))
        layer = replace(cost(), none_bytes=tokens * 10, full_bytes=tokens, full_ns=noise, plain_ns=noise)
        cycle.planned(make_plan([layer], 0, 10**9), RankMeasurement([layer], 0))
    assert cycle.fit.trusted(200, 16)
    restored = BudgetCycle()
    restored.load_state_dict(cycle.state_dict())
    assert restored.fit.trusted(200, 16) and restored.predict(BatchSize(200, 16)) is not None


def test_a_cycle_state_without_plans_loads_as_empty():
    restored = BudgetCycle()
    restored.load_state_dict({})
    assert restored.plans == {} and restored.template is None


def test_a_timed_layer_s_options_are_pruned_by_time_without_a_profile():
    """Selective holds more than full and, measured, costs more: dominated, it is not offered. By FLOPs (10 against
    110) it is cheaper, and stays."""
    from lightning_ckpt.core.plan.solver import layer_options

    slow = cost(full_ns=3000, selective_ns=8000)
    assert [o.choice for o in layer_options(slow)] == ["none", "full"]
    assert [o.seconds for o in layer_options(slow)] == [0.0, 3e-6]
    assert [o.choice for o in layer_options(cost())] == ["none", "full", "selective"]
    assert [o.seconds for o in layer_options(cost())] == [0.0, 0.0, 0.0]  # untimed, no profile: FLOPs only


def test_options_are_not_offloaded_unless_asked():
    from lightning_ckpt.core.plan.solver import layer_options, make_option

    movable = replace(cost(full_ns=3000, selective_ns=1000), offloadable_bytes=10, input_sizes=(2**21,),
                      full_bytes=2**21 + 10, selective_bytes=2**21 + 40, none_bytes=2**23)
    assert make_option(movable, "full").host_bytes == 0 and make_option(movable, "full", moved=True).host_bytes == 10
    assert all(o.host_bytes == 0 for o in layer_options(movable))
    assert any(o.host_bytes for o in layer_options(movable, offload=True))


class _Counted(nn.Module):
    """A layer that counts its forwards and backwards, with a weight its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.zeros(3))
        self.forwards = self.backwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        y = self.lin(x).relu()
        if y.requires_grad:
            y.register_hook(lambda g: setattr(self, "backwards", self.backwards + 1))
        return y


def test_each_timed_run_is_the_layer_s_forward_and_backward_as_training_runs_it(monkeypatch):
    """What is timed: the plain forward and its backward, and the checkpointed ones, whose backward runs the forward
    again; a weight the forward does not use is fine; no .grad is written."""
    from lightning_ckpt.core.measure import rerun

    seen: dict[str, tuple[int, int]] = {}

    reached: list[int] = []  # gradients that reached the input, per run

    def run_each_once(run, modes, device, rounds=3):
        for mode in modes:
            before = (layer.forwards, layer.backwards, len(reached))
            run(mode)
            seen[mode] = (layer.forwards - before[0], layer.backwards - before[1])
            grads[mode] = len(reached) - before[2]
        return {"plain": 50, "harness": 20, "full": 70, "selective": 90}

    monkeypatch.setattr(rerun, "time_modes", run_each_once)
    grads: dict[str, int] = {}
    layer = _Counted()
    x = torch.randn(4, 8, requires_grad=True)
    x.register_hook(lambda g: reached.append(1))
    times = rerun._times(layer, [x], rerun._plain_forward(layer), (x,), {}, selective=True, sharded=False)
    # the harness alone runs neither the layer's forward nor its backward, but a backward of its own to the input;
    # its time is not the layer's
    assert seen == {"plain": (1, 1), "harness": (0, 0), "full": (2, 1), "selective": (2, 1)}
    assert grads == dict.fromkeys(seen, 1)
    assert times == {"plain_ns": 30, "full_ns": 20, "selective_ns": 40}
    # a plain run no slower than the harness counts 1 ns, as a checkpointed run no slower than plain does
    monkeypatch.setattr(rerun, "time_modes", lambda run, modes, device: dict.fromkeys(modes, 20))
    assert rerun._times(layer, [x], rerun._plain_forward(layer), (x,), {}, selective=False, sharded=False) == \
        {"plain_ns": 1, "full_ns": 1}
    monkeypatch.setattr(rerun, "time_modes", run_each_once)
    assert all(p.grad is None for p in layer.parameters()) and x.grad is None
    # a forward set on the instance (as accelerate's hooks do) is the one timed, checkpointed or not
    calls = []
    layer.forward = lambda t: calls.append(1) or _Counted.forward(layer, t)
    rerun._times(layer, [x], rerun._plain_forward(layer), (x,), {}, selective=False, sharded=False)
    assert len(calls) == 1 + 2  # plain once; full once and again in its backward
    # sharded (FSDP2): not timed at all
    monkeypatch.setattr(rerun, "time_modes", lambda *a, **k: pytest.fail("timed a sharded layer"))
    assert rerun._times(layer, [x], rerun._plain_forward(layer), (x,), {}, selective=True, sharded=True) == {}


def test_a_plan_with_the_head_in_chunks_times_the_layers_once_and_only_when_asked(monkeypatch):
    """The chunked head's step measures the layers again; their times come from the step measured first (the
    unchunked one, when there is one), so the chunked step is timed only where it is the only step."""
    from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss
    from lightning_ckpt.core.plan.planner import measure_chunked_head
    from lightning_ckpt.demos import Transformer

    timed: list[tuple[str, ...]] = []

    def times(run, modes, device):
        timed.append(tuple(modes))
        return {"plain": 3000, "harness": 1000, "full": 3500, "selective": 4000}

    monkeypatch.setattr(measure_module, "time_modes", times)
    torch.manual_seed(0)
    model = Transformer(256, 32, n_layer=2, n_embd=32, n_head=4, dropout=0.0)
    chunk_causal_lm_loss(model, 32)
    idx = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))

    def step():
        return model(idx[:, :-1], idx[:, 1:])

    def planned(**settings):
        timed.clear()
        plan = plan_checkpointing(model, step, 0.5, chunk_loss=settings.pop("chunk_loss"), **settings)
        return plan, len(timed)

    # identical blocks share one re-run: one timing per measured step
    for chunk_loss, runs in ((True, 1), (None, 1), (False, 1)):
        plan, n = planned(chunk_loss=chunk_loss)
        assert n == runs and [c.full_ns for c in plan.costs] == [500, 500], chunk_loss
        plan, n = planned(chunk_loss=chunk_loss, time_layers=False)
        assert n == 0 and [c.full_ns for c in plan.costs] == [0, 0], chunk_loss
    timed.clear()
    measured, _ = measure_chunked_head(model, step, Block, ("full",), 32)  # timed unless told not to
    assert len(timed) == 1 and measured.costs[0].plain_ns == 2000


def test_timing_limits_set_the_rounds_and_seconds_a_timing_takes_unless_given(monkeypatch):
    from lightning_ckpt.core.measure.layer_timing import timing_limits

    def rounds_run(limits=None, **given):
        clock = FakeClock({"plain": [4_000_000] * 20})
        monkeypatch.setattr(layer_timing.time, "perf_counter_ns", clock.perf_counter_ns)
        if limits is None:
            time_modes(clock.run, ("plain",), CPU, **given)
        else:
            with timing_limits(*limits):
                time_modes(clock.run, ("plain",), CPU, **given)
        return len(clock.calls)

    assert rounds_run() == 3  # 3 rounds of 4 ms, under 0.03 s
    assert rounds_run((9, 1.0)) == 9
    assert rounds_run((9, 0.02)) == 5  # 20 ms after the fifth round of 4 ms
    assert rounds_run((9, 1.0), rounds=2) == 2 and rounds_run((9, 1.0), seconds=0.008) == 2  # given: kept
    assert rounds_run((1, 1.0)) == 1  # one round is a window
    assert rounds_run() == 3  # and the limits end with the block
    with pytest.raises(KeyError):
        with timing_limits(9, 1.0):
            raise KeyError("the measurement failed")
    assert rounds_run() == 3  # however it ends
    for bad in ((0, 1.0), (3, 0.0)):
        with pytest.raises(ValueError, match=r"pass at least 1 round and more than 0 seconds"):
            with timing_limits(*bad):
                pass


def test_compare_times_its_time_model_s_layers_over_the_longer_window(monkeypatch):
    import lightning_ckpt.commands.plan.measure as plan_measure
    from lightning_ckpt.commands.compare import run as compare_run

    seen = []
    monkeypatch.setattr(plan_measure, "build", lambda config, fake: type("Built", (), {"device": CPU})())
    monkeypatch.setattr(plan_measure, "measure", lambda built: seen.append(layer_timing._LIMITS.get()) or len(seen))
    monkeypatch.setattr(plan_measure, "device_profile", lambda device, built: DeviceProfile.preset("h100-sxm"))
    model = compare_run.time_model_here("tiny.yaml")
    # two measuring steps, the second kept (a fresh process's first times slow), both over the longer window
    assert seen == [(15, 0.5)] * 2 and model.measurement == 2
    assert layer_timing._LIMITS.get() == (layer_timing.TIMING_ROUNDS, layer_timing.TIMING_SECONDS)


def test_compare_measures_its_time_model_in_a_fresh_process_as_it_runs_each_variant(monkeypatch):
    from lightning_ckpt.commands.compare import run as compare_run

    calls = []
    monkeypatch.setattr(compare_run, "in_fresh_process", lambda fn, *args: calls.append((fn, args)) or "the model")
    assert compare_run.measure_time_model("tiny.yaml", "h100-sxm") == "the model"
    assert calls == [(compare_run.time_model_here, ("tiny.yaml", "h100-sxm"))]


def test_a_fresh_process_returns_the_function_s_result_and_raises_its_error_here():
    import os

    from lightning_ckpt.commands.compare.run import in_fresh_process

    assert in_fresh_process(os.getpid) != os.getpid()
    assert in_fresh_process(divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        in_fresh_process(divmod, 1, 0)
