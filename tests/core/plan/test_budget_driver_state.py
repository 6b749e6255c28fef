"""The budget driver's set-up and state (:mod:`lightning_ckpt.core.plan.budget_driver`), without Lightning: what a new
driver holds, ``prepare`` (``"auto"`` on the CPU, measuring the accelerator once), ``apply`` in its three cases (no
budget, a plan, a measuring step) with the options each passes on, the tiles, ``end``, ``settings_changed`` and the
state dict.

A plan is put in the driver's cycle by hand where the test is about applying it (the cycle takes a plan for a batch it
is measuring); where the test is about the cycle itself, a real step of a plain module plans it.
"""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
from torch import nn

from lightning_ckpt.core.checkpoint.chunked_loss import chunk_loss_of
from lightning_ckpt.core.checkpoint.tiling import tiled_names, tiles_of
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.plan import budget_driver as driver_module
from lightning_ckpt.core.plan.budget import AutoBudget
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.budget_driver import BUDGET_DEFAULTS, MEASURED_CHUNK, BudgetDriver, OneRank
from lightning_ckpt.core.plan.checkpoint_plan import CheckpointPlan
from lightning_ckpt.demos import CausalSelfAttention, Transformer

from helpers import Block, blocks, one_step


def gpt() -> Transformer:
    torch.manual_seed(0)
    return Transformer(32, 16, 2, 8, 2, 0.0)


def settings(**changes) -> dict:
    return {**BUDGET_DEFAULTS, "max_length": 0, "time_layers": False, **changes}


def options(module: nn.Module, name: str):
    """The checkpoint options the layer ``name`` of ``module`` is wrapped with."""
    return module.get_submodule(name).forward.options


def with_plan(driver: BudgetDriver, plan: CheckpointPlan) -> None:
    """``plan`` as the driver's latest, as if a batch of 32 had been measured and planned."""
    driver.cycle.begin(BatchSize(32), predict=False)
    driver.cycle.planned(plan)


class Accelerator:
    """Ranks on a device that is not the CPU (``meta``: nothing runs on it here), counting the broadcasts."""

    root_device = torch.device("meta")
    world_size = 1
    is_global_zero = True

    def __init__(self) -> None:
        self.broadcasts = 0

    def broadcast(self, obj, src=0):
        self.broadcasts += 1
        return obj


@pytest.fixture
def measured_devices(monkeypatch):
    """``DeviceProfile.measure`` records its devices; the host has 64 GiB available."""
    devices = []
    monkeypatch.setattr(driver_module.DeviceProfile, "measure", lambda device: devices.append(device) or "profile")
    monkeypatch.setattr(driver_module.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=64 << 30))
    return devices


# --------------------------------------------------------------------------------------------- a new driver, prepare


def test_a_new_driver_has_no_layers_no_tiles_no_plan_and_plans_the_longest_batch_first():
    driver = BudgetDriver(settings(memory_budget=0.8))
    assert driver.checkpointed_layers == [] and driver.tiles_chosen is False and driver.tiles() == {}
    assert driver.plan is None and driver.measured is None and driver.auto is None and driver.device is None
    assert driver.longest_due is True and driver.state_dict() == {}
    assert BudgetDriver(settings()).longest_due is False  # no budget: nothing to plan
    driver.measured_steps = 3
    driver.start()
    assert driver.measured_steps == 0


def test_auto_on_the_cpu_is_refused_and_a_byte_budget_there_measures_nothing(measured_devices):
    with pytest.raises(ValueError) as err:
        BudgetDriver(settings(memory_budget="auto")).prepare(OneRank())
    assert str(err.value) == (
        "`memory_budget='auto'` plans for the accelerator's memory, but this run is on the CPU. Pass a fraction of the"
        " un-checkpointed activation memory (`memory_budget=0.5`) or bytes (`'2GiB'`).")
    driver = BudgetDriver(settings(memory_budget=0.8))
    driver.prepare(OneRank())
    assert driver.device is None and measured_devices == []


