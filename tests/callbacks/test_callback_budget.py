"""GradientCheckpointing(memory_budget=...): measured in the first step, planned, applied from the next batch.

Bytes are counted with saved-tensor hooks inside ``training_step`` (from the second batch on: the first is the
measuring step, whose own counter a nested one would hide). Dropout is off, so weights must be bit-equal to a
run without the callback.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from helpers import two_ranks
from lightning_ckpt import GradientCheckpointing
import lightning_ckpt.callbacks.gradient_checkpointing as callback_module
import lightning_ckpt.core.plan.budget_driver as driver_module
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.core.plan.budget import AUTO_MEMORY_FRACTION, Measurement, combine_costs, pack_costs
from lightning_ckpt.core.plan.planner import LayerCost
from lightning_ckpt.demos import GPT, Block, CountingDataModule

N_LAYER = 4
BLOCKS = [f"model.blocks.{i}" for i in range(N_LAYER)]


class RecordingGPT(GPT):
    """The demo GPT (its ``training_step`` logs) recording, per batch: training_step calls, checkpointed layers
    and the bytes held for backward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(vocab_size=32, block_size=16, n_layer=N_LAYER, n_embd=32, n_head=2, dropout=0.0, **kwargs)
        self.calls = 0
        self.seen: list[list[str]] = []
        self.held: list[int | None] = []

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.seen.append(checkpointed_names(self))
        if self.calls == 1:  # the measuring step: no counter of ours in the way
            self.held.append(None)
            return super().training_step(batch, batch_idx)
        with SavedTensorCounter(exclude=self.parameters()) as saved:
            loss = super().training_step(batch, batch_idx)
        self.held.append(saved.bytes)
        return loss


class ManualGPT(RecordingGPT):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


def fit(model, callbacks=(), max_steps: int = 3, ckpt_path=None, **trainer_kwargs) -> Trainer:
    trainer_kwargs = {"logger": False, "enable_checkpointing": False, **trainer_kwargs}
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, callbacks=list(callbacks),
                      enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=64),
                ckpt_path=ckpt_path)
    return trainer


def run(model_cls=RecordingGPT, callbacks=(), model_kwargs=None, **fit_kwargs) -> tuple[RecordingGPT, Trainer]:
    seed_everything(0)
    model = model_cls(**(model_kwargs or {}))
    trainer = fit(model, callbacks, **fit_kwargs)
    return model, trainer


def assert_same_weights(a: RecordingGPT, b: RecordingGPT) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.fixture(scope="module")
def reference() -> RecordingGPT:
    return run()[0]


@pytest.fixture(scope="module")
def reference_manual() -> RecordingGPT:
    return run(ManualGPT)[0]


def planned(callback: GradientCheckpointing) -> list[str]:
    return [name for name, mode in callback.plan.layers.items() if mode != "none"]


@pytest.mark.parametrize("build_in_configure_model", [False, True])
def test_budget_half_holds_half_the_bytes_and_trains_the_same(reference, build_in_configure_model, caplog):
    callback = GradientCheckpointing(memory_budget=0.5)
    with caplog.at_level(logging.DEBUG, logger="lightning.pytorch"):
        model, _ = run(callbacks=[callback], model_kwargs={"build_in_configure_model": build_in_configure_model})
    chosen = planned(callback)
    assert 0 < len(chosen) < N_LAYER  # a real choice, neither nothing nor everything
    assert model.calls == 3  # training_step once per batch, the measuring step included
    assert model.seen == [BLOCKS, chosen, chosen]  # step 1 fully checkpointed, the plan from step 2
    assert callback.checkpointed_layers == chosen
    assert model.held[2] <= 0.5 * reference.held[2] * 1.02
    assert callback.plan.planned_bytes == pytest.approx(model.held[2], rel=0.05)
    assert callback.plan.baseline_bytes == pytest.approx(reference.held[2], rel=0.05)
    assert_same_weights(model, reference)
    assert checkpointed_names(model) == []  # undone at teardown
    line = next(r.getMessage() for r in caplog.records if "memory_budget=0.5" in r.getMessage())
    assert f"checkpointing {len(chosen)} of {N_LAYER} layers" in line and "budget" in line and "recomputed" in line
    # no text logger: the table goes to the log, at debug level (one info line per new plan)
    table = next(r for r in caplog.records if str(callback.plan) in r.getMessage())
    assert table.levelno == logging.DEBUG


