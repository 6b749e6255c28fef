"""How the configured strategy divides static memory over devices, as ``lightning-ckpt plan`` counts it: each
device's share of the parameters, gradients and optimizer state (:class:`Sharding`, :func:`sharding_of`), and how
many devices a trainer's ``devices`` means (:func:`device_count`).

:mod:`~lightning_ckpt.commands.plan.build` reads the strategy from the config; the bytes one device holds are
:mod:`~lightning_ckpt.commands.plan.static_memory`.

Example::

    >>> sharding_of("fsdp_ckpt", devices=4, num_nodes=2).weights  # each device holds an eighth of the parameters
    8
"""


from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry

from lightning_ckpt.strategies import CheckpointingFSDPStrategy
from lightning_ckpt.strategies.fsdp import cpu_offload_policy


def _import_class(path: str) -> Optional[type]:
    """The class at dotted ``path``, or ``None`` when it cannot be imported here (a strategy's, an accelerator's: the
    build reads both)."""
    module_name, _, cls_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except Exception:  # noqa: BLE001 - any import-time failure means "not here"
        return None


@dataclass(frozen=True)
class Sharding:
    """How the configured strategy divides static memory over devices: each device holds ``1/weights`` of the
    parameters and ``1/states`` of the gradients and optimizer state (buffers and 0-d tensors whole).

    ``world`` is devices x num_nodes; ``note`` says what is not modelled (tensor parallelism) and how CPU offload is
    counted. ``cpu_offload``: the shares live in host memory (``fsdp_ckpt``'s ``cpu_offload``) and the device holds
    only what FSDP2 gathers (:func:`gathered_bytes`); ``reshard_after_forward``: the strategy's, whether a block's
    gathered parameters are freed after its forward.
    """

    strategy: str = "auto"
    world: int = 1
    weights: int = 1
    states: int = 1
    note: str = ""
    cpu_offload: bool = False
    reshard_after_forward: bool = True


#: FSDPStrategy's ``sharding_strategy`` -> (parameters sharded, gradients and optimizer state sharded), each over
#: ``"world"``, ``"node"`` (the devices of one node: hybrid sharding) or ``None`` (whole on every device).
_FSDP_SHARDING: dict[str, tuple[Optional[str], Optional[str]]] = {
    "FULL_SHARD": ("world", "world"),
    "SHARD_GRAD_OP": (None, "world"),  # parameters are gathered from forward to backward: whole at the peak
    "HYBRID_SHARD": ("node", "node"),
    "_HYBRID_SHARD_ZERO2": (None, "node"),
    "NO_SHARD": (None, None),
}


def _strategy_spec(strategy: Any) -> tuple[str, Optional[type], dict[str, Any]]:
    """``(name, class, init arguments)`` of a configured ``trainer.strategy``: a registered name, a class path, or a
    ``{class_path, init_args}`` mapping (LightningCLI's namespace). The class is ``None`` when unknown here."""
    if hasattr(strategy, "as_dict"):  # jsonargparse's Namespace
        strategy = strategy.as_dict()
    if isinstance(strategy, Mapping):
        path = str(strategy.get("class_path", ""))
        return path.rpartition(".")[2], _import_class(path), dict(strategy.get("init_args") or {})
    if isinstance(strategy, Strategy):
        return type(strategy).__name__, type(strategy), {}
    name = str(strategy)
    if name in StrategyRegistry:
        entry = StrategyRegistry[name]
        return name, entry["strategy"], dict(entry["init_params"])
    return name, _import_class(name) if "." in name else None, {}


