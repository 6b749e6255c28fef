"""``lightning-ckpt plan``: the plan's own row in the Settings table and the plan's longest length (issue 32, part 4),
from hand-made measurements with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_ckpt.commands.plan import _across_lengths, _plan_longest, plan_settings
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.commands.plan.measure import Built, Measurement, Sharding, StaticMemory
from lightning_ckpt.commands.plan.predictions import PlanSettings, as_planned, setting_choices, setting_rows
from lightning_ckpt.commands.plan.report import PlanResult, render, report_data
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import LayerCost, make_plan, predict_peak

MIB = 2**20
#: Offload free: a plan offloads what it can.
FAST_LINK = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e12, host_bandwidth=math.inf, name="fast link")


def layers(scale: int = 1, movable: int = 0) -> list[LayerCost]:
    """Four layers of 8 MiB saved un-checkpointed and 1 MiB of inputs (x ``scale``), of which ``movable`` bytes were
    measured as movable to host memory (0 on the CPU or on fake tensors)."""
    return [LayerCost(f"l{i}", "Block", none_bytes=8 * MIB * scale, full_bytes=MIB * scale,
                      selective_bytes=4 * MIB * scale, offloadable_bytes=movable, full_flops=10**9 * scale,
                      selective_flops=10**7 * scale) for i in range(4)]


def result_for(main: Measurement, offload: object, device: DeviceProfile | None, budget: object = 0.5,
               static_bytes: int = 0, device_memory: int | None = None) -> PlanResult:
    """What ``_compute`` makes of ``main``: the plan for ``budget`` and every setting's row."""
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, offload, budget, None)
    plan, error = plan_settings(built, device).plan(main, budget)
    rows = setting_rows(main, setting_choices([c.name for c in main.costs], plan), offload, device=device,
                        kept_ops=plan.kept_ops if plan else {}, plan_offloaded=plan.offloaded if plan else ())
    static = StaticMemory(static_bytes, 0, 0, "AdamW", Sharding())
    return PlanResult("hand-made", built, main, plan, error, budget, rows, static, device_memory, [main.batch_size],
                      profile=device)


# ------------------------------------------------------------------------------------------- the plan's own row


def test_the_plan_row_is_the_plan_s_own_line_when_inputs_were_measured_unmovable():
    """Measured on the CPU (nothing movable) but planned for a device: the planner moves every layer's inputs, so the
    plan's row must count them as the plan does, not as measured. The issue's run showed host memory 0 B and the
    un-offloaded plan's device bytes in that row."""
    main = Measurement(8, layers(movable=0), MIB)
    result = result_for(main, "auto", FAST_LINK)
    plan, row = result.plan, result.rows[-1]
    assert row.name == "plan" and plan is not None and plan.offloaded
    assert (row.activation_bytes, row.peak_bytes, row.host_bytes, row.recompute_flops) == (
        plan.planned_bytes, plan.peak_bytes, plan.planned_host_bytes, plan.recompute_flops)
    assert row.host_bytes > 0
    assert row.predicted_step_seconds == pytest.approx(plan.predicted_step_seconds)
    # The table shows those figures: the plan row's host memory column is the plan line's host bytes.
    report = render(result)
    plan_row = next(line for line in report.splitlines() if line.startswith("| plan |"))
    assert plan_row.endswith(f"| {plan.planned_host_bytes:,} |")
    assert f"| plan | 4 | {plan.planned_bytes:,} |" in plan_row or f"| {plan.planned_bytes:,} |" in plan_row


def test_with_offload_on_every_checkpointed_layer_s_inputs_count_in_host_memory():
    """offload=True on a device, inputs measured unmovable: every_layer keeps 4 x 1 MiB of inputs in host memory and
    holds on the device only the 1 MiB outside the layers (and the newest offloaded layer's 1 MiB, which the engine
    has not moved yet at the end of the forward)."""
    main = Measurement(8, layers(movable=0), MIB)
    rows = {r.name: r for r in result_for(main, True, FAST_LINK, budget=1.0).rows}
    assert rows["every_layer"].host_bytes == 4 * MIB
    assert rows["every_2nd"].host_bytes == 2 * MIB
    assert rows["none"].host_bytes == 0
    # Without a device the costs are as measured: nothing could move.
    assert {r.name: r.host_bytes for r in result_for(main, True, None, budget=1.0).rows}["every_layer"] == 0


def test_as_planned_counts_costs_as_the_planner_does():
    costs = layers(movable=0)
    plan = make_plan(costs, MIB, 0.5, offload="auto", device=FAST_LINK, host_memory=1 << 40)
    assert as_planned(costs, FAST_LINK) == plan.costs
    assert as_planned(costs, None) == costs