def test_manual_optimisation(reference_manual):
    callback = GradientCheckpointing(memory_budget=0.5)
    model, _ = run(ManualGPT, [callback])
    chosen = planned(callback)
    assert model.calls == 3 and model.seen == [BLOCKS, chosen, chosen]
    assert model.held[2] <= 0.5 * reference_manual.held[2] * 1.02
    assert_same_weights(model, reference_manual)


def test_gradient_accumulation_measures_the_first_micro_batch_and_plans_from_the_second():
    reference, _ = run(max_steps=2, accumulate_grad_batches=2)
    callback = GradientCheckpointing(memory_budget=0.5)
    model, trainer = run(callbacks=[callback], max_steps=2, accumulate_grad_batches=2)
    chosen = planned(callback)
    assert trainer.global_step == 2 and model.calls == 4
    # Micro-batch 1 of optimizer step 1 is measured; the plan applies from micro-batch 2 (same optimizer step).
    assert model.seen == [BLOCKS, chosen, chosen, chosen]
    assert max(model.held[1:]) <= 0.5 * max(reference.held[1:]) * 1.02
    assert_same_weights(model, reference)


class CountingRecorder(driver_module.LayerCostRecorder):
    uses = 0

    def __enter__(self):
        type(self).uses += 1
        return super().__enter__()


def test_resume_applies_the_saved_plan_from_the_first_step_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_module, "LayerCostRecorder", CountingRecorder)
    first = GradientCheckpointing(memory_budget=0.5)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    run(callbacks=[first, saver], max_steps=2, enable_checkpointing=True)
    assert CountingRecorder.uses == 1
    path = tmp_path / "step=2.ckpt"
    assert torch.load(path, weights_only=False)["callbacks"]["GradientCheckpointing"]["plan"] == first.plan.state_dict()

    CountingRecorder.uses = 0
    resumed = GradientCheckpointing(memory_budget=0.5)
    model, trainer = run(callbacks=[resumed], max_steps=4, ckpt_path=str(path))
    chosen = planned(first)
    assert CountingRecorder.uses == 0  # nothing measured again
    assert trainer.global_step == 4 and model.seen == [chosen, chosen]  # the plan from the resumed run's first step
    assert resumed.plan.state_dict() == first.plan.state_dict()
    assert resumed.checkpointed_layers == chosen


class ChangeSettingAfter(Callback):
    """Sets ``callback.<name> = value`` at the end of training batch ``batch_idx`` (after the plan is applied)."""

    def __init__(self, callback: GradientCheckpointing, batch_idx: int, name: str, value: object) -> None:
        self.callback, self.batch_idx, self.name, self.value = callback, batch_idx, name, value

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            self.plan_before = self.callback.plan
            setattr(self.callback, self.name, self.value)
            self.plan_after = self.callback.plan


def test_a_new_budget_drops_the_plan_and_measures_again_on_the_next_batch(reference):
    callback = GradientCheckpointing(memory_budget=0.7)
    change = ChangeSettingAfter(callback, 1, "memory_budget", 0.4)
    model, _ = run(callbacks=[callback, change], max_steps=4)
    chosen = planned(callback)
    assert callback.plan.budget_bytes == int(0.4 * callback.plan.baseline_peak_bytes)  # solved for the new budget
    half = model.seen[1]
    assert change.plan_after is None and 0 < len(half) <= len(chosen) < N_LAYER
    # a tighter budget recomputes more (the last block stays plain: its backward comes first, before any recompute)
    assert change.plan_before.recompute_flops < callback.plan.recompute_flops
    # batch 3 runs fully checkpointed again (the measuring step), batch 4 with the new plan
    assert model.seen == [BLOCKS, half, BLOCKS, chosen]
    assert model.held[3] <= callback.plan.budget_bytes
    assert callback.plan.planned_bytes == pytest.approx(model.held[3], rel=0.05)


@pytest.mark.parametrize(("name", "value"), [("layer_cls", Block), ("offload", True), ("use_reentrant", True),
                                           ("checkpoint_kwargs", {"determinism_check": "none"}),
                                           ("time_layers", False)])
def test_each_plan_setting_drops_the_plan_and_measures_again_on_the_next_batch(name, value):
    callback = GradientCheckpointing(memory_budget=0.5)
    change = ChangeSettingAfter(callback, 1, name, value)
    model, _ = run(callbacks=[callback, change], max_steps=4)
    assert change.plan_before is not None and change.plan_after is None
    half = model.seen[1]
    assert 0 < len(half) < N_LAYER
    # batch 3 is a measuring step again (every layer checkpointed), batch 4 runs the plan solved after it
    assert model.seen == [BLOCKS, half, BLOCKS, planned(callback)]
    assert callback.plan is not change.plan_before and getattr(callback, name) == value


