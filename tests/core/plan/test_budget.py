"""The memory-budget arithmetic of :mod:`lightning_ckpt.core.plan.budget`, without a Trainer.

The callback's own tests (test_callback_budget.py) check that a Trainer run calls these at the right moments.
"""

from __future__ import annotations

import pytest
import torch

from helpers import two_ranks
from lightning_ckpt.core.plan.budget import (
    AUTO_MEMORY_FRACTION,
    AutoBudget,
    Measurement,
    auto_memory_budget,
    combine_costs,
    host_memory_share,
    offload_min_bytes,
    pack_costs,
    plan_summary,
    plan_table,
    static_bytes,
)
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES, OffloadEngine, use_engine
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import LayerCost, make_plan

GIB = 2**30


def test_auto_arithmetic():
    gib = GIB
    assert AUTO_MEMORY_FRACTION == 0.9
    assert auto_memory_budget(80 * gib, 30 * gib, 2 * gib) == int(0.9 * 80 * gib) - 32 * gib
    auto = AutoBudget.from_step(device_bytes=80 * gib, static_bytes=30 * gib, step_peak_bytes=45 * gib,
                                activation_bytes=12 * gib)
    assert auto.other_peak_bytes == 3 * gib  # the step's peak beyond static memory and its activations
    assert auto.budget_bytes == int(0.9 * 80 * gib) - 33 * gib
    assert str(auto) == ("auto: 0.9 x 80.0 GiB device memory - 30.0 GiB weights, gradients and optimizer state"
                         " - 3.0 GiB other peak of the step = 39.0 GiB for activations")
    assert AutoBudget.from_step(100, 10, 5, 20).other_peak_bytes == 0  # never negative
    with pytest.raises(ValueError, match="leaves nothing for activations.*fsdp_ckpt.*PEFT"):
        auto_memory_budget(80 * gib, 70 * gib, 2 * gib)


def test_auto_budget_takes_another_fraction_and_refuses_exactly_nothing_left():
    assert AutoBudget(1000, 400, 50, fraction=0.5).budget_bytes == 50
    assert str(AutoBudget(1000, 400, 50, fraction=0.5)).startswith("auto: 0.5 x 1000 B device memory")
    with pytest.raises(ValueError, match=r"0\.5 x 1000 B of device memory leaves nothing"):
        auto_memory_budget(1000, 450, 50, fraction=0.5)  # 500 - 450 - 50 = 0: nothing left


def test_measurement_from_the_bytes_the_step_held():
    costs = [LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0, full_flops=50,
                       selective_flops=5),
             LayerCost("b", "B", none_bytes=200, full_bytes=5, selective_bytes=30, offloadable_bytes=0, full_flops=60,
                       selective_flops=6)]
    measured = Measurement.from_held_bytes(costs, held_bytes=40)
    assert (measured.layer_bytes, measured.outside_bytes, measured.held_bytes) == (15, 25, 40)
    short = Measurement.from_held_bytes(costs, held_bytes=9)  # less than the layers hold: other hooks hid some
    assert short.outside_bytes == 0 and short.held_bytes == 15


def test_a_rank_packs_each_layer_then_the_outside_bytes_then_the_figures():
    cost = LayerCost("a", "B", none_bytes=3000, full_bytes=1000, selective_bytes=2000, offloadable_bytes=1000,
                     full_flops=10, selective_flops=1, calls=2, input_sizes=(1000,), saved_sizes=(1000, 1500, 500),
                     transient_bytes=4000, bf16_bytes=500, fp8_bytes=260, shared_bytes=64, plain_ns=900,
                     full_ns=300, selective_ns=700)
    measured = Measurement([cost], outside_bytes=7, head_bytes=5, head_peak_bytes=9)
    assert pack_costs(measured, [80, 30, 2], min_bytes=1000) == [3000, 1000, 2000, 1000, 10, 1, 2, 4000, 500, 260, 64,
                                                                 0, 900, 300, 700, 2500, 1000, 7, 5, 9, 80, 30, 2]
    # the engine's threshold decides what is moved: at 1200 only the 1500 B storage of what the layer saves
    assert pack_costs(measured, min_bytes=1200)[15:] == [1500, 0, 7, 5, 9]