@pytest.mark.parametrize("auto", [{"memory_budget": "auto"}, {"memory_budget": 0.8, "offload": "auto"}])
def test_auto_on_an_accelerator_measures_it_once_and_shares_half_the_host_memory(measured_devices, auto):
    driver, ranks = BudgetDriver(settings(**auto)), Accelerator()
    driver.prepare(ranks)  # one device on the node: half of 64 GiB
    assert driver.device == ("profile", 32 << 30) and measured_devices == [torch.device("meta")]
    driver.prepare(ranks, num_devices=4)  # measured already: not again
    assert driver.device == ("profile", 32 << 30) and len(measured_devices) == 1 and ranks.broadcasts == 1
    shared = BudgetDriver(settings(**auto))
    shared.prepare(ranks, 4)  # four devices share the host memory
    assert shared.device == ("profile", 8 << 30)


def test_prepare_measures_nothing_without_auto_or_without_fit(measured_devices):
    for changes, fit in [({"memory_budget": 0.8}, True), ({"memory_budget": "auto", "offload": "auto"}, False),
                         ({"memory_budget": None, "offload": False}, True)]:
        driver = BudgetDriver(settings(**changes))
        driver.prepare(Accelerator(), 2, fit=fit)
        assert driver.device is None
    assert measured_devices == []


# --------------------------------------------------------------------------------------------- apply: no budget


def test_without_a_budget_every_option_reaches_the_layers_with_the_loss_chunked_and_the_mlps_tiled():
    said: list[str] = []
    checkpoint_kwargs = {"determinism_check": "none"}
    driver = BudgetDriver(settings(layer_cls=CausalSelfAttention, mode="selective", preserve_rng_state=False,
                                   checkpoint_kwargs=checkpoint_kwargs, chunk_loss=True, tile_mlp=True, tile_tokens=4,
                                   tile_cls=nn.Sequential), info=said.append)
    assert driver.tiles() == {"tile_mlp": True, "tile_tokens": 4, "tile_cls": nn.Sequential}
    module = gpt()
    assert driver.apply(module) == ["blocks.0.attn", "blocks.1.attn"] == driver.checkpointed_layers
    assert checkpointed_names(module) == ["blocks.0.attn", "blocks.1.attn"]
    wrapped = options(module, "blocks.1.attn")
    assert (wrapped.mode, wrapped.preserve_rng_state, wrapped.offload) == ("selective", False, False)
    assert wrapped.checkpoint_kwargs == checkpoint_kwargs
    assert chunk_loss_of(module) == 1024
    assert tiles_of(module) == {"blocks.0.mlp": 4, "blocks.1.mlp": 4}
    assert said == ["GradientCheckpointing: checkpointing 2 layers (blocks.0.attn, blocks.1.attn)"]
    driver.apply(module)  # the same layers again: nothing more said
    assert len(said) == 1


def test_without_a_budget_chunk_loss_none_or_false_leaves_the_loss_whole_and_tile_cls_alone_tiles_nothing():
    for chunk_loss in (None, False):
        module = gpt()
        driver = BudgetDriver(settings(chunk_loss=chunk_loss, tile_cls=nn.Sequential))
        assert driver.tiles() == {}
        assert driver.apply(module) == ["blocks.0", "blocks.1"]
        assert chunk_loss_of(module) is None and tiled_names(module) == []


def test_the_info_line_lists_eight_layers_and_cuts_a_ninth_off():
    said: list[str] = []
    BudgetDriver(settings(), info=said.append).apply(blocks(8))
    BudgetDriver(settings(), info=said.append).apply(blocks(9))
    BudgetDriver(settings(), info=said.append).apply(blocks(10))
    assert said == ["GradientCheckpointing: checkpointing 8 layers (0, 1, 2, 3, 4, 5, 6, 7)",
                    "GradientCheckpointing: checkpointing 9 layers (0, 1, 2, 3, 4, 5, 6, 7, ...)",
                    "GradientCheckpointing: checkpointing 10 layers (0, 1, 2, 3, 4, 5, 6, 7, ...)"]


def test_tiles_chosen_for_the_longest_batch_tile_as_tile_mlp_true_does():
    driver = BudgetDriver(settings(memory_budget=0.8, tile_tokens=8, tile_cls=nn.Sequential))
    driver.tiles_chosen = True
    assert driver.tiles() == {"tile_mlp": True, "tile_tokens": 8, "tile_cls": nn.Sequential}
    assert BudgetDriver(settings(tile_mlp=False, tile_tokens=8)).tiles() == {}


# --------------------------------------------------------------------------------------------- apply: a budget


