"""DDP: :class:`CheckpointingDDPStrategy` (``"ddp_ckpt"``), and the check that reentrant checkpointing is safe.

Reentrant checkpointing is only safe under DDP on a static graph (:func:`check_ddp_settings`); the default,
non-reentrant checkpointing works with any DDP setting.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement
from lightning_ckpt.core.checkpoint.wrapping import is_checkpointed
from lightning_ckpt.strategies.common import (
    _apply_callback,
    _CleanExitLauncher,
    _destroy_process_group_at_exit,
    _register,
)

__all__ = ["CheckpointingDDPStrategy", "check_ddp_settings", "reentrant_layers"]


def reentrant_layers(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` that run under *reentrant* checkpointing.

    Counts layers checkpointed by this package (``use_reentrant=True``, or ``checkpoint_kwargs`` saying so)
    and torch's ``CheckpointWrapper`` with ``CheckpointImpl.REENTRANT``.

    Example::

        >>> from lightning_ckpt import apply_checkpointing
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> _ = apply_checkpointing(model, layer_cls=nn.Linear, use_reentrant=True)
        >>> reentrant_layers(model)
        ['0', '1']
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    names = []
    for name, sub in module.named_modules():
        if is_checkpointed(sub) and sub.forward.options.torch_kwargs().get("use_reentrant", False):
            names.append(name)
        elif isinstance(sub, CheckpointWrapper) and sub.checkpoint_impl == CheckpointImpl.REENTRANT:
            names.append(name)
    return names


def check_ddp_settings(module: nn.Module, ddp_kwargs: dict[str, Any]) -> None:
    """Refuse, before training, DDP settings that break gradient synchronisation with reentrant checkpointing.

    Reentrant checkpointing runs the layer's forward without autograd and its backward as a nested
    backward pass. DDP then sees the checkpointed parameters as unused in forward and ready again in
    backward ("Expected to mark a variable ready only once" with ``find_unused_parameters=True``), and a
    step that skips some parameters (several losses, optional heads) stops the next one ("Expected to
    have finished reduction"). Only ``static_graph=True``, which the user may pass when every step uses
    the same parameters, makes it safe. Non-reentrant checkpointing (the default) needs nothing.

    Example::

        >>> from lightning_ckpt import apply_checkpointing
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> _ = apply_checkpointing(model, layer_cls=nn.Linear, use_reentrant=True)
        >>> check_ddp_settings(model, {"static_graph": True})  # fine: the user says the graph is static
    """
    reentrant = reentrant_layers(module)
    if not reentrant:
        return
    shown = ", ".join(reentrant[:4]) + (", ..." if len(reentrant) > 4 else "")
    fix = (
        "Pass `GradientCheckpointing(use_reentrant=False)` (the default), which works with unused parameters and"
        " `find_unused_parameters=True`; or, only if every training step uses exactly the same parameters,"
        " `CheckpointingDDPStrategy(static_graph=True)`."
    )
    if ddp_kwargs.get("find_unused_parameters", False):
        raise ValueError(
            f"Reentrant checkpointing ({len(reentrant)} layers: {shown}) cannot be combined with DDP's"
            " `find_unused_parameters=True`: DDP marks the checkpointed parameters unused in forward and ready again"
            f" in the recomputation, and fails with 'Expected to mark a variable ready only once'. {fix}"
        )
    if not ddp_kwargs.get("static_graph", False):
        raise ValueError(
            f"Reentrant checkpointing ({len(reentrant)} layers: {shown}) is only safe under DDP with"
            " `static_graph=True`: otherwise a step that leaves some parameters unused (several losses, optional"
            " heads) breaks gradient synchronisation, and DDP stops at the next step waiting for gradients that never"
            f" came. {fix}"
        )


class CheckpointingDDPStrategy(DDPStrategy):
    r"""Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`, with checkpointing applied before wrapping.

    Takes exactly ``DDPStrategy``'s arguments (all launchers, ``start_method="spawn"`` included, and
    multi-node). It reads the settings from the trainer's :class:`~lightning_ckpt.GradientCheckpointing`
    callback and checkpoints the model after ``configure_model``, before ``DistributedDataParallel``
    wraps it. With the default non-reentrant checkpointing any DDP setting works, ``find_unused_parameters``
    included. Reentrant checkpointing is refused before training unless ``static_graph=True`` (see
    :func:`check_ddp_settings`). A spawned run hands the trained weights back and shuts the process group
    down cleanly.

    Registered as ``"ddp_ckpt"``, ``"ddp_ckpt_spawn"``, ``"ddp_ckpt_fork"``, ``"ddp_ckpt_notebook"`` and
    ``"ddp_ckpt_find_unused_parameters_true"``.

    Example::

        trainer = Trainer(strategy="ddp_ckpt", devices=2, callbacks=[GradientCheckpointing(every_n_layers=2)])
        trainer = Trainer(strategy=CheckpointingDDPStrategy(find_unused_parameters=True), devices=2,
                          callbacks=[GradientCheckpointing()])
    """

    strategy_name = "ddp_ckpt"

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _CleanExitLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        _destroy_process_group_at_exit()

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.lightning_module is not None
        _apply_callback(trainer, self.lightning_module)
        check_checkpointing_placement(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            check_ddp_settings(self.lightning_module, self._ddp_kwargs)
        super().setup(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"ddp_ckpt"`` and its launcher variants with ``strategy_registry`` (Lightning's registry)."""
        for name, start_method in (("ddp_ckpt", "popen"), ("ddp_ckpt_spawn", "spawn"), ("ddp_ckpt_fork", "fork"),
                                   ("ddp_ckpt_notebook", "fork")):
            _register(strategy_registry, name, cls, f"DDP with activation checkpointing, start_method={start_method!r}",
                      start_method=start_method)
        _register(strategy_registry, "ddp_ckpt_find_unused_parameters_true", cls,
                  "DDP with activation checkpointing and find_unused_parameters=True", find_unused_parameters=True)
