"""The budget driver's training step (:meth:`BudgetDriver.begin_batch`, :meth:`~BudgetDriver.after_forward`,
:meth:`~BudgetDriver.end_batch`) on a plain module: which sizes are measured, which are predicted from the costs fitted
over three measured sizes and have their held bytes checked (passing, failing on another rank, at the boundary), how
``"auto"`` waits for the first optimizer step, a step with no loss, the warning when other saved-tensor hooks hide the
bytes outside the layers, and the LM head's chunks priced from a measuring step of the demo Transformer.

Every model here is 4 blocks of ``x + down(relu(up(x)))`` (16 -> 64 -> 16, float32) on batches of ``n`` samples. Run
whole, a block saves its input (16 floats a sample) and the ReLU's output (64); fully checkpointed, its input only;
the loss ``out.square().mean()`` saves the last output (16). A fraction budget of 0.8 checkpoints blocks 0 and 1.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import pytest
import torch
from torch import nn

import lightning_ckpt.core.plan.budget_driver as driver_module
from lightning_ckpt.core.checkpoint.chunked_loss import chunk_loss_of
from lightning_ckpt.core.plan.budget import AutoBudget, RankMeasurement, plan_summary
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.budget_driver import BUDGET_DEFAULTS, MEASURED_CHUNK, BudgetDriver, OneRank
from lightning_ckpt.demos import Transformer

from helpers import TwoRanks, blocks

FLOAT = 4
PLAN_08 = {"0": "full", "1": "full", "2": "none", "3": "none"}


def held_by_plan_08(n: int) -> int:
    """Bytes the forward of PLAN_08 leaves held: two checkpointed blocks' inputs, two whole blocks, the loss's input."""
    return (2 * 16 + 2 * (16 + 64) + 16) * n * FLOAT


class Said:
    """The driver's info lines, warnings and report lines."""

    def __init__(self) -> None:
        self.info: list[str] = []
        self.warn: list[str] = []
        self.report: list[str] = []

    def driver(self, **settings) -> BudgetDriver:
        settings = dict(BUDGET_DEFAULTS, **{"memory_budget": 0.8, "max_length": 0, "time_layers": False, **settings})
        return BudgetDriver(settings, info=self.info.append, warn=self.warn.append,
                            report=lambda line, table: self.report.append(line))


def step(driver: BudgetDriver, ranks, module: nn.Module, n: int, *, loss: bool = True, stepped: Optional[bool] = None,
         optimizers=(), opt=None) -> None:
    """One training step of ``n`` samples (``stepped=None``: end_batch's own default)."""
    batch = torch.randn(n, 16)
    driver.begin_batch(ranks, module, batch)
    out = module(batch).square().mean()
    if loss:
        driver.after_forward(ranks, module, out)
    out.backward()
    if opt is not None:
        opt.step()
    if stepped is None:
        driver.end_batch(ranks, module, optimizers=optimizers)
    else:
        driver.end_batch(ranks, module, stepped, optimizers)


@pytest.fixture
def counters(monkeypatch) -> list:
    """Every held-bytes check the driver makes, once it ended."""
    ended = []

    class Recorded(driver_module.SavedTensorCounter):
        def __exit__(self, *exc) -> None:
            super().__exit__(*exc)
            ended.append(self)

    monkeypatch.setattr(driver_module, "SavedTensorCounter", Recorded)
    return ended


# --------------------------------------------------------------------------------------------- measure, predict, check


