"""FSDP2: :class:`CheckpointingFSDPStrategy` (``"fsdp_ckpt"``) shards each block, then the rest, so that
checkpointing sits inside each FSDP unit (:func:`shard_for_checkpointing`).

Mixed precision comes from the Trainer's ``precision`` (:func:`mixed_precision_policy`); a spawned run hands the
unsharded weights back to the main process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_ckpt.callbacks.gradient_checkpointing import find_checkpointing_callback
from lightning_ckpt.core.placement import check_checkpointing_placement, fsdp2, fsdp_units
from lightning_ckpt.core.selection import layer_classes, select_layers
from lightning_ckpt.strategies.common import (
    _apply_callback,
    _CleanExitLauncher,
    _destroy_process_group_at_exit,
    _register,
)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

__all__ = ["CheckpointingFSDPStrategy", "mixed_precision_policy", "shard_for_checkpointing"]


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
    fsdp = fsdp2()
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
    fsdp_module = fsdp2().FSDPModule
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
        return fsdp2().MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
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
            self._launcher = _UnshardingLauncher(self, start_method=self._start_method)

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


class _UnshardingLauncher(_CleanExitLauncher):
    """The clean-exit launcher of :class:`CheckpointingFSDPStrategy`: it hands the unsharded weights back."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        with _unsharded_state_dict(self._strategy, trainer.lightning_module):
            return super()._collect_rank_zero_results(trainer, results)


@contextmanager
def _unsharded_state_dict(strategy: CheckpointingFSDPStrategy, pl_module: pl.LightningModule) -> Iterator[None]:
    """While active, ``pl_module.state_dict()`` returns the full weights (rank 0) when the model is sharded."""
    if not fsdp_units(pl_module):
        yield
        return
    full = strategy.full_state_dict()
    pl_module.state_dict = lambda *args, **kwargs: full  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.state_dict
