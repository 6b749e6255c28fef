"""What one device holds that checkpointing does not change, under the configured strategy: the weights, gradients
and optimizer state (:class:`StaticMemory`, :func:`static_memory`), the host memory there is (:class:`HostMemory`),
and whether the model would fit the device built for real (:func:`would_not_fit`).

How the strategy shards them is :mod:`~lightning_ckpt.commands.plan.sharding`; :mod:`~lightning_ckpt.commands.plan.build`
builds the model they are counted on; the report shows them
(:func:`~lightning_ckpt.commands.plan.report.sharding_lines`).

Example::

    >>> StaticMemory(weights=400, gradients=400, optimizer_state=800, optimizer="AdamW").total  # bytes on one device
    1600
"""


from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import psutil
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_ckpt.core.measure.profiling import storage_key, tensor_bytes
from lightning_ckpt.core.plan.budget import host_memory_share
from lightning_ckpt.strategies.fsdp import mixed_precision_policy, unit_parameters
from lightning_ckpt.commands.plan.build import Built
from lightning_ckpt.commands.plan.sharding import Sharding


@dataclass
class StaticMemory:
    """Bytes that checkpointing does not change, on one device: weights (and buffers), gradients, optimizer state,
    each device's share when the configured strategy shards them (``sharding``; ``unsharded``: the whole).

    Under CPU offload (``sharding.cpu_offload``) the shares are in host memory (``host_*``) and the device figures
    are what FSDP2 gathers there (:func:`gathered_bytes`) and the buffers; no optimizer state.

    Example::

        >>> static = StaticMemory(10, 4, 0, "AdamW", host_weights=100, host_gradients=100, host_optimizer_state=208)
        >>> static.total, static.host_total
        (14, 408)
    """

    weights: int
    gradients: int
    optimizer_state: Optional[int]
    optimizer: str
    sharding: Sharding = field(default_factory=Sharding)
    unsharded: Optional[int] = None
    host_weights: int = 0
    host_gradients: int = 0
    host_optimizer_state: Optional[int] = 0

    @property
    def total(self) -> int:
        """Bytes on the device."""
        return self.weights + self.gradients + (self.optimizer_state or 0)

    @property
    def host_total(self) -> int:
        """Bytes in host memory (CPU offload; 0 without it)."""
        return self.host_weights + self.host_gradients + (self.host_optimizer_state or 0)


@dataclass(frozen=True)
class HostMemory:
    """The host memory one device's process may use (``--host-memory``, else this machine's:
    :func:`this_machine_host_memory`), and what of it is left for offloaded activations once CPU offload's share of
    the parameters, gradients and optimizer state (``static``) is in it.

    Example::

        >>> host = HostMemory(256 * 2**30, given=True, static=120 * 2**30)
        >>> host.for_offload / 2**30, host.fits
        (136.0, True)
        >>> HostMemory(2**30, given=False, static=3 * 2**30).for_offload  # the static share alone does not fit
        0
    """

    total: int
    given: bool
    static: int = 0

    @property
    def for_offload(self) -> int:
        """Bytes offloaded activations may take: what ``static`` leaves (the planner's ``host_memory``)."""
        return max(0, self.total - self.static)

    @property
    def fits(self) -> bool:
        """Whether CPU offload's static share fits at all."""
        return self.static <= self.total


def this_machine_host_memory() -> int:
    """Half of this machine's available memory: the planner's ``host_memory`` when not told
    (:func:`~lightning_ckpt.core.plan.budget.host_memory_share` for one device)."""
    return host_memory_share(psutil.virtual_memory().available, 1)


def gathered_bytes(module: nn.Module, layer_cls: Any = None, precision: Optional[Precision] = None,
                   reshard_after_forward: bool = True) -> tuple[int, int]:
    """``(parameters, gradients)``: the bytes FSDP2 gathers on a device at once for ``module`` sharded by
    ``fsdp_ckpt`` (:func:`~lightning_ckpt.strategies.fsdp.unit_parameters`), whatever the shards are: the root units'
    parameters, kept gathered from their forward to the end of the backward, and the two largest blocks' (the one
    computing and the next, prefetched; every block when ``reshard_after_forward`` is ``False``); the gradients of
    the roots' and the largest block's trainable parameters, held until reduce-scattered. In the dtype they are
    gathered in: ``precision``'s FSDP2 policy (``bf16-mixed``: bfloat16), else the parameters' own.

    Example::

        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> from lightning_ckpt.demos import GPT
        >>> gpt = GPT(vocab_size=8, block_size=4, n_layer=3, n_embd=4, n_head=1)  # blocks of 244, roots of 96 floats
        >>> gathered_bytes(gpt)  # (96 + 2 x 244) x 4 B, (96 + 244) x 4 B
        (2336, 1360)
        >>> gathered_bytes(gpt, precision=MixedPrecision("bf16-mixed", "cpu"))  # gathered in bfloat16
        (1168, 680)
    """
    try:
        policy = mixed_precision_policy(precision) if precision is not None else None
    except ValueError:  # "16-mixed", which fsdp_ckpt refuses when the run starts
        policy = None
    dtype = getattr(policy, "param_dtype", None)

    def nbytes(params: Iterable[torch.Tensor], trainable_only: bool = False) -> int:
        return sum(p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
                   for p in params if p.requires_grad or not trainable_only)

    blocks, roots = unit_parameters(module, layer_cls)
    sizes = sorted((nbytes(b) for b in blocks), reverse=True)
    held = sizes if not reshard_after_forward else sizes[:2]
    grads = max((nbytes(b, trainable_only=True) for b in blocks), default=0)
    return nbytes(roots) + sum(held), nbytes(roots, trainable_only=True) + grads


