"""DDP and FSDP strategies that apply checkpointing at the right moment and with safe settings.

Both read their settings from the trainer's :class:`~lightning_ckpt.GradientCheckpointing` callback
(one source of truth) and apply them after ``configure_model`` and before the model is wrapped or
sharded, so layers built in ``configure_model`` are checkpointed too.

- :class:`~lightning_ckpt.strategies.ddp.CheckpointingDDPStrategy` (``"ddp_ckpt"``) is Lightning's ``DDPStrategy``
  that refuses, before training, the reentrant-checkpointing settings that break DDP's gradient synchronisation
  (:mod:`~lightning_ckpt.strategies.ddp`).
- :class:`~lightning_ckpt.strategies.fsdp.CheckpointingFSDPStrategy` (``"fsdp_ckpt"``) is Lightning's
  ``ModelParallelStrategy`` (FSDP2, ``torch.distributed.fsdp.fully_shard``) that shards the model itself when
  ``configure_model`` did not: one FSDP unit per block, then the rest, so checkpointing sits *inside* each unit
  (:mod:`~lightning_ckpt.strategies.fsdp`).
- :mod:`~lightning_ckpt.strategies.common`: what both share (the callback applied, launching, exiting, registering).

Importing this package registers both names (and their variants) with Lightning's ``StrategyRegistry``.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing

    trainer = Trainer(strategy="ddp_ckpt", devices=4, callbacks=[GradientCheckpointing()])
    trainer = Trainer(strategy="fsdp_ckpt", devices=4, precision="bf16-mixed",
                      callbacks=[GradientCheckpointing(layer_cls="my_project.model.Block")])
"""

from lightning_ckpt.strategies.ddp import CheckpointingDDPStrategy
from lightning_ckpt.strategies.fsdp import CheckpointingFSDPStrategy

__all__ = ["CheckpointingDDPStrategy", "CheckpointingFSDPStrategy"]


def _register_all() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    CheckpointingDDPStrategy.register_strategies(StrategyRegistry)
    CheckpointingFSDPStrategy.register_strategies(StrategyRegistry)


_register_all()
