"""How a :class:`~lightning_ckpt.core.plan.budget_driver.BudgetDriver` solves and reports a plan, called directly on a
driver whose measurement is set by hand: ``_make_plan`` (the budget, fixed or ``"auto"``; the LM head whole, then in
chunks while the budget is missed; the error when nothing fits), ``_solve`` (what it hands ``make_plan``), ``_report``
(the line and table given to ``report=``) and ``_chooses_chunks`` (when the plans choose the head's chunks).

``make_plan`` and the chunked head's pricing are stood in for where a test checks the driver's own choices; the
planner itself is tested in tests/core/plan/test_planner.py and test_chunked_plan.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lightning_ckpt.core.plan import budget_driver as driver_module
from lightning_ckpt.core.plan.budget import AutoBudget, RankMeasurement, plan_summary
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.budget_driver import BUDGET_DEFAULTS, BudgetDriver, OneRank
from lightning_ckpt.core.plan.planner import ChunkedHead, LayerCost, make_plan
from lightning_ckpt.demos import Transformer

from helpers import TwoRanks

SIZE = BatchSize(800, 100)  # bucket 1024
AUTO_TEXT = ("auto: 0.9 x 1000 B device memory - 400 B weights, gradients and optimizer state - 50 B other peak of the"
             " step = 450 B for activations")


def costs(scale: int = 1) -> list[LayerCost]:
    return [LayerCost(f"l{i}", "Block", none_bytes=100 * scale, full_bytes=10 * scale, selective_bytes=40 * scale,
                      offloadable_bytes=0, full_flops=50 * scale, selective_flops=5 * scale) for i in range(4)]


def measured() -> RankMeasurement:
    return RankMeasurement(costs(), outside_bytes=100, head_bytes=20, head_peak_bytes=5)


# Plans as make_plan solves them for `measured()`: nothing checkpointed, 3 of 4 layers, and the head in chunks.
NOTHING = make_plan(costs(), 100, 10**6)
SOME = make_plan(costs(), 100, 0.5)
CHUNKED = {chunk: make_plan(costs(), 100, 0.5, head_bytes=20, chunk_loss=True,
                            chunked=ChunkedHead(chunk, 100, 20, 0, 0)) for chunk in (1024, 512)}
SUMMARY = ("memory_budget=0.5: checkpointing 3 of 4 layers (3 full); activation peak 230 B predicted against a budget"
           " of 250 B (230 B held at the end of the forward, 46% of 500 B without checkpointing); 150 FLOP recomputed"
           " per step")


# What make_plan solves for `measured()` (its head bytes too) at 0.5, both modes.
SOLVED = ("memory_budget=0.5: checkpointing 4 of 4 layers (2 full, 2 selective); activation peak 250 B predicted against"
          " a budget of 252 B (200 B held at the end of the forward, 40% of 500 B without checkpointing); 110 FLOP"
          " recomputed per step")


class Solver:
    """Stands in for ``make_plan``: records each call (its budget and the chunk of its chunked head) and answers from
    ``answers`` (chunk -> plan, or the ValueError to raise); ``None`` answers with the real ``make_plan``."""

    def __init__(self, answers=None) -> None:
        self.answers = answers
        self.calls: list[tuple] = []
        self.args: list[tuple] = []

    def __call__(self, *args, **kwargs):
        chunked = kwargs["chunked"]
        self.calls.append((args[2], None if chunked is None else chunked.chunk_tokens))
        self.args.append((args, kwargs))
        if self.answers is None:
            return make_plan(*args, **kwargs)
        answer = self.answers[self.calls[-1][1]]
        if isinstance(answer, Exception):
            raise answer
        return answer


def driver_for(monkeypatch, answers=None, **settings):
    """A driver measuring a batch of SIZE (its measurement set by hand), with ``make_plan`` stood in for and its
    reports kept; also the LM head's chunks priced by a stand-in that records ``(ranks, run, chunk)``."""
    solver, priced, reported = Solver(answers), [], []
    monkeypatch.setattr(driver_module, "make_plan", solver)

    def chunked_head(ranks, run, chunk):
        priced.append((ranks, run, chunk))
        return ChunkedHead(chunk, 100, 20, 0, 0)

    monkeypatch.setattr(driver_module, "_chunked_head", chunked_head)
    driver = BudgetDriver(dict(BUDGET_DEFAULTS, **{"memory_budget": 0.5, "max_length": 0, **settings}),
                          report=lambda line, table: reported.append((line, table)))
    driver.cycle.begin(SIZE, predict=False)
    driver.measured = measured()
    return driver, solver, priced, reported


def lm() -> Transformer:
    return Transformer(16, 8, 1, 8, 2, 0.0)


# ------------------------------------------------------------------------------------------ _solve


