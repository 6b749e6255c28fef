"""FSDP2: :class:`CheckpointingFSDPStrategy` (``"fsdp_ckpt"``) shards each block, then the rest, so that
checkpointing sits inside each FSDP unit (:func:`shard_for_checkpointing`).

Mixed precision comes from the Trainer's ``precision`` (:func:`mixed_precision_policy`); a spawned run hands the
unsharded weights back to the main process. ``cpu_offload=True`` (``"fsdp_ckpt_cpu_offload"``) keeps parameters,
gradients and optimizer state in host memory with FSDP2's own ``CPUOffloadPolicy`` (:func:`cpu_offload_policy`),
so one device can train a model whose states do not fit it; :func:`unit_parameters` says what each unit gathers.
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
from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement, fsdp2, fsdp_units
from lightning_ckpt.core.checkpoint.selection import layer_classes, select_layers
from lightning_ckpt.strategies.common import (
    _apply_callback,
    _CleanExitLauncher,
    _destroy_process_group_at_exit,
    _register,
)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

__all__ = ["CheckpointingFSDPStrategy", "cpu_offload_policy", "mixed_precision_policy", "shard_for_checkpointing",
           "unit_parameters"]


def shard_for_checkpointing(
    module: nn.Module,
    mesh: Any,
    layer_cls: Union[type[nn.Module], Sequence[type[nn.Module]], None] = None,
    reshard_after_forward: Optional[bool] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
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
        offload_policy: a ``CPUOffloadPolicy`` for all units (``None``: every shard on the device).

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
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
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


def unit_parameters(
    module: nn.Module, layer_cls: Union[type[nn.Module], Sequence[type[nn.Module]], None] = None
) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """The parameters each FSDP unit of :func:`shard_for_checkpointing` would gather, without sharding anything:
    ``(blocks, roots)``, one list per block of ``layer_cls`` (``None``: the detected repeated block) and the
    parameters of the top-level units (everything outside the blocks). FSDP2 gathers a block for its forward and
    again for its backward; a top-level unit is a root, which keeps its parameters gathered from its forward to the
    end of the backward. ``lightning-ckpt plan`` counts what a device holds under CPU offload from them.

    Example::

        >>> from lightning_ckpt.demos import GPT
        >>> blocks, roots = unit_parameters(GPT(vocab_size=8, block_size=4, n_layer=2, n_embd=4, n_head=1))
        >>> len(blocks), sum(p.numel() for p in blocks[0]), sum(p.numel() for p in roots)
        (2, 244, 96)

    A block of width 4: two LayerNorms (2 x 8), qkv (4 x 12 + 12), proj (4 x 4 + 4) and the MLP (4 x 16 + 16,
    16 x 4 + 4): 244. The roots: token and position embeddings (8 x 4, 4 x 4), the final LayerNorm (8), the head
    (4 x 8 + 8): 96.
    """
    classes = _block_classes(module, layer_cls)
    blocks = [list(block.parameters()) for name, block in select_layers(module, classes, every_n_layers=1)
              if name != ""] if classes else []
    in_blocks = {id(p) for params in blocks for p in params}
    return blocks, [p for p in module.parameters() if id(p) not in in_blocks]


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


def cpu_offload_policy(cpu_offload: Any, pin_memory: Optional[bool] = None) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for a ``cpu_offload`` setting, or ``None`` for no offload.

    ``cpu_offload`` is ``True``/``False``/``None`` (Lightning's ``FSDPStrategy`` takes the same), a
    ``CPUOffloadPolicy`` (kept as given), or FSDP1's ``CPUOffload`` (its ``offload_params``). ``True`` pins the host
    copies (faster transfers) when an accelerator is there to pin for: ``pin_memory`` decides, by default whether
    CUDA is available.

    Example::

        >>> cpu_offload_policy(True, pin_memory=False)
        CPUOffloadPolicy(pin_memory=False)
        >>> cpu_offload_policy(False) is None and cpu_offload_policy(None) is None
        True
    """
    fsdp = fsdp2()
    if isinstance(cpu_offload, fsdp.CPUOffloadPolicy):
        return cpu_offload
    if isinstance(cpu_offload, fsdp.OffloadPolicy):  # the base class: no offload
        return None
    from torch.distributed.fsdp import CPUOffload  # FSDP1's setting, as Lightning's FSDPStrategy takes it

    if isinstance(cpu_offload, CPUOffload):
        cpu_offload = cpu_offload.offload_params
    if cpu_offload is None or isinstance(cpu_offload, bool):
        if not cpu_offload:
            return None
        return fsdp.CPUOffloadPolicy(pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
    raise ValueError(f"`cpu_offload={cpu_offload!r}` is not understood. Pass True (parameters, gradients and optimizer"
                     " state in host memory), False, or a `torch.distributed.fsdp.CPUOffloadPolicy`.")


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
        cpu_offload: ``True`` keeps each device's shard of the parameters, their gradients and the optimizer state
            in host memory (FSDP2's ``CPUOffloadPolicy``, pinned when an accelerator is there): each unit's
            parameters are copied to the device and gathered for its forward and backward, its gradients go back to
            host memory, and the optimizer steps there. One device can then train a model whose states do not fit
            it, at the cost of the transfers. A ``CPUOffloadPolicy`` is used as given; ``False`` or ``None``: no
            offload (the name is Lightning's ``FSDPStrategy(cpu_offload=...)``).
        data_parallel_size: ranks to shard over (``"auto"``: all of them, divided by ``tensor_parallel_size``).
        tensor_parallel_size: ranks per tensor-parallel group, for a ``configure_model`` that applies it.
        process_group_backend: ``"gloo"``/``"nccl"``; by default from the device.
        timeout: the process group's timeout.

    Registered as ``"fsdp_ckpt"``, ``"fsdp_ckpt_spawn"`` and ``"fsdp_ckpt_cpu_offload"`` (``cpu_offload=True``).

    Example::

        trainer = Trainer(strategy="fsdp_ckpt", devices=8, precision="bf16-mixed",
                          callbacks=[GradientCheckpointing(layer_cls=Block)])
        trainer.fit(model)
        # one device, parameters, gradients and optimizer state in host memory
        trainer = Trainer(strategy="fsdp_ckpt_cpu_offload", devices=1, precision="bf16-mixed",
                          callbacks=[GradientCheckpointing(layer_cls=Block)])
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
        cpu_offload: Union[bool, Any, None] = None,
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
        #: FSDP2's ``CPUOffloadPolicy`` the units are sharded with, or ``None`` (see ``cpu_offload``).
        self.cpu_offload = cpu_offload_policy(cpu_offload)
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
                reshard_after_forward=self._reshard_after_forward, mp_policy=mp_policy, offload_policy=self.cpu_offload,
            )
            rank_zero_info(f"CheckpointingFSDPStrategy: {len(self.sharded_units)} FSDP units"
                           f" ({', '.join(self.sharded_units[:6])}{', ...' if len(self.sharded_units) > 6 else ''})"
                           + (", parameters, gradients and optimizer state in host memory" if self.cpu_offload else ""))
        elif self.cpu_offload is not None:
            _check_units_offloaded(self.model)
        check_checkpointing_placement(self.model)

        offloaded = self.cpu_offload is not None
        # Under CPU offload the shards live in host memory: materialised there, never moved to the device.
        _materialize_distributed_module(self.model, torch.device("cpu") if offloaded else self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        if offloaded:
            _unmanaged_to_device(self.model, self.root_device)
        else:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not offloaded:  # offloaded: the state stays by its shards
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
        _register(strategy_registry, "fsdp_ckpt_cpu_offload", cls,
                  "FSDP2 with activation checkpointing inside each unit, parameters, gradients and optimizer state in"
                  " host memory", cpu_offload=True)


def _check_units_offloaded(module: nn.Module) -> None:
    """Refuse ``cpu_offload`` when ``configure_model`` sharded ``module`` itself without it: the strategy keeps a
    layout it did not make, so the offload would silently not happen."""
    fsdp = fsdp2()
    plain = [name for name, sub in module.named_modules() if isinstance(sub, fsdp.FSDPModule)
             and not any(isinstance(group.offload_policy, fsdp.CPUOffloadPolicy)
                         for group in _param_groups(sub))]
    if plain:
        raise ValueError(f"`cpu_offload` was asked, but `configure_model` sharded {', '.join(plain[:4])}"
                         f"{', ...' if len(plain) > 4 else ''} without it. Pass"
                         " `offload_policy=CPUOffloadPolicy()` to your `fully_shard` calls, or let the strategy shard"
                         " the model (do not call `fully_shard` in `configure_model`).")


def _param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one unit (none for a unit without parameters)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    if hasattr(state, "_fsdp_param_groups"):  # torch 2.13: a list (several with a shard_placement_fn)
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _unmanaged_to_device(module: nn.Module, device: torch.device) -> None:
    """Move what FSDP2 does not manage to ``device``: buffers, and parameters that are not sharded (FSDP2 keeps its
    own shards in host memory under CPU offload and copies them to the device for each unit)."""
    from torch.distributed.tensor import DTensor

    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)
        for param in sub._parameters.values():
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)


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
