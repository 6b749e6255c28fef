"""``lightning-ckpt plan``: what fits, before a run starts.

One training step of a LightningCLI config's model and data is measured with every matched layer fully
checkpointed (:func:`~lightning_ckpt.core.planner.measure_layer_costs`): each layer's activation bytes
un-checkpointed, fully and selectively checkpointed, and its recompute FLOPs. From those numbers alone (no
further runs) it predicts the activations and extra FLOPs of the standard settings (none, every 4th, every
2nd, every layer, selective everywhere) and of the plan for ``--memory-budget``, and adds the static memory
(weights, gradients and the configured optimizer's state, counted after one optimizer step).

With ``--device-memory`` the step is measured at two batch sizes, activations are fitted per setting as
``fixed + per_sample * batch``, and the largest batch size each setting fits is printed (static memory
plus activations; the transient memory of the backward pass is not included).

With ``--fake``, or by default when the static memory would not fit this machine, the model is built and
the step run under ``torch._subclasses.FakeTensorMode``: shapes, dtypes and bytes without any storage, as
torch's own AutoSAC estimator measures. A 7B-parameter config can be planned on a laptop. When the config's
accelerator is not available here (a ``cuda`` config on a laptop), ``--fake`` is implied and the trainer is built
with ``accelerator="cpu", devices=1`` for planning, the precision kept (``bf16-mixed`` runs under CPU autocast
to bfloat16): PyTorch built without CUDA cannot run autograd on fake CUDA tensors, so the step runs CPU kernels'
shape and dtype rules, and the report says which attention kernel ran and how the target's may differ.

Static memory is one device's share. The command launches no process: the trainer is built for one device
without a strategy, and the configured ``trainer.strategy``, ``devices`` and ``num_nodes`` only say how static
memory is divided (:func:`sharding_of`). Under the package's ``fsdp_ckpt``, Lightning's ``FSDPStrategy`` (by its
``sharding_strategy``) or ``ModelParallelStrategy`` (a name, or a ``class_path`` with ``init_args``), each device
holds its share of the parameters, gradients and optimizer state over the data-parallel devices (devices x
num_nodes for ``fsdp_ckpt`` and full sharding), rows padded as ``fully_shard`` pads them; buffers and 0-d state
whole. The largest batch is then per device.

LightningCLI arguments after the options override the config, as for ``lightning-ckpt fit``.

Example::

    lightning-ckpt plan --config configs/tiny.yaml --memory-budget 0.3 --device-memory 80GiB
    lightning-ckpt plan --config configs/tiny.yaml --trainer.accelerator=cuda --trainer.precision=bf16-mixed \
        --model.init_args.n_embd=4096 --model.init_args.n_layer=32 --device-memory 80GiB

With ``--device`` (a preset such as ``h100-sxm``, or ``auto``: the accelerator the step runs on, measured) the
plan minimises the predicted step time on that device, and every setting gets its predicted step time
(:func:`~lightning_ckpt.core.planner.predict_seconds`). ``--offload auto|true|false`` (default: the config's
``GradientCheckpointing`` offload) plans with offload; ``auto`` (which needs ``--device``) lets the plan choose per
layer what lives in host memory, shown in the per-layer table (``+offload``) and in ``plan.json``'s ``offloaded``.

It prints a Markdown report and writes it to ``plan.md`` in ``--output-dir`` (default
``lightning_ckpt_plan/<config name>``), with every figure in ``plan.json`` and a plot in ``plan.png``.
Exit status: 0, 1 when the budget cannot be met (the report says what can), 2 for a usage error.

``plan.json`` (bytes and FLOPs as integers, ``null`` where a figure does not apply):

- ``config``, ``model``: the config file's name and the LightningModule's class; ``fake``: measured under
  FakeTensorMode; ``planned_for``: the configured accelerator when it is missing here, else ``null``.
- ``batch_size``: the measured batch; ``batch_sizes``: both measured with ``--device-memory``.
- ``memory_budget``: as given (a fraction or bytes); ``device_memory``: ``--device-memory`` in bytes;
  ``device``: the ``--device`` profile's name, or ``null``.
- ``outside_bytes``: activations held outside the matched layers (embeddings, head, loss), part of every setting.
- ``static_bytes_per_device``: weights, gradients and optimizer state one device holds.
- ``static``: ``weights_bytes`` (parameters and buffers), ``gradient_bytes``, ``optimizer_state_bytes``
  (``null`` when ``configure_optimizers`` could not run), ``optimizer``, ``unsharded_bytes`` (the three summed,
  undivided), ``strategy``, ``world`` (devices x num_nodes), ``weight_shards`` and ``state_shards`` (how many ways
  parameters, and gradients and optimizer state, are divided), ``note`` (what is not modelled).
- ``layers``: per matched layer ``{name, class, none_bytes, full_bytes, selective_bytes, full_flops,
  selective_flops}``: bytes held not checkpointed, fully and selectively checkpointed; FLOPs recomputed.
- ``settings``: per setting ``{name, description, checkpointed_layers, activation_bytes, recompute_flops,
  predicted_step_seconds, fixed_bytes, per_sample_bytes, largest_batch}``, names ``none``, ``every_4th``,
  ``every_2nd``, ``every_layer``, ``selective`` and ``plan`` (when the budget can be met).
  ``predicted_step_seconds``: on the ``--device`` profile, ``null`` without one. ``fixed_bytes`` and ``per_sample_bytes``: the fit
  ``activations = fixed + per_sample x batch`` and ``largest_batch`` the largest batch per device that fits in
  ``device_memory`` with the static memory, all ``null`` without ``--device-memory`` (``largest_batch`` also when
  activations do not grow with the batch).
- ``plan``: ``{layers, offloaded, kept_ops, budget_bytes, activation_bytes, host_bytes, recompute_flops,
  predicted_step_seconds, baseline_step_seconds}``: each layer's mode, the layers whose held tensors go to host
  memory, the op outputs an ``ops`` layer keeps, the budget in bytes and the plan's predictions; ``null`` with
  ``plan_error`` saying why when the budget cannot be met.
- ``front``: the planner's plans for budgets from the least setting up to no checkpointing, each
  ``{budget_bytes, activation_bytes, recompute_flops}`` (what ``plan.png`` draws as a line).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import yaml
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_ckpt.commands.arguments import add_device_argument, check_device_argument, parse_budget_arg, parse_bytes_arg
from lightning_ckpt.commands.cli_builder import run_cli
from lightning_ckpt.core.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.core.op_curve import OpRecord, describe
from lightning_ckpt.core.planner import (
    CheckpointPlan,
    LayerCost,
    Offload,
    make_option,
    make_plan,
    measure_step,
    predict,
    predict_seconds,
)
from lightning_ckpt.core.profiling import format_bytes, storage_key, tensor_bytes
from lightning_ckpt.strategies import CheckpointingFSDPStrategy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_BUDGET = 0.5
#: Standard setting -> description, in the order they are reported; each maps to layer modes in :func:`setting_choices`.
SETTINGS = {
    "none": "no checkpointing",
    "every_4th": "every 4th layer, full",
    "every_2nd": "every 2nd layer, full",
    "every_layer": "every layer, full",
    "selective": "every layer, selective",
    "plan": "the plan for the budget",
}
#: What the trainer is built with when the configured accelerator is missing here (planning only, under --fake).
PLANNING_TRAINER = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto")
#: One device, no strategy, whatever the config says: the command plans one device's share and launches nothing.
ONE_DEVICE = PLANNING_TRAINER[1:]
#: Arguments after the options that go to LightningCLI (config overrides).
_CLI_PREFIXES = ("--trainer.", "--model", "--data", "--seed_everything", "--optimizer", "--lr_scheduler")
_LOG_WARNING = r"You are trying to `self.log\(\)` but the `self.trainer` reference is not registered"


# ------------------------------------------------------------------------------------------------ arguments


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        # No abbreviations: an option added later (such as a `--device`) must not be read as `--device-memory`.
        prog="lightning-ckpt plan", allow_abbrev=False,
        description="Measure one training step of a LightningCLI config and show what each checkpointing setting"
                    " holds and recomputes, the cheapest plan for a memory budget, and (with --device-memory) the"
                    " largest batch size each setting fits.")
    parser.add_argument("--config", type=Path, help="LightningCLI YAML config (model, data, trainer)")
    parser.add_argument("--memory-budget", default=None,
                        help="a fraction of the activations without checkpointing (0.3) or bytes (2GiB); default:"
                             f" the config's GradientCheckpointing memory_budget, else {DEFAULT_BUDGET}")
    parser.add_argument("--device-memory", default=None,
                        help="memory of the target device (80GiB): also print the largest batch size each setting fits")
    add_device_argument(parser, "plan for the least predicted step time on this device",
                        "default: the fewest recompute FLOPs, no step times")
    parser.add_argument("--offload", choices=("auto", "true", "false"), default=None,
                        help="plan with offload: 'true' (every checkpointed layer's inputs in host memory), 'false', or"
                             " 'auto' (the plan chooses per layer; needs --device); default: the config's"
                             " GradientCheckpointing offload")
    parser.add_argument("--fake", action="store_true",
                        help="measure under FakeTensorMode: no memory allocated (default when the model would not fit"
                             " this machine)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write plan.md and plan.json (default: lightning_ckpt_plan/<config name>)")
    args, extra = parser.parse_known_args(list(argv))
    bad = [a for a in extra if a.startswith("-") and not a.startswith(_CLI_PREFIXES)]
    if bad or (extra and not extra[0].startswith("-")):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra[:1])} (LightningCLI overrides start with"
                     " --trainer., --model., --data., such as --model.init_args.n_layer=32)")
    args.cli_args = extra
    if args.config is None:
        parser.error("--config is required: pass the LightningCLI YAML of the run to plan, e.g. --config configs/tiny.yaml")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file; pass the path of a LightningCLI YAML config")
    if args.memory_budget is not None:
        try:
            args.memory_budget = parse_budget_arg(args.memory_budget)
        except (TypeError, ValueError):
            parser.error(f"--memory-budget {args.memory_budget}: pass a fraction in (0, 1] of the activations without"
                         " checkpointing, such as 0.3, or bytes, such as 2GiB or 500000000")
    check_device_argument(parser, args.device)
    if args.device_memory is not None:
        try:
            args.device_memory = parse_bytes_arg(args.device_memory)
        except (TypeError, ValueError):
            parser.error(f"--device-memory {args.device_memory}: pass the device's memory in bytes, such as 80GiB,"
                         " 40e9 or 16000000000")
    return args


# ------------------------------------------------------------------------------------------------- building


def configured_accelerator(config: Path, cli_args: Sequence[str] = ()) -> str:
    """The ``trainer.accelerator`` the config asks for (a ``--trainer.accelerator`` argument wins); ``"auto"`` if none.

    Example::

        >>> configured_accelerator(Path("configs/tiny.yaml")), configured_accelerator(Path("configs/tiny.yaml"),
        ...     ["--trainer.accelerator", "cuda"])
        ('cpu', 'cuda')
    """
    value: Any = "auto"
    try:
        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
        value = trainer.get("accelerator", "auto") if isinstance(trainer, Mapping) else "auto"
    except (OSError, yaml.YAMLError, AttributeError):
        pass  # LightningCLI reports a config it cannot read
    for i, arg in enumerate(cli_args):
        if arg.startswith("--trainer.accelerator="):
            value = arg.split("=", 1)[1]
        elif arg == "--trainer.accelerator" and i + 1 < len(cli_args):
            value = cli_args[i + 1]
    if isinstance(value, Mapping):  # a class_path
        value = value.get("class_path", "auto")
    return str(value)


def accelerator_available(accelerator: str) -> bool:
    """Whether Lightning can build a trainer for ``accelerator`` (a name or an Accelerator class path) here.

    Unknown names count as available: LightningCLI reports them as it does for ``fit``.

    Example::

        >>> accelerator_available("cpu"), accelerator_available("auto")
        (True, True)
    """
    name = accelerator.lower()
    if name in ("auto", "cpu"):
        return True
    if name == "gpu":
        return CUDAAccelerator.is_available() or MPSAccelerator.is_available()
    if name in AcceleratorRegistry:
        return bool(AcceleratorRegistry[name]["accelerator"].is_available())
    cls = _import_class(accelerator)
    return True if cls is None else bool(cls.is_available())  # not importable here: LightningCLI says so


def _import_class(path: str) -> Optional[type]:
    """The class at dotted ``path``, or ``None`` when it cannot be imported here."""
    module_name, _, cls_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except Exception:  # noqa: BLE001 - any import-time failure means "not here"
        return None


class AttentionKernels(TorchDispatchMode):
    """Records the names of the attention kernels that run (``aten._scaled_dot_product_flash_attention_for_cpu``, ...).

    Example::

        >>> q = torch.randn(1, 2, 8, 16)
        >>> with AttentionKernels() as seen:
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        >>> sorted(seen.names)
        ['aten._scaled_dot_product_flash_attention_for_cpu']
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        name = str(func.overloadpacket)
        if "attention" in name and "backward" not in name:
            self.names.add(f"aten.{name.split('.')[-1]}")
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class Sharding:
    """How the configured strategy divides static memory over devices: each device holds ``1/weights`` of the
    parameters and ``1/states`` of the gradients and optimizer state (buffers and 0-d tensors whole).

    ``world`` is devices x num_nodes; ``note`` says what is not modelled (tensor parallelism, CPU offload).
    """

    strategy: str = "auto"
    world: int = 1
    weights: int = 1
    states: int = 1
    note: str = ""


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

    Example::

        >>> sharding_of("fsdp_ckpt", devices=4, num_nodes=2)
        Sharding(strategy='fsdp_ckpt', world=8, weights=8, states=8, note='')
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
    if issubclass(cls, ModelParallelStrategy):
        ours = issubclass(cls, CheckpointingFSDPStrategy)
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
    return Sharding(name, world, weights, states, "; ".join(notes))


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