def test_a_measuring_step_checkpoints_every_layer_fully_without_offload_but_with_the_other_options():
    said: list[str] = []
    driver = BudgetDriver(settings(memory_budget=0.8, offload=True, use_reentrant=True, preserve_rng_state=False,
                                   chunk_loss=True, tile_mlp=True, tile_tokens=4, tile_cls=nn.Sequential),
                          info=said.append)
    module = gpt()
    assert driver.apply(module) == ["blocks.0", "blocks.1"]
    wrapped = options(module, "blocks.0")
    assert (wrapped.mode, wrapped.offload, wrapped.use_reentrant, wrapped.preserve_rng_state) == (
        "full", False, True, False)
    assert chunk_loss_of(module) == 1024 and tiles_of(module) == {"blocks.0.mlp": 4, "blocks.1.mlp": 4}
    assert said == []  # with a budget, each plan's line says what is checkpointed


def test_a_measuring_step_runs_the_head_in_measured_chunks_where_the_plan_chooses_them():
    module = gpt()
    BudgetDriver(settings(memory_budget=0.8)).apply(module)
    assert chunk_loss_of(module) == MEASURED_CHUNK
    # a loss the model changes after its head (a logit soft-cap) stays whole, which is said once
    said: list[str] = []
    capped = gpt()
    capped.config = types.SimpleNamespace(final_logit_softcapping=30.0)
    driver = BudgetDriver(settings(memory_budget=0.8), info=said.append)
    driver.apply(capped)
    driver.apply(capped)
    assert chunk_loss_of(capped) is None
    assert said == ["GradientCheckpointing: chunk_loss=None: Transformer's loss stays whole: its"
                    " final_logit_softcapping=30.0 changes the logits between the LM head and the loss, which a head"
                    " run in chunks cannot reproduce."]


def test_a_plan_is_applied_with_the_caller_s_options_then_the_loss_chunked_and_the_mlps_tiled():
    said: list[str] = []
    driver = BudgetDriver(settings(memory_budget=0.8, use_reentrant=True, preserve_rng_state=False, offload=True,
                                   checkpoint_kwargs={"determinism_check": "none"}, chunk_loss=True, tile_mlp=True,
                                   tile_tokens=4, tile_cls=nn.Sequential), info=said.append)
    with_plan(driver, CheckpointPlan({"blocks.0": "full", "blocks.1": "none"}, 100, 60, 80, 10, 0))
    module = gpt()
    assert driver.apply(module) == ["blocks.0"] == checkpointed_names(module)
    wrapped = options(module, "blocks.0")
    assert (wrapped.use_reentrant, wrapped.preserve_rng_state, wrapped.offload) == (True, False, False)
    assert wrapped.checkpoint_kwargs == {"determinism_check": "none"}
    assert chunk_loss_of(module) == 1024  # the plan has no chunks of its own: chunk_loss=True's
    assert tiles_of(module) == {"blocks.0.mlp": 4, "blocks.1.mlp": 4}
    assert said == []


def test_a_plan_s_own_chunks_are_kept_and_chunk_loss_false_chunks_nothing():
    chunked, module = BudgetDriver(settings(memory_budget=0.8, chunk_loss=True)), gpt()
    with_plan(chunked, CheckpointPlan({"blocks.0": "full", "blocks.1": "full"}, 100, 60, 80, 10, 0, chunk_tokens=64))
    chunked.apply(module)
    assert chunk_loss_of(module) == 64
    whole, module = BudgetDriver(settings(memory_budget=0.8, chunk_loss=False)), gpt()
    with_plan(whole, CheckpointPlan({"blocks.0": "full", "blocks.1": "full"}, 100, 60, 80, 10, 0))
    assert whole.apply(module) == ["blocks.0", "blocks.1"]
    assert chunk_loss_of(module) is None and tiled_names(module) == []


def test_reentrant_is_the_setting_unless_checkpoint_kwargs_says_otherwise():
    def reentrant(**changes) -> bool:
        return BudgetDriver(settings(**changes))._reentrant()

    assert reentrant() is False and reentrant(use_reentrant=True) is True
    assert reentrant(checkpoint_kwargs={"use_reentrant": True}) is True
    assert reentrant(use_reentrant=True, checkpoint_kwargs={"use_reentrant": False}) is False
    assert reentrant(use_reentrant=True, checkpoint_kwargs={"determinism_check": "none"}) is True


# --------------------------------------------------------------------------------------------- the cycle


