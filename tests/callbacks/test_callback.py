"""GradientCheckpointing in a real Trainer: same training, applied at the right time, undone, resumable."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.demos import GPT, CountingDataModule


class RecordingGPT(GPT):
    """Records which layers run under checkpoint during training, and can fail on purpose."""

    def __init__(self, fail_at_step: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at_step = fail_at_step
        self.seen_checkpointed: list[list[str]] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at_step:
            raise RuntimeError("planted failure")
        self.seen_checkpointed.append(checkpointed_names(self))
        return super().training_step(batch, batch_idx)


def tiny_gpt(**kwargs) -> RecordingGPT:
    return RecordingGPT(vocab_size=32, block_size=16, n_layer=4, n_embd=32, n_head=4, dropout=0.1, **kwargs)


def fit(model, callbacks=(), max_steps: int = 4, **trainer_kwargs) -> Trainer:
    trainer_kwargs = {"logger": False, "enable_checkpointing": False, **trainer_kwargs}
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, callbacks=list(callbacks),
                      enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=64))
    return trainer


def trained_weights(build_in_configure_model: bool, callbacks=()) -> tuple[RecordingGPT, dict[str, torch.Tensor]]:
    seed_everything(0)
    model = tiny_gpt(build_in_configure_model=build_in_configure_model)
    fit(model, callbacks)
    return model, model.state_dict()


@pytest.mark.parametrize("build_in_configure_model", [False, True])
def test_fit_ends_with_the_same_weights_and_a_plain_model(build_in_configure_model, caplog):
    _, ref = trained_weights(build_in_configure_model)
    callback = GradientCheckpointing(every_n_layers=2)
    with caplog.at_level(logging.INFO):
        model, weights = trained_weights(build_in_configure_model, [callback])
    assert callback.checkpointed_layers == ["model.blocks.0", "model.blocks.2"]
    assert model.seen_checkpointed == [["model.blocks.0", "model.blocks.2"]] * 4
    assert "checkpointing 2 layers (model.blocks.0, model.blocks.2)" in caplog.text
    assert weights.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(weights[name], ref[name], rtol=0, atol=0, msg=name)
    assert checkpointed_names(model) == []
    assert "configure_model" not in model.__dict__


def test_undone_when_fit_fails():
    model = tiny_gpt(fail_at_step=2, build_in_configure_model=True)
    with pytest.raises(RuntimeError, match="planted failure"):
        fit(model, [GradientCheckpointing(layer_cls="lightning_ckpt.demos.Block")])
    assert model.seen_checkpointed == [[f"model.blocks.{i}" for i in range(4)]] * 2
    assert checkpointed_names(model) == []
    assert "configure_model" not in model.__dict__


def test_settings_are_saved_and_a_resumed_run_keeps_them(tmp_path):
    first = GradientCheckpointing(layer_cls="lightning_ckpt.demos.Block", every_n_layers=2)
    fit(tiny_gpt(), [first, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_steps=2,
        enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["GradientCheckpointing"]
    assert saved["settings"]["every_n_layers"] == 2
    assert saved["settings"]["layer_cls"] == "lightning_ckpt.demos.Block"
    assert saved["checkpointed_layers"] == ["model.blocks.0", "model.blocks.2"]

    resumed = GradientCheckpointing()  # defaults: every layer
    model = tiny_gpt()
    trainer = Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[resumed])
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=64),
                ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 4
    assert resumed.every_n_layers == 2 and resumed.layer_cls == "lightning_ckpt.demos.Block"
    assert model.seen_checkpointed == [["model.blocks.0", "model.blocks.2"]] * 2


def test_class_objects_in_settings_are_saved_as_import_paths():
    from lightning_ckpt.demos import Block

    state = GradientCheckpointing(layer_cls=[Block, "torch.nn.LayerNorm"]).state_dict()
    assert state["settings"]["layer_cls"] == ["lightning_ckpt.demos.Block", "torch.nn.LayerNorm"]


def test_a_lightning_strategy_that_checkpoints_on_its_own_is_refused_before_any_change():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_ckpt.demos import Block

    trainer = SimpleNamespace(strategy=FSDPStrategy(activation_checkpointing_policy={Block}))
    model = tiny_gpt()
    with pytest.raises(ValueError, match="recomputing layers twice.*activation_checkpointing_policy"):
        GradientCheckpointing().setup(trainer, model, "fit")
    assert checkpointed_names(model) == []


# ------------------------------------------------------------------------------------------------
# Options as attributes: one source of truth with state_dict and what is applied
# ------------------------------------------------------------------------------------------------

def non_default_options() -> dict:
    from lightning_ckpt.demos import Block

    return dict(layer_cls=[Block, "torch.nn.LayerNorm"], every_n_layers=3, offload=True, mode="selective",
                memory_budget=None, use_reentrant=False, preserve_rng_state=False,
                checkpoint_kwargs={"determinism_check": "none"}, compress="bf16", max_length=48,
                chunk_loss=True, tile_mlp=True, tile_tokens=8, tile_cls=["torch.nn.Sequential"], lean_layers=True,
                time_layers=False)


def applied_options(model) -> dict[str, dict]:
    """What each checkpointed layer of ``model`` actually runs with: torch's checkpoint arguments and offload."""
    return {name: {**sub.forward.options.torch_kwargs(), "offload": sub.forward.options.offload}
            for name, sub in model.named_modules() if name in checkpointed_names(model)}


