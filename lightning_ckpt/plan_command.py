"""``lightning-ckpt plan``: what fits, before a run starts.

One training step of a LightningCLI config's model and data is measured with every matched layer fully
checkpointed (:func:`~lightning_ckpt.planner.measure_layer_costs`): each layer's activation bytes
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

LightningCLI arguments after the options override the config, as for ``lightning-ckpt fit``.

Example::

    lightning-ckpt plan --config configs/tiny.yaml --memory-budget 0.3 --device-memory 80GiB
    lightning-ckpt plan --config configs/tiny.yaml --trainer.accelerator=cuda --trainer.precision=bf16-mixed \
        --model.init_args.n_embd=4096 --model.init_args.n_layer=32 --device-memory 80GiB

With ``--device`` (a preset such as ``h100-sxm``, or ``auto``: the accelerator the step runs on, measured) the
plan minimises the predicted step time on that device, and every setting gets its predicted step time
(:func:`~lightning_ckpt.planner.predict_seconds`).

It prints a Markdown report and writes it to ``plan.md`` in ``--output-dir`` (default
``lightning_ckpt_plan/<config name>``), and every figure to ``plan.json`` (keys: :func:`plan_json`). Exit status: 0, 1 when the budget cannot be met (the report says
what can), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import torch
import yaml
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ckpt.callback import GradientCheckpointing
from lightning_ckpt.cli_builder import run_cli
from lightning_ckpt.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.op_curve import OpRecord, describe
from lightning_ckpt.planner import CheckpointPlan, LayerCost, make_plan, measure_step, predict, predict_seconds
from lightning_ckpt.profiling import format_bytes, optimizer_state_bytes, tensor_bytes
from lightning_ckpt.selection import parse_memory_budget

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
#: Arguments after the options that go to LightningCLI (config overrides).
_CLI_PREFIXES = ("--trainer.", "--model", "--data", "--seed_everything", "--optimizer", "--lr_scheduler")
_LOG_WARNING = r"You are trying to `self.log\(\)` but the `self.trainer` reference is not registered"


# ------------------------------------------------------------------------------------------------ arguments


def parse_budget_arg(text: str) -> float | int | str:
    """``--memory-budget`` text as :func:`~lightning_ckpt.selection.parse_memory_budget` takes it.

    Example::

        >>> parse_budget_arg("0.3"), parse_budget_arg("2GiB"), parse_budget_arg("500000000")
        (0.3, 2147483648, 500000000)
    """
    text = text.strip()
    value: float | int | str = text
    if re.fullmatch(r"\d+", text):
        value = int(text)
    elif re.fullmatch(r"\d*\.\d+(e-?\d+)?|\d+e-?\d+", text):
        value = float(text)
    parsed = parse_memory_budget(value)
    assert parsed is not None
    return parsed


def parse_bytes_arg(text: str) -> int:
    """``--device-memory`` text (``80GiB``, ``40e9``, ``1000000``) as bytes.

    Example::

        >>> parse_bytes_arg("80GiB"), parse_bytes_arg("40e9")
        (85899345920, 40000000000)
    """
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?e\d+", text):
        return int(float(text))
    parsed = parse_memory_budget(int(text) if text.isdigit() else text)
    if not isinstance(parsed, int):
        raise ValueError(f"{text!r} is not a number of bytes")
    return parsed


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt plan", allow_abbrev=False,  # --device is not --device-memory
        description="Measure one training step of a LightningCLI config and show what each checkpointing setting"
                    " holds and recomputes, the cheapest plan for a memory budget, and (with --device-memory) the"
                    " largest batch size each setting fits.")
    parser.add_argument("--config", type=Path, help="LightningCLI YAML config (model, data, trainer)")
    parser.add_argument("--memory-budget", default=None,
                        help="a fraction of the activations without checkpointing (0.3) or bytes (2GiB); default:"
                             f" the config's GradientCheckpointing memory_budget, else {DEFAULT_BUDGET}")
    parser.add_argument("--device-memory", default=None,
                        help="memory of the target device (80GiB): also print the largest batch size each setting fits")
    parser.add_argument("--device", default=None,
                        help="plan for the least predicted step time on this device: a preset"
                             f" ({', '.join(PRESET_NAMES)}) or 'auto' (measure the accelerator the step runs on);"
                             " default: the fewest recompute FLOPs, no step times")
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
        parser.error(f"--config {args.config}: no such file")
    if args.memory_budget is not None:
        try:
            args.memory_budget = parse_budget_arg(args.memory_budget)
        except (TypeError, ValueError):
            parser.error(f"--memory-budget {args.memory_budget}: pass a fraction in (0, 1] of the activations without"
                         " checkpointing, such as 0.3, or bytes, such as 2GiB or 500000000")
    if args.device is not None and args.device != "auto" and args.device not in PRESET_NAMES:
        parser.error(f"--device {args.device}: pass a preset ({', '.join(PRESET_NAMES)}) or 'auto'")
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
    module_name, _, cls_name = accelerator.rpartition(".")
    try:
        cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
        return bool(cls.is_available())
    except Exception:  # noqa: BLE001 - not importable here: LightningCLI says so
        return True


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


@dataclass
class Built:
    """A config's model, its training data and where (and how) to run its step."""

    module: LightningModule
    loader: Any
    device: torch.device
    layer_cls: Any
    offload: bool
    memory_budget: Any
    fake_mode: Optional[FakeTensorMode]
    precision: Precision = field(default_factory=Precision)
    #: The configured accelerator when it is missing here and the trainer was built for the CPU instead.
    planned_for: Optional[str] = None
    #: Attention kernels that ran during measuring.
    attention_kernels: set[str] = field(default_factory=set)

    def mode(self) -> AbstractContextManager[Any]:
        """The context in which tensors are made: the fake mode, or nothing."""
        return self.fake_mode if self.fake_mode is not None else nullcontext()


