"""The costs fitted over the batch shape (core/measure/cost_fit.py) and the budget cycle planning from them: known answers
by hand, the trust region, the extrapolation bound, the margin, and the bound on measuring steps."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from lightning_ckpt.core.measure.cost_fit import EXTRAPOLATION, MARGIN, CostFit, fit_peak
from lightning_ckpt.core.plan.budget import RankMeasurement, combine_costs, pack_costs
from lightning_ckpt.core.plan.budget_cycle import BatchSize, BudgetCycle
from lightning_ckpt.core.plan.planner import LayerCost, make_plan


def cost(tokens: int, length: int) -> list[int]:
    """Three costs by hand: 1000 + 6 T + 2 T L, 40 T, and a count 3."""
    return [1000 + 6 * tokens + 2 * tokens * length, 40 * tokens, 3]


def test_three_sizes_predict_a_fourth_exactly_and_a_square_term_is_needed():
    fit = CostFit()
    for tokens, length in [(32, 8), (160, 40), (400, 100)]:
        fit.add(tokens, length, cost(tokens, length))
    # 1000 + 6*256 + 2*256*64 = 35,304; 40*256 = 10,240
    assert fit.predict(256, 64, margin=0.0) == [35_304, 10_240, 3]
    assert fit.predict(1024, 256, margin=0.0) == cost(1024, 256)  # extrapolated 2.56x past the longest: exact too
    # with the margin, rounded up; the count (position 2) kept as fitted
    assert fit.predict(256, 64, keep=[2]) == [math.ceil(35_304 * (1 + MARGIN)), math.ceil(10_240 * (1 + MARGIN)), 3]
    # without the T*L term a quadratic cost is not reproduced: a line through (1, T) misses by far
    lone = torch.linalg.lstsq(torch.tensor([[1.0, 32], [1, 160], [1, 400]]),
                              torch.tensor([[float(cost(32, 8)[0])], [cost(160, 40)[0]], [cost(400, 100)[0]]])).solution
    assert abs(float(lone[0] + lone[1] * 256) - 35_304) > 1000


def test_fewer_than_three_sizes_predict_nothing():
    fit = CostFit()
    fit.add(32, 8, cost(32, 8))
    fit.add(64, 16, cost(64, 16))
    assert not fit.trusted(48, 12)
    with pytest.raises(RuntimeError, match="3 needed"):
        fit.predict(48, 12)


def test_a_fit_that_does_not_reproduce_its_sizes_is_not_trusted():
    fit = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        fit.add(tokens, length, cost(tokens, length))
    assert fit.trusted(96, 24)
    # a fourth size whose first cost jumps (a layer that saves 50% more past length 32): no a + bT + cTL fits it
    jumped = cost(256, 64)
    jumped[0] = jumped[0] * 3 // 2
    fit.add(256, 64, jumped)
    assert not fit.trusted(96, 24) and not fit.trusted(200, 50)


#: Four sizes whose ``T L`` is ``T^2 / 4``: every cost column is a quadratic in ``T`` at ``T / 32 = 1, 2, 4, 8``, so the
#: residuals of a fit are the projection of the column on the one vector orthogonal to all quadratics there, by hand
#: (Lagrange) ``r = (-8, 14, -7, 1)``, ``|r|^2 = 310``: the largest residual of a column ``y`` is ``14 |r . y| / 310``.
FOUR_SIZES = [(32, 8), (64, 16), (128, 32), (256, 64)]


def test_the_residual_tolerance_is_per_cost_1_percent_of_its_largest_value_and_half_a_unit():
    # bytes 8 B off the model at one size (an allocation rounded up): residual at most 14 x 8 x 14 / 310 = 5.06, far
    # within 1% of 35,304 + 0.5: trusted
    off = CostFit()
    for tokens, length in FOUR_SIZES:
        off.add(tokens, length, [cost(tokens, length)[0] + (8 if tokens == 64 else 0), 3])
    assert off.trusted(100, 25)
    # a count that jumps 3 -> 23 at the fourth size: r . y = 20, residual 14 x 20 / 310 = 0.903, over its own
    # 1% x 23 + 0.5 = 0.73 (though far under 1% of the bytes beside it, and under 1.5 units): not trusted
    jump = CostFit()
    for tokens, length in FOUR_SIZES:
        jump.add(tokens, length, [cost(tokens, length)[0], 23 if tokens == 256 else 3])
    assert not jump.trusted(100, 25)


def test_a_size_measured_again_replaces_its_row_and_a_fit_without_sizes_says_so():
    fresh = CostFit()
    assert not fresh.trusted(64, 16)
    with pytest.raises(RuntimeError, match=r"no fit yet \(0 sizes measured, 3 needed\)"):
        fresh.predict(64, 16)
    fit = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        fit.add(tokens, length, cost(tokens, length))
    fit.add(64, 16, [row + 10 for row in cost(64, 16)])  # measured again after a failed check
    assert fit.sizes == [(32, 8), (128, 32), (64, 16)] and fit.rows[-1] == [row + 10 for row in cost(64, 16)]


def test_fit_peak_through_two_lengths_is_a_line_and_refuses_what_it_cannot_fit():
    assert fit_peak([4, 8], [140, 260]) == pytest.approx((20.0, 30.0, 0.0), abs=1e-9)  # 140 = 20 + 30 x 4, 260 = 20 + 30 x 8
    with pytest.raises(ValueError, match=r"needs 2 or more distinct lengths with a peak each, got \[4, 4, 4\]"):
        fit_peak([4, 4, 4], [1, 2, 3])
    with pytest.raises(ValueError, match=r"got \[4, 8\]"):
        fit_peak([4, 8], [140])


def test_the_trust_region_is_the_measured_range_and_16x_past_it():
    assert EXTRAPOLATION == 16.0
    fit = CostFit()
    for tokens, length in [(40, 10), (80, 20), (160, 40)]:
        fit.add(tokens, length, cost(tokens, length))
    assert fit.trusted(100, 25)  # inside
    assert fit.trusted(160 * 16, 40 * 16) and not fit.trusted(160 * 16 + 1, 40 * 16)  # tokens: 16x the most
    assert not fit.trusted(160 * 16, 40 * 16 + 1)  # length: 16x the longest
    assert fit.trusted(3, 1) and not fit.trusted(2, 1)  # below: the fewest tokens / 16 (2 * 16 < 40)


def test_a_size_exactly_16x_below_the_smallest_measured_is_trusted_and_one_token_fewer_is_not():
    fit = CostFit()
    for tokens, length in [(32, 16), (64, 32), (128, 64)]:
        fit.add(tokens, length, cost(tokens, length))
    # the bound itself: 2 tokens x 16 = 32, the fewest measured; length 1 x 16 = 16, the shortest measured
    assert fit.trusted(2, 1)
    assert not fit.trusted(1, 1)  # 16 < 32 tokens
    assert fit.trusted(32, 1) and fit.trusted(2, 64)  # each bound alone, the other value well inside


def test_a_larger_measured_size_clamps_a_prediction_only_where_it_is_no_shorter():
    fit = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        fit.add(tokens, length, cost(tokens, length))
    # 2 rows of 48: fewer tokens than the 128 measured, but longer sequences (its T L term is larger): by hand
    # 1000 + 6*96 + 2*96*48 = 10,792, with the margin ceil(11,007.84) = 11,008; 40*96 = 3,840 -> ceil(3,916.8) = 3,917.
    # (128, 32) measured 9,960 and does not cover it: it must not cap the prediction
    assert cost(128, 32)[0] == 9_960
    assert fit.predict(96, 48, keep=[2]) == [11_008, 3_917, 3]


def test_predictions_are_clamped_by_the_sizes_measured():
    fit = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        fit.add(tokens, length, cost(tokens, length))
    # at a measured size with the margin, no more than what was measured there (a size covering it)
    assert fit.predict(64, 16, keep=[2]) == cost(64, 16)
    # just past a measured size: at least what it measured, and at most the margin over the fit
    above = fit.predict(65, 16, keep=[2])
    assert cost(64, 16)[0] <= above[0] <= math.ceil(cost(65, 16)[0] * (1 + MARGIN))
    # a cost that shrinks as the batch grows (1000 - 2 T, by hand): past the range the fit says 1000 - 512 = 488,
    # 498 with the margin, but no batch holds less than a smaller one measured: 1000 - 64 = 936 at 32 tokens;
    # and between sizes no more than a larger one measured: 744 at 128 tokens, not 1000 - 100 = 900 (918)
    falling = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        falling.add(tokens, length, [1000 - 2 * tokens])
    assert falling.predict(256, 64) == [936]
    assert falling.predict(50, 12) == [744]


def test_a_smaller_measured_size_clamps_at_equal_tokens_or_equal_length_and_counts_are_never_clamped():
    # a cost that shrinks with T L, 5000 - T L / 4, measured at three sizes none of which covers another; at (64, 20)
    # the fit says 5000 - 320 = 4,680, but (64, 16) measured, with as many tokens and shorter, held 4,744
    by_length = CostFit()
    for tokens, length in [(32, 32), (64, 16), (128, 12)]:
        by_length.add(tokens, length, [5000 - tokens * length // 4])
    assert by_length.predict(64, 20, margin=0.0) == [4744]
    # one that shrinks with T, 5000 - 2 T: at (48, 16) the fit says 4,904, (32, 16) measured, as long, held 4,936
    by_tokens = CostFit()
    for tokens, length in [(32, 16), (64, 13), (16, 24)]:
        by_tokens.add(tokens, length, [5000 - 2 * tokens])
    assert by_tokens.predict(48, 16, margin=0.0) == [4936]
    # a count (kept) is the fit rounded, whatever was measured around it: 1000 - 2 T at 256 and at 50 tokens; and a
    # cost that is 0 at every size is predicted 0, not raised to a byte
    falling = CostFit()
    for tokens, length in [(32, 8), (64, 16), (128, 32)]:
        falling.add(tokens, length, [1000 - 2 * tokens, 0])
    assert falling.predict(256, 64, keep=[0]) == [488, 0] and falling.predict(50, 12, keep=[0]) == [900, 0]


def test_fit_peak_is_the_one_least_squares_of_plan_lengths():
    from lightning_ckpt.commands.plan import predictions

    assert predictions.fit_peak is fit_peak
    assert fit_peak([512, 1024, 4096], [1e6 + 3000 * t + 0.5 * t * t for t in (512, 1024, 4096)]) == pytest.approx(
        (1e6, 3000, 0.5), rel=1e-9)


# ------------------------------------------------------------------------------------ the cycle, on costs by hand


def measurement(tokens: int, length: int) -> RankMeasurement:
    """Two blocks of a small transformer by hand (bytes per token and per token x length), combined as ranks do."""
    costs = [LayerCost(f"b{i}", "Block", none_bytes=600 * tokens + 16 * tokens * length, full_bytes=64 * tokens,
                       selective_bytes=300 * tokens + 16 * tokens * length, offloadable_bytes=0,
                       full_flops=9000 * tokens + 256 * tokens * length, selective_flops=20 * tokens * length,
                       transient_bytes=200 * tokens + 8 * tokens * length) for i in range(2)]
    mine = RankMeasurement(costs, outside_bytes=2000 + 128 * tokens, head_bytes=64 * tokens,
                           head_peak_bytes=64 * tokens)
    return combine_costs(torch.tensor([pack_costs(mine)]), mine)[0]


def long_tailed(seed: int = 0, steps: int = 60) -> list[int]:
    """Lengths from a lognormal (median 48), clipped to 8..768, the longest among them."""
    rng = random.Random(seed)
    lengths = [min(768, max(8, int(rng.lognormvariate(math.log(48), 1.0)))) for _ in range(steps)]
    lengths[steps // 2] = 768
    return lengths


def run_cycle(lengths: list[int], budget: object = 0.8, batch: int = 4) -> tuple[BudgetCycle, list[str]]:
    """The callback's decisions, without a model: measured costs come from :func:`measurement`."""
    cycle, kinds = BudgetCycle(), []
    for length in lengths:
        size = BatchSize(batch * length, length)
        step = cycle.begin(size)
        if step.predicted is not None:
            cycle.planned(make_plan(step.predicted.costs, step.predicted.outside_bytes, budget))
            step = cycle.begin(size, predict=False)
            kinds.append("predicted")
        elif step.measure:
            measured = measurement(size.tokens, size.length)
            cycle.planned(make_plan(measured.costs, measured.outside_bytes, budget), measured)
            kinds.append("measured")
        else:
            kinds.append("covered")
    return cycle, kinds