def test_a_byte_budget_plans_before_the_backward_and_the_module_then_has_that_plan():
    driver, module, ranks = BudgetDriver(settings(memory_budget=0.8)), blocks(), OneRank()
    driver.apply(module)
    batch = torch.randn(32, 16)
    driver.begin_batch(ranks, module, batch)
    loss = module(batch).square().mean()
    driver.after_forward(ranks, module, loss)
    plan = driver.plan
    assert plan is not None and driver.measured is None  # solved before the backward
    loss.backward()
    driver.end_batch(ranks, module)
    assert driver.cycle.applied is plan and driver.plan is plan
    assert checkpointed_names(module) == [name for name, mode in plan.layers.items() if mode != "none"]


def test_auto_waits_for_the_first_optimizer_step_and_keeps_its_figures_in_the_state(monkeypatch):
    monkeypatch.setattr(driver_module, "device_total_bytes", lambda device: 1 << 30)
    monkeypatch.setattr(driver_module, "device_peak_bytes", lambda device: None)
    driver, module, ranks = BudgetDriver(settings(memory_budget="auto")), blocks(), OneRank()
    driver.apply(module)
    one_step(driver, ranks, module, torch.randn(32, 16), stepped=False)
    assert driver.plan is None and driver.measured is not None and driver.auto is None
    driver.end_batch(ranks, module, stepped=True)
    # 4 blocks of 2128 float32 parameters: 34048 bytes of weights and as many of gradients
    assert driver.auto == AutoBudget(1 << 30, 2 * 4 * 2128 * 4, 0) and driver.plan is not None
    state = driver.state_dict()
    assert state.keys() == {"plan", "plans", "auto_budget"} and state["auto_budget"] == [1 << 30, 68096, 0]
    assert state["plan"] == driver.plan.state_dict()
    resumed = BudgetDriver(settings(memory_budget="auto"))
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.auto == driver.auto and resumed.tiles_chosen is False and resumed.cycle.plans.keys() == {32}
    driver.settings_changed()  # other settings: the plans and "auto"'s figures go
    assert driver.auto is None and driver.plan is None and driver.cycle.plans == {} and driver.state_dict() == {}


def test_the_state_holds_every_plan_the_tiles_chosen_and_auto_s_figures_and_restores_them():
    driver, module = BudgetDriver(settings(memory_budget=0.8)), blocks()
    driver.apply(module)
    one_step(driver, OneRank(), module, torch.randn(32, 16))
    driver.auto, driver.tiles_chosen = AutoBudget(80 << 30, 30 << 30, 1 << 30), True
    state = copy.deepcopy(driver.state_dict())
    assert state.keys() == {"plan", "plans", "auto_budget", "tiles_chosen"}
    assert state["plan"] == driver.plan.state_dict() and state["plans"] == driver.cycle.state_dict()
    assert state["auto_budget"] == [80 << 30, 30 << 30, 1 << 30] and state["tiles_chosen"] is True
    resumed = BudgetDriver(settings(memory_budget=0.8))
    resumed.load_state_dict(state)
    assert resumed.tiles_chosen is True and resumed.auto == AutoBudget(80 << 30, 30 << 30, 1 << 30)
    assert resumed.plan.state_dict() == driver.plan.state_dict() and resumed.cycle.plans.keys() == {32}
    # a state with only the latest plan does not say which sizes it holds for: nothing is restored
    only_plan = BudgetDriver(settings(memory_budget=0.8))
    only_plan.load_state_dict({"plan": state["plan"], "auto_budget": state["auto_budget"], "tiles_chosen": True})
    assert only_plan.plan is None and only_plan.cycle.plans == {} and only_plan.auto is None
    assert only_plan.tiles_chosen is False


def test_a_state_loaded_while_measuring_ends_the_measurement():
    driver, module, ranks = BudgetDriver(settings(memory_budget=0.8)), blocks(), OneRank()
    driver.apply(module)
    one_step(driver, ranks, module, torch.randn(32, 16))
    state = copy.deepcopy(driver.state_dict())
    other = BudgetDriver(settings(memory_budget=0.8))
    fresh = blocks()
    other.apply(fresh)
    batch = torch.randn(32, 16)
    other.begin_batch(ranks, fresh, batch)  # measuring
    other.load_state_dict(state)
    module(batch).sum().backward()
    other.end_batch(ranks, fresh)  # the recorder is gone: nothing measured, the loaded plan applied
    assert other.measured is None and other.measured_steps == 1
    assert other.plan.state_dict() == driver.plan.state_dict()