def build(config: Path, fake: bool, cli_args: Sequence[str] = ()) -> Built:
    """Build the config's model (with ``configure_model`` run and the trainer's precision applied), data and
    checkpointing settings; under ``FakeTensorMode`` when ``fake`` (no memory is allocated for weights or
    activations). ``cli_args`` are LightningCLI overrides.

    When the configured accelerator is not available here, ``fake`` must be on: the trainer is then built with
    ``accelerator="cpu", devices=1`` (:data:`PLANNING_TRAINER`), its precision kept, and ``planned_for`` says so.
    """
    target = configured_accelerator(config, cli_args)
    planned_for = None if accelerator_available(target) else target
    if planned_for is not None and not fake:
        raise ValueError(f"plan: the config asks for accelerator={target!r}, which this machine does not have; plan"
                         " for it with --fake (nothing is allocated) or run on a machine that has it.")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    context = fake_mode if fake_mode is not None else nullcontext()
    args = ["--config", str(config), *cli_args, *(PLANNING_TRAINER if planned_for else ())]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        with context:
            cli = run_cli(args, run=False, save_config_callback=None)
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
    return Built(module, data.train_dataloader(), device, settings.get("layer_cls"), bool(settings.get("offload")),
                 settings.get("memory_budget"), fake_mode, precision, planned_for)


def batch_size_of(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch``."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("plan: the training batch has no tensor with a batch dimension; batches must be tensors, or"
                         " tuples/lists/dicts of tensors, with the batch first.")
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
        raise ValueError("plan: the loader's batches differ in structure; cannot make a batch of another size.")
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
            raise ValueError("plan: the training dataloader is empty.")


def _on_device(built: Built, batch: Any) -> Any:
    if built.fake_mode is None:
        return move_data_to_device(batch, built.device)
    fake_mode = built.fake_mode
    with fake_mode:
        return tree_map(lambda t: fake_mode.from_tensor(t).to(built.device) if isinstance(t, torch.Tensor) else t, batch)


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError("plan: `training_step` returned no loss (manual optimization?). `plan` measures models whose"
                         " training_step returns the loss, or a dict with 'loss'.")
    return loss


