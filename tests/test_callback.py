"""GradientCheckpointing in a real Trainer: same training, applied at the right time, undone, resumable."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.demos import GPT, CountingDataModule
from lightning_ckpt.wrapping import checkpointed_names


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
    assert resumed.settings["every_n_layers"] == 2
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
