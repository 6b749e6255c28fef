"""The shipped LightningCLI configs parse and train, and the example's loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.commands.cli import run_cli
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.demos import GPT, CountingDataModule

CONFIGS = Path(__file__).parents[1] / "configs"


def _vit_layers() -> list[str]:
    """ViT's encoder layers as the installed Transformers names them (``vit.encoder.layer.N`` on 4.x, ``vit.layers.N``
    on 5.x): read from the model, not written down."""
    from lightning_ckpt.demos.hf import ViTClassifier

    vit = ViTClassifier(image_size=32, patch_size=8, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128)
    layers = [name for name, m in vit.named_modules() if type(m).__name__ == "ViTLayer"]
    assert len(layers) == 4, layers
    return layers


EXPECTED = {
    "no_checkpointing.yaml": None,
    "every_layer.yaml": [f"model.blocks.{i}" for i in range(8)],
    "every_layer_fp8.yaml": [f"model.blocks.{i}" for i in range(8)],
    "every_4th_offload.yaml": ["model.blocks.0", "model.blocks.4"],
    "configure_model.yaml": ["model.blocks.0", "model.blocks.2", "model.blocks.4", "model.blocks.6"],
    "tiny.yaml": ["model.blocks.0", "model.blocks.2"],
    "hf_lora.yaml": [f"model.base_model.model.model.layers.{i}" for i in range(4)],
    "hf_vit.yaml": _vit_layers(),
}
#: Every layer the planner matches in each config (its repeated block, or the callback's ``layer_cls``).
MATCHED = {name: [f"model.blocks.{i}" for i in range(4 if name == "tiny.yaml" else 8)] for name in EXPECTED}
MATCHED.update({name: EXPECTED[name] for name in ("hf_lora.yaml", "hf_vit.yaml")})


class ValueReadingGPT(GPT):
    """The demo GPT reading a value of its weights as it is built: fake tensors cannot build it."""

    def configure_model(self) -> None:
        super().configure_model()
        weight = self.model.tok_emb.weight
        if not weight.is_meta and torch.isnan(weight).any().item():  # the meta device has no values to read either
            raise AssertionError("fresh weights are never NaN")


def _value_reading_config(tmp_path: Path) -> Path:
    config = (CONFIGS / "tiny.yaml").read_text().replace("class_path: lightning_ckpt.demos.GPT",
                                                          f"class_path: {__name__}.ValueReadingGPT")
    path = tmp_path / "value_reading.yaml"
    path.write_text(config)
    return path


def test_every_config_is_covered():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_and_trains_two_steps(name, tmp_path):
    cli = run_cli(["fit", "--config", str(CONFIGS / name), "--trainer.max_steps=2", "--trainer.logger=false",
                   "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                   "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, GradientCheckpointing)]
    if EXPECTED[name] is None:
        assert callbacks == []
    else:
        assert [c.checkpointed_layers for c in callbacks] == [EXPECTED[name]]
        assert callbacks[0].compress == ("fp8" if name.endswith("_fp8.yaml") else None)


_FIGURES = ("none_bytes", "full_bytes", "selective_bytes", "full_flops", "selective_flops")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_plan_with_fake_runs_on_every_shipped_config_and_measures_what_real_tensors_measure(name, tmp_path, capsys):
    """``lightning-ckpt plan`` on each shipped config, with ``--fake`` (no memory allocated: PEFT's adapters and ViT's
    initialisers included) and without (these small models are measured with real tensors): a plan over every matched
    layer, and the same bytes, FLOPs and peaks either way."""
    reports = {}
    for fake in (True, False):
        out_dir = tmp_path / ("fake" if fake else "real")
        assert plan_main(["--config", str(CONFIGS / name), "--output-dir", str(out_dir), *(["--fake"] * fake)]) == 0
        reports[fake] = json.loads((out_dir / "plan.json").read_text())
        assert reports[fake]["fake"] is fake
        assert [layer["name"] for layer in reports[fake]["layers"]] == MATCHED[name]
        assert set(reports[fake]["plan"]["layers"]) == set(MATCHED[name])
    assert "cannot be built under fake tensors" not in capsys.readouterr().out
    fake, real = reports[True], reports[False]
    assert ([[layer.get(k) for k in _FIGURES] for layer in fake["layers"]]
            == [[layer.get(k) for k in _FIGURES] for layer in real["layers"]])
    # the fixed settings alike; the plan may differ, as its prices do: fake tensors are not timed
    assert ({s["name"]: (s["activation_bytes"], s["peak_bytes"]) for s in fake["settings"] if s["name"] != "plan"}
            == {s["name"]: (s["activation_bytes"], s["peak_bytes"]) for s in real["settings"] if s["name"] != "plan"})
    assert fake["priced_by"] == "recompute FLOPs"
    assert real["priced_by"] == "the times each layer took here in the measuring step"
    for where, source in (("fake", fake), ("real", real)):  # and the report says the same
        assert f"\nChoices priced by {source['priced_by']}.\n" in (tmp_path / where / "plan.md").read_text()


def test_plan_measures_a_model_fake_tensors_cannot_build_with_real_tensors_and_says_why(tmp_path, capsys):
    assert plan_main(["--config", str(_value_reading_config(tmp_path)), "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "plan: the model cannot be built under fake tensors (DataDependentOutputException: aten._local_scalar_dense" in out
    assert "; measuring with real tensors (its size checked on the meta device first)" in out
    assert json.loads((tmp_path / "plan.json").read_text())["fake"] is False


def test_plan_with_fake_on_a_model_fake_tensors_cannot_build_exits_2_saying_what_to_do(tmp_path, capsys):
    assert plan_main(["--config", str(_value_reading_config(tmp_path)), "--fake"]) == 2
    err = capsys.readouterr().err
    assert "the model cannot be built under fake tensors (DataDependentOutputException: aten._local_scalar_dense" in err
    assert "run plan without --fake on a machine that has the config's accelerator" in err


def test_example_loss_falls_quickly():
    seed_everything(0)
    model = GPT(n_layer=2, n_embd=32, block_size=32, vocab_size=32)
    losses = []

    trainer = Trainer(max_steps=80, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing()])
    model.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(float(outputs["loss"]))
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=32, batch_size=16))
    assert losses[-1] < 0.5 * losses[0]


def test_example_script_trains_with_the_callback():
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer = example.main(["--steps", "2", "--layers", "8", "--every-n-layers", "4"])
    assert trainer.global_step == 2
    [callback] = [c for c in trainer.callbacks if isinstance(c, GradientCheckpointing)]
    assert callback.checkpointed_layers == ["model.blocks.0", "model.blocks.4"]
