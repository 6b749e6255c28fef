"""DDP and FSDP strategies that apply checkpointing at the right moment and with safe settings.

Both read their settings from the trainer's :class:`~lightning_ckpt.GradientCheckpointing` callback
(one source of truth) and apply them after ``configure_model`` and before the model is wrapped or
sharded, so layers built in ``configure_model`` are checkpointed too.

- :class:`CheckpointingDDPStrategy` (``"ddp_ckpt"``) is Lightning's ``DDPStrategy`` that refuses, before
  training, the reentrant-checkpointing settings that break DDP's gradient synchronisation.
- :class:`CheckpointingFSDPStrategy` (``"fsdp_ckpt"``) is Lightning's ``ModelParallelStrategy`` (FSDP2,
  ``torch.distributed.fsdp.fully_shard``) that shards the model itself when ``configure_model`` did not:
  one FSDP unit per block, then the rest, so checkpointing sits *inside* each unit.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing

    trainer = Trainer(strategy="ddp_ckpt", devices=4, callbacks=[GradientCheckpointing()])
    trainer = Trainer(strategy="fsdp_ckpt", devices=4, precision="bf16-mixed",
                      callbacks=[GradientCheckpointing(layer_cls="my_project.model.Block")])
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _distributed_is_initialized
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

# `check_lightning_strategy`, `find_checkpointing_callback`, `check_checkpointing_placement` and `fsdp_units` live
# with the concept they check (the callback; placement) and are re-exported here, where they were first defined.
from lightning_ckpt.callbacks.gradient_checkpointing import check_lightning_strategy, find_checkpointing_callback
from lightning_ckpt.core.placement import _fsdp2, check_checkpointing_placement, fsdp_units
from lightning_ckpt.core.selection import layer_classes, select_layers
from lightning_ckpt.core.wrapping import is_checkpointed

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

__all__ = [
    "CheckpointingDDPStrategy",
    "CheckpointingFSDPStrategy",
    "check_checkpointing_placement",
    "check_ddp_settings",
    "check_lightning_strategy",
    "find_checkpointing_callback",
    "fsdp_units",
    "mixed_precision_policy",
    "reentrant_layers",
    "shard_for_checkpointing",
]


# --------------------------------------------------------------------------------------------------
# The callback: one source of truth
# --------------------------------------------------------------------------------------------------


def _apply_callback(trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> list[str]:
    """Apply the trainer's checkpointing callback to ``pl_module`` now (idempotent); ``[]`` without one."""
    callback = find_checkpointing_callback(trainer) if trainer is not None else None
    if callback is None:
        return []
    return callback.apply(pl_module)


# --------------------------------------------------------------------------------------------------
# DDP: reentrant checkpointing is only safe on a static graph
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# FSDP2: shard each block, then the rest, so that checkpointing sits inside each FSDP unit
# --------------------------------------------------------------------------------------------------


def shard_for_checkpointing(
    module: nn.Module,
    mesh: Any,
    layer_cls: Union[type[nn.Module], Sequence[type[nn.Module]], None] = None,
    reshard_after_forward: Optional[bool] = None,
    mp_policy: Any = None,
) -> list[str]:
    """Shard ``module`` with FSDP2: every block of ``layer_cls`` is its own unit, then each top-level child.

    Blocks are sharded before the submodules that contain them, so a checkpointed block's recomputation
    runs inside its own unit and backward all-gathers each block once, with or without checkpointing.
    ``module`` itself (usually the LightningModule) is not sharded: its children are the roots, so a
    ``training_step`` that calls ``self.model(...)`` instead of ``self(...)`` works. Parameters registered
    directly on ``module`` are refused. Returns the names of the units, in the order they were sharded.

    Args:
        module: the module to shard (in place).
        mesh: a 1-D data-parallel ``DeviceMesh`` (``"cpu"`` with gloo or ``"cuda"`` with nccl).
        layer_cls: the block class(es); ``None`` detects the repeated block (no blocks: only the children).
        reshard_after_forward: for the blocks, as in ``fully_shard``; the roots keep theirs (``None``).
        mp_policy: a ``MixedPrecisionPolicy`` for all units (``None``: full precision).

    Example::

        mesh = init_device_mesh("cpu", (world_size,))
        shard_for_checkpointing(gpt, mesh, layer_cls=Block)  # ['model.blocks.0', ..., 'model']
    """
    fsdp = _fsdp2()
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} registers parameters directly ({', '.join(own)}); FSDP shards submodules."
            " Move them into a submodule (e.g. `self.model`), or shard the model yourself in `configure_model`."
        )
    classes = _block_classes(module, layer_cls)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    units: list[str] = []
    if classes:
        for name, block in select_layers(module, classes, every_n_layers=1):
            if name == "":
                continue
            fsdp.fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
            units.append(name)
    for name, child in module.named_children():
        if name in units or not _has_unsharded_parameters(child):
            continue
        fsdp.fully_shard(child, **kwargs)
        units.append(name)
    return units