def sharding_of(strategy: Any, devices: int, num_nodes: int) -> Sharding:
    """How ``strategy`` (as configured: see :func:`_strategy_spec`) shards static memory over ``devices`` x
    ``num_nodes``. The package's ``fsdp_ckpt`` and Lightning's ``ModelParallelStrategy`` shard parameters, gradients
    and optimizer state over the data-parallel size; Lightning's ``FSDPStrategy`` as its ``sharding_strategy`` says.
    ``fsdp_ckpt`` with ``cpu_offload`` keeps the shares in host memory (``Sharding.cpu_offload``).

    Example::

        >>> sharding_of("fsdp_ckpt", devices=4, num_nodes=2)
        Sharding(strategy='fsdp_ckpt', world=8, weights=8, states=8, note='', cpu_offload=False, reshard_after_forward=True)
        >>> sharding_of("fsdp_ckpt_cpu_offload", devices=1, num_nodes=1).cpu_offload
        True
        >>> sharding_of("ddp", devices=8, num_nodes=1).states
        1
        >>> sharding_of({"class_path": "lightning.pytorch.strategies.FSDPStrategy",
        ...              "init_args": {"sharding_strategy": "HYBRID_SHARD"}}, devices=8, num_nodes=2).weights
        8
    """
    name, cls, params = _strategy_spec(strategy)
    world = devices * num_nodes
    if cls is None or not issubclass(cls, (ModelParallelStrategy, FSDPStrategy)):
        return Sharding(name, world)
    notes = []
    offload, reshard = False, True
    if issubclass(cls, ModelParallelStrategy):
        ours = issubclass(cls, CheckpointingFSDPStrategy)
        if ours:
            offload = _cpu_offload_asked(params.get("cpu_offload"))
            reshard = params.get("reshard_after_forward") is not False
            if offload:
                notes.append(CPU_OFFLOAD_NOTE)
        tp = params.get("tensor_parallel_size", 1 if ours else "auto")
        tp = devices if tp == "auto" else int(tp)  # Lightning's "auto": the devices of one node
        dp = params.get("data_parallel_size", "auto")
        dp = (world // tp if ours else num_nodes) if dp == "auto" else int(dp)
        if tp > 1:
            notes.append(f"tensor parallelism (tensor_parallel_size={tp}) is the model's own `configure_model`; it is"
                         " not counted, so each device may hold less than shown")
        weights = states = max(1, dp)
    else:
        mode = params.get("sharding_strategy", "FULL_SHARD")
        over = _FSDP_SHARDING.get(str(getattr(mode, "name", mode)).upper(), ("world", "world"))
        weights, states = ({"world": world, "node": devices, None: 1}[o] for o in over)
        if params.get("cpu_offload"):
            notes.append("`cpu_offload` keeps the shards in host memory, so the device holds less than shown")
    return Sharding(name, world, weights, states, "; ".join(notes), offload, reshard)


#: How :func:`static_memory` counts a device under ``fsdp_ckpt``'s CPU offload (the report's note).
CPU_OFFLOAD_NOTE = ("`cpu_offload`: each device's share of the parameters, gradients and optimizer state is in host"
                    " memory; the device holds the buffers and what FSDP2 gathers there: the root units' parameters"
                    " (kept from their forward to the end of the backward) and two blocks' (one computing, the next"
                    " prefetched), in the dtype they are gathered in, and the gradients of the roots and of one block"
                    " until they are reduce-scattered to host memory; the reduce-scatter's own buffers are not counted")


def _cpu_offload_asked(value: Any) -> bool:
    """Whether a configured ``cpu_offload`` (``True``, a ``CPUOffloadPolicy``, ...) turns CPU offload on.

    Example::

        >>> _cpu_offload_asked(True), _cpu_offload_asked(None), _cpu_offload_asked("nonsense")
        (True, False, False)
    """
    try:
        return cpu_offload_policy(value, pin_memory=False) is not None
    except ValueError:  # the strategy itself refuses it when the run starts
        return False


def device_count(devices: Any) -> Optional[int]:
    """The number of devices a ``trainer.devices`` value asks for; ``None`` for ``"auto"`` and ``-1`` (all here).

    Example::

        >>> device_count(4), device_count("2"), device_count([0, 3]), device_count("0,1,"), device_count("auto")
        (4, 2, 2, 2, None)
    """
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() and int(text) > 0 else None