def test_ranks_are_combined_with_the_maximum_and_auto_with_the_smallest_device():
    mine, other_row = two_ranks()
    gathered = torch.tensor([pack_costs(mine, [1000, 40, 11], min_bytes=DEFAULT_MIN_BYTES), other_row])
    measured, figures = combine_costs(gathered, mine)
    assert [(c.name, c.none_bytes, c.full_bytes, c.selective_bytes, c.full_flops, c.selective_flops)
            for c in measured.costs] == [("a", 120, 10, 45, 50, 9), ("b", 200, 12, 30, 70, 6)]
    assert [(c.bf16_bytes, c.fp8_bytes) for c in measured.costs] == [(4, 2), (6, 3)]
    assert [c.transient_bytes for c in measured.costs] == [300, 0] and (measured.head_bytes, measured.head_peak_bytes) == (4, 60)
    assert [c.movable_bytes("none", min_bytes=0) for c in measured.costs] == [130, 200]  # what this rank would move of b: 200
    assert measured.outside_bytes == 13 and figures == [900, 50, 11]
    # each layer's times: the slowest rank's, so ranks price alike and no rank's step is under-priced
    assert [(c.plain_ns, c.full_ns, c.selective_ns) for c in measured.costs] == [(5000, 2500, 3000), (0, 0, 0)]
    # the shared inputs' bytes a layer decompresses in its backward: the largest over ranks, so ranks plan alike
    other_row[10] = 8192
    gathered = torch.tensor([pack_costs(mine, [1000, 40, 11], min_bytes=DEFAULT_MIN_BYTES), other_row])
    assert [c.shared_bytes for c in combine_costs(gathered, mine)[0].costs] == [8192, 0]
    # and the other way round: this rank's larger outside bytes are kept
    other_row[34] = 3  # the outside bytes
    gathered = torch.tensor([pack_costs(mine, [1000, 40, 11], min_bytes=DEFAULT_MIN_BYTES), other_row])
    assert combine_costs(gathered, mine)[0].outside_bytes == 7


def test_without_figures_every_integer_takes_its_maximum_and_one_rank_is_itself():
    mine = Measurement([LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=4,
                                  full_flops=50, selective_flops=5, calls=3)], 7)
    other = Measurement([LayerCost("a", "B", none_bytes=90, full_bytes=12, selective_bytes=40, offloadable_bytes=2,
                                   full_flops=55, selective_flops=5)], 9)
    measured, figures = combine_costs(torch.tensor([pack_costs(mine), pack_costs(other)]), mine)
    [cost] = measured.costs
    assert (cost.none_bytes, cost.full_bytes, cost.offloadable_bytes, cost.full_flops, cost.calls) == (100, 12, 4, 55, 3)
    assert measured.outside_bytes == 9 and figures == []
    # the moved bytes come back as one storage each: a threshold below them keeps them whole
    assert (cost.movable_bytes("none", min_bytes=1), cost.movable_bytes("full", min_bytes=1)) == (100, 4)
    alone, figures = combine_costs(torch.tensor(pack_costs(mine, [1000])), mine)  # a single process gathers one row
    assert alone.costs[0].none_bytes == 100 and alone.outside_bytes == 7 and figures == [1000]


def test_static_bytes_are_weights_gradients_of_the_trainable_ones_and_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))  # 72 + 18 float32 parameters
    model[1].requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    assert static_bytes(model, [optimizer]) == 4 * (90 + 72)  # no optimizer state before the first step
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    # Adam's two moments of the 72 trainable parameters, and its step counters (one float32 scalar per tensor)
    assert static_bytes(model, [optimizer]) == 4 * (90 + 72 + 2 * 72 + 2)
    assert static_bytes(model, []) == 4 * (90 + 72)


