"""GradientCheckpointing: the Lightning callback. It only decides *when*; selection and wrapping decide what and how."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_ckpt.selection import class_path, parse_memory_budget, resolve_layer_classes, validate_every_n_layers
from lightning_ckpt.wrapping import CheckpointOptions, Mode, apply_checkpointing, remove_checkpointing

_SETTINGS = ("layer_cls", "every_n_layers", "offload", "mode", "memory_budget", "use_reentrant",
             "preserve_rng_state", "checkpoint_kwargs")


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

    Example::

        trainer = Trainer(callbacks=[GradientCheckpointing(every_n_layers=4, offload=True)])
    """

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
        _validate(settings)
        self.settings: dict[str, Any] = settings
        self.checkpointed_layers: list[str] = []
        self._module: Optional[pl.LightningModule] = None
        self._original_configure_model: Any = None

    def apply(self, pl_module: pl.LightningModule) -> list[str]:
        """Checkpoint the selected layers of ``pl_module`` (idempotent) and record their names."""
        options = {k: v for k, v in self.settings.items() if k != "memory_budget"}
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
        from lightning_ckpt.strategies import check_lightning_strategy  # strategies import this module

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
        from lightning_ckpt.strategies import check_checkpointing_placement

        # After the strategy wrapped the model: also covers Lightning's own FSDP/ModelParallel strategies.
        check_checkpointing_placement(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.remove()

    def state_dict(self) -> dict[str, Any]:
        settings = dict(self.settings)
        settings["layer_cls"] = _layer_cls_as_paths(settings["layer_cls"])
        return {"settings": settings, "checkpointed_layers": list(self.checkpointed_layers)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        settings = dict(state_dict["settings"])
        _validate(settings)
        if settings != self.state_dict()["settings"]:
            rank_zero_info(f"GradientCheckpointing: restoring the settings from the checkpoint: {settings}")
            self.settings = settings
            if self._module is not None:
                remove_checkpointing(self._module)
                self.apply(self._module)


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