@pytest.mark.parametrize("time_layers", [True, False])
def test_the_measuring_step_times_the_layers_and_the_plan_is_priced_by_them(reference, time_layers, monkeypatch):
    """Selective measured slower than full (times stand in for the device's): the timed plan never picks it, the
    FLOPs plan does (it recomputes fewer FLOPs); both train exactly like no checkpointing."""
    import lightning_ckpt.core.measure.rerun as measure_module  # where a re-run looks up time_modes

    monkeypatch.setattr(measure_module, "time_modes",
                        lambda run, modes, device, rounds=5: {"plain": 1000, "harness": 0, "full": 1500,
                                                              "selective": 9000})
    callback = GradientCheckpointing(memory_budget=0.7, time_layers=time_layers)
    model, _ = run(callbacks=[callback])
    assert [c.full_ns for c in callback.plan.costs] == [500 if time_layers else 0] * N_LAYER
    assert ("selective" in callback.plan.layers.values()) is not time_layers
    assert_same_weights(model, reference)


def test_time_layers_is_true_or_false():
    with pytest.raises(TypeError, match=r"`time_layers` is True or False, got 'yes'\. Pass True"):
        GradientCheckpointing(memory_budget=0.5, time_layers="yes")


def test_a_setting_the_plan_does_not_depend_on_keeps_the_plan():
    callback = GradientCheckpointing(memory_budget=0.5)
    change = ChangeSettingAfter(callback, 1, "preserve_rng_state", False)
    model, _ = run(callbacks=[callback, change], max_steps=4)
    assert change.plan_after is change.plan_before is callback.plan
    half = model.seen[1]
    assert model.seen == [BLOCKS, half, half, half]


@pytest.mark.parametrize("first", [{"memory_budget": 0.5}, {"every_n_layers": 2}])
def test_memory_budget_and_every_n_layers_are_two_ways_of_choosing(first):
    with pytest.raises(ValueError, match="two ways of choosing.*Pass one"):
        GradientCheckpointing(memory_budget=0.5, every_n_layers=2)
    callback = GradientCheckpointing(**first)
    other = ("every_n_layers", 2) if "memory_budget" in first else ("memory_budget", 0.5)
    with pytest.raises(ValueError, match="two ways of choosing"):
        setattr(callback, *other)
    assert callback.state_dict()["settings"] == GradientCheckpointing(**first).state_dict()["settings"]


def test_an_impossible_budget_fails_before_any_weight_changes_and_leaves_the_model_plain():
    seed_everything(0)
    model = RecordingGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = GradientCheckpointing(memory_budget=0.01)
    with pytest.raises(ValueError, match=r"(?s)least reachable.*Nothing was applied.*budget of at least"):
        fit(model, [callback])
    assert model.calls == 1 and model.seen == [BLOCKS]  # the fully checkpointed first step, no backward after it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert checkpointed_names(model) == [] and all("forward" not in b.__dict__ for b in model.model.blocks)
    assert callback.plan is None and callback.checkpointed_layers == BLOCKS


def test_auto_on_cpu_asks_for_a_fraction_or_bytes_before_anything_changes():
    seed_everything(0)
    model = RecordingGPT(build_in_configure_model=True)
    callback = GradientCheckpointing(memory_budget="auto")
    with pytest.raises(ValueError, match=r"memory_budget='auto'.*CPU.*memory_budget=0.5.*'2GiB'"):
        fit(model, [callback])
    assert model.calls == 0 and model.model is None  # setup raised: configure_model never ran
    assert "configure_model" not in model.__dict__ and callback.checkpointed_layers == []


class FakeGather:
    """A strategy of two ranks: ``all_gather`` stacks this rank's row with ``other``."""

    root_device = torch.device("cpu")

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, self.other])


def test_ranks_are_gathered_as_rows_and_combined():
    """The callback's part: this rank's row gathered with the others'; the arithmetic is tested in test_budget.py."""
    mine, other_row = two_ranks()
    measured, figures = driver_module._combine_over_ranks(FakeGather(torch.tensor(other_row)), mine, [1000, 40, 11])
    expected = combine_costs(torch.tensor([pack_costs(mine, [1000, 40, 11]), other_row]), mine)
    assert (measured, figures) == expected and figures == [900, 50, 11]