def test_host_memory_is_half_of_what_is_free_shared_by_the_node_devices():
    assert host_memory_share(64 * GIB, devices=4) == 8 * GIB
    assert host_memory_share(64 * GIB, devices=1) == 32 * GIB
    assert host_memory_share(1001, devices=0) == 500  # no devices counted: the whole half


def test_the_offload_threshold_is_the_engine_in_charge():
    assert offload_min_bytes(torch.device("cpu")) == DEFAULT_MIN_BYTES
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=4096)):
        assert offload_min_bytes("cpu") == 4096


def test_the_plan_summary_names_the_choice_bytes_recompute_and_the_auto_figures():
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                       full_flops=50, selective_flops=5) for i in range(4)]
    plan = make_plan(costs, outside_bytes=100, memory_budget=0.5)
    # l3's backward has its 100 B alive while the 100 B outside and l0-l2 are held: only "full" (10 B each) fits there
    assert plan_summary(plan, "250B") == (
        "memory_budget='250B': checkpointing 3 of 4 layers (3 full); activation peak 230 B predicted against a budget"
        " of 250 B"
        " (230 B held at the end of the forward, 46% of 500 B without checkpointing); 150 FLOP recomputed per step")
    auto = AutoBudget(device_bytes=1000, static_bytes=400, other_peak_bytes=50)
    assert plan_summary(plan, "auto", auto).endswith(f"recomputed per step ({auto})")
    assert plan_table(plan, auto) == f"{plan}\n{auto}" and plan_table(plan) == str(plan)
    loose = make_plan(costs, outside_bytes=100, memory_budget=1.0)
    assert plan_summary(loose, 1.0).startswith("memory_budget=1.0: checkpointing 0 of 4 layers; activation peak 500 B")


def test_a_timed_plan_summary_adds_the_predicted_step_time():
    costs = [LayerCost(f"l{i}", "Block", none_bytes=4 * 2**20, full_bytes=2**20, selective_bytes=2 * 2**20,
                       offloadable_bytes=0, full_flops=10**9, selective_flops=10**8) for i in range(4)]
    profile = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e11, host_bandwidth=1e10, name="stand-in")
    plan = make_plan(costs, outside_bytes=0, memory_budget=0.5, device=profile)
    line = plan_summary(plan, 0.5)
    assert plan.predicted_step_seconds is not None
    assert line.endswith(f"recomputed per step; {plan.step_time_text()}") and "on stand-in" in line


def test_a_measuring_step_that_held_fp8_inputs_is_taken_apart_at_the_compressed_width():
    """Two layers whose fp32 inputs are 400 B (104 B as fp8); the step held 2 x 104 + 50 outside. Its peak is the
    last layer's backward: 104 held below it, 50 outside, and that layer's 1000 B alive plus its 104 B copy."""
    costs = [LayerCost(f"l{i}", "Block", none_bytes=1000, full_bytes=400, selective_bytes=700, offloadable_bytes=0,
                       full_flops=50, selective_flops=5, fp8_bytes=104, transient_bytes=1000) for i in range(2)]
    measured = Measurement.from_held_bytes(costs, held_bytes=258, compress="fp8")
    assert (measured.outside_bytes, measured.layer_bytes, measured.held_bytes) == (50, 208, 258)
    assert measured.peak_bytes == 50 + 104 + 1000 + 104
    assert [c.full_bytes for c in measured.costs] == [400, 400]  # kept exact: the planner compresses them itself
    exact = Measurement.from_held_bytes(costs, held_bytes=258)
    assert (exact.outside_bytes, exact.layer_bytes) == (0, 800)  # read at full width, the outside would be lost
    mine, other_row = two_ranks()
    mine = Measurement(mine.costs, 7, compress="fp8")
    combined, _ = combine_costs(torch.tensor([pack_costs(mine, [1000, 40, 8]), other_row]), mine)
    assert combined.compress == "fp8"  # every rank measured that way
