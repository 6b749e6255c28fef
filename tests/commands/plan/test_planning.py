"""What `plan` plans from its measurements (commands/plan/planning.py): the settings gathered once, the rows at each
length, and the walk down to the plan's longest length, against a stand-in planner whose figures are set by hand."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from lightning_ckpt.commands.plan import planning
from lightning_ckpt.commands.plan.predictions import CALLBACK_MODES, PlanSettings
from lightning_ckpt.commands.plan.static_memory import HostMemory


def built(**given) -> NS:
    return NS(**{**dict(offload="auto", compress="fp8", chunk_loss=True, tile_mlp=True, reentrant=False), **given})


def test_every_plan_is_made_with_the_run_s_choices_and_the_host_memory_left_for_offload():
    profile = object()
    assert planning.plan_settings(built(), profile, HostMemory(100, given=True, static=30)) == PlanSettings(
        offload="auto", device=profile, compress="fp8", chunk_loss=True, host_memory=70, tile_mlp=True,
        modes=CALLBACK_MODES)
    reentrant = planning.plan_settings(built(reentrant=True, offload=False, compress=None, chunk_loss=None,
                                             tile_mlp=False), None)
    assert reentrant == PlanSettings(offload=False, device=None, compress=None, chunk_loss=None, host_memory=None,
                                     tile_mlp=False, modes=("full",))  # reentrant checkpointing has no selective mode


TOKEN_BYTES = 10  # the stand-in step's least peak per token


def longest(fitted, room, limit=None, refuses=lambda length: None):
    """``_plan_longest`` on a stand-in: the least peak is 10 B a token; the planner refuses past the room ("least
    reachable"), and where ``refuses(length)`` gives its words. Returns the result and the lengths measured."""
    def plan(length, budget):
        if TOKEN_BYTES * length > budget:
            return None, "the least reachable is more"
        error = refuses(length)
        return (None, error) if error else ("the plan", None)

    result = NS(largest_length={"plan": fitted}, main=NS(batch_size=2), longest=None)
    measured = []
    settings = NS(least_peak=lambda length: TOKEN_BYTES * length, plan=plan)
    planning._plan_longest(result, room, settings, lambda length: measured.append(length) or length, limit)
    return result, measured


def test_a_fit_that_promised_too_much_shrinks_by_what_the_least_peak_overshoots():
    result, measured = longest(1000, room=9000)  # 10,000 B at 1,000 tokens: 900 tokens fit
    assert measured == [1000, 900] and result.largest_length["plan"] == 900
    lp = result.longest
    assert (lp.fitted, lp.length, lp.batch_size, lp.plan, lp.least_peak_bytes, lp.capped, lp.shortened) == (
        1000, 900, 2, "the plan", 9000, None, ["overshot"])


def test_where_the_peak_fits_but_no_plan_does_the_length_shrinks_by_1_percent_and_says_why():
    # at the room exactly the least peak fits: not an overshoot, the planner found no plan all the same
    result, measured = longest(1000, room=10_000, refuses=lambda n: "no plan" if n > 990 else None)
    assert measured == [1000, 990] and result.longest.shortened == ["no_plan"]
    assert type(result.largest_length["plan"]) is int and result.largest_length["plan"] == 990
    # under 200 tokens, 1% is under one token: one token shorter each time
    host = lambda n: "`memory_budget=9` needs more than `host_memory=5` (5 B)" if n > 148 else None  # noqa: E731
    result, measured = longest(150, room=10**6, refuses=host)
    assert measured == [150, 149, 148] and result.longest.shortened == ["host_memory"] * 2


def test_a_length_the_model_caps_is_planned_at_the_cap_and_the_fitted_length_stays():
    result, measured = longest(1000, room=10**6, limit=("max_position_embeddings", 500))
    assert measured == [500] and result.longest.capped == ("max_position_embeddings", 500)
    assert result.longest.length == 500 and result.largest_length["plan"] == 1000
    result, measured = longest(1000, room=10**6, limit=("max_position_embeddings", 1000))  # not under the fit
    assert measured == [1000] and result.longest.capped is None and result.largest_length["plan"] == 1000


def test_the_walk_stops_at_one_token_and_nothing_is_planned_without_a_fitted_length():
    result, measured = longest(2, room=5)  # 20 B at 2 tokens, 10 B at 1: neither fits 5 B
    assert measured == [2, 1] and result.longest.plan is None and result.longest.shortened == ["overshot"]
    assert result.largest_length["plan"] == 2  # no plan: the fitted length stays
    result, measured = longest(1, room=100)
    assert measured == [1] and result.longest.length == 1
    for fitted in (0, None):
        result, measured = longest(fitted, room=100)
        assert measured == [] and result.longest is None


@pytest.mark.parametrize("least_peak, error, why", [
    (101, "the least reachable is more", "overshot"),
    (100, "the least reachable is more", "no_plan"),  # at the room: not over it
    (100, "`memory_budget=9` needs more than `host_memory=5` (5 B)", "host_memory"),
    (50, None, "no_plan"),
])
def test_why_a_length_was_shortened(least_peak, error, why):
    assert planning._why_shorter(least_peak, 100, error) == why


class _Plan:
    kept_ops = {"a": [1]}
    offloaded = ("a",)
    chunk_tokens = None


def test_each_setting_s_row_is_predicted_with_the_plan_s_choices_and_the_run_s(monkeypatch):
    monkeypatch.setattr(planning, "setting_choices", lambda names, plan, chunked: ("choices", names, plan, chunked))
    monkeypatch.setattr(planning, "setting_rows", lambda *args, **kwargs: (args, kwargs))
    measured, other, profile, plan = NS(costs=[NS(name="a"), NS(name="b")], chunked=None), object(), object(), _Plan()
    args, kwargs = planning._rows(measured, plan, "auto", profile, other, 123)
    assert args == (measured, ("choices", ["a", "b"], plan, False), "auto", other, 123, {"a": [1]}, profile, ("a",))
    assert kwargs == {"plan_chunked": False}
    plan.chunk_tokens, measured.chunked = 4096, object()
    args, kwargs = planning._rows(measured, plan, "auto", profile)
    assert args[1][3] is True and kwargs == {"plan_chunked": True}
    args, kwargs = planning._rows(measured, None, False, None)
    assert args[1][2] is None and args[5:] == ({}, None, ()) and kwargs == {"plan_chunked": False}


@pytest.mark.parametrize("count, fit", [(1, None), (2, "linear"), (3, "quadratic"), (4, "quadratic")])
def test_across_lengths_each_length_gets_its_plan_and_rows_and_the_fit_is_linear_through_two(monkeypatch, count, fit):
    rows_of = {}
    monkeypatch.setattr(planning, "_rows", lambda m, plan, offload, profile: rows_of.setdefault(
        m.length, [NS(name="none", peak_bytes=7 * m.length), NS(name="plan", peak_bytes=0)]) and
        rows_of[m.length] + [NS(name="seen", peak_bytes=(plan, offload, profile))])
    monkeypatch.setattr(planning, "fit_peak", lambda lengths, peaks: (tuple(lengths), tuple(peaks)))
    monkeypatch.setattr(planning, "largest_length", lambda fit, room: (fit, room))
    settings = NS(plan=lambda m, budget: (f"plan at {m.length} for {budget}", None), least_peak=lambda m: 3 * m.length)
    result = NS(built=NS(offload="auto"), profile="profile", lengths=[], budget=50, length_fit=None,
                rows=[NS(name="none"), NS(name="plan")], largest_length={})
    at = [NS(length=100 * (i + 1), batch_size=1) for i in range(count)]
    planning._across_lengths(result, at, 1000, settings)
    lengths = [m.length for m in at]
    assert [(r.length, r.plan, r.plan_error, r.least_peak_bytes) for r in result.lengths] == [
        (n, f"plan at {n} for 50", None, 3 * n) for n in lengths]
    assert [r.rows[-1].peak_bytes for r in result.lengths] == [(f"plan at {n} for 50", "auto", "profile") for n in lengths]
    assert result.length_fit == fit
    if count >= 2:
        assert result.largest_length == {"none": ((tuple(lengths), tuple(7 * n for n in lengths)), 1000),
                                          "plan": ((tuple(lengths), tuple(3 * n for n in lengths)), 1000)}
    else:
        assert result.largest_length == {}