def test_three_sizes_are_measured_then_a_fourth_is_predicted_and_its_first_step_checked(counters):
    said = Said()
    driver, module, ranks = said.driver(), blocks(), OneRank()
    driver.apply(module)
    for count, n in enumerate([8, 16, 32], start=1):
        batch = torch.randn(n, 16)
        driver.begin_batch(ranks, module, batch)
        assert driver.cycle.measuring == BatchSize(n) and driver.plan is None
        loss = module(batch).square().mean()
        driver.after_forward(ranks, module, loss)
        # The plan is made before the backward, from the costs just measured.
        assert driver.plan is not None and driver.plan.layers == PLAN_08 and driver.measured is None
        loss.backward()
        driver.end_batch(ranks, module)
        assert driver.measured_steps == count and driver.cycle.applied is driver.plan
        assert driver.checkpointed_layers == ["0", "1"]
    assert driver.cycle.sizes == {8: BatchSize(8), 16: BatchSize(16), 32: BatchSize(32)}
    template = driver.cycle.template
    # Of 32 samples: whole, a block holds 80 floats a sample; fully checkpointed its input (16); selective, its input
    # and both matmuls' outputs (16 + 64 + 16); the loss holds the last output, and its backward makes the loss's
    # gradient and four 32 x 16 tensors alive together.
    assert [(c.none_bytes, c.full_bytes, c.selective_bytes) for c in template.costs] == [(10240, 2048, 12288)] * 4
    assert not any(c.timed for c in template.costs)  # time_layers=False: measured, not timed
    assert (template.outside_bytes, template.head_bytes, template.head_peak_bytes) == (2048, 2048, 4 * 2048 + 4)
    assert counters == [] and said.info == said.warn == []

    step(driver, ranks, module, 64)  # bucket 64: no plan covers it, planned from the fit instead of measured
    assert driver.measured_steps == 3 and driver.cycle.sizes[64] == BatchSize(64)
    plan = driver.plan
    assert plan.layers == PLAN_08 and held_by_plan_08(64) < plan.planned_bytes
    assert said.report[-1] == ("GradientCheckpointing: batches up to 64 samples (predicted from the sizes measured), "
                               + plan_summary(plan, 0.8))
    # Its first step counted what its forward held (the parameters not counted): no more than planned.
    assert [(c.bytes, c.offloaded_bytes) for c in counters] == [(held_by_plan_08(64), 0)]
    assert driver.cycle.predicted == driver.cycle.checked == {64} and driver.cycle.applied is plan

    step(driver, ranks, module, 48)  # covered by the plan for 64, already checked
    assert len(counters) == 1 and driver.measured_steps == 3 and driver.plan is plan and len(said.report) == 4


def test_a_check_failed_on_another_rank_drops_the_predicted_plan_and_its_size_is_measured_next(counters):
    said = Said()
    ranks = TwoRanks(scale=1, other_flag=0)  # this rank's sizes and costs; the other rank's held-bytes check failed
    driver, module = said.driver(), blocks()
    driver.apply(module)
    for n in [8, 16, 32]:
        step(driver, ranks, module, n)
    batch = torch.randn(64, 16)
    driver.begin_batch(ranks, module, batch)
    planned = driver.cycle.applied.planned_bytes
    assert driver.cycle.checking and planned == 54314  # 2% over each cost of 64 samples, rounded up
    driver.after_forward(ranks, module, module(batch).square().mean())
    # This rank held no more than planned; the other one did, so both drop the plan.
    assert counters[0].bytes == held_by_plan_08(64) < planned
    assert said.info == ["GradientCheckpointing: a batch of 64 samples held more than its predicted plan (52.0 KiB >"
                         " 53.0 KiB planned); its size is measured on its next batch."]
    assert driver.cycle.remeasure == {64} and 64 not in driver.cycle.plans and driver.cycle.checked == set()
    driver.end_batch(ranks, module)
    step(driver, ranks, module, 64)
    assert driver.measured_steps == 4 and driver.cycle.remeasure == set() and driver.cycle.sizes[64] == BatchSize(64)
    assert len(counters) == 1 and not said.report[-1].endswith("(predicted from the sizes measured)")


