"""Where saved tensors live: hooks that keep tensors saved for backward in host memory.

Around a checkpointed layer the only tensors saved for backward are the layer's inputs (torch's
checkpoint saves them through the active saved-tensor hooks), so wrapping the checkpoint call in
:class:`OffloadToHost` moves exactly those inputs to (pinned) host memory in forward and back to
their device in backward. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> layer = torch.nn.Linear(8, 8)
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> with OffloadToHost():
    ...     y = checkpoint(layer, x, use_reentrant=False)
    >>> y.sum().backward()
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt.profiling import report_held

_warned_cpu = False


def _warn_cpu_once() -> None:
    global _warned_cpu
    if not _warned_cpu:
        _warned_cpu = True
        warnings.warn(
            "lightning_ckpt: `offload=True` has no effect here: the saved layer inputs are already in host (CPU)"
            " memory. Offload moves them off an accelerator.",
            stacklevel=3,
        )


def _pack(tensor: torch.Tensor) -> Any:
    if tensor.device.type == "cpu" or isinstance(tensor, torch.nn.Parameter):
        if tensor.device.type == "cpu":
            _warn_cpu_once()
        report_held(tensor, "kept")  # still held where it is; these hooks hide it from outer counters
        return tensor
    report_held(tensor, "offloaded")
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


class OffloadToHost(saved_tensors_hooks):
    """Saved-tensor hooks that keep accelerator tensors saved for backward in pinned host memory.

    Parameters are never moved (they stay resident anyway). CPU tensors are left where they are,
    with a one-time warning that offload does nothing on a CPU-only run.
    """

    def __init__(self) -> None:
        super().__init__(_pack, _unpack)