def _block_classes(
    module: nn.Module, layer_cls: Union[type[nn.Module], Sequence[type[nn.Module]], None]
) -> tuple[type[nn.Module], ...]:
    try:
        return layer_classes(module, layer_cls)
    except ValueError as err:
        if layer_cls is not None:
            raise
        rank_zero_info(f"CheckpointingFSDPStrategy: no repeated block to shard on its own ({err}); sharding the"
                       " top-level submodules only.")
        return ()


def _has_unsharded_parameters(module: nn.Module) -> bool:
    fsdp_module = _fsdp2().FSDPModule
    covered = {id(p) for sub in module.modules() if isinstance(sub, fsdp_module) for p in sub.parameters()}
    return any(id(p) not in covered for p in module.parameters())


def mixed_precision_policy(precision_plugin: Precision) -> Any:
    """The FSDP2 ``MixedPrecisionPolicy`` for Lightning's ``precision`` setting (``None``: full precision).

    ``"bf16-mixed"`` all-gathers and computes in bfloat16 and reduces gradients in float32; ``"*-true"``
    precisions convert the module itself, so they need no policy. ``"16-mixed"`` needs a gradient
    scaler that FSDP2 does not synchronise across ranks, and is refused.

    Example::

        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> mixed_precision_policy(MixedPrecision("bf16-mixed", "cpu")).param_dtype
        torch.bfloat16
    """
    precision = getattr(precision_plugin, "precision", "32-true")
    if precision == "16-mixed":
        raise ValueError(
            "CheckpointingFSDPStrategy does not support `precision='16-mixed'` (its gradient scaler is not synchronised"
            " across FSDP ranks). Pass `precision='bf16-mixed'`, or `'16-true'`/`'bf16-true'`."
        )
    if isinstance(precision_plugin, MixedPrecision) and precision == "bf16-mixed":
        return _fsdp2().MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