@dataclass
class Built:
    """A config's model, its training data and where (and how) to run its step."""

    module: LightningModule
    loader: Any
    device: torch.device
    layer_cls: Any
    offload: Offload  # the config's callback's, or --offload
    memory_budget: Any
    fake_mode: Optional[FakeTensorMode]
    precision: Precision = field(default_factory=Precision)
    #: The configured accelerator when it is missing here and the trainer was built for the CPU instead.
    planned_for: Optional[str] = None
    #: Attention kernels that ran during measuring.
    attention_kernels: set[str] = field(default_factory=set)
    #: How the configured strategy shards static memory (the trainer itself is built for one device).
    sharding: Sharding = field(default_factory=Sharding)

    def mode(self) -> AbstractContextManager[Any]:
        """The context in which tensors are made: the fake mode, or nothing."""
        return self.fake_mode if self.fake_mode is not None else nullcontext()


def build(config: Path, fake: bool, cli_args: Sequence[str] = ()) -> Built:
    """Build the config's model (with ``configure_model`` run and the trainer's precision applied), data and
    checkpointing settings; under ``FakeTensorMode`` when ``fake`` (no memory is allocated for weights or
    activations). ``cli_args`` are LightningCLI overrides.

    The trainer is built for one device without a strategy (:data:`ONE_DEVICE`); the configured strategy, devices
    and num_nodes only say how static memory is sharded (``sharding``). When the configured accelerator is not
    available here, ``fake`` must be on: the trainer is then built with ``accelerator="cpu"`` too
    (:data:`PLANNING_TRAINER`), its precision kept, and ``planned_for`` says so.
    """
    target = configured_accelerator(config, cli_args)
    planned_for = None if accelerator_available(target) else target
    if planned_for is not None and not fake:
        raise ValueError(f"plan: the config asks for accelerator={target!r}, which this machine does not have; plan"
                         " for it with --fake (nothing is allocated) or run on a machine that has it.")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    context = fake_mode if fake_mode is not None else nullcontext()
    configured = ["--config", str(config), *cli_args]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        with context:
            cli = run_cli([*configured, *(PLANNING_TRAINER if planned_for else ONE_DEVICE)], run=False,
                          save_config_callback=None)
    trainer_config = cli.parser.parse_args(configured).trainer
    devices = device_count(trainer_config.devices)
    sharding = sharding_of(trainer_config.strategy, devices or _auto_devices(cli, planned_for), trainer_config.num_nodes)
    if devices is None and planned_for is not None:
        sharding = replace(sharding, note="; ".join(filter(None, [sharding.note, f"devices={trainer_config.devices!r}"
                           " counted as 1 (the accelerator is not here to count them): pass --trainer.devices=N"])))
    module = cli.model
    device = cli.trainer.strategy.root_device
    precision = cli.trainer.precision_plugin
    with context, (nullcontext() if fake else torch.device(device)):
        module.configure_model()
        if any(t.device != device for t in (*module.parameters(), *module.buffers())):
            module.to(device)
        precision.convert_module(module)  # "bf16-true" and the like: weights in that dtype, as Lightning does
    module.train()
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, GradientCheckpointing)]
    settings = callbacks[0].settings if callbacks else {}
    data = cli.datamodule if cli.datamodule is not None else module
    if cli.datamodule is not None:
        data.prepare_data()
        data.setup("fit")
    return Built(module, data.train_dataloader(), device, settings.get("layer_cls"), settings.get("offload") or False,
                 settings.get("memory_budget"), fake_mode, precision, planned_for, sharding=sharding)