@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
def test_a_long_tailed_run_measures_at_most_4_steps_in_60_in_any_order(order):
    lengths = long_tailed()
    assert min(lengths) == 8 and max(lengths) == 768
    lengths = {"random": lengths, "ascending": sorted(lengths), "descending": sorted(lengths, reverse=True)}[order]
    cycle, kinds = run_cycle(lengths)
    assert kinds.count("measured") == cycle.measured_steps <= 4, kinds
    assert kinds[:1] == ["measured"] and "predicted" in kinds


def test_a_predicted_plan_is_the_plan_its_measurement_would_make_within_the_margin():
    fit_lengths, target = [8, 16, 32], 100
    truth = measurement(4 * target, target)
    budget = int(0.8 * make_plan(truth.costs, truth.outside_bytes, 1.0).peak_bytes)
    cycle, _ = run_cycle(fit_lengths + [target], budget=budget)
    measured_plan = make_plan(truth.costs, truth.outside_bytes, budget)
    predicted_plan = cycle.plans[BatchSize(4 * target, target).bucket]
    # exact costs by hand: the prediction is the truth raised by the margin, so its planned bytes are the
    # measured plan's at most 2% over, and the truth's peak under the predicted plan is within the budget
    assert predicted_plan.layers == measured_plan.layers
    assert measured_plan.planned_bytes <= predicted_plan.planned_bytes <= math.ceil(
        measured_plan.planned_bytes * (1 + MARGIN)) + 8
    assert 0 < predicted_plan.recompute_flops and predicted_plan.peak_bytes <= budget