def test_solve_hands_make_plan_the_settings_budget_full_mode_when_reentrant_and_the_device_s_profile(monkeypatch):
    solver = Solver({0: "the plan"})
    monkeypatch.setattr(driver_module, "make_plan", solver)
    driver = BudgetDriver(dict(BUDGET_DEFAULTS, memory_budget=0.5, use_reentrant=True, offload=True, compress="bf16"))
    profile = object()
    driver.device = (profile, 123)
    mine, head = measured(), ChunkedHead(0, 1, 2, 3, 4)
    assert driver._solve(OneRank(), mine, None, head) == "the plan"
    assert driver._solve(OneRank(), mine, 777, head) == "the plan"  # a budget given is kept
    first, second = solver.args
    assert first == ((mine.costs, 100, 0.5, ("full",), True, profile),
                     dict(host_memory=123, min_bytes=1 << 20, head_bytes=20, head_peak_bytes=5, compress="bf16",
                          chunked=head))
    assert second[0][2] == 777 and second[1] == first[1]


def test_solve_without_a_budget_takes_auto_s_and_without_a_device_plans_with_no_profile(monkeypatch):
    solver = Solver({None: "the plan"})
    monkeypatch.setattr(driver_module, "make_plan", solver)
    driver = BudgetDriver(dict(BUDGET_DEFAULTS, memory_budget="auto"))
    driver.auto = AutoBudget(1000, 400, 50)
    assert driver._solve(OneRank(), measured()) == "the plan"
    (args, kwargs), = solver.args
    assert args[2:] == (450, ("full", "selective"), False, None)
    assert kwargs["host_memory"] is None and kwargs["compress"] is None and kwargs["chunked"] is None


# ------------------------------------------------------------------------------------------ _report


def reporting_driver(**settings):
    reported: list[tuple[str, str]] = []
    driver = BudgetDriver(dict(BUDGET_DEFAULTS, memory_budget=0.5, **settings),
                          report=lambda line, table: reported.append((line, table)))
    return driver, reported


def test_report_gives_the_plan_s_line_and_table_for_the_batch_size_and_says_when_it_was_predicted():
    driver, reported = reporting_driver()
    driver._report(OneRank(), SOME, None, SIZE)
    driver._report(OneRank(), SOME, None, SIZE, predicted=True)
    table = f"Planned for batches up to 800 tokens (length 100)\n{SOME}"
    assert reported == [
        (f"GradientCheckpointing: batches up to 800 tokens (length 100), {SUMMARY}", table),
        (f"GradientCheckpointing: batches up to 800 tokens (length 100) (predicted from the sizes measured), {SUMMARY}",
         table),
    ]


def test_report_without_a_size_and_with_auto_s_figures():
    driver, reported = reporting_driver()
    driver._report(OneRank(), SOME, AutoBudget(1000, 400, 50), None)
    assert reported == [(f"GradientCheckpointing: {SUMMARY} ({AUTO_TEXT})", f"{SOME}\n{AUTO_TEXT}")]


def test_report_says_nothing_off_rank_zero():
    driver, reported = reporting_driver()
    driver._report(TwoRanks(is_global_zero=False), SOME, None, SIZE, predicted=True)
    assert reported == []


# ------------------------------------------------------------------------------------------ _chooses_chunks


def chooser(**settings):
    said: list[str] = []
    return BudgetDriver(dict(BUDGET_DEFAULTS, **{"memory_budget": 0.5, **settings}), info=said.append), said


def test_a_byte_or_fraction_budget_with_chunk_loss_none_chooses_the_chunks_of_a_chunkable_model():
    for budget in (0.5, 2**30):
        driver, said = chooser(memory_budget=budget)
        assert driver._chooses_chunks(lm()) is True and said == []
    driver, said = chooser()
    assert driver._chooses_chunks(nn.Linear(2, 2)) is False and said == []  # no LM to chunk


@pytest.mark.parametrize("settings", [dict(chunk_loss=True), dict(chunk_loss=False), dict(memory_budget=None),
                                      dict(memory_budget="auto")])
def test_chunk_loss_set_or_no_budget_or_auto_chooses_no_chunks(settings):
    driver, said = chooser(**settings)
    assert driver._chooses_chunks(lm()) is False and said == []


def test_a_model_sharded_by_fsdp2_chooses_no_chunks(monkeypatch):
    monkeypatch.setattr(driver_module, "fsdp2", lambda: types.SimpleNamespace(FSDPModule=nn.LayerNorm))
    driver, said = chooser()
    assert driver._chooses_chunks(lm()) is False and said == []