@pytest.mark.parametrize("over, passed", [(0, True), (1, False)])
def test_the_check_compares_device_and_host_bytes_held_with_those_planned_inclusive(monkeypatch, over, passed):
    # Offloading is not on the CPU: the predicted plan gets host bytes, and the count is set on its way out.
    host = 1000
    said = Said()
    driver, module, ranks = said.driver(), blocks(), OneRank()

    class Counted(driver_module.SavedTensorCounter):
        def __exit__(self, *exc) -> None:
            super().__exit__(*exc)
            self.bytes, self.offloaded_bytes = driver.cycle.applied.planned_bytes + over, host

    solve = driver._solve

    def solve_with_host_bytes(ranks, measured, budget=None, chunked=None):
        plan = solve(ranks, measured, budget, chunked)
        return replace(plan, planned_host_bytes=host) if budget is None else plan  # None: the predicted plan

    monkeypatch.setattr(driver_module, "SavedTensorCounter", Counted)
    driver._solve = solve_with_host_bytes
    driver.apply(module)
    for n in [8, 16, 32, 64]:
        step(driver, ranks, module, n)
    assert driver.cycle.predicted == ({64} if passed else set()) and driver.cycle.checked == driver.cycle.predicted
    assert driver.cycle.remeasure == (set() if passed else {64}) and len(said.info) == (0 if passed else 1)


def test_a_size_whose_predicted_plan_misses_the_budget_is_measured_instead(counters):
    said = Said()
    driver, module, ranks = said.driver(), blocks(), OneRank()
    solve = driver._solve

    def predicted_out_of_reach(ranks, measured, budget=None, chunked=None):
        if budget is None:  # the prediction's solve
            raise ValueError("out of reach")
        return solve(ranks, measured, budget, chunked)

    driver._solve = predicted_out_of_reach
    driver.apply(module)
    for n in [8, 16, 32, 64]:
        step(driver, ranks, module, n)
    assert driver.measured_steps == 4 and driver.cycle.predicted == set() and counters == []
    assert driver.cycle.sizes[64] == BatchSize(64) and driver.plan.layers == PLAN_08
    assert said.report[-1] == "GradientCheckpointing: batches up to 64 samples, " + plan_summary(driver.plan, 0.8)


# --------------------------------------------------------------------------------------------- begin_batch's inputs


def test_the_longest_batch_is_planned_on_the_first_batch_only_and_sizes_come_from_length_fn():
    driver, module, ranks = Said().driver(), blocks(), OneRank()
    longest: list[tuple] = []
    driver.plan_longest = lambda *args: longest.append(args)

    def longest_step():
        raise AssertionError("not run: plan_longest is stood in for")

    def twenty(batch) -> int:
        return 20

    driver.apply(module)
    batch = torch.randn(32, 16)
    driver.begin_batch(ranks, module, batch, twenty, longest_step)
    assert longest == [(ranks, module, batch, longest_step, twenty)]
    assert driver.cycle.measuring == BatchSize(20) and driver.measured_steps == 1
    driver.after_forward(ranks, module, module(batch).square().mean())
    driver.end_batch(ranks, module)
    assert driver.cycle.sizes == {32: BatchSize(20)}
    driver.begin_batch(ranks, module, torch.randn(64, 16), twenty, longest_step)  # checked already: not again
    assert len(longest) == 1 and driver.measured_steps == 1 and driver.cycle.current == BatchSize(20)
    driver.end(module)

    without = Said().driver()
    without.plan_longest = lambda *args: longest.append(args)
    without.begin_batch(ranks, blocks(), batch)  # no longest_step: nothing to plan it with
    assert len(longest) == 1 and without.measured_steps == 1
    without.end()


def test_layers_are_timed_when_asked():
    driver, module, ranks = Said().driver(time_layers=True), blocks(), OneRank()
    driver.apply(module)
    step(driver, ranks, module, 8)
    assert all(c.plain_ns > 0 and c.full_ns > 0 and c.selective_ns > 0 for c in driver.cycle.template.costs)


# --------------------------------------------------------------------------------------------- a step with no loss


