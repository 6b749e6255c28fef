"""``lightning-ckpt plan``'s arithmetic on measurements: the settings, the fit over batch sizes, the largest batch
and the planner's front."""

from __future__ import annotations

import pytest

from lightning_ckpt.commands.plan.measure import Measurement
from lightning_ckpt.commands.plan.predictions import (
    fit_line,
    fit_peak,
    largest_length,
    largest_batch,
    planner_front,
    setting_choices,
    setting_rows,
)
from lightning_ckpt.core.plan.planner import LayerCost, make_plan

NAMES = [f"l{i}" for i in range(4)]


def measurement(batch_size: int, none: int, full: int, selective: int, outside: int) -> Measurement:
    """Four equal layers (50 FLOP recomputed full, 5 selective), ``outside`` bytes outside them."""
    return Measurement(batch_size, [LayerCost(n, "Block", none_bytes=none, full_bytes=full, selective_bytes=selective,
                                              offloadable_bytes=0, full_flops=50, selective_flops=5) for n in NAMES],
                       outside)


def test_setting_choices_checkpoint_every_nth_layer_from_the_first():
    choices = setting_choices(["a", "b", "c", "d", "e"], None)
    assert list(choices) == ["none", "every_4th", "every_2nd", "every_layer", "selective"]
    assert choices["none"] == {}
    assert choices["every_4th"] == {"a": "full", "e": "full"}
    assert choices["every_2nd"] == {"a": "full", "c": "full", "e": "full"}
    assert choices["every_layer"] == dict.fromkeys("abcde", "full")
    assert choices["selective"] == dict.fromkeys("abcde", "selective")


def test_setting_choices_add_the_plan_s_layers_last():
    main = measurement(8, 100, 10, 40, 100)
    plan = make_plan(main.costs, main.outside_bytes, 320)
    choices = setting_choices(NAMES, plan)
    assert list(choices)[-1] == "plan"
    assert choices["plan"] == dict(plan.layers)


def test_fit_line_and_largest_batch():
    assert fit_line(8, 500, 4, 300) == (100.0, 50.0)
    assert fit_line(2, 100, 6, 100) == (100.0, 0.0)
    assert largest_batch(20, 30, 980) == 32  # exactly full
    assert largest_batch(0.3, 0.1, 3.3) == 30  # (3.3 - 0.3) / 0.1 is 29.999...: still 30
    assert largest_batch(100, 10, 50) == 0  # the fixed part alone does not fit
    assert largest_batch(100, 0, 50) == 0
    assert largest_batch(100, 0, 100) is None


def test_setting_rows_predict_each_setting_and_fit_it_over_the_batch():
    main, other = measurement(8, 100, 10, 40, 100), measurement(4, 60, 6, 24, 60)
    rows = setting_rows(main, setting_choices(NAMES, None), False, other, room=1000)
    got = {r.name: (r.layers, r.activation_bytes, r.recompute_flops, r.fixed_bytes, r.per_sample_bytes)
           for r in rows}
    assert got == {
        # name: (checkpointed layers, bytes at batch 8, FLOPs, fixed, per sample)
        "none": (0, 500, 0, 100.0, 50.0),  # 100 + 4 x 100; at batch 4: 60 + 4 x 60
        "every_4th": (1, 410, 50, 82.0, 41.0),  # l0 full
        "every_2nd": (2, 320, 100, 64.0, 32.0),
        "every_layer": (4, 140, 200, 28.0, 14.0),
        "selective": (4, 260, 20, 52.0, 26.0),
    }
    # The largest batch is the step's peak that fits, not the end of the forward's bytes. every_layer's peak is l3's
    # backward: 100 outside, l0-l2's 3 x 10 inputs and l3's 100 recomputed: 230 B at batch 8, 60 + 18 + 60 = 138 B at
    # batch 4, so 46 + 23 x batch; 46 + 23 x 41 = 989 B fits 1000 B, batch 42 needs 1012 B. Its activations (28 + 14 x
    # batch) would have said 69, whose peak is 1633 B. Without checkpointing the peak is the forward's end: 18.
    peaks = {r.name: (r.peak_bytes, r.peak_fixed_bytes, r.peak_per_sample_bytes, r.largest_batch) for r in rows}
    assert peaks["every_layer"] == (230, 46.0, 23.0, 41)
    assert peaks["none"] == (500, 100.0, 50.0, 18)
    assert peaks["every_2nd"] == (320, 64.0, 32.0, 29)  # l3's backward: 100 + 10 + 100 + 10 held, its 100
    assert all(r.predicted_step_seconds is None for r in rows)  # no device


def test_setting_rows_without_a_second_batch_size_have_no_fit():
    rows = setting_rows(measurement(8, 100, 10, 40, 100), {"every_layer": dict.fromkeys(NAMES, "full")}, False,
                        room=1000)
    assert [(r.activation_bytes, r.fixed_bytes, r.per_sample_bytes, r.largest_batch) for r in rows] == [
        (140, None, None, None)]


def test_planner_front_includes_the_run_s_budget_and_drops_the_unreachable():
    main = measurement(8, 100, 10, 40, 100)
    # Each layer's backward has its 100 B alive while the layers before it hold theirs and the 100 B outside stay.
    # 230 B, the least: three layers full (3 x 10) and the last plain. 320 B: the first three selective (3 x 40), the
    # last plain, is the fewest FLOPs within it. 50 B cannot be met.
    front = planner_front(main, False, 230, points=2, include=[320, 50])
    assert [(p["budget_bytes"], p["peak_bytes"], p["activation_bytes"], p["recompute_flops"]) for p in front] == [
        (230, 230, 230, 150), (320, 320, 320, 15), (500, 500, 500, 0)]
    assert all(p["predicted_step_seconds"] is None for p in front)


@pytest.mark.parametrize("lowest", [230, 500])
def test_planner_front_keeps_equal_plans_once(lowest):
    main = measurement(8, 100, 10, 40, 100)
    front = planner_front(main, False, lowest, points=8, include=[500, 500])
    pairs = [(p["activation_bytes"], p["recompute_flops"]) for p in front]
    assert len(pairs) == len(set(pairs))
    assert pairs[-1] == (500, 0)


def test_fit_peak_through_three_lengths_is_the_quadratic_and_gives_the_largest_length():
    # peak = 1e6 + 3000 T + 0.5 T^2 at 512, 2048 and 8192 tokens
    lengths = [512, 2048, 8192]
    peaks = [1_000_000 + 3000 * t + t * t // 2 for t in lengths]
    assert fit_peak(lengths, peaks) == pytest.approx((1e6, 3000, 0.5), rel=1e-9)
    # At 10,000 tokens the peak is 1e6 + 3e7 + 5e7 = 81,000,000 B.
    assert largest_length(fit_peak(lengths, peaks), 81_000_000) == 10_000
    assert largest_length(fit_peak(lengths, peaks), 80_999_999) == 9_999
    assert largest_length(fit_peak(lengths, peaks), 999_999) == 0


def test_fit_peak_through_two_lengths_is_a_line():
    assert fit_peak([1024, 4096], [3_000_000, 9_000_000]) == pytest.approx((1e6, 1953.125, 0.0))
    assert largest_length((1e6, 1953.125, 0.0), 1e6 + 1953.125 * 5000) == 5000
    assert largest_length((1e6, 0.0, 0.0), 2e6) is None  # does not grow with the length
    with pytest.raises(ValueError, match="2 or more distinct lengths"):
        fit_peak([512, 512], [1, 2])