def test_a_loss_kept_whole_chooses_no_chunks_and_says_why_once():
    softcapped = lm()
    softcapped.config = types.SimpleNamespace(final_logit_softcapping=30.0)
    driver, said = chooser()
    assert driver._chooses_chunks(softcapped) is False
    assert driver._chooses_chunks(softcapped) is False
    assert said == ["GradientCheckpointing: chunk_loss=None: Transformer's loss stays whole: its"
                    " final_logit_softcapping=30.0 changes the logits between the LM head and the loss, which a head"
                    " run in chunks cannot reproduce."]
    # A loss found whole on a fake step is said with the model's own reasons, joined.
    driver, said = chooser()
    driver._loss_whole = "the fake step's reason"
    assert driver._chooses_chunks(softcapped) is False
    assert said == [said[0]] and said[0].endswith("cannot reproduce; the fake step's reason.")
    # ... and alone, on a model otherwise chunkable.
    driver, said = chooser()
    driver._loss_whole = "the fake step's reason"
    assert driver._chooses_chunks(lm()) is False and driver._chooses_chunks(lm()) is False
    assert said == ["GradientCheckpointing: chunk_loss=None: the fake step's reason."]


# ------------------------------------------------------------------------------------------ _make_plan


def test_a_fraction_budget_is_solved_for_the_measurement_and_reported_for_the_batch_size(monkeypatch):
    driver, solver, priced, reported = driver_for(monkeypatch)
    driver._make_plan(OneRank(), nn.Linear(2, 2))
    assert solver.calls == [(0.5, None)] and priced == []
    plan = driver.plan
    assert plan.layers == {"l0": "selective", "l1": "full", "l2": "full", "l3": "selective"}
    assert driver.cycle.plans == {1024: plan} and driver.measured is None and driver._chunked is None
    # the measurement (combined over the ranks) is what later sizes are predicted from
    assert driver.cycle.template is not None and driver.cycle.template.outside_bytes == 100
    assert [c.none_bytes for c in driver.cycle.template.costs] == [100] * 4
    assert reported == [(f"GradientCheckpointing: batches up to 800 tokens (length 100), {SOLVED}",
                         f"Planned for batches up to 800 tokens (length 100)\n{plan}")]


def test_a_fraction_budget_is_kept_even_with_auto_figures_left_from_before(monkeypatch):
    driver, solver, _, reported = driver_for(monkeypatch)
    driver.auto = AutoBudget(1000, 400, 50)
    driver._make_plan(OneRank(), nn.Linear(2, 2))
    assert solver.calls == [(0.5, None)]
    assert reported[0][0] == f"GradientCheckpointing: batches up to 800 tokens (length 100), {SOLVED}"


def auto_stats(monkeypatch, static: int, peak, total: int) -> list[tuple]:
    """``static_bytes``, ``device_peak_bytes`` and ``device_total_bytes`` answering these, their calls recorded."""
    seen: list[tuple] = []
    monkeypatch.setattr(driver_module, "static_bytes", lambda module, optimizers: seen.append(
        ("static", module, optimizers)) or static)
    monkeypatch.setattr(driver_module, "device_peak_bytes", lambda device: seen.append(("peak", device)) or peak)
    monkeypatch.setattr(driver_module, "device_total_bytes", lambda device: seen.append(("total", device)) or total)
    return seen


def test_auto_s_first_plan_takes_its_budget_from_static_memory_and_the_step_s_peak_combined_over_ranks(monkeypatch):
    driver, solver, _, reported = driver_for(monkeypatch, memory_budget="auto")
    seen = auto_stats(monkeypatch, static=1000, peak=(3000, 9999), total=10_000)
    module, optimizers, ranks = nn.Linear(2, 2), [object()], TwoRanks()
    driver._make_plan(ranks, module, optimizers)
    cpu = torch.device("cpu")
    assert seen == [("static", module, optimizers), ("peak", cpu), ("total", cpu)]
    # This rank: 3000 peak - 1000 static - 210 activation peak = 1790 other; the other rank's figures are twice
    # these: the least device memory, the most static and other peak.
    assert driver.auto == AutoBudget(10_000, 2000, 3580)
    assert solver.calls == [(int(0.9 * 10_000) - 2000 - 3580, None)]
    (args, _), = solver.args
    assert [c.none_bytes for c in args[0]] == [200] * 4 and args[1] == 200  # the costs combined over ranks
    line, table = reported[0]
    assert line == (f"GradientCheckpointing: batches up to 800 tokens (length 100), "
                    f"{plan_summary(driver.plan, 'auto', driver.auto)}")
    assert table.endswith(f"\n{driver.auto}") and driver.cycle.plans == {1024: driver.plan}