def test_a_step_with_no_loss_makes_its_plan_at_its_end():
    driver, module, ranks = Said().driver(), blocks(), OneRank()
    driver.apply(module)
    step(driver, ranks, module, 8, loss=False, stepped=False)  # no optimizer step either: a byte budget does not wait
    assert driver.plan is not None and driver.plan.layers == PLAN_08 and driver.cycle.applied is driver.plan
    # No loss: the head's backward is not measured.
    assert driver.cycle.template.head_peak_bytes == 0 and driver.cycle.template.outside_bytes == 8 * 16 * FLOAT
    assert driver.measured_steps == 1 and driver.measured is None


def test_a_predicted_step_with_no_loss_ends_its_check_at_its_end(counters):
    driver, module, ranks = Said().driver(), blocks(), OneRank()
    driver.apply(module)
    for n in [8, 16, 32]:
        step(driver, ranks, module, n)
    step(driver, ranks, module, 64, loss=False)
    assert [c.bytes for c in counters] == [held_by_plan_08(64)] and driver.cycle.checked == {64}
    assert driver.measured_steps == 3


# --------------------------------------------------------------------------------------------- "auto"


def test_auto_waits_for_the_first_optimizer_step_then_keeps_its_budget_for_every_size(monkeypatch, counters):
    resets = []
    monkeypatch.setattr(driver_module, "device_total_bytes", lambda device: 1 << 30)
    monkeypatch.setattr(driver_module, "device_peak_bytes", lambda device: None)
    monkeypatch.setattr(driver_module, "reset_device_peaks", resets.append)
    said = Said()
    driver, module, ranks = said.driver(memory_budget="auto"), blocks(), OneRank()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    driver.apply(module)
    step(driver, ranks, module, 8, stepped=False, optimizers=[opt], opt=opt)
    assert resets == [torch.device("cpu")] and driver.plan is None and driver.measured is not None
    step(driver, ranks, module, 8, optimizers=[opt], opt=opt)  # not measured again; stepped by default: planned
    assert driver.measured_steps == 1 and driver.measured is None
    # 8512 float32 parameters: weights, gradients and SGD's momentum; no peak figures on the CPU.
    assert driver.auto == AutoBudget(1 << 30, 3 * 8512 * FLOAT, 0)
    assert driver.plan.checkpoints_nothing and driver.cycle.applied is driver.plan
    assert said.report == ["GradientCheckpointing: batches up to 8 samples, "
                           + plan_summary(driver.plan, "auto", driver.auto)]
    for n in [16, 32, 64]:
        step(driver, ranks, module, n, optimizers=[opt], opt=opt)
    assert driver.measured_steps == 3 and resets == [torch.device("cpu")]
    assert driver.cycle.predicted == driver.cycle.checked == {64} and [c.bytes for c in counters] == [
        (4 * (16 + 64) + 16) * 64 * FLOAT]
    assert said.report[-1] == ("GradientCheckpointing: batches up to 64 samples (predicted from the sizes measured), "
                               + plan_summary(driver.plan, "auto", driver.auto))
    assert said.report[-1].endswith(f" ({driver.auto})")


# --------------------------------------------------------------------------------------------- what the step held


def test_other_saved_tensor_hooks_inside_the_driver_s_hide_the_outside_bytes_and_it_warns():
    said = Said()
    driver, module, ranks = said.driver(), blocks(), OneRank()
    driver.apply(module)
    batch = torch.randn(32, 16)
    driver.begin_batch(ranks, module, batch)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = module(batch).square().mean()
    driver.after_forward(ranks, module, loss)
    assert said.warn == [
        "GradientCheckpointing: the bytes held outside the checkpointed layers could not be measured (other"
        " saved-tensor hooks were entered after this callback's); the plan counts them as 0. Put GradientCheckpointing"
        " after such callbacks in `callbacks`."]
    assert driver.plan.layers == PLAN_08 and driver.cycle.template.outside_bytes == 0
    loss.backward()
    driver.end_batch(ranks, module)