def test_offload_auto_plans_by_time_on_the_measured_device_and_trains_the_same(reference, monkeypatch):
    """The accelerator's profile is measured in setup; here one with infinite host bandwidth stands in for it, and the
    fake engine for the copies: offload is then free, so the plan recomputes nothing and offloads instead."""
    profile = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e11, host_bandwidth=math.inf, name="stand-in")
    monkeypatch.setattr(driver_module, "_measure_device", lambda ranks, num_devices: (profile, 1 << 40))
    # Every block's backward brings back all it saved, and the one before it is prefetched meanwhile: offloading
    # everything peaks at about 0.56 of the peak without checkpointing.
    callback = GradientCheckpointing(memory_budget=0.6, offload="auto")
    with use_engine(OffloadEngine(FakeStreams(seed=2), min_bytes=0)) as engine:
        model, _ = run(callbacks=[callback])
    plan = callback.plan
    assert plan.offload == "auto" and plan.device == "stand-in" and plan.recompute_flops == 0
    # The last block's backward comes first, while the others' saved tensors are away: offloading it would not lower
    # the peak, so it stays as it is.
    assert plan.offloaded == BLOCKS[:-1] and set(plan.layers.values()) == {"none"}
    assert model.seen[1:] == [BLOCKS[:-1], BLOCKS[:-1]]  # wrapped to offload what they save, not to recompute
    newest = next(c.movable_bytes("none", 0) for c in reversed(plan.costs) if c.name in plan.offloaded)
    assert model.held[2] + newest == pytest.approx(plan.planned_bytes, rel=0.05)  # the newest stays on the device
    assert model.held[2] + newest <= plan.peak_bytes <= plan.budget_bytes
    assert engine.stats.offloaded_bytes >= 2 * plan.host_bytes  # steps 2 and 3
    assert_same_weights(model, reference)


def test_offload_auto_needs_a_budget_and_an_accelerator():
    with pytest.raises(ValueError, match="`memory_budget=None` asks for no plan"):
        GradientCheckpointing(offload="auto")
    model = RecordingGPT()
    with pytest.raises(ValueError, match="this run is on the CPU, where nothing is offloaded"):
        fit(model, [GradientCheckpointing(memory_budget=0.5, offload="auto")])
    assert checkpointed_names(model) == []


def test_the_plan_table_reaches_a_logger_that_takes_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    callback = GradientCheckpointing(memory_budget=0.5)
    logger = TensorBoardLogger(tmp_path, name="tb")
    run(callbacks=[callback], max_steps=2, logger=logger)
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    [event] = events.Tensors("gradient_checkpointing/plan/text_summary")
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    # the shape it was made for (4 sequences of 16 tokens), then the plan's table
    assert text.splitlines() == ["    " + line for line in ["Planned for batches up to 64 tokens (length 16)",
                                                          *str(callback.plan).splitlines()]]
    assert all(name in text for name in BLOCKS) and "selective" in text


@pytest.mark.accelerator
def test_auto_on_an_accelerator_plans_for_the_device(caplog):
    callback = GradientCheckpointing(memory_budget="auto")
    seed_everything(0)
    model = RecordingGPT()
    with caplog.at_level(logging.INFO):
        Trainer(max_steps=3, accelerator="cuda", devices=1, callbacks=[callback], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
            model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=64))
    total = torch.cuda.mem_get_info()[1]
    # A tiny model fits many times over: the plan checkpoints nothing, from the first optimizer step on.
    assert 0 < callback.plan.budget_bytes < AUTO_MEMORY_FRACTION * total
    assert planned(callback) == [] and model.seen == [BLOCKS, [], []]
    assert "auto: 0.9 x" in caplog.text and "weights, gradients and optimizer state" in caplog.text


