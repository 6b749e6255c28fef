"""What both checkpointing strategies share: the callback applied at the right moment, a launcher whose workers
exit cleanly, the process group destroyed at exit, and registering names with Lightning's strategy registry."""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _distributed_is_initialized
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from lightning_ckpt.callbacks.gradient_checkpointing import find_checkpointing_callback


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
# Launching and tearing down
# --------------------------------------------------------------------------------------------------


class _CleanExitLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher that ends the workers cleanly.

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


# --------------------------------------------------------------------------------------------------
# Registering
# --------------------------------------------------------------------------------------------------


def _register(registry: _StrategyRegistry, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``name``; registering the same class again (e.g. on re-import) is a no-op.

    Example::

        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> registry = _StrategyRegistry()
        >>> _register(registry, "my_ddp", DDPStrategy, "DDP, unused parameters found", find_unused_parameters=True)
        >>> _register(registry, "my_ddp", DDPStrategy, "DDP, unused parameters found", find_unused_parameters=True)
        >>> registry["my_ddp"]["init_params"]
        {'find_unused_parameters': True}
    """
    same = name in registry and registry[name]["strategy"].__name__ == cls.__name__
    registry.register(name, cls, description=description, override=same, **init_params)
