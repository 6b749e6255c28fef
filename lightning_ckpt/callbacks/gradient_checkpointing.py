"""GradientCheckpointing: the Lightning callback. It only decides *when*; selection and wrapping decide what and how,
and :mod:`~lightning_ckpt.core.plan.budget` holds the memory-budget arithmetic (ranks combined, ``"auto"``, the report).

Also here: finding the callback on a Trainer, and refusing a Lightning strategy that would checkpoint as well.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Generic, Optional, TypeVar, Union, overload

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from lightning.pytorch.utilities.model_helpers import is_overridden

import psutil

from lightning_ckpt.core.plan.budget import (
    AutoBudget,
    RankMeasurement,
    combine_costs,
    host_memory_share,
    offload_min_bytes,
    pack_costs,
    plan_summary,
    plan_table,
    static_bytes,
)
from lightning_ckpt.core.checkpoint.offload import release_all
from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement, fsdp2
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.longest import batch_of_length, longest_length, measure_fake_step, sequence_length_of
from lightning_ckpt.core.measure.memory_stats import device_peak_bytes, device_total_bytes, reset_device_peaks
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, format_bytes
from lightning_ckpt.core.plan.budget_cycle import BatchSize, BudgetCycle, batch_size_of
from lightning_ckpt.core.plan.planner import (
    CheckpointPlan,
    ChunkedHead,
    HeadCount,
    LayerCostRecorder,
    Offload,
    chunk_sizes,
    head_and_loss_bytes,
    make_plan,
)
from lightning_ckpt.core.checkpoint.selection import (class_path, parse_memory_budget, resolve_layer_classes,
                                                      validate_every_n_layers)
from lightning_ckpt.core.checkpoint.chunked_loss import (
    DEFAULT_CHUNK_TOKENS,
    LossNotChunkable,
    chunk_causal_lm_loss,
    chunked_models,
    losses_kept_whole,
    unchunk_causal_lm_loss,
)
from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.checkpoint.tiling import apply_tiling, tile_classes, token_wise_modules, validate_tile_tokens
from lightning_ckpt.core.checkpoint.wrapping import (
    CheckpointOptions,
    Mode,
    apply_checkpointing,
    checkpointed_names,
    remove_checkpointing,
)

_SETTINGS = ("layer_cls", "every_n_layers", "offload", "mode", "memory_budget", "use_reentrant",
             "preserve_rng_state", "checkpoint_kwargs", "compress", "max_length", "chunk_loss", "tile_mlp",
             "tile_tokens", "tile_cls", "time_layers")

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
        time_layers: bool = True,
    ) -> None:
        if length_fn is not None and not callable(length_fn):
            raise TypeError(f"`length_fn` must be a function of the batch returning its tokens, got {length_fn!r}.")
        settings = dict(layer_cls=layer_cls, every_n_layers=every_n_layers, offload=offload, mode=mode,
                        memory_budget=memory_budget, use_reentrant=use_reentrant,
                        preserve_rng_state=preserve_rng_state, checkpoint_kwargs=checkpoint_kwargs, compress=compress,
                        max_length=max_length, chunk_loss=chunk_loss, tile_mlp=tile_mlp, tile_tokens=tile_tokens,
                        tile_cls=tile_cls, time_layers=time_layers)
        settings = {name: copy.copy(value) for name, value in settings.items()}
        _validate(settings)
        self._settings: dict[str, Any] = settings  # the one place the options live; attributes read from it
        self.length_fn = length_fn
        self.checkpointed_layers: list[str] = []
        self._cycle = BudgetCycle()  # the plans per batch size, and which one the module has
        self._module: Optional[pl.LightningModule] = None
        self._original_configure_model: Any = None
        self._recorder: Optional[LayerCostRecorder] = None
        self._check: Optional[SavedTensorCounter] = None  # a predicted plan's held bytes, this step
        self._measured: Optional[RankMeasurement] = None  # this rank's, until the plan is made
        self._auto: Optional[AutoBudget] = None  # "auto": the figures of the first plan, whose budget every size keeps
        self._start_step = 0
        self._device: Optional[tuple[DeviceProfile, int]] = None  # profile and host memory, for "auto"
        self._longest_checked = False  # the longest batch planned for (or found unknown) before the first step
        self._fake_failed = False  # fake tensors could not run the step (said once)
        # chunk_loss=None: a model whose loss cannot be chunked (found on a fake step) keeps it whole; said once
        self._loss_whole: Optional[str] = None
        self._said_whole = False
        self._tiles_chosen = False  # tile_mlp=None: the longest batch is held only with tiles, so the run tiles
        # chunk_loss=None with a budget: the measuring step runs the head chunked; the unchunked head and loss are
        # measured apart on fake tensors, and the plan chooses between them
        self._head_count: Optional[HeadCount] = None
        self._chunked: Optional[_HeadRun] = None  # this rank's step measured, its LM head counted: until the plan
        self._measured_steps = 0  # training steps run as measuring steps (measured_steps)

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """With ``memory_budget``: the plan of the latest training batch (``None`` while a new size is measured)."""
        return self._cycle.latest

    @property
    def plans(self) -> dict[int, CheckpointPlan]:
        """With ``memory_budget``: each batch-size bucket (tokens, or samples, rounded up to a power of two: a batch
        of 4 x 100 tokens is in bucket 512) and its plan; see :mod:`~lightning_ckpt.core.plan.budget_cycle`."""
        return dict(self._cycle.plans)

    @property
    def measured_steps(self) -> int:
        """With ``memory_budget``: the training steps of this fit that ran fully checkpointed to measure a size no
        plan covered (the longest batch's fake step before the first step is not one: it trains nothing)."""
        return self._measured_steps

    @property
    def settings(self) -> Mapping[str, Any]:
        """All options by name, read-only (set them as attributes: ``callback.every_n_layers = 2``)."""
        return MappingProxyType(self._settings)

    def apply(self, pl_module: pl.LightningModule) -> list[str]:
        """Checkpoint the selected layers of ``pl_module`` (idempotent) and record their names.

        With ``memory_budget``: the plan when there is one, else every matched layer fully checkpointed (the
        measuring step).
        """
        options = {k: v for k, v in self._settings.items()
                   if k not in ("memory_budget", "every_n_layers", "mode", "max_length", "chunk_loss", "tile_mlp",
                                "tile_tokens", "tile_cls", "time_layers")}
        chunk_loss = self._settings["chunk_loss"] is True
        tiles = self._tiles()
        if self._settings["memory_budget"] is None:
            names = apply_checkpointing(pl_module, every_n_layers=self._settings["every_n_layers"],
                                        mode=self._settings["mode"], chunk_loss=chunk_loss, **options, **tiles)
        elif self.plan is not None:
            options.pop("layer_cls")
            options.pop("offload")  # the plan's own, which it was solved for
            options.pop("compress")
            names = self.plan.apply(pl_module, **options)
            if chunk_loss and self.plan.chunk_tokens is None:
                chunk_causal_lm_loss(pl_module)
            if tiles:  # after the plan, which re-wraps each layer whole
                apply_tiling(pl_module, tiles["tile_cls"], tiles["tile_tokens"])
        else:  # measuring: every layer, full, compressed as asked (so it holds no more than the plans can), and the
            # head chunked when the plan may choose it (no more than the unchunked head holds)
            names = apply_checkpointing(pl_module, **{**options, "offload": False}, chunk_loss=chunk_loss, **tiles)
            if self._chooses_chunks(pl_module):
                chunk_causal_lm_loss(pl_module, _MEASURED_CHUNK)
        if names != self.checkpointed_layers and self._settings["memory_budget"] is None:
            # with a budget, the line each new plan logs says it (a switch between plans says nothing)
            shown = ", ".join(names) if len(names) <= 8 else ", ".join(names[:8]) + ", ..."
            rank_zero_info(f"GradientCheckpointing: checkpointing {len(names)} layers ({shown})")
        self.checkpointed_layers = names
        return names

    def _tiles(self) -> dict[str, Any]:
        """The tiling options :func:`apply_checkpointing` gets: ``tile_mlp=True`` with its ``tile_tokens`` and
        ``tile_cls``, or none (``False``, and ``None``).

        ``None`` with a budget: tiles where the longest batch, planned before the first step, is held only with them
        (then for the whole run, every plan measured with them); else nothing.
        """
        if self._settings["tile_mlp"] is not True and not self._tiles_chosen:
            return {}
        return {"tile_mlp": True, "tile_tokens": self._settings["tile_tokens"], "tile_cls": self._settings["tile_cls"]}

    def remove(self) -> None:
        """Undo everything this callback did to the module it was set up on."""
        if self._module is None:
            return
        remove_checkpointing(self._module)
        if self._original_configure_model is not None:
            del self._module.configure_model
            self._original_configure_model = None
        self._module = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_lightning_strategy(trainer.strategy)
        self._prepare(trainer, fit=stage == "fit")
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

    def _prepare(self, trainer: Any, fit: bool = True) -> None:
        """Refuse ``"auto"`` on the CPU, and measure the accelerator once for ``"auto"`` (the Trainer's, or the view of
        a Fabric that :class:`~lightning_ckpt.callbacks.fabric.FabricCheckpointing` passes)."""
        if self._settings["memory_budget"] == "auto" and trainer.strategy.root_device.type == "cpu":
            raise ValueError(
                "`memory_budget='auto'` plans for the accelerator's memory, but this run is on the CPU. Pass a"
                " fraction of the un-checkpointed activation memory (`memory_budget=0.5`) or bytes (`'2GiB'`)."
            )
        if fit and self._device is None and "auto" in (self._settings["memory_budget"], self._settings["offload"]):
            self._device = _measure_device(trainer)

    def _attach(self, module: torch.nn.Module) -> list[str]:
        """Checkpoint ``module`` now (its layers exist) and keep it as the module re-planned and undone later."""
        self._module = module  # type: ignore[assignment]
        return self.apply(module)  # type: ignore[arg-type]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy wrapped the model: also covers Lightning's own FSDP/ModelParallel strategies.
        check_checkpointing_placement(pl_module)

    # ------------------------------------------------------------------ memory budget: measure, plan, apply

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._measured_steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._settings["memory_budget"] is None or self._measured is not None:
            return  # no budget, or "auto" waits for the first optimizer step to make its first plan
        if not self._longest_checked:
            self._longest_checked = True
            self._plan_longest(trainer, pl_module, batch)
        # Every rank decides from the same size (the largest over ranks) and the same plans, so all of them enter
        # the measuring step's collectives together, or none does.
        size = _largest_over_ranks(trainer.strategy, batch_size_of(batch, self.length_fn))
        step = self._cycle.begin(size, predict=not self._first_auto())
        if step.predicted is not None:
            # Planned from the costs fitted over the sizes measured: no measuring step. The same on every rank (the
            # fit is of rows combined over ranks). A budget the conservative prediction cannot reach is measured.
            try:
                plan = self._solve(trainer, step.predicted)
            except ValueError:
                plan = None
            if plan is not None:
                self._cycle.planned(plan)
                if trainer.is_global_zero:
                    _report_plan(trainer, plan, self._settings["memory_budget"], self._auto, size, predicted=True)
            else:
                self._cycle.abandon()
            step = self._cycle.begin(size, predict=False)
        if step.switch:
            self._reapply(pl_module)
        if self._cycle.checking:
            # The cheap check of a predicted plan: the bytes this forward leaves held, counted once per storage.
            self._check = SavedTensorCounter(exclude=pl_module.parameters())
            self._check.__enter__()
        if step.measure:
            # Every matched layer is fully checkpointed; measure it during this ordinary step.
            self._measured_steps += 1
            self._chunked = None
            if self._chooses_chunks(pl_module):
                self._head_count = HeadCount(pl_module).__enter__()
            elif self._settings["chunk_loss"] is None:  # sharded since `setup` chunked it: the model's own head
                unchunk_causal_lm_loss(pl_module)
            layers = [(name, pl_module.get_submodule(name)) for name in self.checkpointed_layers]
            if self._first_auto():
                reset_device_peaks(trainer.strategy.root_device)
            self._recorder = LayerCostRecorder(pl_module, layers, selective=not self._reentrant(),
                                               time_layers=self._settings["time_layers"])
            self._recorder.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._end_check(trainer)
        if self._stop_measuring(loss) and not self._first_auto():
            # Planned before the backward: an impossible budget fails before any weight has changed.
            self._make_plan(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stop_measuring()  # a step that returned no loss ran no backward
        self._end_check(trainer)
        # The first "auto" plan also needs the static memory, optimizer state included: it waits for the first
        # optimizer step.
        if self._measured is not None and (not self._first_auto() or trainer.global_step > self._start_step):
            self._make_plan(trainer, pl_module)
        if self._cycle.latest is not None and self._cycle.applied is not self._cycle.latest:
            self._reapply(pl_module)  # the plan just made, for the next batch of this size

    def _end_check(self, trainer: pl.Trainer) -> None:
        """End the held-bytes check of a predicted plan (on its first step, at the size it was predicted for): held
        more than its ``planned_bytes`` (on any rank: every rank learns it, so all decide alike) and the bucket is
        measured on its next batch; held no more and the plan's later steps are not checked."""
        check, self._check = self._check, None
        if check is None:
            return
        check.__exit__(None, None, None)
        plan, size = self._cycle.applied, self._cycle.current
        assert plan is not None and size is not None
        held_as_planned = check.bytes + check.offloaded_bytes <= plan.planned_bytes + plan.planned_host_bytes
        if _all_ranks(trainer.strategy, held_as_planned):
            self._cycle.check_passed(size)
        else:
            self._cycle.check_failed(size)
            rank_zero_info(f"GradientCheckpointing: a batch of {size} held more than its predicted plan"
                           f" ({format_bytes(check.bytes)} > {format_bytes(plan.planned_bytes)} planned); its size"
                           " is measured on its next batch.")

    def _plan_longest(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Before the first step: plan for ``batch`` at the longest length (:mod:`~lightning_ckpt.core.measure.longest`),
        measured on fake tensors; an impossible budget raises here, before anything is trained."""
        if self._first_auto() or self._cycle.plans or self._settings["max_length"] == 0:
            return  # "auto" needs a real step's static memory first; a resumed run has its plans; 0 turns it off
        longest = longest_length(pl_module, self._settings["max_length"])
        if longest is None:
            return
        # A first batch already that long needs no fake step: its own measuring step plans before its backward (and
        # tile_mlp=None then tiles nothing: tiles are chosen on the fake step). The ranks decide from the longest first
        # batch over them, so that all of them take the same path.
        first = _largest_over_ranks(trainer.strategy, BatchSize(0, sequence_length_of(batch) or 0)).length
        shorter = first < longest[0]
        if shorter and _sharded(pl_module):
            rank_zero_warn("GradientCheckpointing: the longest batch is not planned before the first step under FSDP2"
                           " (its sharded layers gather their weights for real); the budget is checked on each batch"
                           " as it comes.")
            shorter = False
        if not shorter and sequence_length_of(batch) is None and self._settings["max_length"] is not None:
            rank_zero_warn("GradientCheckpointing: `max_length` needs token ids in the batch (a 2-D integer tensor,"
                           " batch x length); this batch has none, so the longest batch is not planned before the"
                           " first step.")
        found = self._fake_measured(trainer, pl_module, batch, longest) if shorter else None
        # Every rank plans, or none does: the plan combines the ranks' costs.
        if not _all_ranks(trainer.strategy, found is not None):
            return
        assert found is not None
        found = self._tiled_if_needed(trainer, pl_module, batch, longest, found)
        if longest[1] != "max_length" and not self._holds(trainer, *found):
            # The model's limit is only a hint (today's models take 32K-131K, beyond most data): not refused here.
            held = self._longest_held(trainer, pl_module, batch, first, longest[0])
            rank_zero_info(f"GradientCheckpointing: the budget does not hold a batch at the model's longest length"
                           f" ({longest[0]}, from {longest[1]}); at this batch size it holds up to length {held}"
                           " (planned before the first step on fake tensors, through your training_step). A longer"
                           " batch will stop the run; pass `max_length=` your data's longest length to plan for it"
                           " instead.")
            return
        size = _largest_over_ranks(trainer.strategy, batch_size_of(batch_of_length(batch, longest[0]), self.length_fn))
        self._cycle.begin(size, predict=False)
        self._take(*found, _ONE_CHUNK)
        try:
            self._make_plan(trainer, pl_module)
        except ValueError as err:
            raise ValueError(f"{err}\n  Planned before the first step for the longest sequences the run may see:"
                             f" length {longest[0]}, from {longest[1]}. Nothing was trained. If the data is never"
                             " that long, pass `max_length=` its longest length.") from None
        rank_zero_info(f"GradientCheckpointing: the budget holds the longest batch, {size}: planned before the first"
                       f" step for length {longest[0]} (from {longest[1]}) on fake tensors, through your"
                       " training_step.")

    def _tiled_if_needed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, longest: tuple[int, str],
                         found: tuple[RankMeasurement, Optional[HeadCount]]) -> tuple[RankMeasurement,
                                                                                     Optional[HeadCount]]:
        """With ``tile_mlp=None`` and a ``max_length`` (a promise; the model's own limit is only a hint, for which
        the run is not slowed): where no plan holds the longest batch but one with the layers' MLPs over tiles of
        tokens does (measured again on fake tensors), the run tiles from here on and ``found`` becomes the tiled
        measurement. Every rank decides alike (the costs are combined over ranks)."""
        if (self._settings["tile_mlp"] is not None or longest[1] != "max_length" or self._holds(trainer, *found)
                or not token_wise_modules(pl_module, self._settings["tile_cls"])):
            return found
        self._tiles_chosen = True
        tiled = self._fake_measured(trainer, pl_module, batch, longest)
        if _all_ranks(trainer.strategy, tiled is not None) and self._holds(trainer, *tiled):  # type: ignore[misc]
            rank_zero_info(f"GradientCheckpointing: the budget holds the longest batch (length {longest[0]}) only with"
                           " each layer's MLP over tiles of tokens (tile_mlp=None lets the plan choose): tiling them"
                           " for the run.")
            return tiled  # type: ignore[return-value]
        self._tiles_chosen = False
        self.apply(pl_module)  # untiled again
        return found

    def _fake_measured(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                       longest: tuple[int, str]) -> Optional[tuple[RankMeasurement, Optional[HeadCount]]]:
        """One fully checkpointed step of ``batch`` at length ``longest[0]`` on fake tensors: its costs, and the LM
        head's calls where the plan chooses its chunks; ``None`` (said once) where fake tensors cannot run it."""
        resized = batch_of_length(batch, longest[0])
        modes = ("full",) if self._reentrant() else ("full", "selective")
        chooses = self._chooses_chunks(pl_module)
        remove_checkpointing(pl_module)
        tiles = self._tiles()
        again = False
        try:
            if tiles:  # measured as the run computes it
                apply_tiling(pl_module, tiles["tile_cls"], tiles["tile_tokens"])
            # The head as the run computes it: chunked with chunk_loss=True. Where the plan chooses, through
            # lm_loss in one chunk (fake tensors hold nothing): whole, and seen to reach lm_loss at all; its chunks
            # are priced apart.
            if self._settings["chunk_loss"] is True:
                chunk_causal_lm_loss(pl_module)
            elif chooses:
                chunk_causal_lm_loss(pl_module, _ONE_CHUNK)
            with self._longest_step(trainer, pl_module) as step, HeadCount(pl_module) as count:
                found = measure_fake_step(pl_module, step, resized, self._settings["layer_cls"], modes)
            return (RankMeasurement(found.costs, found.outside_bytes, found.head_bytes, found.head_peak_bytes,
                                    self._settings["compress"]), count if chooses else None)
        except LossNotChunkable as err:
            if not chooses:  # chunk_loss=True: the first step would stop on it; said before anything is trained
                raise
            # chunk_loss=None: this model's loss stays whole (said once), and the step is measured again so
            self._loss_whole = (f"{err.model}'s loss stays whole: its forward changes the logits between the LM head"
                                " and the loss, which a head run in chunks cannot reproduce")
            again = True
        except Exception as err:  # noqa: BLE001 - whatever fake tensors cannot run: carry on as without a length
            if not self._fake_failed:
                self._fake_failed = True
                rank_zero_warn(f"GradientCheckpointing: could not measure the longest batch (length {longest[0]}, from"
                               f" {longest[1]}) on fake tensors before the first step ({type(err).__name__}: {err});"
                               " the budget is checked on each batch as it comes.")
            return None
        finally:
            self.apply(pl_module)
        return self._fake_measured(trainer, pl_module, batch, longest) if again else None

    def _holds(self, trainer: pl.Trainer, measured: RankMeasurement, count: Optional[HeadCount]) -> bool:
        """Whether some plan holds ``measured`` (combined over ranks, so every rank answers alike) within the
        budget: with the LM head whole, or in any of the chunks the plan may choose."""
        run = _HeadRun(measured, count, _ONE_CHUNK) if count is not None and count.calls else None
        combined, _ = _combine_over_ranks(trainer.strategy, measured if run is None else _rechunked(run, None), [])
        for chunk in [None, *(chunk_sizes(DEFAULT_CHUNK_TOKENS) if run is not None else [])]:
            try:
                self._solve(trainer, combined, None,
                            None if chunk is None or run is None else _chunked_head(trainer.strategy, run, chunk))
                return True
            except ValueError:
                continue
        return False

    def _longest_held(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, shortest: int,
                      longest: int) -> int:
        """The longest length the budget holds at ``batch``'s size, to ``longest / 64``: bisected between 0 and
        ``longest`` (which it does not hold) with fake steps, every rank alike; 0 when none is held or fake tensors
        stop running. ``shortest`` (the first batch's length, measured anyway) is tried first."""
        held, missed, probe = 0, longest, max(shortest, 1)
        while missed - held > max(1, longest // 64):
            found = self._fake_measured(trainer, pl_module, batch, (probe, "a search for the longest length held"))
            if not _all_ranks(trainer.strategy, found is not None):
                break
            assert found is not None
            if self._holds(trainer, *found):
                held = probe
            else:
                missed = probe
            probe = (held + missed) // 2
        return held

    @contextlib.contextmanager
    def _longest_step(self, trainer: Any, pl_module: Any) -> Iterator[Callable[[Any], torch.Tensor]]:
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

    def _chooses_chunks(self, pl_module: Any) -> bool:
        """Whether the plans choose between the LM head and loss chunked and unchunked: ``chunk_loss=None`` with a
        byte or fraction budget, a model whose loss can be chunked, not sharded by FSDP2 (whose layers cannot run
        on fake tensors)."""
        if (self._settings["chunk_loss"] is not None or self._settings["memory_budget"] in (None, "auto")
                or _sharded(pl_module)):
            return False
        whole = [*losses_kept_whole(pl_module), *([self._loss_whole] if self._loss_whole else [])]
        if whole and not self._said_whole:  # a model whose loss cannot be chunked: None means whole, said once
            self._said_whole = True
            rank_zero_info(f"GradientCheckpointing: chunk_loss=None: {'; '.join(whole)}.")
        return self._loss_whole is None and bool(chunked_models(pl_module))

    def _first_auto(self) -> bool:
        return self._settings["memory_budget"] == "auto" and self._auto is None

    def _reapply(self, pl_module: pl.LightningModule) -> None:
        """Checkpoint ``pl_module`` as the latest plan says (fully, while a size is measured)."""
        remove_checkpointing(pl_module)
        self.apply(pl_module)
        self._cycle.applied = self._cycle.latest

    def _reentrant(self) -> bool:
        kwargs = self._settings["checkpoint_kwargs"] or {}
        return bool(kwargs.get("use_reentrant", self._settings["use_reentrant"]))

    def _stop_measuring(self, loss: Optional[torch.Tensor] = None) -> bool:
        """Leave the measuring hooks (if measuring; the head's backward measured from ``loss``, when given); ``True``
        when this ended a measurement."""
        recorder, self._recorder = self._recorder, None
        count, self._head_count = self._head_count, None
        if count is not None:
            count.__exit__(None, None, None)
        if recorder is None:
            return False
        if loss is not None:
            recorder.measure_head(loss)
        recorder.__exit__(None, None, None)
        costs = recorder.costs()
        measured = RankMeasurement.from_held_bytes(costs, recorder.held_bytes, recorder.head_bytes, recorder.head_peak_bytes,
                                                   self._settings["compress"])
        held_all = recorder.held_bytes >= measured.layer_bytes
        if not held_all:
            rank_zero_warn("GradientCheckpointing: the bytes held outside the checkpointed layers could not be measured"
                           " (other saved-tensor hooks were entered after this callback's); the plan counts them as 0."
                           " Put GradientCheckpointing after such callbacks in `callbacks`.")
        self._take(measured, count if held_all else None, _MEASURED_CHUNK)
        return True

    def _take(self, measured: RankMeasurement, count: Optional[HeadCount], ran: int) -> None:
        """Keep ``measured`` for the next plan. Where the plan chooses the LM head's chunks (``count`` saw the head
        run through lm_loss, in chunks of ``ran`` tokens: a step that computes its loss itself is not changed by
        chunking the model's), each chunk and the unchunked head are priced from it."""
        self._measured = measured
        if count is not None and count.calls:
            self._chunked = _HeadRun(measured, count, ran)
            self._measured = _rechunked(self._chunked, None)

    def _make_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._measured is not None
        budget: object = self._settings["memory_budget"]
        auto: Optional[AutoBudget] = None
        measured = self._measured
        if budget == "auto" and self._auto is not None:
            auto = self._auto
            budget = auto.budget_bytes
            measured, _ = _combine_over_ranks(trainer.strategy, measured, [])
        elif budget == "auto":
            device = trainer.strategy.root_device
            static = static_bytes(pl_module, trainer.optimizers)
            peak = (device_peak_bytes(device) or (0, 0))[0]
            mine = AutoBudget.from_step(int(device_total_bytes(device)), static, peak, measured.peak_bytes)
            figures = [mine.device_bytes, mine.static_bytes, mine.other_peak_bytes]
            measured, figures = _combine_over_ranks(trainer.strategy, measured, figures)
            auto = self._auto = AutoBudget(*figures)
            budget = auto.budget_bytes
        else:
            measured, _ = _combine_over_ranks(trainer.strategy, measured, [])
        if self._chooses_chunks(pl_module) and not _all_ranks(trainer.strategy, self._chunked is not None):
            self._chunked = None  # a rank whose outside bytes were not measured: no choice, and no unmatched gather
        source, size = self._chunked, self._cycle.measuring
        self._measured = self._chunked = None
        # The head whole first: a plan that checkpoints nothing so is the cheapest there is (a chunked head only adds
        # its forward again). Else chunks of 1024, halved while the budget is missed (as `plan_checkpointing` does),
        # each against the whole head; every rank tries the same (combined over ranks), so all of them solve alike.
        plan: Optional[CheckpointPlan] = None
        error: Optional[ValueError] = None
        for chunk in [None, *(chunk_sizes(DEFAULT_CHUNK_TOKENS) if source is not None else [])]:
            try:
                # An impossible budget raises here; the step's own full checkpointing is undone by `on_exception`.
                plan = self._solve(trainer, measured, budget,
                                   None if chunk is None else _chunked_head(trainer.strategy, source, chunk))
            except ValueError as err:
                error = err
                continue
            if chunk is not None or plan.checkpoints_nothing:
                break
        if plan is None:
            raise ValueError(f"{error}\n  This was for a batch of {size} (the largest over ranks).") from None
        self._cycle.planned(plan, measured)
        if trainer.is_global_zero:
            _report_plan(trainer, plan, self._settings["memory_budget"], auto, size)

    def _solve(self, trainer: pl.Trainer, measured: RankMeasurement, budget: object = None,
               chunked: Optional[ChunkedHead] = None) -> CheckpointPlan:
        """The plan for ``measured`` (combined over ranks) at ``budget`` (``None``: the byte budget, or "auto"'s);
        with ``chunked``, the cheaper of the LM head and loss unchunked (``measured``) or chunked."""
        if budget is None:
            budget = self._auto.budget_bytes if self._auto is not None else self._settings["memory_budget"]
        modes = ("full",) if self._reentrant() else ("full", "selective")
        profile, host_memory = self._device if self._device is not None else (None, None)
        return make_plan(measured.costs, measured.outside_bytes, budget, modes, self._settings["offload"], profile,
                         host_memory=host_memory, min_bytes=offload_min_bytes(trainer.strategy.root_device),
                         head_bytes=measured.head_bytes, head_peak_bytes=measured.head_peak_bytes,
                         compress=self._settings["compress"], chunked=chunked)

    # ------------------------------------------------------------------ end, state

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end()

    def _end(self) -> None:
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._head_count is not None:
            self._head_count.__exit__(None, None, None)
            self._head_count = None
        self._chunked = None
        if self._check is not None:
            self._check.__exit__(None, None, None)
            self._check = None
        self._measured = None
        self._longest_checked = False
        self._cycle.abandon()
        self.remove()
        if self._settings["offload"]:
            release_all()  # the pinned host buffers pooled for offload

    def state_dict(self) -> dict[str, Any]:
        settings = {name: copy.copy(value) for name, value in self._settings.items()}
        settings["layer_cls"] = _layer_cls_as_paths(settings["layer_cls"])
        settings["tile_cls"] = _layer_cls_as_paths(settings["tile_cls"])
        state = {"settings": settings, "checkpointed_layers": list(self.checkpointed_layers)}
        if self.plan is not None:
            state["plan"] = self.plan.state_dict()
        if self._cycle.plans:
            state["plans"] = self._cycle.state_dict()
        if self._auto is not None:
            state["auto_budget"] = [self._auto.device_bytes, self._auto.static_bytes, self._auto.other_peak_bytes]
        if self._tiles_chosen:
            state["tiles_chosen"] = True
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # a setting added since the checkpoint was saved (time_layers) keeps this run's value
        settings = {**self.state_dict()["settings"], **state_dict["settings"]}
        plans = state_dict.get("plans")
        if settings != self.state_dict()["settings"]:
            rank_zero_info(f"GradientCheckpointing: restoring the settings from the checkpoint: {settings}")
            self._update_settings(settings)
        if plans is not None and settings.get("memory_budget") is not None:
            # A resumed run: the plans from the checkpoint, from the first step, without measuring those sizes again.
            # (A checkpoint with only "plan" does not say which sizes it holds for: every size is measured anew.)
            self._cycle.load_state_dict(plans)
            self._tiles_chosen = bool(state_dict.get("tiles_chosen"))  # the plans were measured with tiles
            if "auto_budget" in state_dict:
                self._auto = AutoBudget(*state_dict["auto_budget"])
            self._measured = None
            if self._recorder is not None:
                self._recorder.__exit__(None, None, None)
                self._recorder = None
            if self._module is not None and checkpointed_names(self._module):
                self.apply(self._module)

    def _update_settings(self, changes: Mapping[str, Any]) -> None:
        """Validate ``changes`` with the other settings, then store them and re-apply to checkpointed layers."""
        unknown = sorted(set(changes) - set(_SETTINGS))
        if unknown:
            raise ValueError(f"GradientCheckpointing has no option {', '.join(map(repr, unknown))}; the options are"
                             f" {', '.join(_SETTINGS)}.")
        settings = {**self._settings, **{name: copy.copy(value) for name, value in changes.items()}}
        _validate(settings)
        if settings == self._settings:
            return
        if self.plan is not None and _PLAN_SETTINGS & {k for k in settings if settings[k] != self._settings[k]}:
            # The plan was solved for the old budget and options; measure again on the next training batch.
            self._cycle.clear()
            self._auto = None
        self._settings.update(settings)
        # Only where the layers exist and are checkpointed: before `configure_model` ran, applying now would find
        # no layers; the pending application will use the new settings anyway.
        if self._module is not None and checkpointed_names(self._module):
            remove_checkpointing(self._module)
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
                  "chunk_loss", "tile_mlp", "tile_tokens", "tile_cls", "time_layers"}
# The constructor options a plan does not depend on, each with why (a test keeps the two sets covering them all).
_KEEPS_PLAN = {
    "every_n_layers": "refused with memory_budget other than 1, so a plan never used it",
    "mode": "the plan chooses each layer's mode itself; `mode` applies only without memory_budget",
    "preserve_rng_state": "saves the RNG states, not activations: the layers and their bytes stay the same",
    "length_fn": "a plain attribute read per batch to size it, not a setting; set it before fit, as the sizes"
                 " the plans were measured at are counted by it",
    "max_length": "only says which size to plan before the first step; the plans kept are each for its own size",
}


# --------------------------------------------------------------------------------------------- budget: the calls


#: The chunk a measuring step runs the LM head in when the plan chooses it; smaller chunks (down to
#: :data:`~lightning_ckpt.core.plan.planner.MIN_CHUNK_TOKENS`) are priced from it on fake tensors of the head alone. A
#: budget that only smaller chunks reach is exceeded on measuring steps, by at most what they free (as offload's is).
_MEASURED_CHUNK = DEFAULT_CHUNK_TOKENS
#: Chunks of more tokens than any batch has: the head and loss whole, through lm_loss.
_ONE_CHUNK = 2**62


@dataclass
class _HeadRun:
    """A step measured (``measured``) with its LM heads (counted by ``count``) through lm_loss in chunks of ``chunk``
    tokens."""

    measured: RankMeasurement
    count: HeadCount
    chunk: int

    @property
    def tokens(self) -> int:
        """Each head's share of the tokens."""
        return self.count.tokens // len(self.count.heads)

    @functools.cached_property
    def alone(self) -> list[tuple[int, int]]:
        """Each head and loss alone as the step ran them: saved and backward-peak bytes on fake tensors
        (:func:`~lightning_ckpt.core.plan.planner.head_and_loss_bytes`), once, when another chunk is priced."""
        return [head_and_loss_bytes(head, self.tokens, self.chunk, self.count.dtypes) for head in self.count.heads]


def _rechunked(run: _HeadRun, chunk: Optional[int]) -> RankMeasurement:
    """The step of ``run`` as it would have been with the LM heads in chunks of ``chunk`` tokens (``None``: whole):
    its bytes, plus what the head and loss alone hold more that way (on fake tensors, per head over its share of the
    tokens). Two chunk sizes of at least every token are one chunk alike."""
    if chunk is not None and min(chunk, run.tokens) == min(run.chunk, run.tokens):
        return run.measured
    saved = peak = 0
    for head, (ran_saved, ran_peak) in zip(run.count.heads, run.alone):
        other_saved, other_peak = head_and_loss_bytes(head, run.tokens, chunk, run.count.dtypes)
        saved, peak = saved + other_saved - ran_saved, peak + other_peak - ran_peak
    measured = run.measured
    return replace(measured, outside_bytes=measured.outside_bytes + saved, head_bytes=measured.head_bytes + saved,
                   head_peak_bytes=max(0, measured.head_peak_bytes + peak))


def _chunked_head(strategy: Strategy, run: _HeadRun, chunk: int) -> ChunkedHead:
    """The :class:`ChunkedHead` of the step of ``run`` with the LM heads in chunks of ``chunk`` tokens, combined over
    ranks."""
    mine, count = _rechunked(run, chunk), run.count
    calls = len(count.heads) * -(-run.tokens // chunk)
    head = count.chunked_head(chunk, 0, 0, mine.head_peak_bytes, calls=calls)
    both, figures = _combine_over_ranks(strategy, replace(mine, head_peak_bytes=head.head_peak_bytes),
                                        [0, head.flops, head.chunks, head.tokens])
    return ChunkedHead(chunk, both.outside_bytes, both.head_bytes, both.head_peak_bytes, *figures[1:])


def _combine_over_ranks(strategy: Strategy, measured: RankMeasurement, figures: list[int]) -> tuple[RankMeasurement, list[int]]:
    """Every rank's costs and ``figures`` gathered and combined (:func:`~lightning_ckpt.core.plan.budget.combine_costs`)."""
    row = pack_costs(measured, figures, offload_min_bytes(strategy.root_device))
    local = torch.tensor(row, dtype=torch.int64, device=strategy.root_device)
    return combine_costs(strategy.all_gather(local).reshape(-1, local.numel()), measured)


def _measure_device(trainer: pl.Trainer) -> tuple[DeviceProfile, int]:
    """The accelerator's :class:`DeviceProfile` and the host memory offload may use on this rank, rank 0's on every
    rank (all ranks must solve the same plan): half of the host memory free now, shared by the node's devices."""
    if trainer.strategy.root_device.type == "cpu":
        raise ValueError(
            "`offload='auto'` weighs offload against recompute by the time each takes on the accelerator it"
            " measures, but this run is on the CPU, where nothing is offloaded. Pass offload=False on the CPU, or"
            " run on a GPU; to plan for a GPU from here, use `plan_checkpointing(..., offload='auto',"
            " device='h100-sxm')` or `lightning-ckpt plan --device NAME --offload auto`."
        )
    profile = DeviceProfile.measure(trainer.strategy.root_device)
    host_memory = host_memory_share(psutil.virtual_memory().available, trainer.num_devices)
    return trainer.strategy.broadcast((profile, host_memory), src=0)


def _all_ranks(strategy: Strategy, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one small all-gather; none on a single device)."""
    if strategy.world_size <= 1:
        return flag
    local = torch.tensor([int(flag)], dtype=torch.int64, device=strategy.root_device)
    return bool(strategy.all_gather(local).min())


def _sharded(module: torch.nn.Module) -> bool:
    """Whether any submodule of ``module`` is an FSDP2 unit (``fully_shard``)."""
    fsdp_module = getattr(fsdp2(), "FSDPModule", None)
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in module.modules())


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned (a tensor, or a dict with ``"loss"``); a ``TypeError`` otherwise
    (manual optimization), which the longest batch's measurement reports and passes over."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}, not a loss")
    return loss


def _largest_over_ranks(strategy: Strategy, size: BatchSize) -> BatchSize:
    """The largest tokens and length over all ranks (one small all-gather; none on a single device)."""
    if strategy.world_size <= 1:
        return size
    local = torch.tensor([size.tokens, size.length], dtype=torch.int64, device=strategy.root_device)
    largest = strategy.all_gather(local).reshape(-1, 2).amax(dim=0).tolist()
    return BatchSize(int(largest[0]), int(largest[1]))


def _report_plan(trainer: pl.Trainer, plan: CheckpointPlan, memory_budget: object, auto: Optional[AutoBudget],
                 size: Optional[BatchSize] = None, predicted: bool = False) -> None:
    """One line in the log (info); the whole table to each logger that takes text, else to the log at debug level
    (one line per new plan at info: a run of many lengths makes many plans)."""
    shape = f"batches up to {size}{' (predicted from the sizes measured)' if predicted else ''}, " if size else ""
    rank_zero_info(f"GradientCheckpointing: {shape}{plan_summary(plan, memory_budget, auto)}")
    table = (f"Planned for batches up to {size}\n" if size is not None else "") + plan_table(plan, auto)
    sent = False
    for logger in trainer.loggers:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):  # TensorBoard's SummaryWriter; shown as Markdown, hence the code block
            add_text("gradient_checkpointing/plan", "\n".join("    " + line for line in table.splitlines()),
                     trainer.global_step)
            sent = True
    if not sent:
        rank_zero_debug(f"GradientCheckpointing plan:\n{table}")


def _layer_cls_as_paths(layer_cls: Any) -> Any:
    if isinstance(layer_cls, type):
        return class_path(layer_cls)
    if isinstance(layer_cls, (list, tuple)):
        return [class_path(c) if isinstance(c, type) else c for c in layer_cls]
    return layer_cls