def _auto_devices(cli: Any, planned_for: Optional[str]) -> int:
    """How many devices ``devices="auto"`` (or -1) means: the configured accelerator's count here, 1 when it is missing."""
    return 1 if planned_for is not None else max(1, int(type(cli.trainer.accelerator).auto_device_count()))


def batch_size_of(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch``."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        got = f"a 0-d tensor first in a {type(batch).__name__}" if leaves else f"a {type(batch).__name__} of no tensor"
        raise ValueError(f"plan: the training batch has no tensor with a batch dimension (got {got}). Make the"
                         " dataloader yield tensors, or tuples/lists/dicts of tensors, with the batch first.")
    return leaves[0].shape[0]


def batch_of_size(loader: Any, size: int) -> Any:
    """A batch of ``size`` samples: the loader's batches concatenated along the first dimension, then cut.

    Example::

        >>> loader = [(torch.arange(4), torch.ones(4, 2)), (torch.arange(4, 8), torch.ones(4, 2))]
        >>> idx, x = batch_of_size(loader, 6)
        >>> idx.tolist(), tuple(x.shape)
        ([0, 1, 2, 3, 4, 5], (6, 2))
    """
    batches, have = [], 0
    for batch in _cycle(loader):
        batches.append(batch)
        have += batch_size_of(batch)
        if have >= size:
            break
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError("plan: the loader's batches differ in structure (keys, or tuple/list layout); cannot make a"
                         f" batch of {size} samples from them. Make the dataloader yield every batch in one structure.")
    # A copy of exactly `size` rows: a slice would keep (and count) the whole concatenated storage.
    leaves = [torch.cat(parts)[:size].clone() if isinstance(parts[0], torch.Tensor) else parts[0]
              for parts in zip(*(leaves for leaves, _ in flat))]
    return tree_unflatten(leaves, spec)


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("plan: the training dataloader is empty: check the data's settings in the config (the"
                             " number of samples, `batch_size` with `drop_last`).")


def _on_device(built: Built, batch: Any) -> Any:
    if built.fake_mode is None:
        return move_data_to_device(batch, built.device)
    fake_mode = built.fake_mode
    with fake_mode:
        return tree_map(lambda t: fake_mode.from_tensor(t).to(built.device) if isinstance(t, torch.Tensor) else t, batch)


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        what = "None" if output is None else f"a {type(output).__name__} without a tensor 'loss'"
        raise ValueError(f"plan: `training_step` returned {what} (manual optimization?)."
                         " `plan` measures models whose training_step returns the loss, or a dict with 'loss': return it.")
    return loss


# ------------------------------------------------------------------------------------------------ measuring


@dataclass
class Measurement:
    """Per-layer costs and the bytes outside the layers, at one batch size."""

    batch_size: int
    costs: list[LayerCost]
    outside_bytes: int
    outside_ops: tuple[OpRecord, ...] = ()  # the step's ops outside the layers (for predicted step times)


def measure(built: Built, batch_size: Optional[int] = None) -> Measurement:
    """One fully checkpointed training step at ``batch_size`` (default: the loader's; see
    :func:`~lightning_ckpt.core.planner.measure_layer_costs`)."""
    if batch_size is None:
        batch_size = batch_size_of(next(_cycle(built.loader)))
    batch = _on_device(built, batch_of_size(built.loader, batch_size))
    with built.mode():
        batch = built.precision.convert_input(batch)
    module = built.module

    def step() -> torch.Tensor:
        # The trainer's precision (autocast for "bf16-mixed"), as Lightning runs training_step.
        with built.precision.train_step_context(), AttentionKernels() as kernels:
            loss = _loss(module.training_step(batch, 0))
        built.attention_kernels |= kernels.names
        return loss

    with built.mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LOG_WARNING)
        measured = measure_step(module, step, built.layer_cls)
    return Measurement(batch_size, measured.costs, measured.outside_bytes, measured.outside_ops)