# --------------------------------------------------------------------------------------------- end


def test_end_leaves_the_measuring_hooks_and_forgets_the_step_in_progress():
    driver, module, ranks = BudgetDriver(settings(memory_budget=0.8)), gpt(), OneRank()
    driver.apply(module)
    idx = torch.zeros(2, 8, dtype=torch.long)
    driver.begin_batch(ranks, module, idx)  # measuring, the LM head counted
    assert driver.cycle.measuring is not None and module.head._forward_hooks
    module(idx, idx)
    driver.end(module)
    assert not module.head._forward_hooks and checkpointed_names(module) == [] and chunk_loss_of(module) is None
    assert driver.measured is None and driver.cycle.measuring is None and driver.longest_due is True
    driver.end_batch(ranks, module)  # nothing left to stop or to plan
    assert driver.plan is None and driver.measured is None
    driver.apply(module)
    driver.begin_batch(ranks, module, idx)  # the size is measured again
    assert driver.measured_steps == 2 and driver.cycle.measuring == BatchSize(16, 8)
    driver.end()


def test_end_after_the_forward_forgets_the_costs_measured():
    driver, module, ranks = BudgetDriver(settings(memory_budget="auto")), blocks(), OneRank()
    driver.apply(module)
    one_step(driver, ranks, module, torch.randn(32, 16), stepped=False)  # "auto": measured, not planned yet
    assert driver.measured is not None and driver.longest_due is False
    driver.end(module)
    assert driver.measured is None and driver.longest_due is True and checkpointed_names(module) == []


def test_end_leaves_the_check_of_a_predicted_plan():
    driver, module, ranks = BudgetDriver(settings(memory_budget=0.8)), blocks(), OneRank()
    driver.apply(module)
    one_step(driver, ranks, module, torch.randn(32, 16))
    state = copy.deepcopy(driver.state_dict())
    state["plans"]["predicted"] = [32]  # as if the plan for 32 had been predicted: its first step is checked
    resumed, fresh = BudgetDriver(settings(memory_budget=0.8)), blocks()
    resumed.load_state_dict(state)
    resumed.apply(fresh)
    batch = torch.randn(32, 16)
    resumed.begin_batch(ranks, fresh, batch)
    assert resumed.cycle.checking
    fresh(batch).sum().backward()
    resumed.end(fresh)
    resumed.end_batch(ranks, fresh)  # no check left to end: the plan is neither passed nor failed
    assert resumed.cycle.checked == set() and resumed.cycle.remeasure == set()
    assert resumed.cycle.plans.keys() == {32}


def test_the_longest_batch_is_planned_again_after_end_for_a_model_whose_head_is_not_chosen(monkeypatch):
    warned: list[str] = []
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(32, 16), Block(), Block(), Block())
    driver = BudgetDriver(settings(memory_budget=0.8, max_length=16, layer_cls=Block), warn=warned.append)
    driver.apply(module)
    ids = torch.zeros(2, 8, dtype=torch.long)

    def failing():
        raise RuntimeError("no fake step")

    driver.begin_batch(OneRank(), module, ids, longest_step=failing)
    assert warned == ["GradientCheckpointing: could not measure the longest batch (length 16, from max_length) on fake"
                      " tensors before the first step (RuntimeError: no fake step); the budget is checked on each"
                      " batch as it comes."]
    driver.end(module)
    driver.apply(module)
    step = lambda: contextlib.nullcontext(lambda batch: module(batch).square().mean())  # noqa: E731
    driver.begin_batch(OneRank(), module, ids, longest_step=step)
    assert driver.cycle.plans.keys() == {32} and driver.cycle.sizes[32] == BatchSize(32, 16)
    longest = driver.cycle.plans[32]  # the first batch itself, shorter, is then measured
    assert not longest.checkpoints_nothing and longest.chunk_tokens is None
    first = BudgetDriver(settings(memory_budget=0.8, max_length=16, layer_cls=Block))  # planned on its first batch
    first.apply(module)
    first.begin_batch(OneRank(), module, ids, longest_step=step)
    assert first.cycle.plans[32].layers == longest.layers
    first.end(module)
