"""Where checkpointing sits relative to FSDP units and torch's own ``CheckpointWrapper``.

Checkpointing belongs *inside* an FSDP unit, ``FSDP(checkpoint(block))``, and a layer must be checkpointed
once: by this package or by torch's ``CheckpointWrapper``, never both. Plain PyTorch; nothing here imports
Lightning.

Example::

    >>> from torch import nn
    >>> from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> apply_checkpointing(model, layer_cls=nn.Linear)
    ['0', '1']
    >>> fsdp_units(model)  # nothing sharded
    []
    >>> check_checkpointing_placement(model)  # checkpointed once, no FSDP unit inside a layer: fine
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_ckpt.core.checkpoint.selection import is_inside
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names

__all__ = ["check_checkpointing_placement", "fsdp2", "fsdp_units"]


def fsdp2() -> Any:
    """torch's FSDP2 module (public since torch 2.6, under ``_composable`` before)."""
    try:
        from torch.distributed import fsdp
        fsdp.fully_shard  # noqa: B018
    except (ImportError, AttributeError):  # pragma: no cover - torch < 2.6
        from torch.distributed._composable import fsdp
    return fsdp


#: The name :func:`fsdp2` had before it was shared (tests still import it).
_fsdp2 = fsdp2


def fsdp_units(module: nn.Module) -> list[str]:
    """Names of the FSDP units in ``module``: modules sharded with FSDP2's ``fully_shard`` or wrapped in FSDP1.

    Example::

        >>> fsdp_units(nn.Linear(2, 2))
        []
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp_module = fsdp2().FSDPModule
    return [name for name, sub in module.named_modules() if isinstance(sub, (fsdp_module, FullyShardedDataParallel))]


def check_checkpointing_placement(module: nn.Module) -> None:
    """Refuse layers checkpointed twice; warn about FSDP units *inside* a checkpointed layer.

    A layer checkpointed by this package inside or around torch's ``CheckpointWrapper`` (from
    ``FSDPStrategy(activation_checkpointing_policy=...)`` or ``apply_activation_checkpointing``) would be
    recomputed twice: that is an error. Checkpointing belongs inside the FSDP unit, ``FSDP(checkpoint(block))``;
    units inside a checkpointed layer (e.g. ``fully_shard`` on each ``nn.Linear`` with ``layer_cls=Block``)
    have their hooks run again in the recomputation, so they get a warning (on rank zero).

    Example::

        >>> check_checkpointing_placement(nn.Linear(2, 2))  # nothing checkpointed, nothing sharded: fine
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    checkpointed = checkpointed_names(module)
    wrappers = [name for name, sub in module.named_modules() if isinstance(sub, CheckpointWrapper)]
    for layer in checkpointed:
        for wrapper in wrappers:
            if layer == wrapper or is_inside(wrapper, layer) or is_inside(layer, wrapper):
                raise ValueError(
                    f"`{layer}` is checkpointed by GradientCheckpointing and by torch's `CheckpointWrapper`"
                    f" (`{wrapper}`, from an `activation_checkpointing_policy` or `apply_activation_checkpointing`):"
                    " it would be recomputed twice. Remove one of them; the callback alone is enough."
                )
    units = fsdp_units(module)
    for layer in checkpointed:
        inner = [unit for unit in units if unit != layer and is_inside(unit, layer)]
        if inner:
            _warn_on_rank_zero(
                f"The checkpointed layer `{layer}` contains FSDP units ({', '.join(inner[:4])}), whose hooks run"
                " again when it is recomputed. Shard whole layers instead (one FSDP unit per checkpointed layer:"
                " `fully_shard` on the block, or an `auto_wrap_policy` of the layer class), so that checkpointing"
                " sits inside the unit."
            )
            return


def _warn_on_rank_zero(message: str) -> None:
    """Warn once per job, not once per rank: only on rank zero of the default process group (or without one)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
