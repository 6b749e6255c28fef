"""A memory budget that holds on every batch: the per-size cycle (plain, no Trainer) and the callback on batches
whose lengths vary from step to step (a short first batch, then long and short ones).

Bytes are counted with saved-tensor hooks inside ``training_step`` on the steps that are not measuring steps (a
nested counter would hide the measuring step's own). Dropout is off, so weights must be bit-equal to a run
without the callback.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses import FakeTensor
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_ckpt import GradientCheckpointing, MemoryMonitor
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, checkpointed_names, remove_checkpointing
from lightning_ckpt.core.measure.memory_stats import format_summary
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.core.plan.budget_cycle import BatchSize, BucketState, BudgetCycle, batch_size_of
from lightning_ckpt.core.plan.planner import LayerCost, make_plan
from lightning_ckpt.demos import GPT, counting_sequences

from helpers import StepPeaks, assert_moved_alike, counted_peak

N_LAYER = 4
BLOCKS = [f"model.blocks.{i}" for i in range(N_LAYER)]
LENGTHS = [8, 64, 16, 64, 32, 8, 64, 48]  # the first batch short; 4 x 48 = 192 tokens share 64's bucket (256)
BATCH = 4


def a_plan(bytes_per_layer: int = 10, mode: str = "full"):
    """A one-layer plan that checkpoints it (``mode``): one that checkpoints nothing would hold for smaller batches
    of every bucket."""
    plan = make_plan([LayerCost("l0", "Block", none_bytes=100, full_bytes=bytes_per_layer, selective_bytes=40,
                                offloadable_bytes=0, full_flops=50, selective_flops=5)], outside_bytes=0,
                     memory_budget=1.0)
    return replace(plan, layers={"l0": mode})


# ------------------------------------------------------------------------------------------- sizes and buckets


def test_a_batch_size_rounds_its_tokens_up_to_a_power_of_two_and_covers_smaller_and_shorter_batches():
    assert [BatchSize(n).bucket for n in (1, 2, 3, 64, 65, 1000)] == [1, 2, 4, 64, 128, 1024]
    big = BatchSize(tokens=512, length=128)
    assert big.covers(BatchSize(512, 128)) and big.covers(BatchSize(256, 64))
    assert not big.covers(BatchSize(513, 128))  # more tokens
    assert not big.covers(BatchSize(256, 256))  # fewer tokens, but longer: attention's T^2 terms grow
    assert str(big) == "512 tokens (length 128)" and str(BatchSize(8)) == "8 samples"


def test_batch_size_of_counts_token_ids_a_length_fn_or_samples():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_size_of((ids, ids)) == BatchSize(21, 7)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert batch_size_of({"input_ids": mask, "mask": mask}, length_fn=lambda b: int(b["mask"].sum())) == BatchSize(3, 3)
    assert batch_size_of([torch.zeros(5, 3, 8, 8)]) == BatchSize(5, 1)  # images: samples
    assert batch_size_of({"x": "no tensor"}) == BatchSize(1, 1)
    assert batch_size_of((torch.zeros(8),)) == BatchSize(8, 1)  # a 1-D tensor: 8 samples
    assert batch_size_of(torch.tensor(3.0)) == BatchSize(1, 1)  # a 0-D one: a sample
    assert batch_size_of({"x": torch.zeros(5, 3)}, length_fn=lambda b: 7) == BatchSize(7, 1)  # no token ids: length 1
    assert str(BatchSize(8, 2)) == "8 tokens (length 2)"


# ------------------------------------------------------------------------------------------- the cycle


def test_the_cycle_measures_each_new_size_and_reuses_a_plan_only_where_its_size_covers_the_batch():
    cycle = BudgetCycle()
    first = cycle.begin(BatchSize(100, 25))  # bucket 128
    assert first.measure and not first.switch  # the module starts fully checkpointed
    assert cycle.state(128) is BucketState.MEASURING
    short = a_plan(10)
    cycle.planned(short)
    assert cycle.state(128) is BucketState.PLANNED and cycle.plan_for(BatchSize(100, 25)) is short

    long_step = cycle.begin(BatchSize(400, 100))  # bucket 512, never measured
    assert long_step.measure and long_step.plan is None and not long_step.switch
    long = a_plan(40, "selective")
    cycle.planned(long)
    assert cycle.plans == {128: short, 512: long}

    # a short batch runs its own (cheaper) plan; a switch each time the plan changes, none when it stays
    steps = [cycle.begin(size) for size in (BatchSize(90, 30), BatchSize(96, 24), BatchSize(300, 75))]
    assert [(s.plan, s.switch) for s in steps] == [(None, False), (short, True), (long, True)]
    # (90, 30) is in bucket 128 but longer than the 25 measured there: measured, and its plan replaces the bucket's
    assert steps[0].measure is True
    assert cycle.latest is long and cycle.state(512) is BucketState.APPLIED and cycle.state(128) is BucketState.PLANNED

    with pytest.raises(RuntimeError, match="needs a measuring or predicted step"):
        cycle.planned(a_plan())


def test_a_plan_that_checkpoints_nothing_holds_for_every_smaller_batch_in_any_bucket():
    cycle = BudgetCycle()
    cycle.begin(BatchSize(1200, 300))  # bucket 2048
    nothing = replace(a_plan(), layers={"l0": "none"})
    cycle.planned(nothing)
    assert nothing.checkpoints_nothing and cycle.begin(BatchSize(1200, 300)).switch  # from the measuring layout
    # bucket 1024 and bucket 32, never measured: no plan is cheaper than checkpointing nothing, so no measuring step
    for size in (BatchSize(1000, 250), BatchSize(32, 8)):
        step = cycle.begin(size)
        assert step.plan is nothing and not step.measure and not step.switch
    assert cycle.measured_steps == 1
    assert cycle.begin(BatchSize(1000, 400)).measure  # fewer tokens, but longer: not covered
    # a plan that checkpoints something covers its own bucket only: a smaller batch may afford a cheaper one
    cycle = BudgetCycle()
    cycle.begin(BatchSize(1200, 300))
    cycle.planned(a_plan())
    assert cycle.begin(BatchSize(1000, 250)).measure
    for changed in ({"offloaded": ["l0"]}, {"chunk_tokens": 1024}):  # the module is changed, so not "nothing"
        assert not replace(nothing, **changed).checkpoints_nothing


def test_switching_to_a_plan_that_checkpoints_the_module_alike_changes_nothing():
    cycle = BudgetCycle()
    for tokens, plan in ((64, a_plan(10)), (256, a_plan(40)), (1024, a_plan(40, "selective"))):
        cycle.begin(BatchSize(tokens, tokens // 4))
        cycle.planned(plan)
    switches = [cycle.begin(BatchSize(t, t // 4)).switch for t in (64, 256, 1024, 64, 1024)]
    # 64 -> 256: both "full" (other sizes, other figures), no switch; 256 -> 1024: full -> selective; and back
    assert switches == [True, False, True, True, True]
    assert cycle.applied is cycle.plans[1024]  # the applied plan is the batch's own, for its check
    a, b = a_plan(10), a_plan(40)
    assert a.applies_like(b) and not a.applies_like(replace(b, compress="fp8"))
    assert not a.applies_like(replace(b, offloaded=["l0"])) and not a.applies_like(replace(b, chunk_tokens=512))
    assert replace(a, layers={"l0": "none"}).applies_like(replace(b, layers={"l0": "none"}, compress="fp8"))
    # op-level: the ops kept, by position among the layer's ops
    ops = (OpRecord("aten.mm.default", 8, 10, 8), OpRecord("aten.relu.default", 8, 1, 8))
    keep = [replace(a, layers={"l0": "ops"}, kept_ops={"l0": kept}, costs=[replace(a.costs[0], ops=ops)])
            for kept in ([0], [0], [1])]
    assert keep[0].applies_like(keep[1]) and not keep[0].applies_like(keep[2])


def test_two_op_level_plans_keeping_the_same_positions_of_other_ops_do_not_apply_alike():
    a = a_plan()
    mm, relu = OpRecord("aten.mm.default", 8, 10, 8), OpRecord("aten.relu.default", 8, 1, 8)
    # both keep position 0, which is the matmul in one layer's op list and the relu in the other's: the policies
    # keep different ops, so switching between them must re-wrap the layer
    first, second = (replace(a, layers={"l0": "ops"}, kept_ops={"l0": [0]}, costs=[replace(a.costs[0], ops=ops)])
                     for ops in ((mm, relu), (relu, mm)))
    assert first._op_names("l0")[0] == "aten.mm.default" and second._op_names("l0")[0] == "aten.relu.default"
    assert not first.applies_like(second) and not second.applies_like(first)
    assert first.applies_like(replace(first, planned_bytes=first.planned_bytes + 1))  # figures alone: alike


def test_the_cycle_round_trips_through_its_state_dict():
    cycle = BudgetCycle()
    for size, plan in ((BatchSize(64, 16), a_plan(10)), (BatchSize(256, 64), a_plan(40, "selective"))):
        cycle.begin(size)
        cycle.planned(plan)
    restored = BudgetCycle()
    restored.load_state_dict(cycle.state_dict())
    assert restored.sizes == cycle.sizes
    assert {b: p.state_dict() for b, p in restored.plans.items()} == {b: p.state_dict() for b, p in cycle.plans.items()}
    assert restored.latest is restored.plans[256] and restored.applied is restored.latest
    step = restored.begin(BatchSize(60, 15))
    assert not step.measure and step.plan is restored.plans[64] and step.switch


def test_a_resumed_cycle_measures_a_bucket_whose_check_failed_before_the_save():
    from test_cost_fit import measurement, run_cycle  # the cycle on costs by hand

    cycle, kinds = run_cycle([8, 16, 32, 100])  # three sizes measured, 4 x 100 tokens (bucket 512) predicted
    assert kinds == ["measured"] * 3 + ["predicted"]
    cycle.check_failed(BatchSize(400, 100))  # its step held more than predicted: the bucket's next batch is measured
    restored = BudgetCycle()
    restored.load_state_dict(cycle.state_dict())
    # the fit alone would predict 4 x 99 tokens (inside the measured range 16x over), and does so in bucket 1024
    assert restored.fit.trusted(396, 99) and restored.begin(BatchSize(800, 200)).predicted is not None
    restored.abandon()
    step = restored.begin(BatchSize(396, 99))
    assert step.predicted is None and step.measure and restored.measuring == BatchSize(396, 99)
    assert restored.remeasure == {512}
    restored.planned(make_plan(measurement(396, 99).costs, 0, 0.8), measurement(396, 99))
    assert 512 not in restored.remeasure and restored.begin(BatchSize(404, 101)).predicted is not None


def test_a_fresh_or_abandoned_cycle_has_no_step_to_plan_and_says_so():
    cycle = BudgetCycle()
    assert cycle.state(64) is None and cycle.current is None and cycle.latest is None and not cycle.checking
    message = "BudgetCycle.planned() needs a measuring or predicted step: call begin() first."
    with pytest.raises(RuntimeError) as info:
        cycle.planned(a_plan())
    assert str(info.value) == message
    cycle.begin(BatchSize(64, 16))
    assert cycle.state(64) is BucketState.MEASURING
    cycle.abandon()  # the step ended without a plan
    assert cycle.state(64) is None
    with pytest.raises(RuntimeError) as info:
        cycle.planned(a_plan())
    assert str(info.value) == message


def test_each_step_carries_its_size_and_a_predicted_step_changes_nothing_yet():
    from test_cost_fit import run_cycle

    cycle, _ = run_cycle([8, 16, 32])
    size = BatchSize(400, 100)
    predicted = cycle.begin(size)
    assert predicted.predicted is not None and predicted.plan is None
    assert predicted.size == size and predicted.switch is False
    covered = cycle.begin(BatchSize(120, 30))  # covered by the 128 tokens of length 32 measured
    assert covered.size == BatchSize(120, 30) and covered.plan is cycle.plans[128]


def test_a_bucket_measured_after_its_plan_was_predicted_is_not_checked_and_a_failed_one_leaves_no_predicted_plan():
    from test_cost_fit import measurement, run_cycle

    cycle, kinds = run_cycle([8, 16, 32, 100])
    assert kinds[-1] == "predicted" and cycle.predicted == {512}
    size = BatchSize(480, 120)  # bucket 512, not covered by its 400 tokens: measured (as after predict=False)
    assert cycle.begin(size, predict=False).measure
    cycle.planned(make_plan(measurement(480, 120).costs, 0, 0.8), measurement(480, 120))
    assert cycle.predicted == set()
    step = cycle.begin(size)
    assert step.plan is cycle.plans[512] and not cycle.checking  # a measured plan holds what it measured
    # a predicted plan whose check failed is dropped with its predicted mark: every predicted bucket has its plan
    step = cycle.begin(BatchSize(1600, 400))  # bucket 2048, predicted (inside 16x the measured)
    cycle.planned(make_plan(step.predicted.costs, 0, 0.8))
    assert cycle.predicted == {2048}
    cycle.check_failed(BatchSize(1600, 400))
    assert cycle.predicted == set() and 2048 not in cycle.plans and cycle.remeasure == {2048}


def test_a_resumed_cycle_checks_what_was_not_checked_and_restores_its_latest_plan():
    from test_cost_fit import run_cycle

    cycle, _ = run_cycle([8, 16, 32, 100])  # bucket 512 predicted, not yet checked
    restored = BudgetCycle()
    restored.load_state_dict(cycle.state_dict())
    assert restored.predicted == {512} and restored.checked == set()
    assert restored.begin(BatchSize(400, 100)).plan is restored.plans[512] and restored.checking  # checked now
    cycle.check_passed(BatchSize(400, 100))
    restored.load_state_dict(cycle.state_dict())
    assert restored.checked == {512} and restored.begin(BatchSize(400, 100)).plan is not None
    assert not restored.checking
    # the latest plan round-trips when it is a dropped one (its check failed) and when there is none (measuring)
    cycle.check_failed(BatchSize(400, 100))
    restored.load_state_dict(cycle.state_dict())
    assert restored.latest is not None and restored.latest.state_dict() == cycle.latest.state_dict()
    cycle.begin(BatchSize(4000, 1000), predict=False)
    assert cycle.latest is None and cycle.state_dict()["latest"] is None
    restored.load_state_dict(cycle.state_dict())
    assert restored.latest is None and restored.applied is None


def test_a_cycle_saved_before_the_fit_was_loads_its_plans_and_measures_new_sizes():
    from test_cost_fit import run_cycle

    cycle, _ = run_cycle([8, 16, 32])
    old = {key: cycle.state_dict()[key] for key in ("plans", "latest")}  # what checkpoints held before d26615d
    restored = BudgetCycle()
    restored.load_state_dict(old)
    assert restored.sizes == cycle.sizes and restored.fit.sizes == [] and restored.template is None
    assert restored.predicted == restored.checked == restored.remeasure == set()
    assert restored.begin(BatchSize(120, 30)).plan is restored.plans[128]
    assert restored.begin(BatchSize(400, 100)).measure  # nothing to predict from: measured


def test_a_predicted_size_s_bytes_to_move_are_predicted_like_its_bytes_held():
    from test_cost_fit import run_cycle

    cycle, _ = run_cycle([8, 16, 32])
    predicted = cycle.begin(BatchSize(400, 100)).predicted
    # by hand: each block saves 600 T + 16 T L = 880,000 B at 4 x 100 tokens, all of it movable (no sizes recorded,
    # so one storage), raised by the 2% margin: 897,600 B, under any offload threshold (not dropped at 1 MiB)
    assert [c.movable_bytes("none", min_bytes=0) for c in predicted.costs] == [897_600, 897_600]
    assert [c.none_bytes for c in predicted.costs] == [897_600, 897_600]


# ------------------------------------------------------------------------------------------- the callback


class VaryingGPT(GPT):
    """The demo GPT recording, per batch, the checkpointed layers and (outside measuring steps) the bytes held."""

    def __init__(self, callback: GradientCheckpointing | None = None) -> None:
        super().__init__(vocab_size=32, block_size=max(LENGTHS), n_layer=N_LAYER, n_embd=32, n_head=2, dropout=0.0)
        # No longest length known ahead: these tests follow the per-batch cycle from the first batch (the longest
        # batch planned before the first step is tests/core/measure/test_longest.py's)
        del self.hparams["block_size"]
        self.callback = callback
        self.seen: list[list[str]] = []
        self.held: list[int | None] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(checkpointed_names(self))
        if self.callback is not None and self.callback.driver.cycle.measuring is not None:
            self.held.append(None)  # a measuring step: fully checkpointed, its own counters active
            return super().training_step(batch, batch_idx)
        with SavedTensorCounter(exclude=self.parameters()) as saved:
            loss = super().training_step(batch, batch_idx)
        self.held.append(saved.bytes)
        return loss


def varying_batches(lengths=LENGTHS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for i, length in enumerate(lengths):
        seqs = counting_sequences(BATCH, length + 1, 32, seed=i)
        batches.append((seqs[:, :-1], seqs[:, 1:]))
    return batches


def fit(callbacks=(), lengths=LENGTHS, model=None, **trainer_kwargs) -> VaryingGPT:
    seed_everything(0)
    model = model or VaryingGPT(next((c for c in callbacks if isinstance(c, GradientCheckpointing)), None))
    trainer_kwargs = {"logger": False, **trainer_kwargs}
    trainer = Trainer(max_steps=len(lengths), accelerator="cpu", devices=1, callbacks=list(callbacks),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      **trainer_kwargs)
    trainer.fit(model, DataLoader(varying_batches(lengths), batch_size=None))
    return model


def step_peak(length: int, full: bool, compress=None) -> int:
    """The activation peak of a forward and backward of a fresh model on a batch of ``length`` (plain, or every block
    fully checkpointed, its inputs held under ``compress``), counted by ``benchmarks/_peak.py``."""
    seed_everything(0)
    model = VaryingGPT()
    if full:
        apply_checkpointing(model, compress=compress)
    x, y = varying_batches([length])[0]
    return counted_peak(model, lambda: torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))


@pytest.fixture(scope="module")
def reference() -> VaryingGPT:
    return fit()


def test_a_byte_budget_holds_on_every_batch_and_short_batches_run_a_cheaper_plan(reference):
    long_none, long_full = step_peak(64, full=False), step_peak(64, full=True)
    budget = (long_none + long_full) // 2  # between full checkpointing and none at the longest length
    assert step_peak(8, full=False) < budget < long_none  # the short batch fits without any checkpointing
    callback, counted = GradientCheckpointing(memory_budget=budget), StepPeaks()
    model = fit([callback, counted])

    for length, held, peak in zip(LENGTHS, model.held, counted.peaks):
        if held is not None:  # a step that ran a plan: its whole activation peak within the budget
            assert held <= peak <= budget * 1.02, (length, held, peak, budget)
    assert model.seen[5] == []  # the shortest batch, planned for its own size, checkpoints nothing
    # measured: the first three sizes (32, 256 and 64 tokens); length 32 (128 tokens) is planned from their fit, with
    # no measuring step; the rest run a plan made for a size that covers them (length 48 runs the plan measured at
    # 64, in the same bucket of 256 tokens)
    measuring = [held is None for held in model.held]
    assert measuring == [True, True, True, False, False, False, False, False]
    assert callback.driver.cycle.predicted == {128} and callback.driver.cycle.measured_steps == 3
    assert sorted(callback.plans) == [32, 64, 128, 256]
    # the longest batches need checkpointing; the shortest run none at all: a short batch does not pay for a long one
    assert 0 < len(model.seen[3]) and model.seen[3] == model.seen[6]
    assert callback.plans[32].recompute_flops == 0 < callback.plans[256].recompute_flops
    assert model.held[5] == reference.held[5]  # nothing checkpointed: as much as the plain model
    assert callback.plan is callback.plans[256]  # the latest batch's (length 48, bucket 256)
    a, b = model.state_dict(), reference.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_budget_only_compression_reaches_holds_on_every_batch_measuring_steps_included(reference):
    exact_floor, fp8_floor = step_peak(64, full=True), step_peak(64, full=True, compress="fp8")
    budget = (exact_floor + fp8_floor) // 2  # below every block fully checkpointed with exact inputs
    with pytest.raises(ValueError, match=r"(?s)least reachable.*\n  - or compress="):
        fit([GradientCheckpointing(memory_budget=budget)])
    callback, counted = GradientCheckpointing(memory_budget=budget, compress="fp8"), StepPeaks()
    model = fit([callback, counted])

    assert len(counted.peaks) == len(LENGTHS)
    # every step, the measuring ones too (they run fully checkpointed, compressed as the plans are)
    for length, held, peak in zip(LENGTHS, model.held, counted.peaks):
        assert peak <= budget * 1.02, (length, held is None, peak, budget)
    assert max(counted.peaks) > fp8_floor  # the budget is used, not undercut by checkpointing more than needed
    assert {plan.compress for plan in callback.plans.values()} == {"fp8"}
    # the backward saw fp8 copies: the weights moved close to the exact run's, not equal
    seed_everything(0)
    start = VaryingGPT().state_dict()  # the weights both runs started from
    assert_moved_alike(model.state_dict(), reference.state_dict(), start)


def test_a_plan_made_on_a_short_first_batch_would_break_the_budget_on_a_long_one():
    """What the cycle prevents, measured: the first batch's plan (nothing checkpointed) on the longest batch."""
    long_none, long_full = step_peak(64, full=False), step_peak(64, full=True)
    budget = (long_none + long_full) // 2
    callback = GradientCheckpointing(memory_budget=budget)
    fit([callback], lengths=[8])
    assert callback.plan.layers == dict.fromkeys(BLOCKS, "none")
    assert long_none > budget  # that plan on a long batch would hold all of this