def test_the_monitor_sees_the_measuring_step_as_a_fully_checkpointed_one(tmp_path):
    """The first step's extra per-layer runs are hidden from MemoryMonitor: its activations figure for step 1 equals
    that of a run with every layer fully checkpointed and the LM head chunked (the plan may choose it), and later
    steps hold the plan's bytes."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_ckpt import MemoryMonitor
    from lightning_ckpt.core.measure.memory_stats import ACTIVATIONS

    def activations(callback, name):
        logger = CSVLogger(tmp_path, name=name)
        run(callbacks=[callback, MemoryMonitor(log_every_n_steps=1)], logger=logger, log_every_n_steps=1)
        with open(f"{logger.log_dir}/metrics.csv") as f:
            return [float(row[ACTIVATIONS]) for row in csv.DictReader(f) if row.get(ACTIVATIONS)]

    full = activations(GradientCheckpointing(chunk_loss=True), "full")  # measuring, the head runs chunked (issue 32)
    budget = GradientCheckpointing(memory_budget=0.5)
    planned = activations(budget, "budget")
    assert len(planned) == len(full) == 3
    assert planned[0] == full[0]
    assert planned[1] == planned[2] > full[1]
    assert planned[1] * 2**30 == pytest.approx(budget.plan.planned_bytes, rel=0.05)


class HookedGPT(RecordingGPT):
    """A model whose own saved-tensor hooks wrap its forward: the callback's, entered before them, see nothing."""

    def training_step(self, batch, batch_idx):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return super().training_step(batch, batch_idx)


def test_the_user_s_own_saved_tensor_hooks_make_the_outside_bytes_unmeasurable_and_that_is_said():
    callback = GradientCheckpointing(memory_budget=0.5)
    with pytest.warns(UserWarning, match=r"bytes held outside the checkpointed layers could not be measured \(other"
                                         r" saved-tensor hooks were entered after this callback's\); the plan counts"
                                         r" them as 0"):
        run(HookedGPT, callbacks=[callback], max_steps=2)
    assert callback.plan.outside_bytes == 0


def test_a_new_compress_setting_drops_the_plan_and_measures_again_on_the_next_batch():
    # The plan counts each layer's inputs at the compressed width: one solved for exact inputs is wrong for fp8.
    test_each_plan_setting_drops_the_plan_and_measures_again_on_the_next_batch("compress", "fp8")


def test_every_constructor_option_either_drops_the_plan_or_is_listed_as_keeping_it():
    import inspect

    options = set(inspect.signature(GradientCheckpointing.__init__).parameters) - {"self"}
    drops, keeps = callback_module._PLAN_SETTINGS, set(callback_module._KEEPS_PLAN)
    assert not drops & keeps, drops & keeps
    assert options - drops - keeps == set(), "a new option: add it to _PLAN_SETTINGS or to _KEEPS_PLAN with why"
    assert (drops | keeps) - options == set()  # no stale names
    assert all(callback_module._KEEPS_PLAN[name] for name in keeps)


class OneRank:
    root_device = torch.device("cpu")
    world_size = 1
    is_global_zero = False

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)


def test_auto_takes_the_measuring_step_s_activation_peak_off_the_step_s_peak_not_its_held_bytes(monkeypatch):
    """Device totals patched on the CPU: 10,000 B device, 4,000 B static, 6,000 B step peak. The fp8 measuring step
    held 258 B (one layer's compressed inputs) but peaked at 1,258 B (its backward: 1,000 B alive next to the
    258 B copy), so the step's other peak is 6,000 - 4,000 - 1,258 = 742 B and the budget 0.9 x 10,000 - 4,000 - 742."""
    from types import SimpleNamespace

    from lightning_ckpt.core.plan.budget import AutoBudget, RankMeasurement
    from lightning_ckpt.core.plan.budget_cycle import BatchSize

    monkeypatch.setattr(driver_module, "device_total_bytes", lambda device: 10_000)
    monkeypatch.setattr(driver_module, "static_bytes", lambda module, optimizers: 4_000)
    monkeypatch.setattr(driver_module, "device_peak_bytes", lambda device: (6_000, 6_000))
    cost = LayerCost("l0", "Block", none_bytes=1000, full_bytes=1000, selective_bytes=1000, offloadable_bytes=0,
                     full_flops=10, selective_flops=10, fp8_bytes=258)
    measured = RankMeasurement([cost], outside_bytes=0, compress="fp8")
    assert (measured.held_bytes, measured.peak_bytes) == (258, 1_258)
    callback = GradientCheckpointing(memory_budget="auto", compress="fp8")
    callback.driver.measured = measured
    callback.driver.cycle.begin(BatchSize(64, 16))
    trainer = SimpleNamespace(strategy=OneRank(), optimizers=[], is_global_zero=False)
    callback.driver._make_plan(trainer.strategy, None, trainer.optimizers)
    assert (callback.driver.auto.other_peak_bytes, callback.plan.budget_bytes) == (742, 4_258)
    assert callback.driver.auto == AutoBudget(10_000, 4_000, 742) and callback.plans[64] is callback.plan