def setup_on(callback: GradientCheckpointing, model) -> None:
    """What a Trainer does before training: the callback's ``setup``, then the model's ``configure_model``."""
    callback.setup(Trainer(logger=False, accelerator="cpu", devices=1), model, "fit")
    model.configure_model()


def test_every_option_reads_back_its_init_value_and_cannot_be_changed_in_place():
    options = non_default_options()
    callback = GradientCheckpointing(**options)
    for name, value in options.items():
        assert getattr(callback, name) == value, name
    assert dict(callback.settings) == options
    callback.layer_cls.append("torch.nn.Linear")  # a copy: only setting the attribute changes the option
    callback.checkpoint_kwargs["use_reentrant"] = True
    assert callback.layer_cls == options["layer_cls"]
    assert callback.checkpoint_kwargs == {"determinism_check": "none"}
    with pytest.raises(TypeError):
        callback.settings["every_n_layers"] = 1  # read-only view


def test_setting_an_option_changes_what_is_saved_and_what_is_applied():
    callback = GradientCheckpointing()
    callback.every_n_layers = 2
    callback.preserve_rng_state = False
    saved = callback.state_dict()["settings"]
    assert (saved["every_n_layers"], saved["preserve_rng_state"]) == (2, False)

    model = tiny_gpt()
    setup_on(callback, model)
    assert checkpointed_names(model) == ["model.blocks.0", "model.blocks.2"]
    assert {o["preserve_rng_state"] for o in applied_options(model).values()} == {False}

    callback.every_n_layers = 3  # already applied: re-applied with the new value
    callback.use_reentrant = True
    assert checkpointed_names(model) == ["model.blocks.0", "model.blocks.3"]
    assert {o["use_reentrant"] for o in applied_options(model).values()} == {True}
    assert callback.checkpointed_layers == ["model.blocks.0", "model.blocks.3"]
    callback.remove()
    assert checkpointed_names(model) == []


