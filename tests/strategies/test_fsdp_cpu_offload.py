"""``CheckpointingFSDPStrategy(cpu_offload=True)`` (issue 39, part 4): FSDP2's ``CPUOffloadPolicy`` keeps parameters,
gradients and optimizer state in host memory, one unit gathered at a time.

The distributed runs use 2 CPU processes with gloo, started by the strategy's own ``start_method="spawn"`` launcher
from this process (as ``test_spawn_fsdp_hands_back_the_unsharded_weights`` in ``test_strategies.py``). FSDP2 takes
CPU offload on a CPU mesh when the host copies are not pinned, which ``cpu_offload=True`` picks where there is no
CUDA. On the CPU, host and device memory are one, so the runs assert what FSDP2 was told (every parameter of every
unit offloaded), what it gathers at once (one block and the root), and that training ends where it ends without
offload; what the device then holds is counted by ``lightning-ckpt plan`` (``test_plan_cpu_offload.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_helpers import GPT_ARGS, RecordTraining, SeededGPT, ShardsItselfGPT
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

import lightning_ckpt.strategies  # noqa: F401  (registers "fsdp_ckpt_cpu_offload")
from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.placement import fsdp2
from lightning_ckpt.demos import Block, CountingDataModule
from lightning_ckpt.strategies import CheckpointingFSDPStrategy
from lightning_ckpt.strategies.fsdp import _param_groups, cpu_offload_policy

DATA = dict(vocab_size=32, block_size=16, batch_size=4, num_samples=32)  # 4 steps per epoch on 2 ranks


# ------------------------------------------------------------------------------------------------ settings


def test_cpu_offload_takes_lightning_s_values_and_fsdp2_s_policy():
    assert cpu_offload_policy(True, pin_memory=False) == CPUOffloadPolicy(pin_memory=False)
    assert cpu_offload_policy(True, pin_memory=True) == CPUOffloadPolicy(pin_memory=True)
    assert cpu_offload_policy(True).pin_memory is torch.cuda.is_available()  # pinned only with an accelerator
    given = CPUOffloadPolicy(pin_memory=False)
    assert cpu_offload_policy(given) is given
    assert cpu_offload_policy(CPUOffload(offload_params=True), pin_memory=False) == CPUOffloadPolicy(pin_memory=False)
    for off in (False, None, CPUOffload(offload_params=False), OffloadPolicy()):
        assert cpu_offload_policy(off) is None, off
    assert CheckpointingFSDPStrategy().cpu_offload is None
    assert CheckpointingFSDPStrategy(cpu_offload=True).cpu_offload == CPUOffloadPolicy(
        pin_memory=torch.cuda.is_available())


@pytest.mark.parametrize("bad", ["yes", 1, "cpu"])
def test_a_cpu_offload_that_is_not_understood_says_what_to_pass(bad):
    with pytest.raises(ValueError, match=r"`cpu_offload=.*` is not understood\. Pass True \(parameters, gradients and"
                                         r" optimizer state in host memory\), False, or a .*CPUOffloadPolicy"):
        CheckpointingFSDPStrategy(cpu_offload=bad)


def test_fsdp_ckpt_cpu_offload_is_registered_with_cpu_offload_on():
    entry = StrategyRegistry["fsdp_ckpt_cpu_offload"]
    assert entry["strategy"] is CheckpointingFSDPStrategy and entry["init_params"] == {"cpu_offload": True}
    trainer = Trainer(strategy="fsdp_ckpt_cpu_offload", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is CheckpointingFSDPStrategy
    assert trainer.strategy.cpu_offload == CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


# ------------------------------------------------------------------------------------------------ 2 processes


class RecordOffload(Callback):
    """Per rank, at the start of training: the FSDP units, how many shard with ``CPUOffloadPolicy``, how many of
    their parameters FSDP2 keeps in host memory (``FSDPParam.offload_to_cpu``) out of all; and while each block's
    attention runs (in forward and in the recompute of backward), how many units are gathered at once. Handed back
    as ``trainer.callback_metrics["offload/per_rank"]``: ``[units, offloaded units, parameters, offloaded
    parameters, least gathered, most gathered, blocks seen]`` per rank."""

    def __init__(self) -> None:
        self.figures: list[int] = []
        self.gathered: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fsdp = fsdp2()
        units = [module for module in pl_module.modules() if isinstance(module, fsdp.FSDPModule)]
        groups = [[g for g in _param_groups(unit)] for unit in units]
        params = [p for unit_groups in groups for g in unit_groups for p in g.fsdp_params]
        offloaded = sum(all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in gs) and bool(gs) for gs in groups)
        self.figures = [len(units), offloaded, len(params), sum(p.offload_to_cpu for p in params)]

        def count(*_: Any) -> None:
            self.gathered.append(sum(any(g.is_unsharded for g in gs) for gs in groups))

        for block in (m for m in pl_module.modules() if isinstance(m, Block)):
            block.attn.register_forward_pre_hook(count)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = torch.tensor([*self.figures, min(self.gathered), max(self.gathered), len(self.gathered)])
        trainer.callback_metrics["offload/per_rank"] = trainer.strategy.all_gather(mine).reshape(2, -1).cpu()


def _fit(cpu_offload: bool) -> tuple[dict[str, torch.Tensor], Trainer]:
    seed_everything(0)
    model = SeededGPT(**GPT_ARGS)
    trainer = Trainer(strategy=CheckpointingFSDPStrategy(start_method="spawn", cpu_offload=cpu_offload),
                      accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing(), RecordTraining(Block), RecordOffload()])
    trainer.fit(model, CountingDataModule(**DATA))
    return {k: v.float() for k, v in model.state_dict().items()}, trainer


@pytest.fixture(scope="module")
def fits() -> dict[bool, tuple[dict[str, torch.Tensor], Trainer]]:
    return {offload: _fit(offload) for offload in (False, True)}


def test_offloaded_training_ends_where_training_on_the_device_ends(fits):
    """Same data, same steps: the weights with parameters, gradients and AdamW's state in host memory are those
    without offload (handed back unsharded by the spawn launcher), and training moved them."""
    (plain, _), (offloaded, trainer) = fits[False], fits[True]
    initial = SeededGPT(**GPT_ARGS).state_dict()
    assert plain.keys() == offloaded.keys() == initial.keys()
    assert max(float((plain[k] - initial[k].float()).abs().max()) for k in plain) > 1e-3
    for key in plain:
        torch.testing.assert_close(offloaded[key], plain[key], rtol=0, atol=1e-6, msg=key)
    n_layer, steps = GPT_ARGS["n_layer"], 4
    # Checkpointing still sits inside each unit: every block's forward ran twice a step (forward, recompute).
    assert trainer.callback_metrics["record/per_rank"].tolist() == [[2 * n_layer * steps, steps]] * 2


def test_every_unit_shards_with_cpu_offload_and_gathers_one_block_at_a_time(fits):
    """Units: the 2 blocks and the rest (``model``: embeddings, final norm, head), every one with
    ``CPUOffloadPolicy``; every parameter (each block's 12 and the root's 6) is kept in host memory. While a block's
    attention runs, exactly 2 units are gathered: that block and the root, which FSDP2 keeps gathered from its
    forward to the end of the backward. 2 blocks x 2 runs (forward, recompute) x 4 steps = 16 counts."""
    per_rank = fits[True][1].callback_metrics["offload/per_rank"].tolist()
    n_layer = GPT_ARGS["n_layer"]
    params = n_layer * 12 + 6
    assert per_rank == [[n_layer + 1, n_layer + 1, params, params, 2, 2, 2 * n_layer * 4]] * 2
    without = fits[False][1].callback_metrics["offload/per_rank"].tolist()
    assert without == [[n_layer + 1, 0, params, 0, 2, 2, 2 * n_layer * 4]] * 2  # the same layout, kept on the device


def test_cpu_offload_with_a_model_that_shards_itself_without_it_is_refused():
    """``configure_model`` called ``fully_shard`` without an offload policy: the strategy keeps that layout, so
    ``cpu_offload`` would do nothing; it is refused with what to do instead."""
    seed_everything(0)
    trainer = Trainer(strategy=CheckpointingFSDPStrategy(start_method="spawn", cpu_offload=True),
                      accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception, match=r"`cpu_offload` was asked, but `configure_model` sharded .*without it\."
                                        r" Pass `offload_policy=CPUOffloadPolicy\(\)`"):
        trainer.fit(ShardsItselfGPT(build_in_configure_model=True, **GPT_ARGS), CountingDataModule(**DATA))


def test_the_strategy_keeps_every_option_it_is_given_and_refuses_an_unknown_start_method():
    from datetime import timedelta

    from lightning_ckpt.strategies.fsdp import CheckpointingFSDPStrategy

    default = CheckpointingFSDPStrategy()
    assert (default._reshard_after_forward, default._save_distributed_checkpoint, default._start_method,
            default.sharded_units, default.cpu_offload) == (True, False, "popen", [], None)
    for method in ("popen", "spawn", "fork", "forkserver"):
        assert CheckpointingFSDPStrategy(start_method=method)._start_method == method
    given = CheckpointingFSDPStrategy(reshard_after_forward=False, save_distributed_checkpoint=True,
                                      data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
                                      timeout=timedelta(seconds=42))
    assert (given._reshard_after_forward, given._save_distributed_checkpoint, given._data_parallel_size,
            given._tensor_parallel_size, given._process_group_backend, given._timeout) == (
        False, True, 2, 1, "gloo", timedelta(seconds=42))
    with pytest.raises(ValueError) as info:
        CheckpointingFSDPStrategy(start_method="thread")
    assert str(info.value) == "`start_method='thread'` is not understood. Pass 'popen', 'spawn', 'fork' or 'forkserver'."