def test_auto_s_first_plan_counts_no_peak_figure_as_zero(monkeypatch):
    driver, solver, _, _ = driver_for(monkeypatch, {None: NOTHING}, memory_budget="auto")
    driver.measured = RankMeasurement([], 0)
    auto_stats(monkeypatch, static=0, peak=None, total=1000)
    driver._make_plan(OneRank(), nn.Linear(2, 2))
    assert driver.auto == AutoBudget(1000, 0, 0) and solver.calls == [(900, None)]


def test_auto_s_later_plans_keep_the_first_plan_s_budget(monkeypatch):
    driver, solver, _, reported = driver_for(monkeypatch, memory_budget="auto")
    auto = driver.auto = AutoBudget(1000, 400, 50)
    seen = auto_stats(monkeypatch, static=1, peak=(1, 1), total=1)
    driver._make_plan(TwoRanks(), nn.Linear(2, 2))
    assert seen == [] and driver.auto is auto
    assert solver.calls == [(450, None)]
    (args, _), = solver.args
    assert [c.none_bytes for c in args[0]] == [200] * 4 and args[1] == 200
    assert reported[0][0].endswith(f" ({AUTO_TEXT})") and reported[0][1].endswith(f"\n{AUTO_TEXT}")


def test_a_whole_head_plan_that_checkpoints_nothing_is_taken_without_trying_chunks(monkeypatch):
    driver, solver, priced, reported = driver_for(monkeypatch, {None: NOTHING})
    driver._chunked = source = object()
    driver._make_plan(OneRank(), lm())
    assert solver.calls == [(0.5, None)] and priced == []
    assert driver.plan is NOTHING and driver.cycle.plans == {1024: NOTHING} and len(reported) == 1
    assert driver._chunked is None and source is not None


def test_a_whole_head_plan_that_checkpoints_is_weighed_against_the_head_in_chunks_of_1024(monkeypatch):
    driver, solver, priced, reported = driver_for(monkeypatch, {None: SOME, 1024: CHUNKED[1024]})
    driver._chunked = source = object()
    ranks = OneRank()
    driver._make_plan(ranks, lm())
    assert solver.calls == [(0.5, None), (0.5, 1024)]
    assert priced == [(ranks, source, 1024)]
    assert driver.plan is CHUNKED[1024] and len(reported) == 1 and driver._chunked is None


def test_chunks_are_halved_while_the_budget_is_missed(monkeypatch):
    missed = ValueError("missed")
    driver, solver, priced, _ = driver_for(monkeypatch, {None: missed, 1024: missed, 512: CHUNKED[512]})
    driver._chunked = source = object()
    ranks = OneRank()
    driver._make_plan(ranks, lm())
    assert solver.calls == [(0.5, None), (0.5, 1024), (0.5, 512)]
    assert priced == [(ranks, source, 1024), (ranks, source, 512)]
    assert driver.plan is CHUNKED[512] and driver.cycle.plans == {1024: CHUNKED[512]}


def test_when_no_plan_fits_the_last_error_is_raised_for_the_batch_size(monkeypatch):
    answers = {chunk: ValueError(f"no plan at {chunk}") for chunk in (None, 1024, 512, 256)}
    driver, solver, _, reported = driver_for(monkeypatch, answers)
    driver._chunked = object()
    with pytest.raises(ValueError) as raised:
        driver._make_plan(OneRank(), lm())
    assert str(raised.value) == "no plan at 256\n  This was for a batch of 800 tokens (length 100) (the largest over ranks)."
    assert solver.calls == [(0.5, None), (0.5, 1024), (0.5, 512), (0.5, 256)]
    assert driver.plan is None and driver.cycle.plans == {} and reported == []
    assert driver.measured is None and driver._chunked is None


def test_without_the_head_s_run_only_the_whole_head_is_solved(monkeypatch):
    driver, solver, priced, _ = driver_for(monkeypatch, {None: SOME})
    driver._make_plan(OneRank(), lm())
    assert solver.calls == [(0.5, None)] and priced == [] and driver.plan is SOME


def test_where_another_rank_did_not_run_the_head_in_chunks_no_rank_chooses_chunks(monkeypatch):
    driver, solver, priced, _ = driver_for(monkeypatch, {None: SOME})
    driver._chunked = object()
    ranks = TwoRanks(other_flag=0)
    driver._make_plan(ranks, lm())
    assert solver.calls == [(0.5, None)] and priced == [] and driver.plan is SOME
    assert [rows.shape[1] for rows in ranks.gathered][1:] == [1]  # the costs, then the flag


def test_where_the_plans_choose_no_chunks_the_ranks_gather_no_flag(monkeypatch):
    driver, solver, _, _ = driver_for(monkeypatch, {None: SOME}, chunk_loss=True)
    ranks = TwoRanks(other_flag=0)
    driver._make_plan(ranks, lm())
    assert len(ranks.gathered) == 1 and ranks.gathered[0].shape[1] > 1 and solver.calls == [(0.5, None)]
