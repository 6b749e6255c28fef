"""How ``lightning-ckpt plan`` measures: a config's model and data built for one device (for real or under
``FakeTensorMode``), one fully checkpointed training step measured, the static memory one device holds under the
configured strategy, and the ``--device`` profile.

The command itself is :mod:`lightning_ckpt.commands.plan`; the predictions made from these measurements are in
:mod:`lightning_ckpt.commands.plan.predictions`, the report in :mod:`lightning_ckpt.commands.plan.report`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import psutil
import torch
import yaml
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from torch import nn
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_ckpt.commands.cli_builder import run_cli
from lightning_ckpt.core.checkpoint.chunked_loss import DEFAULT_CHUNK_TOKENS, chunk_loss_of, chunked_models
from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.measure.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.core.measure.fake_values import real_branches
from lightning_ckpt.core.measure.longest import batch_of_length as core_batch_of_length
from lightning_ckpt.core.measure.longest import length_limit, sequence_length_of
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.measure.profiling import storage_key, tensor_bytes
from lightning_ckpt.core.plan.budget import host_memory_share
from lightning_ckpt.core.plan.planner import (PLAN_MODES, ChunkedHead, LayerCost, Offload, measure_chunked_head,
                                              measure_step)
from lightning_ckpt.strategies import CheckpointingFSDPStrategy
from lightning_ckpt.strategies.fsdp import cpu_offload_policy, mixed_precision_policy, unit_parameters

#: What the trainer is built with when the configured accelerator is missing here (planning only, under --fake).
PLANNING_TRAINER = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto")
#: One device, no strategy, whatever the config says: the command plans one device's share and launches nothing.
ONE_DEVICE = PLANNING_TRAINER[1:]
_LOG_WARNING = r"You are trying to `self.log\(\)` but the `self.trainer` reference is not registered"


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
    #: How the checkpointed layers hold their inputs: the config's callback's ``compress``, or --compress.
    compress: Optional[Compress] = None
    #: The LM head and loss in chunks: the config's callback's ``chunk_loss``, or --chunk-loss (``None``: the plan
    #: chooses).
    chunk_loss: Optional[bool] = None
    #: How the configured strategy shards static memory (the trainer itself is built for one device).
    sharding: Sharding = field(default_factory=Sharding)
    #: The config's callback checkpoints with ``use_reentrant``: its plans are full or none, and so are the command's.
    reentrant: bool = False
    #: The layers' MLPs over tiles of tokens (the config's callback's ``tile_mlp=True``, or --tile-mlp), with its
    #: ``tile_tokens`` and ``tile_cls``.
    tile_mlp: bool = False
    tile_tokens: Optional[int] = None
    tile_cls: Any = None
    #: The config's callback's ``time_layers``: the measuring step times each layer and the plan is priced by those
    #: times (real tensors only); ``False``: by FLOPs.
    time_layers: bool = True

    def mode(self) -> AbstractContextManager[Any]:
        """The context in which tensors are made: the fake mode, or nothing."""
        return self.fake_mode if self.fake_mode is not None else nullcontext()


@contextmanager
def _made_for_real(cls: Optional[type]) -> Iterator[None]:
    """Inside, ``cls`` is made with real tensors even under a fake mode (its ``__init__`` runs without it)."""
    if cls is None:
        yield
        return
    own = cls.__dict__.get("__init__")
    init = cls.__init__

    @functools.wraps(init)
    def real_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    cls.__init__ = real_init  # type: ignore[misc]
    try:
        yield
    finally:
        if own is None:
            del cls.__init__
        else:
            cls.__init__ = own  # type: ignore[misc]


@contextmanager
def _swappable(fake_mode: Optional[FakeTensorMode]) -> Iterator[None]:
    """Inside, ``module.to(...)`` works on weights made under ``fake_mode`` (PEFT moves its adapters so; so does a
    ``"bf16-true"`` precision). ``Module._apply`` swaps a fake weight for its converted copy, which
    ``torch.utils.swap_tensors`` refuses while the fake mode's memo of converted tensors holds a weak reference to
    it; the memo is a cache of conversions, so the two tensors' entries are dropped first."""
    if fake_mode is None:
        yield
        return
    swap = torch.utils.swap_tensors
    memo = fake_mode.fake_tensor_converter.tensor_memo

    def unmemoized_swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key in [k for k, v in memo.items() if v is t1 or v is t2]:
            del memo[key]
        swap(t1, t2)

    torch.utils.swap_tensors = unmemoized_swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