class CheckpointingFSDPStrategy(ModelParallelStrategy):
    r"""Fully sharded data parallel (FSDP2, ``fully_shard``) with checkpointing inside each FSDP unit.

    Builds on Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`. After
    ``configure_model`` (the model may also be built in ``__init__``), it checkpoints the layers chosen by
    the trainer's :class:`~lightning_ckpt.GradientCheckpointing` callback and, unless ``configure_model``
    already called ``fully_shard``, shards every block of the callback's ``layer_cls`` (or the detected
    repeated block) as its own unit, then each top-level submodule (:func:`shard_for_checkpointing`). The
    recomputation therefore runs inside the block's unit: backward all-gathers each block once, as without
    checkpointing. Mixed precision comes from the Trainer's ``precision`` (``"bf16-mixed"``: parameters
    all-gathered in bfloat16, gradients reduced in float32).

    Args:
        reshard_after_forward: free each block's gathered parameters after forward (``True``, the memory
            saving default) or keep them until backward (``False``, one all-gather less per block).
        save_distributed_checkpoint: ``False`` (default) saves one full checkpoint file, which loads into a
            plain, unsharded copy of the model (``MyModel.load_from_checkpoint(path)``); ``True`` saves a folder
            of shards per rank, for models too large to gather.
        start_method: ``"popen"`` (default: the script is relaunched per rank, or processes come from the
            cluster), or ``"spawn"``/``"fork"``/``"forkserver"`` (processes started from the Trainer; the trained,
            unsharded weights are handed back to the main process).
        data_parallel_size: ranks to shard over (``"auto"``: all of them, divided by ``tensor_parallel_size``).
        tensor_parallel_size: ranks per tensor-parallel group, for a ``configure_model`` that applies it.
        process_group_backend: ``"gloo"``/``"nccl"``; by default from the device.
        timeout: the process group's timeout.

    Registered as ``"fsdp_ckpt"`` and ``"fsdp_ckpt_spawn"``.

    Example::

        trainer = Trainer(strategy="fsdp_ckpt", devices=8, precision="bf16-mixed",
                          callbacks=[GradientCheckpointing(layer_cls=Block)])
        trainer.fit(model)
    """

    strategy_name = "fsdp_ckpt"

    def __init__(
        self,
        reshard_after_forward: Optional[bool] = True,
        save_distributed_checkpoint: bool = False,
        start_method: StartMethod = "popen",
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: int = 1,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"`start_method={start_method!r}` is not understood. Pass 'popen', 'spawn', 'fork' or"
                             " 'forkserver'.")
        self._start_method = start_method
        self._reshard_after_forward = reshard_after_forward
        self.sharded_units: list[str] = []

    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _CleanExitLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = max(1, self.num_nodes * self.num_processes // int(self._tensor_parallel_size))
        super().setup_environment()
        _destroy_process_group_at_exit()

    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TypeError(
                "Found modules wrapped in FSDP1's `FullyShardedDataParallel`; CheckpointingFSDPStrategy uses FSDP2."
                " Use `torch.distributed.fsdp.fully_shard` in `configure_model`, or let the strategy shard the model."
            )
        mp_policy = mixed_precision_policy(self.precision_plugin)
        _apply_callback(trainer, self.lightning_module)
        if not fsdp_units(self.model):  # else `configure_model` (or an earlier run) sharded it: keep that layout
            callback = find_checkpointing_callback(trainer)
            layer_cls = callback.layer_cls if callback is not None else None
            self.sharded_units = shard_for_checkpointing(
                self.lightning_module, self.device_mesh["data_parallel"], layer_cls,
                reshard_after_forward=self._reshard_after_forward, mp_policy=mp_policy,
            )
            rank_zero_info(f"CheckpointingFSDPStrategy: {len(self.sharded_units)} FSDP units"
                           f" ({', '.join(self.sharded_units[:6])}{', ...' if len(self.sharded_units) > 6 else ''})")
        check_checkpointing_placement(self.model)

        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def full_state_dict(self) -> dict[str, Any]:
        """The model's unsharded weights, on CPU, on rank 0 (an empty dict on the other ranks; collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"fsdp_ckpt"`` and ``"fsdp_ckpt_spawn"`` with ``strategy_registry`` (Lightning's registry)."""
        _register(strategy_registry, "fsdp_ckpt", cls, "FSDP2 with activation checkpointing inside each unit")
        _register(strategy_registry, "fsdp_ckpt_spawn", cls,
                  "FSDP2 with activation checkpointing inside each unit, start_method='spawn'", start_method="spawn")


# --------------------------------------------------------------------------------------------------
# Launching and tearing down
# --------------------------------------------------------------------------------------------------


class _CleanExitLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher that hands back unsharded weights and ends the workers cleanly.

    A worker whose interpreter finalizes with gloo state still alive can abort at exit ("terminate called
    without an active exception"), which fails the whole run although training finished. So once a worker
    has handed its results back, it destroys the process groups (after a barrier) and leaves with
    ``os._exit(0)``, as forked workers always do, skipping interpreter finalization. A worker that raised
    leaves through the usual error path instead.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        _shutdown_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        with _unsharded_state_dict(self._strategy, trainer.lightning_module):
            return super()._collect_rank_zero_results(trainer, results)


@contextmanager
def _unsharded_state_dict(strategy: Strategy, pl_module: pl.LightningModule) -> Iterator[None]:
    """While active, ``pl_module.state_dict()`` returns the full weights (rank 0) when the model is sharded."""
    if not isinstance(strategy, CheckpointingFSDPStrategy) or not fsdp_units(pl_module):
        yield
        return
    full = strategy.full_state_dict()
    pl_module.state_dict = lambda *args, **kwargs: full  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.state_dict


def _shutdown_process_group() -> None:
    if _distributed_is_initialized():
        torch.distributed.barrier()
        _destroy_dist_connection()


_exit_hook_registered = False


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group when the interpreter exits (Lightning itself only does this for nccl)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_release_process_group)
        _exit_hook_registered = True


def _release_process_group(grace_seconds: float = 0.05) -> None:
    """Let the process group's worker threads finish, then destroy it; run at exit, before interpreter shutdown.

    Gloo's worker threads drop a finished collective's tensors after the caller has returned, and need the GIL to
    do it. A worker still doing so when the interpreter starts shutting down is ended mid-destructor, and the
    whole process aborts ("terminate called without an active exception") although training finished. Gloo has
    no call that waits for its workers, so this sleeps briefly (the GIL released) before destroying the group.
    """
    if _distributed_is_initialized():
        time.sleep(grace_seconds)
        _destroy_dist_connection()


def _register(registry: _StrategyRegistry, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``name``; registering the same class again (e.g. on re-import) is a no-op."""
    same = name in registry and registry[name]["strategy"].__name__ == cls.__name__
    registry.register(name, cls, description=description, override=same, **init_params)


def _register_all() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    CheckpointingDDPStrategy.register_strategies(StrategyRegistry)
    CheckpointingFSDPStrategy.register_strategies(StrategyRegistry)


_register_all()