# ------------------------------------------------------------------------------------------- the least peak


@pytest.mark.parametrize(("offload", "device", "compress"), [
    (False, None, None), (True, None, None), ("auto", FAST_LINK, None), ("auto", FAST_LINK, "fp8"),
    (False, FAST_LINK, "bf16")])
def test_least_peak_is_the_least_budget_the_planner_meets(offload, device, compress):
    costs = [LayerCost(f"l{i}", "Block", none_bytes=8 * MIB, full_bytes=MIB, selective_bytes=4 * MIB,
                       offloadable_bytes=0, full_flops=10**9, selective_flops=10**7, bf16_bytes=MIB // 2,
                       fp8_bytes=MIB // 4 + 64) for i in range(4)]
    main = Measurement(8, costs, 3 * MIB)
    settings = PlanSettings(offload, device, compress)
    least = settings.least_peak(main)
    plan, error = settings.plan(main, least)
    assert plan is not None and plan.peak_bytes == least, error
    assert settings.plan(main, least - 1)[0] is None


def test_least_peak_with_a_head_is_met_by_the_planner():
    """Every layer full fits the least reachable peak. The solver once chose the last layer selective (its backward
    holds 1 MiB of exact inputs more, LayerOption.backward_extra, which the knapsack's floors left out); the repair
    then asked every layer to free 1 MiB more, which nothing can, and the plan was refused."""
    main = Measurement(8, layers(), 3 * MIB, head_bytes=MIB, head_peak_bytes=2 * MIB)
    least = PlanSettings().least_peak(main)
    assert least == predict_peak(main.costs, main.outside_bytes, {c.name: "full" for c in main.costs},
                                 head_bytes=MIB, head_peak_bytes=2 * MIB) == 13 * MIB
    assert PlanSettings().plan(main, least)[0] is not None


def test_least_peak_known_answers():
    """Four layers: 8 MiB saved plain, 1 MiB of inputs; 3 MiB outside them, of which 1 MiB the head's (freed before
    the layers' backward) and 2 MiB its backward's peak."""
    main = Measurement(8, layers(), 3 * MIB, head_bytes=MIB, head_peak_bytes=2 * MIB)
    # l3's backward: 3 MiB outside, l0-l2's 3 x 1 MiB of inputs, its own 8 MiB less the 1 MiB of head already freed
    assert PlanSettings().least_peak(main) == 3 * MIB + 3 * MIB + 7 * MIB
    # with offload (on a device, so the inputs move): l0-l2 hold nothing on the device, l3's 1 MiB inputs come back
    assert PlanSettings(True, FAST_LINK).least_peak(main) == 3 * MIB + 7 * MIB + MIB


# ------------------------------------------------------------------------------------------- the longest length


def at_length(length: int, bend: float = 0.0) -> Measurement:
    """A step at ``length`` tokens whose bytes grow with it: 1 MiB x length / 1024 per layer's inputs, 8 x that saved
    plain, 3 x that outside the layers; ``bend`` adds that fraction of (length / 1024)^3 MiB to the outside bytes
    (what a quadratic through the lengths below misses)."""
    scale = length / 1024
    costs = [LayerCost(f"l{i}", "Block", none_bytes=round(8 * MIB * scale), full_bytes=round(MIB * scale),
                       selective_bytes=round(4 * MIB * scale), offloadable_bytes=0, full_flops=round(10**9 * scale),
                       selective_flops=round(10**7 * scale)) for i in range(4)]
    outside = round(3 * MIB * scale + bend * scale**3 * MIB)
    return Measurement(1, costs, outside, length=length)


def longest_result(offload: object, device: DeviceProfile | None, room: int, bend: float = 0.0,
                   lengths: tuple[int, ...] = (1024, 2048, 4096)) -> tuple[PlanResult, list[int]]:
    measured = [at_length(t) for t in lengths]
    result = result_for(measured[0], offload, device, budget=0.5, device_memory=room)
    settings = plan_settings(result.built, device)
    _across_lengths(result, measured, room, settings)
    asked: list[int] = []

    def measure_length(length: int) -> Measurement:
        asked.append(length)
        return at_length(length, bend)

    _plan_longest(result, room, settings, measure_length, None)
    return result, asked


def test_the_plan_s_longest_length_is_where_its_least_peak_meets_the_room():
    """Exact: the least peak is l3's backward, 3 MiB outside, 3 x 1 MiB of inputs and its 8 MiB: 14 MiB per 1024
    tokens, so 100 MiB of room fits floor(100 / 14 x 1024) = 7314 tokens; every_layer's peak is that least here."""
    room = 100 * MIB
    result, asked = longest_result(False, None, room)
    assert [at.least_peak_bytes for at in result.lengths] == [14 * MIB, 28 * MIB, 56 * MIB]
    assert result.largest_length["plan"] == 7314 == math.floor(100 / 14 * 1024)
    assert result.largest_length["every_layer"] == 7314
    assert asked == [7314]  # measured again there, once: the plan fits
    longest = result.longest
    assert longest is not None and longest.plan is not None and longest.length == 7314
    assert longest.plan.peak_bytes == longest.least_peak_bytes <= room and longest.plan.budget_bytes == room
    assert room - longest.plan.peak_bytes < 14 * MIB / 1024  # one token more would not fit


def test_offload_lengthens_the_plan_s_longest_length_beyond_every_setting_s():
    """With offload on a device the plan's least peak is 12 MiB per 1024 tokens (3 outside, l3's 8 and its 1 MiB of
    inputs brought back; l0-l2 hold nothing on the device): 100 MiB fit floor(100 / 12 x 1024) = 8533 tokens, more
    than every_layer's 7314."""
    room = 100 * MIB
    result, _ = longest_result("auto", FAST_LINK, room)
    assert result.largest_length["plan"] == 8533 == math.floor(100 / 12 * 1024)
    assert result.largest_length["every_layer"] == 7314
    longest = result.longest
    assert longest is not None and longest.plan is not None and longest.plan.offloaded
    assert longest.plan.peak_bytes <= room
    # the predicted step time, per token
    assert longest.seconds_per_token() == pytest.approx(longest.plan.predicted_step_seconds / 8533)
    data = report_data(result)
    assert data["largest_length"]["plan"] == 8533
    assert data["longest_plan"]["length"] == 8533 and data["longest_plan"]["plan"]["peak_bytes"] <= room
    assert [at["least_peak_bytes"] for at in data["lengths"]] == [12 * MIB, 24 * MIB, 48 * MIB]
    report = render(result)
    assert "| plan (least peak) | 12,582,912 | 25,165,824 | 50,331,648 | - | 8533 |" in report
    assert "**The plan's longest length: 8,533 tokens** at batch size 1 (offload 'auto', exact)" in report
    assert f"{1e6 * longest.seconds_per_token():.3f} us per token" in report


def test_where_the_fit_promised_too_much_the_length_shrinks_and_is_measured_again():
    """The outside bytes bend upward beyond the measured lengths: at 7314 tokens the least peak overshoots the room,
    so the plan there fails and a shorter length, scaled by room / least peak, is measured again until one fits."""
    room = 100 * MIB
    result, asked = longest_result(False, None, room, bend=0.05)
    assert asked[0] == 7314 and len(asked) >= 2 and asked == sorted(asked, reverse=True)
    longest = result.longest
    assert longest is not None and longest.plan is not None
    assert longest.length == asked[-1] == result.largest_length["plan"] < 7314
    assert longest.plan.peak_bytes <= room
    assert longest.fitted == 7314
    assert "(the fit gave 7,314; its least peak there overshot, so shorter lengths were measured)" in render(result)


def test_without_device_memory_there_is_no_longest_length():
    measured = [at_length(t) for t in (1024, 2048)]
    result = result_for(measured[0], False, None)
    _across_lengths(result, measured, None, plan_settings(result.built, None))
    assert result.largest_length["plan"] is None and result.longest is None
    assert report_data(result)["largest_length"] is None


# ------------------------------------------------------------------------------------------- the command


TINY = Path(__file__).parents[3] / "configs" / "tiny.yaml"


def test_plan_lengths_prints_the_plan_s_longest_length(tmp_path, capsys):
    """On the tiny config (fake tensors) with a device memory its block_size reaches: the plan's longest length is
    printed, written to plan.json, and the plan there fits with the static memory."""
    rc = plan_main(["--config", str(TINY), "--fake", "--lengths", "4,8,16", "--device-memory", "1100KiB",
                    "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    longest = data["longest_plan"]
    assert longest is not None and longest["plan"] is not None, data["largest_length"]
    assert data["largest_length"]["plan"] == longest["length"] >= data["largest_length"]["every_layer"]
    room = data["device_memory"] - data["static_bytes_per_device"]
    assert longest["plan"]["peak_bytes"] <= room and longest["plan"]["budget_bytes"] == room
    assert f"**The plan's longest length: {longest['length']:,} tokens** at batch size 8" in out
