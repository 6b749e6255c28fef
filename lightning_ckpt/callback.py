"""GradientCheckpointing: the Lightning callback. It only decides *when*; selection and wrapping decide what and how.

Also here: finding the callback on a Trainer, and refusing a Lightning strategy that would checkpoint as well.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, Optional, TypeVar, Union, overload

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_ckpt.placement import check_checkpointing_placement
from lightning_ckpt.selection import class_path, parse_memory_budget, resolve_layer_classes, validate_every_n_layers
from lightning_ckpt.wrapping import (
    CheckpointOptions,
    Mode,
    apply_checkpointing,
    checkpointed_names,
    remove_checkpointing,
)

_SETTINGS = ("layer_cls", "every_n_layers", "offload", "mode", "memory_budget", "use_reentrant",
             "preserve_rng_state", "checkpoint_kwargs")

T = TypeVar("T")


class _Option(Generic[T]):
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
    def __get__(self, obj: None, owner: type) -> _Option[T]: ...

    @overload
    def __get__(self, obj: GradientCheckpointing, owner: type) -> T: ...

    def __get__(self, obj: Optional[GradientCheckpointing], owner: type) -> Union[T, _Option[T]]:
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
        offload: keep the checkpointed layers' inputs in pinned host memory instead of the device.
        mode: ``"full"`` recomputes the whole layer; ``"selective"`` keeps matmul/attention outputs.
        memory_budget: reserved for the budget planner; only ``None`` is supported yet.
        use_reentrant: use torch's reentrant checkpoint (not recommended; non-reentrant is the default).
        preserve_rng_state: replay the RNG state in recompute so dropout masks match.
        checkpoint_kwargs: extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the above.

    Layers are checkpointed in ``setup`` and, for models built in ``configure_model``, right after it,
    before any strategy wraps the model. Everything is undone in ``teardown`` (or on an exception).

    Every argument is also an attribute (``callback.every_n_layers``, ...). Setting one validates it like the
    constructor (a bad value raises and changes nothing) and, when layers are already checkpointed, re-applies.

    Example::

        >>> callback = GradientCheckpointing(every_n_layers=4, offload=True)
        >>> callback.every_n_layers
        4
        >>> callback.every_n_layers = 2
        >>> callback.state_dict()["settings"]["every_n_layers"]
        2

        trainer = Trainer(callbacks=[callback])
    """

    layer_cls: _Option[Union[str, type, Sequence[Union[str, type]], None]] = _Option(
        "The layer class(es) to checkpoint, as given (classes or dotted import paths); ``None``: detected.")
    every_n_layers: _Option[int] = _Option("Checkpoint matched layers 0, n, 2n, ... in registration order.")
    offload: _Option[bool] = _Option("Keep the checkpointed layers' inputs in pinned host memory.")
    mode: _Option[Mode] = _Option("``'full'`` or ``'selective'``.")
    memory_budget: _Option[Union[float, int, str, None]] = _Option("Reserved for the budget planner (``None``).")
    use_reentrant: _Option[bool] = _Option("Use torch's reentrant checkpoint.")
    preserve_rng_state: _Option[bool] = _Option("Replay the RNG state in the recomputation.")
    checkpoint_kwargs: _Option[Optional[dict[str, Any]]] = _Option(
        "Extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the other options.")

    def __init__(
        self,
        layer_cls: Union[str, type, Sequence[Union[str, type]], None] = None,
        every_n_layers: int = 1,
        offload: bool = False,
        mode: Mode = "full",
        memory_budget: Union[float, int, str, None] = None,
        use_reentrant: bool = False,
        preserve_rng_state: bool = True,
        checkpoint_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        settings = dict(layer_cls=layer_cls, every_n_layers=every_n_layers, offload=offload, mode=mode,
                        memory_budget=memory_budget, use_reentrant=use_reentrant,
                        preserve_rng_state=preserve_rng_state, checkpoint_kwargs=checkpoint_kwargs)
        settings = {name: copy.copy(value) for name, value in settings.items()}
        _validate(settings)
        self._settings: dict[str, Any] = settings  # the one place the options live; attributes read from it
        self.checkpointed_layers: list[str] = []
        self._module: Optional[pl.LightningModule] = None
        self._original_configure_model: Any = None

    @property
    def settings(self) -> Mapping[str, Any]:
        """All options by name, read-only (set them as attributes: ``callback.every_n_layers = 2``)."""
        return MappingProxyType(self._settings)

    def apply(self, pl_module: pl.LightningModule) -> list[str]:
        """Checkpoint the selected layers of ``pl_module`` (idempotent) and record their names."""
        options = {k: v for k, v in self._settings.items() if k != "memory_budget"}
        names = apply_checkpointing(pl_module, **options)
        if names != self.checkpointed_layers:
            self.checkpointed_layers = names
            shown = ", ".join(names) if len(names) <= 8 else ", ".join(names[:8]) + ", ..."
            rank_zero_info(f"GradientCheckpointing: checkpointing {len(names)} layers ({shown})")
        return names

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

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy wrapped the model: also covers Lightning's own FSDP/ModelParallel strategies.
        check_checkpointing_placement(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.remove()

    def state_dict(self) -> dict[str, Any]:
        settings = {name: copy.copy(value) for name, value in self._settings.items()}
        settings["layer_cls"] = _layer_cls_as_paths(settings["layer_cls"])
        return {"settings": settings, "checkpointed_layers": list(self.checkpointed_layers)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        settings = dict(state_dict["settings"])
        if settings != self.state_dict()["settings"]:
            rank_zero_info(f"GradientCheckpointing: restoring the settings from the checkpoint: {settings}")
            self._update_settings(settings)

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
    :class:`GradientCheckpointing` as well, layers would be recomputed twice.

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


def _validate(settings: Mapping[str, Any]) -> None:
    validate_every_n_layers(settings["every_n_layers"])
    resolve_layer_classes(settings["layer_cls"])
    CheckpointOptions(settings["offload"], settings["mode"], settings["use_reentrant"],
                      settings["preserve_rng_state"], settings["checkpoint_kwargs"] or {})
    if parse_memory_budget(settings["memory_budget"]) is not None:
        raise NotImplementedError(
            "`memory_budget` is not yet supported by GradientCheckpointing. Pass `every_n_layers` (and `layer_cls`)"
            " to choose the checkpointed layers."
        )


def _layer_cls_as_paths(layer_cls: Any) -> Any:
    if isinstance(layer_cls, type):
        return class_path(layer_cls)
    if isinstance(layer_cls, (list, tuple)):
        return [class_path(c) if isinstance(c, type) else c for c in layer_cls]
    return layer_cls