def _without_weight_init(fake: bool) -> AbstractContextManager[Any]:
    """Under fake tensors, Transformers' own ``no_init_weights``: weights have no values to initialise there, and an
    initialiser that reads one (``trunc_normal_``'s rejection loop, as ViT's) cannot run on them."""
    if not fake:
        return nullcontext()
    for where in ("transformers.initialization", "transformers.modeling_utils"):  # 5.x, then 4.x
        no_init = getattr(_import_module(where), "no_init_weights", None)
        if no_init is not None:
            return no_init()
    return nullcontext()


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _RealDataCLI(LightningCLI):
    """LightningCLI whose datamodule is made with real tensors when the model is made under fake ones: data is
    cheap to build, its values decide the branches a step takes (:mod:`~lightning_ckpt.core.measure.fake_values`), and a
    datamodule that reads its own tensors in ``__init__`` (``.item()``, ``.tolist()``) cannot be built on fake
    tensors."""

    def instantiate_classes(self) -> None:
        data = self.config.get("data")
        path = data.get("class_path") if data is not None and hasattr(data, "get") else None
        with _made_for_real(_import_class(path) if isinstance(path, str) else None):
            super().instantiate_classes()


@contextmanager
def _seed_banner(shown: bool) -> Iterator[None]:
    """Lightning's "Seed set to N" log line as is when ``shown``, else dropped (a config built again reseeds)."""
    logger = logging.getLogger("lightning.fabric.utilities.seed")
    def drop(record: logging.LogRecord) -> bool:
        return False

    if not shown:
        logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def build(config: Path, fake: bool, cli_args: Sequence[str] = (), seed_banner: bool = True, meta: bool = False) -> Built:
    """Build the config's model (with ``configure_model`` run and the trainer's precision applied), data and
    checkpointing settings; under ``FakeTensorMode`` when ``fake`` (no memory is allocated for weights or
    activations). ``cli_args`` are LightningCLI overrides.

    The trainer is built for one device without a strategy (:data:`ONE_DEVICE`); the configured strategy, devices
    and num_nodes only say how static memory is sharded (``sharding``). When the configured accelerator is not
    available here, ``fake`` must be on: the trainer is then built with ``accelerator="cpu"`` too
    (:data:`PLANNING_TRAINER`), its precision kept, and ``planned_for`` says so. ``seed_banner=False`` drops
    Lightning's "Seed set to N" line (the config's ``seed_everything``) for a build after the first. ``meta=True``
    (not with ``fake``) builds the weights on the meta device: sizes and dtypes only, for :func:`would_not_fit` on a
    model that cannot be built under fake tensors.
    """
    target = configured_accelerator(config, cli_args)
    planned_for = None if accelerator_available(target) else target
    if planned_for is not None and not fake:
        raise ValueError(f"plan: the config asks for accelerator={target!r}, which this machine does not have; plan"
                         " for it with --fake (nothing is allocated) or run on a machine that has it.")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    context: AbstractContextManager[Any] = (fake_mode if fake_mode is not None
                                            else torch.device("meta") if meta else nullcontext())
    configured = ["--config", str(config), *cli_args]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        with context, _swappable(fake_mode), _without_weight_init(fake), _seed_banner(seed_banner):
            cli = run_cli([*configured, *(PLANNING_TRAINER if planned_for else ONE_DEVICE)], cli_class=_RealDataCLI,
                          run=False, save_config_callback=None)
    trainer_config = cli.parser.parse_args(configured).trainer
    devices = device_count(trainer_config.devices)
    sharding = sharding_of(trainer_config.strategy, devices or _auto_devices(cli, planned_for), trainer_config.num_nodes)
    if devices is None and planned_for is not None:
        sharding = replace(sharding, note="; ".join(filter(None, [sharding.note, f"devices={trainer_config.devices!r}"
                           " counted as 1 (the accelerator is not here to count them): pass --trainer.devices=N"])))
    module = cli.model
    device = cli.trainer.strategy.root_device
    precision = cli.trainer.precision_plugin
    with context, _swappable(fake_mode), _without_weight_init(fake), (nullcontext() if fake or meta
                                                                       else torch.device(device)):
        module.configure_model()
        if not meta and any(t.device != device for t in (*module.parameters(), *module.buffers())):
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
                 settings.get("memory_budget"), fake_mode, precision, planned_for, compress=settings.get("compress"),
                 chunk_loss=settings.get("chunk_loss"), sharding=sharding, tile_mlp=settings.get("tile_mlp") is True,
                 tile_tokens=settings.get("tile_tokens"), tile_cls=settings.get("tile_cls"),
                 time_layers=settings.get("time_layers", True) is not False,
                 reentrant=bool((settings.get("checkpoint_kwargs") or {}).get("use_reentrant",
                                                                              settings.get("use_reentrant", False))))


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


def loader_batch_size(loader: Any) -> int:
    """The batch size ``loader`` yields: its first batch's.

    Example::

        >>> loader_batch_size([(torch.zeros(6, 2), torch.zeros(6)), (torch.zeros(2, 2), torch.zeros(2))])
        6
    """
    return batch_size_of(next(_cycle(loader)))


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