def test_a_step_that_saves_nothing_outside_the_layers_does_not_warn():
    said = Said()
    driver, module, ranks = said.driver(), blocks(), OneRank()
    driver.apply(module)
    batch = torch.randn(32, 16)
    driver.begin_batch(ranks, module, batch)
    loss = module(batch).sum()  # saves nothing: the layers' inputs are all the step holds
    driver.after_forward(ranks, module, loss)
    assert said.warn == [] and driver.cycle.template.outside_bytes == 0
    assert driver.cycle.template.layer_bytes == 4 * 32 * 16 * FLOAT
    loss.backward()
    driver.end_batch(ranks, module)


def test_compressed_inputs_are_taken_off_as_compressed():
    said = Said()
    driver, module, ranks = said.driver(compress="bf16"), blocks(), OneRank()
    driver.apply(module)
    step(driver, ranks, module, 32)
    template = driver.cycle.template
    # The layers' inputs were held as bfloat16 (half): what is left over is the loss's input, as without compress.
    assert said.warn == [] and template.compress == "bf16"
    assert (template.outside_bytes, template.layer_bytes) == (32 * 16 * FLOAT, 4 * 32 * 16 * 2)


# --------------------------------------------------------------------------------------------- the LM head's chunks


def transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(64, 16, 2, 16, 2, 0.0)


@pytest.fixture
def rechunked(monkeypatch) -> list:
    """Every ``_rechunked(run, chunk)`` call, with what it returned."""
    calls = []
    original = driver_module._rechunked

    def recorded(run, chunk):
        calls.append((run, chunk, original(run, chunk)))
        return calls[-1][2]

    monkeypatch.setattr(driver_module, "_rechunked", recorded)
    return calls


def test_a_measuring_step_with_the_head_in_chunks_prices_the_whole_head_from_it(rechunked):
    said = Said()
    driver, module, ranks = said.driver(memory_budget=0.5), transformer(), OneRank()
    driver.apply(module)
    idx = torch.randint(0, 64, (4, 16))
    driver.begin_batch(ranks, module, (idx, idx))
    assert chunk_loss_of(module) == MEASURED_CHUNK and driver._head_count is not None
    loss = module(idx, idx)
    driver.after_forward(ranks, module, loss)
    run, chunk, whole = rechunked[0]
    # The step ran its 64 tokens in one chunk of MEASURED_CHUNK; the plan starts from the head whole.
    assert chunk is None and run.chunk == MEASURED_CHUNK and (run.count.calls, run.count.tokens) == (1, 64)
    assert isinstance(run.measured, RankMeasurement) and run.measured.compress is None
    assert whole.outside_bytes > run.measured.outside_bytes and whole.head_bytes > run.measured.head_bytes
    template = driver.cycle.template
    assert (template.outside_bytes, template.head_bytes, template.head_peak_bytes) == (
        whole.outside_bytes, whole.head_bytes, whole.head_peak_bytes)
    assert driver._head_count is None and driver.plan is not None
    loss.backward()
    driver.end_batch(ranks, module)


def test_hidden_outside_bytes_leave_the_head_unchunked_and_unpriced(rechunked):
    said = Said()
    driver, module, ranks = said.driver(memory_budget=0.6), transformer(), OneRank()
    driver.apply(module)
    idx = torch.randint(0, 64, (4, 16))
    driver.begin_batch(ranks, module, (idx, idx))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = module(idx, idx)
    driver.after_forward(ranks, module, loss)
    assert len(said.warn) == 1 and rechunked == [] and driver.cycle.template.outside_bytes == 0
    assert driver.plan is not None and driver.plan.chunk_tokens is None
    loss.backward()
    driver.end_batch(ranks, module)


def test_chunk_loss_true_keeps_the_model_s_chunks_while_measuring(rechunked):
    driver, module, ranks = Said().driver(memory_budget=0.5, chunk_loss=True), transformer(), OneRank()
    driver.apply(module)
    idx = torch.randint(0, 64, (4, 16))
    driver.begin_batch(ranks, module, (idx, idx))
    assert chunk_loss_of(module) == 1024 and driver._head_count is None
    loss = module(idx, idx)
    driver.after_forward(ranks, module, loss)
    assert rechunked == [] and driver.plan is not None
    loss.backward()
    driver.end_batch(ranks, module)