@dataclass
class StaticMemory:
    """Bytes that checkpointing does not change, on one device: weights (and buffers), gradients, optimizer state,
    each device's share when the configured strategy shards them (``sharding``; ``unsharded``: the whole)."""

    weights: int
    gradients: int
    optimizer_state: Optional[int]
    optimizer: str
    sharding: Sharding = field(default_factory=Sharding)
    unsharded: Optional[int] = None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + (self.optimizer_state or 0)


def sharded_bytes(tensors: Iterable[Optional[torch.Tensor]], shards: int) -> int:
    """Bytes one device holds of ``tensors`` when each is split along its first dimension over ``shards`` devices,
    as ``fully_shard`` splits parameters: rows padded to a multiple of ``shards`` (the largest share); 0-d tensors
    whole; each storage once. With ``shards=1``: :func:`~lightning_ckpt.core.profiling.tensor_bytes`.

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
        return StaticMemory(weights, gradients, None, f"unknown: configure_optimizers or its step failed ({err})",
                            sharding)
    finally:
        for p in params:
            p.grad = None
    names = ", ".join(type(o).__name__ for o in optimizers) or "none"
    return StaticMemory(*share(sharding.weights, sharding.states, optimizers), names, sharding,
                        sum(share(1, 1, optimizers)))


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


# ------------------------------------------------------------------------------------------------ predicting


def setting_choices(names: Sequence[str], plan: Optional[CheckpointPlan]) -> dict[str, dict[str, str]]:
    """Layer modes of each standard setting (``"plan"`` only when there is one).

    Example::

        >>> setting_choices(["a", "b", "c"], None)["every_2nd"]
        {'a': 'full', 'c': 'full'}
    """
    out: dict[str, dict[str, str]] = {
        "none": {},
        "every_4th": {n: "full" for i, n in enumerate(names) if i % 4 == 0},
        "every_2nd": {n: "full" for i, n in enumerate(names) if i % 2 == 0},
        "every_layer": dict.fromkeys(names, "full"),
        "selective": dict.fromkeys(names, "selective"),
    }
    if plan is not None:
        out["plan"] = dict(plan.layers)
    return out


@dataclass
class SettingRow:
    name: str
    layers: int
    activation_bytes: int
    recompute_flops: int
    fixed_bytes: Optional[float] = None  # activations = fixed_bytes + per_sample_bytes * batch
    per_sample_bytes: Optional[float] = None
    largest_batch: Optional[int] = None
    predicted_step_seconds: Optional[float] = None  # with a device profile


def fit_line(x1: int, y1: int, x2: int, y2: int) -> tuple[float, float]:
    """``(intercept, slope)`` of the line through two points.

    Example::

        >>> fit_line(4, 140, 8, 260)
        (20.0, 30.0)
    """
    slope = (y2 - y1) / (x2 - x1)
    return y1 - slope * x1, slope


def largest_batch(fixed: float, per_sample: float, room: float) -> Optional[int]:
    """The largest batch ``b >= 0`` with ``fixed + per_sample * b <= room``; ``None`` when unbounded.

    Example::

        >>> largest_batch(20, 30, 1000), largest_batch(20, 30, 10), largest_batch(20, 0, 1000)
        (32, 0, None)
    """
    if per_sample <= 0:
        return None if fixed <= room else 0
    return max(0, math.floor((room - fixed) / per_sample + 1e-9))


def setting_rows(main: Measurement, choices: Mapping[str, Mapping[str, str]], offload: Offload,
                 other: Optional[Measurement] = None, room: Optional[int] = None,
                 kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}),
                 device: Optional[DeviceProfile] = None, plan_offloaded: Sequence[str] = ()) -> list[SettingRow]:
    """Predicted bytes and FLOPs of each setting at ``main``'s batch size; with ``other`` (a second batch size)
    the linear fit, with ``room`` (device memory minus static memory) the largest batch that fits, and with
    ``device`` the predicted step time. An ``"ops"`` layer keeps the ops at positions ``kept_ops[name]``."""
    rows = []
    for name, layers in choices.items():
        # "auto" is the plan's choice (its layers, in `plan_offloaded`); the standard settings then offload nothing
        moved: Union[bool, list[str]] = list(plan_offloaded) if name == "plan" else offload is True
        act, flops = predict(main.costs, main.outside_bytes, layers, moved, kept_ops)
        row = SettingRow(name, sum(m != "none" for m in layers.values()), act, flops)
        if device is not None:
            row.predicted_step_seconds, _ = predict_seconds(main.costs, main.outside_ops, layers, device, moved,
                                                            kept_ops)
        if other is not None:
            act2, _ = predict(other.costs, other.outside_bytes, layers, moved, kept_ops)
            row.fixed_bytes, row.per_sample_bytes = fit_line(main.batch_size, act, other.batch_size, act2)
            if room is not None:
                row.largest_batch = largest_batch(row.fixed_bytes, row.per_sample_bytes, room)
        rows.append(row)
    return rows


def planner_front(main: Measurement, offload: Offload, lowest: int, points: int = 16,
                  include: Sequence[int] = (), device: Optional[DeviceProfile] = None) -> list[dict[str, Any]]:
    """The planner's plans for ``points`` budgets from ``lowest`` bytes up to the activations without checkpointing,
    and for the budgets in ``include`` (the run's own), each ``{budget_bytes, activation_bytes, recompute_flops}``;
    budgets it cannot meet are left out, equal plans kept once.

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 50, 5) for i in range(4)]
        >>> [(p["activation_bytes"], p["recompute_flops"]) for p in planner_front(Measurement(8, costs, 100), False, 140, 4)]
        [(140, 200), (260, 20), (380, 10), (500, 0)]
    """
    baseline, _ = predict(main.costs, main.outside_bytes, {}, offload is True)
    front: list[dict[str, int]] = []
    budgets = {round(lowest + (baseline - lowest) * i / max(1, points - 1)) for i in range(points)} | set(include)
    for budget in sorted(budgets):
        try:
            plan = make_plan(main.costs, main.outside_bytes, max(1, budget), offload=offload, device=device,
                             outside_ops=main.outside_ops)
        except ValueError:
            continue
        point = {"budget_bytes": plan.budget_bytes, "activation_bytes": plan.planned_bytes,
                 "recompute_flops": plan.recompute_flops, "predicted_step_seconds": plan.predicted_step_seconds}
        if not front or (front[-1]["activation_bytes"], front[-1]["recompute_flops"]) != (plan.planned_bytes,
                                                                                         plan.recompute_flops):
            front.append(point)
    return front


# ------------------------------------------------------------------------------------------------ reporting


def _b(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{round(n):,}"


_CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def where_measured(built: Built) -> list[str]:
    """Report paragraphs: the precision and attention kernels the step ran with and, when the configured accelerator
    is missing here, what the measurement stands in for and how the target's kernels may differ."""
    name = str(getattr(built.precision, "precision", "32-true"))
    dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float16"
    autocast = (f" (the step under torch.autocast({built.precision.device!r}, {dtype}))"
                if isinstance(built.precision, MixedPrecision) else "")
    kernels = ", ".join(f"`{k}`" for k in sorted(built.attention_kernels)) or "none (no fused attention ran)"
    lines = [f"Precision: {name}{autocast}. Attention kernels: {kernels}.", ""]
    if built.planned_for is None:
        return lines
    lines += [
        f"**Planned for accelerator={built.planned_for!r} on this machine's CPU.** The config asks for"
        f" {built.planned_for!r}, which is not available here, so the trainer was built with"
        f" {', '.join(a.split('.', 1)[1] for a in PLANNING_TRAINER)} for planning, precision kept ({name})."
        " PyTorch without CUDA cannot run autograd on fake CUDA tensors, so the step ran on fake CPU tensors with"
        " CPU kernels' shapes and dtypes; static memory is one device's share (see Static memory).",
        "",
    ]
    if _CPU_FLASH in built.attention_kernels:
        lines += [
            "How the target may differ: CPU flash attention saves query, key, value, output and a float32"
            " log-sum-exp per row, as CUDA's flash and memory-efficient kernels do (plus a few bytes of RNG state;"
            " the memory-efficient kernel pads the log-sum-exp to a multiple of 32 rows). Where the target falls back"
            " to the math kernel (a head size, dtype or mask its fused kernels do not support), attention saves its"
            " batch x heads x seq x seq weights and holds far more than planned. CUDA and CPU autocast cast a few ops"
            " differently; matmuls and linears run in the autocast dtype on both.",
            "",
        ]
    else:
        lines += ["How the target may differ: no fused attention kernel ran here. CPU runs attention with dropout (and"
                  " some masks) as the math implementation, which saves the batch x heads x seq x seq weights; CUDA's"
                  " flash kernel supports dropout and saves only a log-sum-exp per row, so the target may hold less"
                  " than planned. A model that picks its attention implementation by device may differ too.", ""]
    return lines