def batch_of_length(batch: Any, length: int) -> Any:
    """``batch`` at sequence length ``length``: :func:`lightning_ckpt.core.measure.longest.batch_of_length`, with ``--lengths``'
    errors for a batch without token ids or a length under 1.

    Example::

        >>> batch_of_length((torch.arange(6).view(2, 3),), 4)[0].tolist()
        [[0, 1, 2, 0], [3, 4, 5, 3]]
    """
    if length < 1:
        raise ValueError(f"plan: --lengths: a length of {length} tokens; pass lengths of 1 or more")
    resized = core_batch_of_length(batch, length)
    if resized is None:
        raise ValueError("plan: --lengths needs token ids in the batch (a 2-D integer tensor, batch x length) to know"
                         " the sequence length; the training batch has none.")
    return resized


def check_length(built: Built, length: int) -> None:
    """A ``ValueError`` naming ``length`` and why when the model cannot take sequences that long."""
    limit = length_limit(built.module)
    if limit is not None and length > limit[1]:
        name, value = limit
        raise ValueError(f"plan: --lengths: the model cannot take a length of {length} tokens: its {name} is {value}"
                         f" (its position table ends there). Pass lengths up to {value}, or a larger {name} (such as"
                         f" --model.init_args.{name}={length}).")


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
    head_bytes: int = 0  # of outside_bytes, saved after the last layer (see LayerCostRecorder.head_bytes)
    head_peak_bytes: int = 0  # what the head's backward makes alive at once (LayerCostRecorder.head_peak_bytes)
    length: Optional[int] = None  # the sequence length measured (dim 1 of the token ids); None without token ids
    chunked: Optional[ChunkedHead] = None  # the same step with the LM head and loss in chunks (see chunk_size)


def measure(built: Built, batch_size: Optional[int] = None, length: Optional[int] = None) -> Measurement:
    """One fully checkpointed training step at ``batch_size`` (default: the loader's; see
    :func:`~lightning_ckpt.core.plan.planner.measure_layer_costs`), with ``length`` its sequence length (default: the
    loader's; another cut or tiled by :func:`batch_of_length`, within :func:`check_length`)."""
    if batch_size is None:
        batch_size = loader_batch_size(built.loader)
    batch = batch_of_size(built.loader, batch_size)
    if length is not None:
        check_length(built, length)
        batch = batch_of_length(batch, length)
    measured_length = sequence_length_of(batch)
    real_batch = batch
    batch = _on_device(built, batch)
    # the real values of the batch's integer tensors, so that a fake step takes a real step's branches
    branches = (real_branches(dict(zip(tree_flatten(batch)[0], tree_flatten(real_batch)[0])))
                if built.fake_mode is not None else nullcontext())
    with built.mode():
        batch = built.precision.convert_input(batch)
    module = built.module

    def step() -> torch.Tensor:
        # The trainer's precision (autocast for "bf16-mixed"), as Lightning runs training_step.
        with built.precision.train_step_context(), AttentionKernels() as kernels:
            loss = _loss(module.training_step(batch, 0))
        built.attention_kernels |= kernels.names
        return loss

    with built.mode(), branches, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LOG_WARNING)
        try:
            measured = measure_step(module, step, built.layer_cls, time_layers=built.time_layers)
            chunk = chunk_size(built)
            chunked = None if chunk is None else measure_chunked_head(module, step, built.layer_cls, PLAN_MODES,
                                                                      chunk, time_layers=False)[1]
        except (IndexError, RuntimeError) as err:
            if length is None:
                raise
            raise ValueError(f"plan: --lengths: the step failed at a length of {length} tokens, which the model may"
                             f" not take ({type(err).__name__}: {err})") from err
    return Measurement(batch_size, measured.costs, measured.outside_bytes, measured.outside_ops, measured.head_bytes,
                       measured.head_peak_bytes, measured_length, chunked)


def chunk_size(built: Built) -> Optional[int]:
    """The tokens a chunk the plan measures the chunked LM head and loss with: the model's own chunk size if it has
    one, else :data:`~lightning_ckpt.core.checkpoint.chunked_loss.DEFAULT_CHUNK_TOKENS`; ``None`` when ``built.chunk_loss`` is
    ``False`` or the model has no loss :func:`~lightning_ckpt.core.checkpoint.chunked_loss.chunk_causal_lm_loss` can chunk.

    Example::

        >>> chunk_size(Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None))  # no LM loss
    """
    names = chunked_models(built.module) if built.chunk_loss is not False else []
    if not names:
        return None
    return chunk_loss_of(built.module.get_submodule(names[0])) or DEFAULT_CHUNK_TOKENS


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


# ------------------------------------------------------------------------------------------------ device


def device_profile(device: Optional[str], built: Built) -> Optional[DeviceProfile]:
    """The ``--device`` profile: a preset, or ``auto``: the accelerator the step runs on, measured here."""
    if device is None or device != "auto":
        return DeviceProfile.preset(device) if device is not None else None
    if built.planned_for is not None:
        raise ValueError(f"--device auto measures the accelerator the step runs on, but the config's"
                         f" {built.planned_for!r} is not here; pass a preset instead ({', '.join(PRESET_NAMES)}).")
    return DeviceProfile.measure(built.device)