# ------------------------------------------------------------------------------------------------ measuring


@dataclass
class Measurement:
    """Per-layer costs and the bytes outside the layers, at one batch size."""

    batch_size: int
    costs: list[LayerCost]
    outside_bytes: int
    outside_ops: tuple[OpRecord, ...] = ()  # the step's ops outside the layers (for predicted step times)


def measure(built: Built, batch_size: int) -> Measurement:
    """One fully checkpointed training step at ``batch_size`` (see :func:`~lightning_ckpt.planner.measure_layer_costs`)."""
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
    """Bytes that checkpointing does not change: weights (and buffers), gradients, optimizer state."""

    weights: int
    gradients: int
    optimizer_state: Optional[int]
    optimizer: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + (self.optimizer_state or 0)


def static_memory(built: Built) -> StaticMemory:
    """Count weights and gradients, and the optimizer state after one step on zero gradients.

    The optimizer comes from the module's ``configure_optimizers``; its step changes the weights (Adam's weight
    decay), so this runs after everything else has been measured.
    """
    module = built.module
    params = list(module.parameters())
    weights = tensor_bytes([*params, *module.buffers()])
    gradients = tensor_bytes(p for p in params if p.requires_grad)
    try:
        with built.mode():
            optimizers = _optimizers(module.configure_optimizers())
            for p in params:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            for optimizer in optimizers:
                optimizer.step()
    except Exception as err:  # noqa: BLE001 - a configure_optimizers that needs the Trainer, a closure, ...
        return StaticMemory(weights, gradients, None, f"unknown: configure_optimizers or its step failed ({err})")
    finally:
        for p in params:
            p.grad = None
    names = ", ".join(type(o).__name__ for o in optimizers) or "none"
    return StaticMemory(weights, gradients, optimizer_state_bytes(optimizers), names)


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


def setting_rows(main: Measurement, choices: Mapping[str, Mapping[str, str]], offload: bool,
                 other: Optional[Measurement] = None, room: Optional[int] = None,
                 kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}),
                 device: Optional[DeviceProfile] = None) -> list[SettingRow]:
    """Predicted bytes and FLOPs of each setting at ``main``'s batch size; with ``other`` (a second batch size)
    the linear fit, with ``room`` (device memory minus static memory) the largest batch that fits, and with
    ``device`` the predicted step time. An ``"ops"`` layer keeps the ops at positions ``kept_ops[name]``."""
    rows = []
    for name, layers in choices.items():
        act, flops = predict(main.costs, main.outside_bytes, layers, offload, kept_ops)
        row = SettingRow(name, sum(m != "none" for m in layers.values()), act, flops)
        if device is not None:
            row.predicted_step_seconds, _ = predict_seconds(main.costs, main.outside_ops, layers, device, offload,
                                                            kept_ops)
        if other is not None:
            act2, _ = predict(other.costs, other.outside_bytes, layers, offload, kept_ops)
            row.fixed_bytes, row.per_sample_bytes = fit_line(main.batch_size, act, other.batch_size, act2)
            if room is not None:
                row.largest_batch = largest_batch(row.fixed_bytes, row.per_sample_bytes, room)
        rows.append(row)
    return rows


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
        " CPU kernels' shapes and dtypes; static memory is one device's, unsharded.",
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
        + (" Offload is on: checkpointed layers' inputs count as host memory." if built.offload else ""),
        "",
        *where_measured(built),
        "## Layers",
        "",
        "| layer | class | none (B) | full (B) | selective (B) | recompute full (FLOP) | recompute selective (FLOP)"
        " | plan | plan (B) | recompute plan (FLOP) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for c in main.costs:
        mode, keep = (plan.layers[c.name], plan.kept_ops.get(c.name, ())) if plan else ("-", ())
        planned = (f"{_b(c.device_bytes(mode, built.offload, keep))} | {_b(c.flops(mode, keep))}"  # type: ignore[arg-type]
                   if plan else "- | -")
        lines.append(f"| {c.name} | {c.cls} | {_b(c.none_bytes)} | {_b(c.device_bytes('full', built.offload))}"
                     f" | {_b(c.device_bytes('selective', built.offload))} | {_b(c.full_flops)}"
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
        f"Optimizer state counted after one optimizer step. Without checkpointing, activations are"
        f" {100 * none_bytes / (none_bytes + static.total):.0f}% of static memory plus activations"
        + (": checkpointing cannot save much here; shard the weights and optimizer state (FSDP) or train fewer"
           " parameters (PEFT)." if none_bytes < static.total else "."),
    ]
    return "\n".join(lines) + "\n"


