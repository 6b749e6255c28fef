"""The budget driver (:mod:`lightning_ckpt.core.plan.budget_driver`) without Lightning: a plain module, a plain loop,
and ranks stood in for by :class:`~lightning_ckpt.core.plan.budget_driver.Ranks` of our own.

The callbacks' tests (tests/callbacks/) check that a Trainer's hooks and a Fabric loop drive it at the right moments.
"""

from __future__ import annotations

import copy

import torch

from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.plan.budget_driver import BUDGET_DEFAULTS, BudgetDriver, OneRank

from helpers import TwoRanks, blocks, one_step


def test_two_ranks_rows_are_combined_with_their_maximum_and_every_rank_solves_that_plan():
    settings = dict(BUDGET_DEFAULTS, memory_budget=0.8, max_length=0, time_layers=False)
    batch = torch.randn(32, 16)
    alone, together = BudgetDriver(settings), BudgetDriver(settings)
    one, two = blocks(), blocks()
    alone.apply(one)
    together.apply(two)
    ranks = TwoRanks()
    one_step(alone, OneRank(), one, batch)
    one_step(together, ranks, two, batch)
    assert alone.measured_steps == together.measured_steps == 1
    mine, theirs = alone.plan, together.plan
    assert mine is not None and theirs is not None
    # The other rank's costs, twice this one's, are the maximum: the plan is solved for them.
    assert [c.none_bytes for c in theirs.costs] == [2 * c.none_bytes for c in mine.costs]
    assert [c.full_flops for c in theirs.costs] == [2 * c.full_flops for c in mine.costs]
    assert theirs.outside_bytes == 2 * mine.outside_bytes
    assert any(rows.shape == (2, rows.shape[1]) and rows.shape[1] > 2 for rows in ranks.gathered)
    assert checkpointed_names(two) == together.checkpointed_layers
    assert theirs.layers == {name: mode for name, mode in mine.layers.items()}  # the same choice at twice the bytes


def test_a_covered_batch_runs_the_plan_without_measuring_and_the_state_restores_it():
    settings = dict(BUDGET_DEFAULTS, memory_budget=0.8, max_length=0, time_layers=False)
    driver, module, ranks = BudgetDriver(settings), blocks(), OneRank()
    driver.apply(module)
    one_step(driver, ranks, module, torch.randn(32, 16))
    one_step(driver, ranks, module, torch.randn(24, 16))  # fewer samples, bucket 32: covered by the plan for 32
    assert driver.measured_steps == 1 and driver.plan is not None
    state = copy.deepcopy(driver.state_dict())
    resumed = BudgetDriver(settings)
    resumed.load_state_dict(state)
    assert resumed.cycle.plans.keys() == driver.cycle.plans.keys() == {32}
    fresh = blocks()
    resumed.apply(fresh)
    one_step(resumed, ranks, fresh, torch.randn(32, 16))
    assert resumed.measured_steps == 0 and resumed.plan.state_dict() == driver.plan.state_dict()
    driver.end(module)
    assert checkpointed_names(module) == []


def test_without_a_budget_it_checkpoints_every_n_th_layer_and_says_so_through_info():
    said: list[str] = []
    driver = BudgetDriver(dict(BUDGET_DEFAULTS, every_n_layers=2), info=said.append)
    module = blocks()
    assert driver.apply(module) == ["0", "2"]
    driver.begin_batch(OneRank(), module, torch.randn(4, 16))  # no budget: nothing to measure or plan
    assert driver.measured_steps == 0 and driver.plan is None
    assert said == ["GradientCheckpointing: checkpointing 2 layers (0, 2)"]


def test_offload_auto_measures_the_accelerator_and_shares_half_the_free_host_memory_among_the_node_s_devices(
        monkeypatch):
    import types

    from lightning_ckpt.core.plan import budget_driver as driver_module

    profile = object()
    monkeypatch.setattr(driver_module.DeviceProfile, "measure", lambda device: (profile, device))
    monkeypatch.setattr(driver_module.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=64 << 30))
    sent = []
    ranks = types.SimpleNamespace(root_device=torch.device("meta"),
                                  broadcast=lambda obj, src=0: sent.append(src) or obj)
    # half of 64 GiB free, over 4 devices: 8 GiB each; rank 0's figures go to every rank
    assert driver_module._measure_device(ranks, 4) == ((profile, torch.device("meta")), 8 << 30) and sent == [0]