def sharding_lines(static: StaticMemory) -> list[str]:
    """Report paragraph: whether, and how, the figures above are one device's share of sharded static memory."""
    s = static.sharding
    if s.states == 1 and s.weights == 1:
        text = (f"Not sharded (strategy {s.strategy!r}, {s.world} device{'s' * (s.world > 1)} in all: devices x"
                " num_nodes): every device holds all of it." + (f" Note: {s.note}." if s.note else ""))
        return [text, ""]
    unsharded = "" if static.unsharded is None else f" ({format_bytes(static.unsharded)} unsharded)"
    what = (f"parameters, gradients and optimizer state over {s.states} devices" if s.weights == s.states else
            f"gradients and optimizer state over {s.states} devices, parameters over {s.weights}")
    return [f"**One device's share{unsharded}:** strategy {s.strategy!r} shards {what}"
            f" ({s.world} in all: devices x num_nodes), rows padded as `fully_shard` pads them; buffers and 0-d"
            " optimizer state (step counters) are whole on every device. The command launches no process: it plans"
            " one device's share, and the largest batch is per device." + (f" Note: {s.note}." if s.note else ""), ""]


def render(title: str, built: Built, main: Measurement, plan: Optional[CheckpointPlan], plan_error: Optional[str],
           budget: object, rows: Sequence[SettingRow], static: StaticMemory, device_memory: Optional[int],
           batch_sizes: Sequence[int]) -> str:
    """The report, as Markdown."""
    how = ("fake tensors (FakeTensorMode: no memory allocated)" if built.fake_mode is not None else "real tensors")
    lines = [
        f"# Checkpointing plan: {title}",
        "",
        f"One training step of {type(built.module).__name__} at batch size {main.batch_size}, measured on"
        f" {built.device} with {how}, every matched layer fully checkpointed. Bytes are activations held for"
        " backward; FLOPs are recomputed in backward per step (matmul and attention as torch's FlopCounterMode"
        " counts them, one per output element for other ops). Every figure below is predicted from this one"
        " measurement; no setting was run."
        + (" Offload is on: checkpointed layers' inputs count as host memory." if built.offload is True else "")
        + (" Offload is 'auto': the plan chooses per layer what lives in host memory (its `offload` column)."
           if built.offload == "auto" else ""),
        "",
        *where_measured(built),
        "## Layers",
        "",
        "| layer | class | none (B) | full (B) | selective (B) | recompute full (FLOP) | recompute selective (FLOP)"
        " | plan | plan (B) | recompute plan (FLOP) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    planned_costs = {c.name: c for c in plan.costs} if plan else {}
    for c in main.costs:
        mode, keep = (plan.layers[c.name], plan.kept_ops.get(c.name, ())) if plan else ("-", ())
        planned = "- | -"
        if plan:
            option = make_option(planned_costs[c.name], mode, keep, c.name in plan.offloaded)  # type: ignore[arg-type]
            planned = f"{_b(option.device_bytes)} | {_b(option.flops)}"
            mode += " +offload" if plan.offload == "auto" and c.name in plan.offloaded else ""
        lines.append(f"| {c.name} | {c.cls} | {_b(c.none_bytes)} | {_b(c.device_bytes('full', built.offload is True))}"
                     f" | {_b(c.device_bytes('selective', built.offload is True))} | {_b(c.full_flops)}"
                     f" | {_b(c.selective_flops)} | {mode} | {planned} |")
    lines += [f"| (outside the layers) | | {_b(main.outside_bytes)} | {_b(main.outside_bytes)} | {_b(main.outside_bytes)}"
              " | 0 | 0 | | | |", ""]
    if plan is not None and plan.kept_ops:
        lines += ["Op-level choices (`ops`): which op outputs each layer keeps and which ops it recomputes:", "",
                  *[f"- {name}: {describe(c.ops, plan.kept_ops[name])}" for c in main.costs
                    for name in [c.name] if name in plan.kept_ops],
                  ""]
    lines += [f"## Plan for memory_budget={budget!r}", ""]
    if plan is not None:
        n = sum(m != "none" for m in plan.layers.values())
        lines.append(f"{n} of {len(plan.layers)} layers checkpointed"
                     f" ({', '.join(f'{k}: {v}' for k, v in plan.layers.items() if v != 'none') or 'none needed'}):"
                     f" activations {format_bytes(plan.planned_bytes)} ({100 * plan.planned_bytes / plan.baseline_bytes:.0f}%"
                     f" of {format_bytes(plan.baseline_bytes)} without checkpointing), budget {format_bytes(plan.budget_bytes)};"
                     f" recompute {_b(plan.recompute_flops)} FLOP per step"
                     + (f"; {plan.step_time_text()}." if plan.predicted_step_seconds is not None else "."))
    else:
        lines.append(f"No plan: {plan_error}")
    memory_head = f" | largest batch in {format_bytes(device_memory)}" if device_memory is not None else ""
    timed = rows[0].predicted_step_seconds is not None
    time_head = f" | predicted step time on {plan.device if plan else 'the device'} | vs none" if timed else ""
    fit_head = " | fixed (B) | per sample (B)" if len(batch_sizes) > 1 else ""
    none_bytes = rows[0].activation_bytes
    lines += [
        "",
        "## Settings",
        "",
        f"| setting | checkpointed layers | activations (B) | activations | of none | recompute (FLOP)"
        f" | static + activations{fit_head}{memory_head}{time_head} |",
        "|---|---:|---:|---:|---:|---:|---:"
        + "|---:" * ((len(batch_sizes) > 1) * 2 + (device_memory is not None) + 2 * timed) + "|",
    ]
    for r in rows:
        fit = f" | {_b(r.fixed_bytes)} | {_b(r.per_sample_bytes)}" if len(batch_sizes) > 1 else ""
        fits = (f" | {'unbounded' if r.largest_batch is None else r.largest_batch}" if device_memory is not None else "")
        step = (f" | {1000 * r.predicted_step_seconds:.2f} ms"
                f" | +{100 * (r.predicted_step_seconds / rows[0].predicted_step_seconds - 1):.0f}%"
                if r.predicted_step_seconds is not None and rows[0].predicted_step_seconds else "")
        lines.append(f"| {r.name} | {r.layers} | {_b(r.activation_bytes)} | {format_bytes(r.activation_bytes)}"
                     f" | {100 * r.activation_bytes / none_bytes:.0f}% | {_b(r.recompute_flops)}"
                     f" | {format_bytes(static.total + r.activation_bytes)}{fit}{fits}{step} |")
    lines += ["", "Settings: " + "; ".join(f"{k}: {v}" for k, v in SETTINGS.items() if k in {r.name for r in rows}) + "."]
    if len(batch_sizes) > 1:
        lines.append(f"Activations were measured at batch sizes {batch_sizes[0]} and {batch_sizes[1]} and fitted as"
                     " fixed + per sample x batch.")
    if device_memory is not None:
        lines.append(f"Largest batch: static memory plus activations within {format_bytes(device_memory)}"
                     f" ({_b(device_memory)} B); the backward pass's transient memory (gradients being computed,"
                     " recomputed layers, allocator slack) needs some headroom on top.")
    state = "unknown" if static.optimizer_state is None else _b(static.optimizer_state)
    lines += [
        "",
        "## Static memory (checkpointing does not change it)",
        "",
        "| weights and buffers (B) | gradients (B) | optimizer state (B) | optimizer | total |",
        "|---:|---:|---:|---|---:|",
        f"| {_b(static.weights)} | {_b(static.gradients)} | {state} | {static.optimizer} | {format_bytes(static.total)} |",
        "",
        *sharding_lines(static),
        f"Optimizer state counted after one optimizer step. Without checkpointing, activations are"
        f" {100 * none_bytes / (none_bytes + static.total):.0f}% of static memory plus activations"
        + (": checkpointing cannot save much here; shard the weights and optimizer state (FSDP) or train fewer"
           " parameters (PEFT)." if none_bytes < static.total else "."),
    ]
    return "\n".join(lines) + "\n"


def report_data(title: str, built: Built, main: Measurement, plan: Optional[CheckpointPlan], plan_error: Optional[str],
                budget: object, rows: Sequence[SettingRow], static: StaticMemory, device_memory: Optional[int],
                batch_sizes: Sequence[int], front: Sequence[Mapping[str, int]],
                profile: Optional[DeviceProfile] = None) -> dict[str, Any]:
    """Every figure of the report as plain data (``plan.json``; the keys are listed in the module docstring)."""
    s = static.sharding
    return {
        "config": title,
        "model": type(built.module).__name__,
        "fake": built.fake_mode is not None,
        "planned_for": built.planned_for,
        "batch_sizes": list(batch_sizes),
        "batch_size": main.batch_size,
        "memory_budget": budget,
        "device_memory": device_memory,
        "device": profile.name if profile is not None else None,
        "outside_bytes": main.outside_bytes,
        "static_bytes_per_device": static.total,
        "static": {"weights_bytes": static.weights, "gradient_bytes": static.gradients,
                   "optimizer_state_bytes": static.optimizer_state, "optimizer": static.optimizer,
                   "unsharded_bytes": static.unsharded, "strategy": s.strategy, "world": s.world,
                   "weight_shards": s.weights, "state_shards": s.states, "note": s.note},
        "layers": [{"name": c.name, "class": c.cls, "none_bytes": c.none_bytes,
                    "full_bytes": c.device_bytes("full", built.offload is True),
                    "selective_bytes": c.device_bytes("selective", built.offload is True), "full_flops": c.full_flops,
                    "selective_flops": c.selective_flops} for c in main.costs],
        "settings": [{"name": r.name, "description": SETTINGS.get(r.name, r.name), "checkpointed_layers": r.layers,
                      "activation_bytes": r.activation_bytes, "recompute_flops": r.recompute_flops,
                      "predicted_step_seconds": r.predicted_step_seconds, "fixed_bytes": r.fixed_bytes,
                      "per_sample_bytes": r.per_sample_bytes, "largest_batch": r.largest_batch} for r in rows],
        "plan": None if plan is None else {
            "layers": dict(plan.layers),
            "offloaded": list(plan.offloaded),
            "budget_bytes": plan.budget_bytes, "activation_bytes": plan.planned_bytes,
            "host_bytes": plan.planned_host_bytes, "recompute_flops": plan.recompute_flops,
            "kept_ops": plan.kept_ops, "predicted_step_seconds": plan.predicted_step_seconds,
            "baseline_step_seconds": plan.baseline_step_seconds},
        "plan_error": plan_error,
        "front": [dict(p) for p in front],
    }


def plot(data: Mapping[str, Any], path: Path) -> Optional[Figure]:
    """Activations against recompute cost (predicted step time when every setting has one, else recompute FLOPs)
    of every setting in ``data`` (:func:`report_data`), the planner's front over budgets as a line and the chosen
    plan as a star; saved as a PNG. Returns the figure (``None`` without matplotlib). Points are in bytes and FLOPs
    (or seconds), the axes' labels formatted for people.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, MaxNLocator
    except ImportError:
        print("plan: the plot needs matplotlib (`pip install matplotlib`); wrote the report only.", file=sys.stderr)
        return None
    settings = data["settings"]
    timed = all(s["predicted_step_seconds"] is not None for s in settings)
    cost = "predicted_step_seconds" if timed else "recompute_flops"
    fig = Figure(figsize=(6.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    front = [p for p in data["front"] if p.get(cost) is not None]
    if front:
        front = sorted(front, key=lambda p: p[cost])
        ax.plot([p[cost] for p in front], [p["activation_bytes"] for p in front], ".-", color="tab:gray", alpha=0.6,
                label="planner's front over budgets")
    for s in settings:
        chosen = s["name"] == "plan"
        ax.scatter([s[cost]], [s["activation_bytes"]], marker="*" if chosen else "o", s=160 if chosen else 40,
                   color="tab:red" if chosen else "black" if s["name"] == "none" else "tab:blue", zorder=3,
                   label=s["name"])
        ax.annotate("plan (chosen)" if chosen else s["name"], (s[cost], s["activation_bytes"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(EngFormatter(unit="s" if timed else "FLOP"))
    ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_xlabel("predicted step time" if timed else "recompute per step")
    ax.set_ylabel("activations held for backward, per device (MB = 10⁶ B)")
    ax.legend(handles=ax.lines, loc="upper right", fontsize=8)
    ax.set_title(f"Checkpointing plan: activations vs recompute\n{data['config']}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return fig


def device_profile(device: Optional[str], built: Built) -> Optional[DeviceProfile]:
    """The ``--device`` profile: a preset, or ``auto``: the accelerator the step runs on, measured here."""
    if device is None or device != "auto":
        return DeviceProfile.preset(device) if device is not None else None
    if built.planned_for is not None:
        raise ValueError(f"--device auto measures the accelerator the step runs on, but the config's"
                         f" {built.planned_for!r} is not here; pass a preset instead ({', '.join(PRESET_NAMES)}).")
    return DeviceProfile.measure(built.device)


# ------------------------------------------------------------------------------------------------ driver


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-ckpt plan --config X.yaml [--memory-budget 0.3] [--device-memory 80GiB] [--fake]``; the exit status."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    fake = args.fake
    target = configured_accelerator(args.config, args.cli_args)
    if not accelerator_available(target):
        if not fake:
            print(f"plan: the config's accelerator {target!r} is not available here; planning for it with fake tensors"
                  " on the CPU (no memory allocated).", flush=True)
        fake = True
    built = build(args.config, fake=True, cli_args=args.cli_args)
    if not fake and would_not_fit(built):
        print(f"plan: the weights, gradients and optimizer state would not fit this machine's {built.device} memory;"
              " measuring with fake tensors (no memory allocated).", flush=True)
        fake = True
    if not fake:
        built = build(args.config, fake=False, cli_args=args.cli_args)
    if args.offload is not None:
        built.offload = {"true": True, "false": False, "auto": "auto"}[args.offload]
    if built.offload == "auto" and args.device is None:
        print("plan: offload 'auto' prices offload against recompute in time on a device: pass --device NAME (a preset"
              f" such as {PRESET_NAMES[0]}) or --device auto, or --offload true/false.", file=sys.stderr)
        return 2
    config_budget = built.memory_budget if built.memory_budget not in (None, "auto") else None
    budget = args.memory_budget if args.memory_budget is not None else config_budget or DEFAULT_BUDGET

    size = batch_size_of(next(_cycle(built.loader)))
    main_m = measure(built, size)
    other = None
    if args.device_memory is not None:
        other = measure(built, size // 2 if size >= 2 else 2)
    try:
        profile = device_profile(args.device, built)
    except ValueError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    plan, plan_error = None, None
    try:
        plan = make_plan(main_m.costs, main_m.outside_bytes, budget, offload=built.offload, device=profile,
                         outside_ops=main_m.outside_ops)
    except ValueError as err:
        plan_error = str(err)
    static = static_memory(built)
    room = None if args.device_memory is None else args.device_memory - static.total
    names = [c.name for c in main_m.costs]
    rows = setting_rows(main_m, setting_choices(names, plan), built.offload, other, room,
                        plan.kept_ops if plan is not None else {}, profile, plan.offloaded if plan is not None else ())
    batch_sizes = sorted([main_m.batch_size] + ([other.batch_size] if other else []))
    report = render(args.config.name, built, main_m, plan, plan_error, budget, rows, static, args.device_memory,
                    batch_sizes)
    front = planner_front(main_m, built.offload, min(r.activation_bytes for r in rows),
                          include=[plan.budget_bytes] if plan is not None else [], device=profile)
    data = report_data(args.config.name, built, main_m, plan, plan_error, budget, rows, static, args.device_memory,
                       batch_sizes, front, profile)
    out_dir = (args.output_dir or Path("lightning_ckpt_plan") / args.config.stem).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.md").write_text(report)
    (out_dir / "plan.json").write_text(json.dumps(data, indent=1) + "\n")
    drawn = plot(data, out_dir / "plan.png") is not None
    print(report)
    print(f"plan: wrote {out_dir / 'plan.md'}, plan.json" + (" and plan.png" if drawn else ""), flush=True)
    if plan is None:
        print(f"plan: memory_budget={budget!r} cannot be met; see 'No plan' above.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