def sharded_bytes(tensors: Iterable[Optional[torch.Tensor]], shards: int) -> int:
    """Bytes one device holds of ``tensors`` when each is split along its first dimension over ``shards`` devices,
    as ``fully_shard`` splits parameters: rows padded to a multiple of ``shards`` (the largest share); 0-d tensors
    whole; each storage once. With ``shards=1``: :func:`~lightning_ckpt.core.measure.profiling.tensor_bytes`.

    Example::

        >>> sharded_bytes([torch.zeros(10, 4), torch.zeros(())], 4)  # 3 of 10 rows of 4 float32; a whole scalar
        52
    """
    seen: set[tuple[Any, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta" or storage_key(tensor) in seen:
            continue
        seen.add(storage_key(tensor))
        nbytes, rows = tensor.untyped_storage().nbytes(), (tensor.shape[0] if tensor.dim() else 0)
        total += nbytes if rows == 0 or shards == 1 else -(-rows // shards) * nbytes // rows
    return total


def static_memory(built: Built) -> StaticMemory:
    """Count weights and gradients, and the optimizer state after one step on zero gradients: one device's share
    under the configured strategy (:attr:`Built.sharding`).

    The optimizer comes from the module's ``configure_optimizers``; its step changes the weights (Adam's weight
    decay), so this runs after everything else has been measured.

    Under CPU offload (``fsdp_ckpt``'s ``cpu_offload``) those shares are in host memory (``host_*``), and the device
    holds the buffers, what FSDP2 gathers (:func:`gathered_bytes`) and no optimizer state.
    """
    module, sharding = built.module, built.sharding
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    buffers = tensor_bytes(module.buffers())

    def share(weights: int, states: int, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, int, int]:
        moments = [t for o in optimizers for state in o.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return (sharded_bytes(params, weights) + buffers, sharded_bytes(trainable, states), sharded_bytes(moments, states))

    try:
        with built.mode():
            optimizers = _optimizers(module.configure_optimizers())
            for p in trainable:
                p.grad = torch.zeros_like(p)
            for optimizer in optimizers:
                optimizer.step()
    except Exception as err:  # noqa: BLE001 - a configure_optimizers that needs the Trainer, a closure, ...
        weights, gradients, _ = share(sharding.weights, sharding.states, [])
        return _offloaded(StaticMemory(weights, gradients, None, f"unknown: configure_optimizers or its step failed"
                                       f" ({err})", sharding), built, buffers)
    finally:
        for p in params:
            p.grad = None
    names = ", ".join(type(o).__name__ for o in optimizers) or "none"
    return _offloaded(StaticMemory(*share(sharding.weights, sharding.states, optimizers), names, sharding,
                                   sum(share(1, 1, optimizers))), built, buffers)


def _offloaded(static: StaticMemory, built: Built, buffers: int) -> StaticMemory:
    """``static`` as it is under CPU offload (:attr:`Sharding.cpu_offload`): its shares of the parameters, gradients
    and optimizer state in host memory; on the device the buffers and what FSDP2 gathers (:func:`gathered_bytes`).
    Unchanged without CPU offload."""
    if not static.sharding.cpu_offload:
        return static
    parameters, gradients = gathered_bytes(built.module, built.layer_cls, built.precision,
                                           static.sharding.reshard_after_forward)
    return replace(static, weights=buffers + parameters, gradients=gradients,
                   optimizer_state=None if static.optimizer_state is None else 0,
                   host_weights=static.weights - buffers, host_gradients=static.gradients,
                   host_optimizer_state=static.optimizer_state)


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (one, a list, a tuple with schedulers, dicts)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured if isinstance(item, (torch.optim.Optimizer, Mapping, list, tuple))
                for o in _optimizers(item)]
    return []


def _available_memory(device: torch.device) -> Optional[int]:
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def would_not_fit(built: Built) -> bool:
    """Whether weights, gradients and two optimizer copies of the trainable weights exceed 80% of what is free."""
    params = list(built.module.parameters())
    trainable = tensor_bytes(p for p in params if p.requires_grad)
    need = tensor_bytes(params) + 3 * trainable
    available = _available_memory(built.device)
    return available is not None and need > 0.8 * available