def plan_json(main: Measurement, plan: Optional[CheckpointPlan], budget: object, rows: Sequence[SettingRow],
              static: StaticMemory, device: Optional[DeviceProfile]) -> dict[str, Any]:
    """Every figure of the report under fixed keys (``plan.json``):

    - ``batch_size``, ``memory_budget``, ``device`` (the profile's name, or null);
    - ``static_bytes_per_device``: weights, gradients and optimizer state (one device's, unsharded);
    - ``settings``: per setting ``{name, checkpointed_layers, activation_bytes, recompute_flops,
      predicted_step_seconds, largest_batch}`` (null where not predicted), names among ``none``, ``every_4th``,
      ``every_2nd``, ``every_layer``, ``selective`` and ``plan``;
    - ``plan``: ``{layers, offloaded, kept_ops, planned_bytes, budget_bytes, recompute_flops,
      predicted_step_seconds, baseline_step_seconds}``, or null when the budget cannot be met;
    - ``layers``: per matched layer ``{name, class, none_bytes, full_bytes, selective_bytes, full_flops,
      selective_flops}``, and ``outside_bytes``.
    """
    return {
        "batch_size": main.batch_size,
        "memory_budget": budget,
        "device": device.name if device is not None else None,
        "static_bytes_per_device": static.total,
        "settings": [{"name": r.name, "checkpointed_layers": r.layers, "activation_bytes": r.activation_bytes,
                      "recompute_flops": r.recompute_flops, "predicted_step_seconds": r.predicted_step_seconds,
                      "largest_batch": r.largest_batch} for r in rows],
        "plan": None if plan is None else {
            "layers": plan.layers, "offloaded": [n for n, m in plan.layers.items() if plan.offload and m != "none"],
            "kept_ops": plan.kept_ops, "planned_bytes": plan.planned_bytes, "budget_bytes": plan.budget_bytes,
            "recompute_flops": plan.recompute_flops, "predicted_step_seconds": plan.predicted_step_seconds,
            "baseline_step_seconds": plan.baseline_step_seconds},
        "layers": [{"name": c.name, "class": c.cls, "none_bytes": c.none_bytes, "full_bytes": c.full_bytes,
                    "selective_bytes": c.selective_bytes, "full_flops": c.full_flops,
                    "selective_flops": c.selective_flops} for c in main.costs],
        "outside_bytes": main.outside_bytes,
    }


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
    config_budget = built.memory_budget if built.memory_budget not in (None, "auto") else None
    budget = args.memory_budget if args.memory_budget is not None else config_budget or DEFAULT_BUDGET

    size = batch_size_of(next(iter(built.loader)))
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
                        plan.kept_ops if plan is not None else {}, profile)
    batch_sizes = sorted([main_m.batch_size] + ([other.batch_size] if other else []))
    report = render(args.config.name, built, main_m, plan, plan_error, budget, rows, static, args.device_memory,
                    batch_sizes)
    out_dir = (args.output_dir or Path("lightning_ckpt_plan") / args.config.stem).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.md").write_text(report)
    figures = plan_json(main_m, plan, budget, rows, static, profile)
    (out_dir / "plan.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(report)
    print(f"plan: wrote {out_dir / 'plan.md'} and plan.json", flush=True)
    if plan is None:
        print(f"plan: memory_budget={budget!r} cannot be met; see 'No plan' above.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
