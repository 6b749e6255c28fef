"""How ``lightning-ckpt plan`` builds what it measures: a config's model and data for one device, for real or under
``FakeTensorMode`` (:func:`build`, :class:`Built`), and the accelerator the config asks for.

The trainer is built for one device without a strategy (:data:`ONE_DEVICE`); how the configured strategy shards
static memory is :mod:`~lightning_ckpt.commands.plan.sharding`, the measuring step
:mod:`~lightning_ckpt.commands.plan.measure`.

Example::

    built = build(Path("config.yaml"), fake=True)  # the model's weights and the batches as fake tensors
    built.module, built.device, built.sharding.world
"""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import Precision
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_ckpt.commands.cli_builder import run_cli
from lightning_ckpt.commands.plan.sharding import Sharding, _import_class, device_count, sharding_of
from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.plan.planner import Offload


#: What the trainer is built with when the configured accelerator is missing here (planning only, under --fake).
PLANNING_TRAINER = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto")
#: One device, no strategy, whatever the config says: the command plans one device's share and launches nothing.
ONE_DEVICE = PLANNING_TRAINER[1:]


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
    #: The layers' norms and gated MLPs run lean (the config's callback's ``lean_layers=True``, or --lean-layers).
    lean_layers: bool = False
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
                 lean_layers=settings.get("lean_layers") is True,
                 time_layers=settings.get("time_layers", True) is not False,
                 reentrant=bool((settings.get("checkpoint_kwargs") or {}).get("use_reentrant",
                                                                              settings.get("use_reentrant", False))))


def _auto_devices(cli: Any, planned_for: Optional[str]) -> int:
    """How many devices ``devices="auto"`` (or -1) means: the configured accelerator's count here, 1 when it is missing."""
    return 1 if planned_for is not None else max(1, int(type(cli.trainer.accelerator).auto_device_count()))
