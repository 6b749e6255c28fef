"""GradientCheckpointing: the Lightning callback. It only decides *when*: its hooks hand each training step to a
:class:`~lightning_ckpt.core.plan.budget_driver.BudgetDriver` (the memory budget's plans per batch size, measured,
solved, applied and agreed over ranks), as Lightning's ``ThroughputMonitor`` hands its figures to ``Throughput``;
selection and wrapping decide what and how, and :mod:`~lightning_ckpt.core.plan.budget` holds the arithmetic.

Also here: the callback's settings (validated together, each an attribute), finding the callback on a Trainer, and
refusing a Lightning strategy that would checkpoint as well.

About 550 lines: the class is under 300; the rest is its settings' documentation and validation, which
:class:`~lightning_ckpt.callbacks.fabric.FabricCheckpointing` shares.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, Optional, TypeVar, Union, overload

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_ckpt.core.checkpoint.offload import release_all
from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement
from lightning_ckpt.core.plan.budget_driver import BudgetDriver
from lightning_ckpt.core.plan.planner import CheckpointPlan, Offload
from lightning_ckpt.core.checkpoint.selection import (class_path, parse_memory_budget, resolve_layer_classes,
                                                      validate_every_n_layers)
from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.checkpoint.lean import apply_lean, lean_names, remove_lean
from lightning_ckpt.core.checkpoint.tiling import tile_classes, validate_tile_tokens
from lightning_ckpt.core.checkpoint.wrapping import CheckpointOptions, Mode, checkpointed_names, remove_checkpointing

_SETTINGS = ("layer_cls", "every_n_layers", "offload", "mode", "memory_budget", "use_reentrant",
             "preserve_rng_state", "checkpoint_kwargs", "compress", "max_length", "chunk_loss", "tile_mlp",
             "tile_tokens", "tile_cls", "lean_layers", "time_layers")

T = TypeVar("T")


class _SettingAttribute(Generic[T]):
    """A constructor argument exposed as an attribute of the callback.

    Reading returns the value held in the callback's settings (a copy for lists and dicts, so that changing it
    in place cannot skip validation); setting validates the new value together with the other settings, exactly
    as the constructor does, and only then stores it (and re-applies, when layers are already checkpointed).
    """

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _SettingAttribute[T]: ...

    @overload
    def __get__(self, obj: GradientCheckpointing, owner: type) -> T: ...

    def __get__(self, obj: Optional[GradientCheckpointing], owner: type) -> Union[T, _SettingAttribute[T]]:
        if obj is None:
            return self
        return copy.copy(obj._settings[self.name])

    def __set__(self, obj: GradientCheckpointing, value: T) -> None:
        obj._update_settings({self.name: value})

class GradientCheckpointing(Callback):
    r"""Activation (gradient) checkpointing for the layers of a LightningModule.

    Checkpointed layers keep only their inputs in forward and recompute everything else in backward:
    activation memory drops to about the layer inputs, at the cost of about one extra forward of those
    layers per step. Loss and gradients are unchanged (dropout included, the RNG state is replayed).

    Args:
        layer_cls: the layer class to checkpoint, its dotted import path, or a list of either.
            ``None`` detects the repeated block (the class that fills an ``nn.ModuleList``/``nn.Sequential``).
        every_n_layers: checkpoint matched layers 0, n, 2n, ... in registration order.
        offload: keep the checkpointed layers' inputs in pinned host memory instead of the device; with
            ``memory_budget``, ``"auto"`` lets the plan choose per layer what lives in host memory (see below).
        mode: ``"full"`` recomputes the whole layer; ``"selective"`` keeps matmul/attention outputs.
        memory_budget: let the callback choose: a fraction of the activation bytes held without checkpointing
            (``0.5``), bytes (``"2GiB"``, ``"2GB"`` = 2e9, or a whole number: ``5555996`` from YAML too), or ``"auto"``
            (what fits the accelerator). The first training step
            runs fully checkpointed and measures each layer; from the next batch on, the cheapest plan that
            fits (fewest recomputed FLOPs; each layer ``"none"``, ``"full"`` or ``"selective"``) is applied.
            Replaces ``every_n_layers`` and ``mode``. With ``memory_budget="auto"`` or ``offload="auto"`` the
            callback measures the accelerator in ``setup`` (:meth:`DeviceProfile.measure`, a few seconds) and the
            plan has the least predicted step time instead; ``offload="auto"`` also weighs keeping each layer's
            tensors in host memory against recomputing them, by the part of the copies the next layer's compute
            cannot hide, within half of the host memory free at setup (shared by the node's devices).
        use_reentrant: use torch's reentrant checkpoint (not recommended; non-reentrant is the default).
        preserve_rng_state: replay the RNG state in recompute so dropout masks match.
        checkpoint_kwargs: extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the above.
        length_fn: with ``memory_budget``, the tokens in a batch (for example
            ``lambda batch: int(batch["attention_mask"].sum())``); default: ``batch * seq`` of a 2-D integer main
            tensor (token ids), else the batch's samples. Plans are kept per size (see below).
        compress: ``None`` (exact), ``"bf16"`` or ``"fp8"``: hold the checkpointed layers' inputs compressed until
            their recompute, for about half or a quarter of their fp32 bytes (on the device, or with ``offload``,
            in host memory and in transfer). The forward runs on the exact inputs; the backward starts from the
            decompressed copy, so gradients are close, not equal. With ``memory_budget`` the plan counts the
            compressed bytes. See the guide "Compressed checkpoints".
        max_length: with ``memory_budget``, the longest sequence the run will see (default: the model's
            ``block_size`` / ``max_position_embeddings`` where it has one). Before the first step, the first batch
            at this length (its batch size kept) is measured on fake tensors (no memory) and planned for: a budget
            that cannot hold a ``max_length`` you gave is refused before anything is trained, and that plan is kept
            for batches it covers. The model's own limit is only a hint: a budget that cannot hold it is not
            refused; the longest length it holds is said once, and a batch that comes longer stops the run. That
            planning runs your ``training_step`` on fake tensors (its ``self.log`` muted; what it keeps elsewhere, a
            list of losses, gets a fake tensor); ``max_length=0`` turns it off: nothing runs before the first step,
            and each batch is planned as it comes.
        chunk_loss: ``True``: the LM head and the cross-entropy run in chunks of tokens, so nothing of ``tokens x
            vocab`` is kept for backward (:func:`lightning_ckpt.lm_loss`), for Transformers ``*ForCausalLM`` called
            with ``labels`` (PEFT-wrapped too), litgpt's ``GPT`` called with ``targets=`` and the demo GPT; with
            ``memory_budget`` the plans are measured with it. ``False``: the loss runs as the model computes it.
            ``None``: so too without a budget; with a byte or fraction budget (not under FSDP2) each plan chooses:
            the measuring step runs the head in chunks of 1024 tokens, the plain head and loss and chunks of 512 and
            256 are priced apart on fake tensors, the largest chunk that fits is taken (as ``plan_checkpointing``
            does), and ``plan.chunk_tokens`` says what was chosen. Other models keep their loss, said once, as does
            a model that changes its logits before the loss (Gemma 2's ``final_logit_softcapping``).
        tile_mlp: ``True``: each decoder layer's MLP and norms (and the final norm) run over tiles of tokens, each tile
            under checkpoint, so that only one tile's intermediates are alive at a time (ALST's TiledMLP;
            :mod:`~lightning_ckpt.core.checkpoint.tiling`), in every layer, checkpointed or not: Transformers' Llama, Mistral,
            Qwen2/3, Phi3, Gemma/2/3 decoder layers, litgpt's ``Block``, the demo GPT; ``tile_cls`` names the class for
            a model of your own. ``False``: whole. ``None``: whole for now (a budget's plan will choose it).
        tile_tokens: with ``tile_mlp``: tokens per tile along the sequence; ``None``: ``ceil(length / hidden)`` tiles
            (ALST's rule).
        tile_cls: with ``tile_mlp``: the class(es) to tile instead of the MLPs it knows (a class, a dotted import
            path, or a list of either); name only modules that compute each token alone.
        lean_layers: ``True``: each decoder layer's norms recompute their output in backward (nested checkpoint)
            and its gated MLP keeps only gate and up (:mod:`~lightning_ckpt.core.checkpoint.lean`), in every layer,
            checkpointed or not, for Transformers' Llama, Mistral, Qwen2/3, Gemma/2/3 and litgpt: the same
            gradients bit for bit, one Llama layer's backward peak about a fifth lower, for a norm's forward and
            ``act(gate)`` again per layer and step. With ``memory_budget`` the plans are measured with it.
        time_layers: with ``memory_budget``, the measuring step also times each distinct layer's forward and backward
            on the device, plainly, fully and selectively checkpointed (a few more runs of one layer), and the plan
            has the least measured time instead of the fewest FLOPs (the slowest rank's times: every rank plans
            alike). ``False``: FLOPs (or, with ``"auto"``, the device's rates) alone, the same plan on every run.
            Not under FSDP2, whose hooks expect one backward per forward: there plans count FLOPs.

    Layers are checkpointed in ``setup`` and, for models built in ``configure_model``, right after it,
    before any strategy wraps the model. Everything is undone in ``teardown`` (or on an exception).

    Every argument is also an attribute (``callback.every_n_layers``, ...). Setting one validates it like the
    constructor (a bad value raises and changes nothing) and, when layers are already checkpointed, re-applies.

    With ``memory_budget``, the budget holds on every batch, whatever its size: a batch larger (more tokens, or
    longer sequences) than any its size bucket was planned for gets its own plan, solved from costs fitted over the
    sizes measured (a + b tokens + c tokens x length, 2% over) where the fit is trusted, else from a measuring step
    (fully checkpointed while its costs are recorded: the first three sizes, a size 16x past all measured, or a bucket
    whose predicted plan held more than planned); the plan is used for the batches it covers, and a short batch so
    runs the cheaper plan its own size allows (:mod:`~lightning_ckpt.core.plan.budget_cycle`). ``callback.plan`` holds the latest batch's
    :class:`~lightning_ckpt.core.plan.planner.CheckpointPlan` (and ``checkpointed_layers`` its choice), ``callback.plans``
    every bucket's. The plans are saved in Lightning checkpoints with the fit: a resumed run applies them without
    measuring those sizes again, and predicts new sizes from the fit. Under DDP and FSDP2 every rank measures its own batch, the per-layer
    costs are combined with their maximum over ranks, and every rank solves the same plan. Under FSDP2 each layer
    must be its own unit (``strategy='fsdp_ckpt'`` shards it so): measuring gathers each layer's parameters once
    more, in the first step only.

    Example::

        >>> callback = GradientCheckpointing(every_n_layers=4, offload=True)
        >>> callback.every_n_layers
        4
        >>> callback.every_n_layers = 2
        >>> callback.state_dict()["settings"]["every_n_layers"]
        2

        trainer = Trainer(callbacks=[callback])
    """

    layer_cls: _SettingAttribute[Union[str, type, Sequence[Union[str, type]], None]] = _SettingAttribute(
        "The layer class(es) to checkpoint, as given (classes or dotted import paths); ``None``: detected.")
    every_n_layers: _SettingAttribute[int] = _SettingAttribute("Checkpoint matched layers 0, n, 2n, ... in registration order.")
    offload: _SettingAttribute[Offload] = _SettingAttribute("Keep the checkpointed layers' inputs in pinned host memory; ``'auto'``: the"
                                        " plan chooses per layer.")
    mode: _SettingAttribute[Mode] = _SettingAttribute("``'full'`` or ``'selective'``.")
    memory_budget: _SettingAttribute[Union[float, int, str, None]] = _SettingAttribute(
        "A fraction (``0.5``), bytes (``'2GiB'``) or ``'auto'``: the callback plans what to checkpoint; ``None``: off.")
    use_reentrant: _SettingAttribute[bool] = _SettingAttribute("Use torch's reentrant checkpoint.")
    preserve_rng_state: _SettingAttribute[bool] = _SettingAttribute("Replay the RNG state in the recomputation.")
    checkpoint_kwargs: _SettingAttribute[Optional[dict[str, Any]]] = _SettingAttribute(
        "Extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the other options.")
    compress: _SettingAttribute[Optional[Compress]] = _SettingAttribute(
        "``None``, ``'bf16'`` or ``'fp8'``: how checkpointed layers hold their inputs until the recompute.")
    max_length: _SettingAttribute[Optional[int]] = _SettingAttribute(
        "With ``memory_budget``: the longest sequence the run will see, planned for before the first step; ``None``:"
        " the model's ``block_size`` / ``max_position_embeddings``; ``0``: no planning before the first step.")
    chunk_loss: _SettingAttribute[Optional[bool]] = _SettingAttribute(
        "``True``: the LM head and loss in chunks of tokens; ``False`` / ``None``: as the model computes them.")
    tile_mlp: _SettingAttribute[Optional[bool]] = _SettingAttribute(
        "``True``: each layer's MLP over tiles of tokens; ``False``: whole; ``None``: whole until a plan chooses.")
    tile_tokens: _SettingAttribute[Optional[int]] = _SettingAttribute(
        "With ``tile_mlp``: tokens per tile; ``None``: ``ceil(length / hidden)`` tiles.")
    tile_cls: _SettingAttribute[Union[str, type, Sequence[Union[str, type]], None]] = _SettingAttribute(
        "With ``tile_mlp``: the class(es) to tile instead of the MLPs it knows; ``None``: those it knows.")
    lean_layers: _SettingAttribute[bool] = _SettingAttribute(
        "Norms recompute in backward and gated MLPs keep gate and up only (exact).")
    time_layers: _SettingAttribute[bool] = _SettingAttribute(
        "With ``memory_budget``: price each layer's choices by the times measured on the device (else by FLOPs).")
    def __init__(
        self,
        layer_cls: Union[str, type, Sequence[Union[str, type]], None] = None,
        every_n_layers: int = 1,
        offload: Offload = False,
        mode: Mode = "full",
        memory_budget: Union[float, int, str, None] = None,
        use_reentrant: bool = False,
        preserve_rng_state: bool = True,
        checkpoint_kwargs: Optional[dict[str, Any]] = None,
        length_fn: Optional[Callable[[Any], int]] = None,
        compress: Optional[Compress] = None,
        max_length: Optional[int] = None,
        chunk_loss: Optional[bool] = None,
        tile_mlp: Optional[bool] = None,
        tile_tokens: Optional[int] = None,
        tile_cls: Union[str, type, Sequence[Union[str, type]], None] = None,
        lean_layers: bool = False,
        time_layers: bool = True,
    ) -> None:
        if length_fn is not None and not callable(length_fn):
            raise TypeError(f"`length_fn` must be a function of the batch returning its tokens, got {length_fn!r}.")
        arguments = locals()
        settings = {name: copy.copy(arguments[name]) for name in _SETTINGS}
        _validate(settings)
        self._settings: dict[str, Any] = settings  # the one place the options live; attributes read from it
        self.length_fn = length_fn
        #: The memory budget's plans and their cycle, driven by this callback's hooks (it reads ``_settings``).
        self.driver = BudgetDriver(settings, info=rank_zero_info, warn=rank_zero_warn,
                                   report=functools.partial(_report_plan, self))  # picklable, for spawn
        self._module: Optional[pl.LightningModule] = None
        self._original_configure_model: Any = None
        self._trainer: Optional[pl.Trainer] = None  # the plan table's loggers and step
        self._start_step = 0

    @property
    def checkpointed_layers(self) -> list[str]:
        """The names of the layers checkpointed now."""
        return self.driver.checkpointed_layers

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """With ``memory_budget``: the plan of the latest training batch (``None`` while a new size is measured)."""
        return self.driver.plan

    @property
    def plans(self) -> dict[int, CheckpointPlan]:
        """With ``memory_budget``: each batch-size bucket (tokens, or samples, rounded up to a power of two: a batch
        of 4 x 100 tokens is in bucket 512) and its plan; see :mod:`~lightning_ckpt.core.plan.budget_cycle`."""
        return dict(self.driver.cycle.plans)

    @property
    def measured_steps(self) -> int:
        """With ``memory_budget``: the training steps of this fit that ran fully checkpointed to measure a size no
        plan covered (the longest batch's fake step before the first step is not one: it trains nothing)."""
        return self.driver.measured_steps

    @property
    def settings(self) -> Mapping[str, Any]:
        """All options by name, read-only (set them as attributes: ``callback.every_n_layers = 2``)."""
        return MappingProxyType(self._settings)

    def apply(self, pl_module: pl.LightningModule) -> list[str]:
        """Checkpoint the selected layers of ``pl_module`` (idempotent) and record their names.

        With ``memory_budget``: the plan when there is one, else every matched layer fully checkpointed (the
        measuring step). With ``lean_layers``, the norms and gated MLPs run lean first, so that every measurement
        sees them.
        """
        lean = self._settings["lean_layers"]
        if lean:
            apply_lean(pl_module)  # idempotent
        try:
            return self.driver.apply(pl_module)
        except BaseException:
            if lean:  # nothing left half-applied
                remove_lean(pl_module)
            raise

    def remove(self) -> None:
        """Undo everything this callback did to the module it was set up on."""
        if self._module is None:
            return
        remove_checkpointing(self._module)
        remove_lean(self._module)
        if self._original_configure_model is not None:
            del self._module.configure_model
            self._original_configure_model = None
        self._module = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_lightning_strategy(trainer.strategy)
        self._trainer = trainer
        self.driver.prepare(trainer.strategy, trainer.num_devices, fit=stage == "fit")
        self._module = pl_module
        if is_overridden("configure_model", pl_module):
            # Layers built in `configure_model` do not exist yet; checkpoint them right after it runs,
            # which is still before the strategy moves or wraps the model.
            original = pl_module.configure_model

            @functools.wraps(original)
            def configure_model_then_checkpoint() -> None:
                original()
                self.apply(pl_module)

            self._original_configure_model = original
            pl_module.configure_model = configure_model_then_checkpoint
        else:
            self.apply(pl_module)

    def _attach(self, module: torch.nn.Module) -> list[str]:
        """Checkpoint ``module`` now (its layers exist) and keep it as the module re-planned and undone later."""
        self._module = module  # type: ignore[assignment]
        return self.apply(module)  # type: ignore[arg-type]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy wrapped the model: also covers Lightning's own FSDP/ModelParallel strategies.
        check_checkpointing_placement(pl_module)

    # ------------------------------------------------------------------ memory budget: the driver, at each hook

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self.driver.start()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._trainer = trainer
        self.driver.begin_batch(trainer.strategy, pl_module, batch, self.length_fn,
                                functools.partial(_training_step, trainer, pl_module))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.driver.after_forward(trainer.strategy, pl_module, loss)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.driver.end_batch(trainer.strategy, pl_module, trainer.global_step > self._start_step, trainer.optimizers)

    # ------------------------------------------------------------------ end, state

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end()

    def _end(self) -> None:
        self.driver.end()
        self.remove()
        self._trainer = None
        if self._settings["offload"]:
            release_all()  # the pinned host buffers pooled for offload

    def state_dict(self) -> dict[str, Any]:
        settings = {name: copy.copy(value) for name, value in self._settings.items()}
        settings["layer_cls"] = _layer_cls_as_paths(settings["layer_cls"])
        settings["tile_cls"] = _layer_cls_as_paths(settings["tile_cls"])
        return {"settings": settings, "checkpointed_layers": list(self.checkpointed_layers), **self.driver.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # a setting added since the checkpoint was saved (time_layers) keeps this run's value
        settings = {**self.state_dict()["settings"], **state_dict["settings"]}
        if settings != self.state_dict()["settings"]:
            rank_zero_info(f"GradientCheckpointing: restoring the settings from the checkpoint: {settings}")
            self._update_settings(settings)
        if state_dict.get("plans") is not None and settings.get("memory_budget") is not None:
            # A resumed run: the plans from the checkpoint, from the first step, without measuring those sizes again.
            self.driver.load_state_dict(state_dict)
            if self._module is not None and checkpointed_names(self._module):
                self.apply(self._module)

    def _update_settings(self, changes: Mapping[str, Any]) -> None:
        """Validate ``changes`` with the other settings, then store them and re-apply to checkpointed layers."""
        settings = _merged_settings(self._settings, changes)
        if settings == self._settings:
            return
        if self.plan is not None and _PLAN_SETTINGS & {k for k in settings if settings[k] != self._settings[k]}:
            # The plan was solved for the old budget and options; measure again on the next training batch.
            self.driver.settings_changed()
        self._settings.update(settings)
        # Only where the layers exist and are checkpointed: before `configure_model` ran, applying now would find
        # no layers; the pending application will use the new settings anyway.
        if self._module is not None and (checkpointed_names(self._module) or lean_names(self._module)):
            remove_checkpointing(self._module)
            remove_lean(self._module)
            self.apply(self._module)

def find_checkpointing_callback(trainer: pl.Trainer) -> Optional[GradientCheckpointing]:
    """The trainer's :class:`GradientCheckpointing` callback, or ``None`` when it has none.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> find_checkpointing_callback(Trainer(callbacks=[GradientCheckpointing()], logger=False)).mode
        'full'
    """
    found = [cb for cb in trainer.callbacks if isinstance(cb, GradientCheckpointing)]
    if len(found) > 1:
        raise ValueError(
            f"The Trainer has {len(found)} `GradientCheckpointing` callbacks; pass one (its `layer_cls` can be a list"
            " of classes)."
        )
    return found[0] if found else None


def check_lightning_strategy(strategy: Strategy) -> None:
    """Refuse Lightning strategies configured to checkpoint on their own while the callback checkpoints too.

    Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)`` (or the deprecated
    ``activation_checkpointing=...``) wraps layers in torch's ``CheckpointWrapper`` after sharding; with
    :class:`GradientCheckpointing` as well, layers would be recomputed twice. ``DeepSpeedStrategy`` is refused
    too: DeepSpeed brings its own activation checkpointing, and the callback is not verified under its engine.

    Example::

        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> check_lightning_strategy(DDPStrategy())  # no checkpointing of its own: fine
    """
    if isinstance(strategy, FSDPStrategy) and getattr(strategy, "_activation_checkpointing_kwargs", None):
        raise ValueError(
            "`FSDPStrategy(activation_checkpointing_policy=...)` and the `GradientCheckpointing` callback would both"
            " checkpoint the model, recomputing layers twice. Remove `activation_checkpointing_policy` (the callback"
            " checkpoints inside the FSDP units when `auto_wrap_policy` wraps the layer class), or remove the callback."
        )
    if isinstance(strategy, DeepSpeedStrategy):  # Lightning's class imports without deepspeed installed
        raise ValueError(
            "`GradientCheckpointing` does not support `DeepSpeedStrategy`: DeepSpeed checkpoints activations its own"
            " way, and torch's checkpoint under its engine (ZeRO partitioning) is not verified by this package. Remove"
            " the callback and use DeepSpeed's activation checkpointing: call `deepspeed.checkpointing.checkpoint(block,"
            " x)` in your model's forward and set the `activation_checkpointing` section of the DeepSpeed config (in"
            " Lightning: `DeepSpeedStrategy(partition_activations=True, cpu_checkpointing=True,"
            " contiguous_memory_optimization=True)`). Or keep the callback and shard with `strategy='fsdp_ckpt'`."
        )


def _merged_settings(settings: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with ``changes`` (copies), validated together."""
    unknown = sorted(set(changes) - set(_SETTINGS))
    if unknown:
        raise ValueError(f"GradientCheckpointing has no option {', '.join(map(repr, unknown))}; the options are"
                         f" {', '.join(_SETTINGS)}.")
    merged = {**settings, **{name: copy.copy(value) for name, value in changes.items()}}
    _validate(merged)
    return merged


def _validate(settings: Mapping[str, Any]) -> None:
    every_n_layers = validate_every_n_layers(settings["every_n_layers"])
    resolve_layer_classes(settings["layer_cls"])
    auto_offload = settings["offload"] == "auto"
    CheckpointOptions(False if auto_offload else settings["offload"], settings["mode"], settings["use_reentrant"],
                      settings["preserve_rng_state"], settings["checkpoint_kwargs"] or {}, settings["compress"])
    budget = parse_memory_budget(settings["memory_budget"], allow_auto=True)
    if settings["chunk_loss"] is not None and not isinstance(settings["chunk_loss"], bool):
        raise TypeError(f"`chunk_loss` is True, False or None, got {settings['chunk_loss']!r}. Pass True (the LM"
                        " head and loss in chunks), False (whole) or None (a budget's plan chooses).")
    _validate_tiles(settings)
    if not isinstance(settings["lean_layers"], bool):
        raise TypeError(f"`lean_layers` is True or False, got {settings['lean_layers']!r}. Pass True (norms and gated"
                        " MLPs hold less for backward, the same gradients) or False (the layers as they are).")
    if not isinstance(settings["time_layers"], bool):
        raise TypeError(f"`time_layers` is True or False, got {settings['time_layers']!r}. Pass True (plans priced by"
                        " the times measured on the device) or False (by FLOPs: the same plan on every run).")
    max_length = settings["max_length"]
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0):
        raise ValueError(f"`max_length` is the longest sequence the run will see, in tokens: pass an int >= 1 (or"
                         f" None: the model's block_size / max_position_embeddings; or 0: plan no longest batch before"
                         f" the first step), got {max_length!r}.")
    if auto_offload and budget is None:
        raise ValueError("`offload='auto'` lets the memory-budget plan choose which layers offload, but"
                         " `memory_budget=None` asks for no plan. Pass a memory_budget (0.5, '2GiB' or 'auto'), or"
                         " offload=True / False.")
    if budget is not None and every_n_layers != 1:
        raise ValueError(
            f"`memory_budget={settings['memory_budget']!r}` and `every_n_layers={every_n_layers}` are two ways of choosing"
            " the checkpointed layers. Pass one: `memory_budget` alone lets the callback choose (leave `every_n_layers`"
            " at 1), or set `memory_budget=None` to checkpoint every n-th layer."
        )


def _validate_tiles(settings: Mapping[str, Any]) -> None:
    """``tile_mlp`` is True, False or None; ``tile_tokens`` and ``tile_cls`` need a ``tile_mlp`` that is not False."""
    tile_mlp = settings["tile_mlp"]
    if tile_mlp is not None and not isinstance(tile_mlp, bool):
        raise TypeError(f"`tile_mlp` is True, False or None, got {tile_mlp!r}. Pass True (each layer's MLP over tiles"
                        " of tokens), False (whole) or None (whole until a budget's plan chooses).")
    if settings["tile_tokens"] is not None:
        validate_tile_tokens(settings["tile_tokens"])
    tile_classes(settings["tile_cls"])
    if tile_mlp is False and (settings["tile_tokens"] is not None or settings["tile_cls"] is not None):
        raise ValueError(f"`tile_tokens={settings['tile_tokens']!r}` and `tile_cls={settings['tile_cls']!r}` say how"
                         " the MLP is tiled, but `tile_mlp=False` tiles nothing. Pass tile_mlp=True (or None) with"
                         " them, or leave both None.")


_PLAN_SETTINGS = {"layer_cls", "memory_budget", "offload", "use_reentrant", "checkpoint_kwargs", "compress",
                  "chunk_loss", "tile_mlp", "tile_tokens", "tile_cls", "lean_layers", "time_layers"}
# The constructor options a plan does not depend on, each with why (a test keeps the two sets covering them all).
_KEEPS_PLAN = {
    "every_n_layers": "refused with memory_budget other than 1, so a plan never used it",
    "mode": "the plan chooses each layer's mode itself; `mode` applies only without memory_budget",
    "preserve_rng_state": "saves the RNG states, not activations: the layers and their bytes stay the same",
    "length_fn": "a plain attribute read per batch to size it, not a setting; set it before fit, as the sizes"
                 " the plans were measured at are counted by it",
    "max_length": "only says which size to plan before the first step; the plans kept are each for its own size",
}


# --------------------------------------------------------------------------------------------- Lightning's side


@contextlib.contextmanager
def _training_step(trainer: Any, pl_module: Any) -> Iterator[Callable[[Any], torch.Tensor]]:
    """The loss of a (fake) batch, as the run computes it: here the module's ``training_step`` under the
    trainer's precision, with its ``self.log()`` off (it must not log fake tensors)."""
    precision = trainer.precision_plugin

    def step(fake_batch: Any) -> torch.Tensor:
        with precision.train_step_context():
            return _loss_of(pl_module.training_step(precision.convert_input(fake_batch), 0))

    trainer_ref, pl_module._trainer = pl_module._trainer, None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
            yield step
    finally:
        pl_module._trainer = trainer_ref


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned (a tensor, or a dict with ``"loss"``); a ``TypeError`` otherwise
    (manual optimization), which the longest batch's measurement reports and passes over."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}, not a loss")
    return loss


def _report_plan(callback: GradientCheckpointing, line: str, table: str) -> None:
    """A new plan's line in the log (info), its table to the loggers of the callback's trainer
    (:func:`_send_plan_table`)."""
    trainer = callback._trainer
    rank_zero_info(line)
    _send_plan_table(trainer.loggers if trainer is not None else [], table, trainer.global_step if trainer else 0)


def _send_plan_table(loggers: Sequence[Any], table: str, step: int) -> None:
    """A new plan's whole table to each logger that takes text, else to the log at debug level (one line per new plan
    is logged at info: a run of many lengths makes many plans)."""
    sent = False
    for logger in loggers:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):  # TensorBoard's SummaryWriter; shown as Markdown, hence the code block
            add_text("gradient_checkpointing/plan", "\n".join("    " + line for line in table.splitlines()), step)
            sent = True
    if not sent:
        rank_zero_debug(f"GradientCheckpointing plan:\n{table}")


def _layer_cls_as_paths(layer_cls: Any) -> Any:
    if isinstance(layer_cls, type):
        return class_path(layer_cls)
    if isinstance(layer_cls, (list, tuple)):
        return [class_path(c) if isinstance(c, type) else c for c in layer_cls]
    return layer_cls