def test_a_resumed_cycle_runs_every_size_it_has_a_plan_for_without_measuring():
    callback = GradientCheckpointing(memory_budget=(step_peak(64, False) + step_peak(64, True)) // 2)
    fit([callback], lengths=LENGTHS[:4])
    state = callback.state_dict()
    resumed = GradientCheckpointing(memory_budget=callback.memory_budget)
    resumed.load_state_dict(state)
    assert {b: p.state_dict() for b, p in resumed.plans.items()} == {
        b: p.state_dict() for b, p in callback.plans.items()}
    model = fit([resumed], lengths=[64, 8, 16, 24])
    assert None not in model.held and resumed.driver.cycle.measured_steps == 0  # none measured
    assert model.seen[1] == []
    # 24 (96 tokens, bucket 128) was never planned: predicted from the fit saved with the plans, and checked
    assert resumed.driver.cycle.fit.sizes == callback.driver.cycle.fit.sizes == [(32, 8), (256, 64), (64, 16)]
    assert resumed.driver.cycle.predicted == resumed.driver.cycle.checked == {128}


def test_an_out_of_reach_budget_at_a_new_size_names_the_batch_and_changes_nothing():
    # fits the short batch fully checkpointed (with a margin for the prediction), not the long one
    callback = GradientCheckpointing(memory_budget=int(1.05 * step_peak(8, full=True)))
    seed_everything(0)
    model = VaryingGPT(callback)  # the weights fit() would make
    with pytest.raises(ValueError, match=r"(?s)least reachable.*\n  This was for a batch of 256 tokens \(length 64\)"):
        fit([callback], lengths=[8, 8, 64], model=model)
    assert checkpointed_names(model) == []  # undone
    # refused before the third batch's backward: the weights are those of two plain steps
    plain = fit(lengths=[8, 8])
    a, b = model.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_monitor_s_summary_compares_peak_activations_with_the_budget(tmp_path):
    budget = (step_peak(64, full=False) + step_peak(64, full=True)) // 2
    monitor, callback = MemoryMonitor(), GradientCheckpointing(memory_budget=budget)
    # the monitor first: the callback's measuring hooks then sit inside the monitor's counter, not under it
    fit([monitor, callback], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    summary = monitor.summary
    assert summary["chooser"] == "memory_budget" and summary["budget_bytes"] == budget
    # the budget bounds the step's activation peak: that is what the summary compares with it (the held bytes are less)
    assert 0 < summary["activation_bytes"] < summary["activation_peak_bytes"] <= budget
    text = format_summary(summary)
    assert f"{summary['activation_peak_bytes'] / budget:.2f}x the memory_budget of" in text
    assert "every_n_layers" not in text


# ------------------------------------------------------------------------------------------- a model nobody here wrote


class PaddedLlama(LightningModule):
    """Transformers' Llama from a config, trained on dict batches padded per batch (as its collators do), recording
    the bytes held for backward on the steps the callback does not measure."""

    def __init__(self, callback: GradientCheckpointing | None = None) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        self.model = transformers.LlamaForCausalLM(config)
        self.callback = callback
        self.held: list[int | None] = []

    def training_step(self, batch, batch_idx):
        if isinstance(batch["input_ids"], FakeTensor):  # planning the longest batch before the first step
            return self.model(**batch).loss
        if self.callback is not None and self.callback.driver.cycle.measuring is not None:
            self.held.append(None)
            return self.model(**batch).loss
        with SavedTensorCounter(exclude=self.parameters()) as saved:
            loss = self.model(**batch).loss
        self.held.append(saved.bytes)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def padded_batches(lengths) -> list[dict[str, torch.Tensor]]:
    out = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length // 2:] = 0  # the second sequence padded to the batch's longest
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def llama_held(length: int, full: bool) -> int:
    model = PaddedLlama()
    if full:
        apply_checkpointing(model)
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model.model(**padded_batches([length])[0]).loss
    return saved.bytes


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_transformers_llama_on_batches_padded_per_batch_holds_a_byte_budget_on_every_step():
    lengths = [16, 128, 32, 128, 16, 64, 128]
    budget = (llama_held(128, full=False) + llama_held(128, full=True)) // 2
    assert llama_held(16, full=False) < budget < llama_held(128, full=False)
    callback = GradientCheckpointing(memory_budget=budget)
    model = PaddedLlama(callback)
    trainer = Trainer(max_steps=len(lengths), accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(padded_batches(lengths), batch_size=None))
    # 16, 128, 32 measured; 64 (bucket 128) planned from their fit, its check passed (still a predicted plan)
    assert [h is None for h in model.held] == [True, True, True, False, False, False, False]
    assert callback.driver.cycle.predicted == {128} and callback.driver.cycle.measured_steps == 3
    assert all(h <= budget for h in model.held if h is not None), (model.held, budget)
    short, long = callback.plans[32], callback.plans[256]  # 2 x 16 and 2 x 128 tokens
    assert short.recompute_flops == 0 < long.recompute_flops  # the short batches recompute nothing


# ------------------------------------------------------------------------------------------- quiet logs


class PlansSeen(Callback):
    """The plan each training batch runs under (after the checkpointing callback's own batch start), and every plan
    the callback has kept after each batch (a plan solved at a measuring step may be replaced before a batch runs it)."""

    def __init__(self, callback: GradientCheckpointing) -> None:
        # `made` keeps the plans, not only their ids: a plan replaced and freed could leave its id to a new one.
        self.callback, self.plans, self.made = callback, [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.plans.append(self.callback.plan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.made.update({id(plan): plan for plan in self.callback.plans.values()})


def test_a_long_run_of_varying_lengths_logs_one_line_per_new_plan_and_none_per_switch(caplog):
    """60 steps whose lengths are drawn long-tailed (8..64, the first ones short): one log line for each new plan
    (its summary), and nothing when a batch switches to a plan made before or to a measuring step."""
    import logging
    import random

    rng = random.Random(0)
    lengths = [8, 12] + [min(64, max(8, int(rng.lognormvariate(3.0, 0.6)))) for _ in range(58)]
    budget = (step_peak(64, full=False) + step_peak(64, full=True)) // 2
    callback = GradientCheckpointing(memory_budget=budget)
    seen = PlansSeen(callback)
    with caplog.at_level(logging.INFO):
        fit([callback, seen], lengths=lengths)
    ours = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO
            and r.getMessage().startswith(("GradientCheckpointing", "lightning_ckpt"))]
    switches = sum(a is not b for a, b in zip(seen.plans, seen.plans[1:]))
    assert 1 < len(seen.made) < switches  # plans are re-used: batches switch back and forth between them
    plan_lines = [m for m in ours if m.startswith("GradientCheckpointing: batches up to")]
    assert len(plan_lines) == len(seen.made)
    assert len(ours) - len(plan_lines) <= 1, ours  # at most "detected the repeated layer class", once


def test_a_re_planned_bucket_keeps_the_size_of_its_new_measurement_not_the_larger_of_both():
    # (100, 25) and (90, 30) share bucket 128; neither covers the other. The re-plan was measured at (90, 30) only,
    # so a batch of 100 tokens at length 30 is covered by neither measurement and must be measured again.
    cycle, p1, p2 = BudgetCycle(), a_plan(10), a_plan(20)
    assert cycle.begin(BatchSize(100, 25)).measure
    cycle.planned(p1)
    assert cycle.begin(BatchSize(90, 30)).measure  # longer than the plan's length
    cycle.planned(p2)
    assert cycle.sizes[128] == BatchSize(90, 30) and cycle.plans[128] is p2
    assert cycle.begin(BatchSize(100, 30)).measure is True


def test_an_fp8_plan_counts_the_same_bytes_outside_the_layers_as_an_exact_one():
    # The measuring step held the blocks' inputs as fp8 copies: taking exact-width inputs off its count would leave
    # too little outside them. Embeddings, head and loss hold the same whether the blocks compress or not.
    exact, fp8 = GradientCheckpointing(memory_budget=0.5), GradientCheckpointing(memory_budget=0.5, compress="fp8")
    fit([exact], lengths=[64, 8])
    fit([fp8], lengths=[64, 8])
    assert sorted(exact.plans) == sorted(fp8.plans) == [32, 256]
    assert [exact.plans[b].outside_bytes for b in (256, 32)] == [104_996, 13_156]  # the figures
    # fp8 once counted 121,892 and 15,268 B in about one run in five: 16,896 and 2,112 B more, one block input's fp8
    # copy (16,384 + 512 B of scales at length 64). A later block's input had been put at the address of an earlier
    # one's freed exact input, so the two were taken for one input shared by two blocks and moved outside the layers.
    # Storages are now numbered, not keyed by address: equal in ten runs of ten.
    assert [fp8.plans[b].outside_bytes for b in (256, 32)] == [104_996, 13_156]


class JumpingGPT(VaryingGPT):
    """Past length 32 its step also saves a ``[batch, length, 256]`` float tensor (16 KiB per sequence position of a
    batch of 4) outside the layers: costs no fit over shorter batches can predict."""

    def __init__(self, callback: GradientCheckpointing | None = None, jump: bool = True) -> None:
        super().__init__(callback)
        self.jump = jump
        self.extra = torch.nn.Parameter(torch.ones(256))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x = batch[0]
        if self.jump and x.shape[1] > 32:
            loss = loss + (self.extra * torch.rand(x.shape[0], x.shape[1], 256)).sum() * 0
        return loss


def test_a_predicted_plan_is_checked_on_its_first_step_only(monkeypatch):
    """Lengths 8, 16, 24 measured; 40 predicted (bucket 256) and checked on its step; 36 and 40 again run the same
    plan, sizes it covers, unchecked; 48 (bucket 256) is predicted anew and checkpoints alike: unchecked. One check in
    the run, not four (each check hooks every saved tensor)."""
    import lightning_ckpt.core.plan.budget_driver as module

    made = []

    class Counting(module.SavedTensorCounter):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(module, "SavedTensorCounter", Counting)
    callback = GradientCheckpointing(memory_budget=10 * 2**20)
    fit([callback], lengths=[8, 16, 24, 40, 36, 40, 48], model=JumpingGPT(callback, False))
    assert callback.driver.cycle.predicted == callback.driver.cycle.checked == {256}
    assert callback.driver.cycle.sizes[256] == BatchSize(192, 48)  # 48: predicted anew, checkpointing alike: not checked
    assert len(made) == 1
    # resumed from its state: the check passed before the save is not run again
    resumed = GradientCheckpointing(memory_budget=10 * 2**20)
    resumed.load_state_dict(callback.state_dict())
    fit([resumed], lengths=[40, 36], model=JumpingGPT(resumed, False))
    assert len(made) == 1 and resumed.driver.cycle.measured_steps == 0


@pytest.mark.parametrize("jump", [False, True])
def test_a_predicted_plan_whose_step_holds_more_than_planned_measures_its_bucket_again(jump):
    lengths = [8, 16, 24, 40, 36, 40]  # 40 (160 tokens) predicted from 8, 16, 24; 36 (144) in the same bucket (256)
    budget = 10 * 2**20  # room for everything: the plans checkpoint nothing, so held bytes are the whole forward's
    callback = GradientCheckpointing(memory_budget=budget)
    model = fit([callback], lengths=lengths, model=JumpingGPT(callback, jump))
    measuring = [held is None for held in model.held]
    if not jump:  # the fit was right: 36 runs the plan predicted for 40
        assert measuring == [True, True, True, False, False, False] and callback.driver.cycle.measured_steps == 3
        assert callback.driver.cycle.predicted == {256} and callback.driver.cycle.remeasure == set()
    else:  # 40 held 160 KiB more than planned: the check drops its plan, 36 is measured, then 40 (no fit any more)
        assert measuring == [True, True, True, False, True, True] and callback.driver.cycle.measured_steps == 5
        assert callback.driver.cycle.predicted == set() and not callback.driver.cycle.fit.trusted(160, 40)