def test_a_bucket_whose_check_passed_is_checked_again_only_for_a_plan_that_checkpoints_otherwise():
    cycle, kinds = run_cycle([8, 16, 32, 100])
    assert kinds[-1] == "predicted" and cycle.checking
    cycle.check_passed(BatchSize(400, 100))
    assert not cycle.checking

    def predict(size: BatchSize, layout=None) -> bool:
        step = cycle.begin(size)
        plan = make_plan(step.predicted.costs, step.predicted.outside_bytes, 0.8)
        cycle.planned(plan if layout is None else replace(plan, layers=layout))
        cycle.begin(size, predict=False)
        return cycle.checking

    assert predict(BatchSize(440, 110)) is False  # bucket 512 again, checkpointed alike: the same costs were checked
    assert predict(BatchSize(480, 120), {"l0": "full", "l1": "none"}) is True  # otherwise: checked
    assert predict(BatchSize(1200, 300)) is True  # another bucket: checked


def test_a_failed_check_drops_the_predicted_plan_and_the_next_batch_of_its_bucket_is_measured():
    cycle, kinds = run_cycle([8, 16, 32, 100])
    size = BatchSize(400, 100)
    assert kinds[-1] == "predicted" and cycle.checking and cycle.current == size
    cycle.check_failed(size)
    assert size.bucket not in cycle.plans and not cycle.checking
    step = cycle.begin(BatchSize(396, 99))  # same bucket, smaller: the fit would predict it, the check says measure
    assert step.measure
    cycle.planned(make_plan(measurement(396, 99).costs, 0, 0.8), measurement(396, 99))
    assert (396, 99) in cycle.fit.sizes and cycle.measured_steps == 4
    predicted = cycle.begin(BatchSize(404, 101)).predicted  # measured once: the bucket is predicted again
    assert predicted is not None and [c.calls for c in predicted.costs] == [1, 1]  # a count takes no margin
    assert predicted.costs[0].full_bytes == math.ceil(64 * 404 * (1 + MARGIN))  # 64 bytes a token, 2% over


def test_a_fit_a_hair_above_an_integer_is_that_integer_before_the_margin():
    """least squares of integer rows lands on them only to float precision: 880,000.0000000016 bytes, raised by 2%,
    is 897,600 bytes (880,000 x 1.02), not 897,601; a byte more than the tolerance is still rounded up."""
    fit = CostFit()
    for tokens in (64, 128, 256):
        fit.add(tokens, 16, [0, 0])  # measured rows of nothing: no bound on the predictions below
    fit._coeffs = torch.tensor([[880_000.0000000016, 3.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert fit.predict(512, 16) == [897_600, 4]  # 3 x 1.02 = 3.06: up to 4
    fit._coeffs = torch.tensor([[880_000.01, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert fit.predict(512, 16, margin=0.0) == [880_001, 0]