def test_setting_an_option_during_fit_changes_the_checkpointed_layers_from_the_next_step():
    callback = GradientCheckpointing(layer_cls="lightning_ckpt.demos.Block")

    def every_2nd_from_step_2(trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            callback.every_n_layers = 2

    model = tiny_gpt(build_in_configure_model=True)
    fit(model, [callback, LambdaCallback(on_train_batch_start=every_2nd_from_step_2)])
    every = [f"model.blocks.{i}" for i in range(4)]
    assert model.seen_checkpointed == [every, every, ["model.blocks.0", "model.blocks.2"], ["model.blocks.0",
                                                                                           "model.blocks.2"]]
    assert checkpointed_names(model) == []


@pytest.mark.parametrize(("start", "name", "bad"), [
    ({}, "every_n_layers", 0),
    ({}, "every_n_layers", "2"),
    ({}, "mode", "partial"),
    ({}, "offload", "yes"),
    ({}, "layer_cls", "no.such.Block"),
    ({}, "layer_cls", 3),
    ({}, "memory_budget", "lots"),
    ({"mode": "selective"}, "use_reentrant", True),  # valid alone, not with the other options
    ({"mode": "selective"}, "checkpoint_kwargs", {"use_reentrant": True}),
])
def test_a_bad_value_raises_the_constructors_error_and_changes_nothing(start, name, bad):
    with pytest.raises(Exception) as from_constructor:
        GradientCheckpointing(**{**start, name: bad})
    callback = GradientCheckpointing(layer_cls="lightning_ckpt.demos.Block", every_n_layers=2, **start)
    model = tiny_gpt()
    setup_on(callback, model)
    saved, applied, value = callback.state_dict(), applied_options(model), getattr(callback, name)

    with pytest.raises(type(from_constructor.value)) as from_setter:
        setattr(callback, name, bad)
    assert str(from_setter.value) == str(from_constructor.value)
    assert getattr(callback, name) == value
    assert callback.state_dict() == saved
    assert applied_options(model) == applied and list(applied) == ["model.blocks.0", "model.blocks.2"]


def test_load_state_dict_refuses_an_unknown_option():
    callback = GradientCheckpointing()
    with pytest.raises(ValueError, match="no option 'every_n'.*every_n_layers"):
        callback.load_state_dict({"settings": {"every_n": 2}})
    assert "every_n" not in callback.state_dict()["settings"]


def test_a_checkpoint_saved_before_a_setting_existed_keeps_this_run_s_value_of_it(caplog):
    saved = GradientCheckpointing(time_layers=False).state_dict()
    del saved["settings"]["time_layers"]  # saved by a release without `time_layers`
    callback = GradientCheckpointing(time_layers=False)
    with caplog.at_level("INFO"):
        callback.load_state_dict(saved)
    assert "restoring the settings" not in caplog.text  # nothing differs: nothing to restore
    saved["settings"]["every_n_layers"] = 3
    with caplog.at_level("INFO"):
        callback.load_state_dict(saved)
    assert "restoring the settings" in caplog.text
    assert callback.every_n_layers == 3 and callback.time_layers is False


def test_load_state_dict_updates_the_attributes_and_what_is_applied():
    saved = GradientCheckpointing(layer_cls="lightning_ckpt.demos.Block", every_n_layers=3, use_reentrant=True,
                                  preserve_rng_state=False, checkpoint_kwargs={"determinism_check": "none"})
    callback = GradientCheckpointing()
    model = tiny_gpt()
    setup_on(callback, model)
    assert checkpointed_names(model) == [f"model.blocks.{i}" for i in range(4)]

    callback.load_state_dict(saved.state_dict())
    assert (callback.layer_cls, callback.every_n_layers, callback.use_reentrant, callback.preserve_rng_state,
            callback.checkpoint_kwargs) == ("lightning_ckpt.demos.Block", 3, True, False, {"determinism_check": "none"})
    assert callback.state_dict()["settings"] == saved.state_dict()["settings"]
    assert checkpointed_names(model) == ["model.blocks.0", "model.blocks.3"]
    assert {o["use_reentrant"] for o in applied_options(model).values()} == {True}

    bad = {"settings": {**saved.state_dict()["settings"], "every_n_layers": 0}}
    with pytest.raises(ValueError, match="every_n_layers"):
        callback.load_state_dict(bad)
    assert callback.every_n_layers == 3
