"""`lightning-ckpt compare`: variant configs, the gradient check, and real runs of the tiny config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_ckpt.cli import main as cli_main
from lightning_ckpt.compare import PERTURB_ENV, first_step_difference, variant_config

TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"
COLUMNS = ["variant", "layers", "peak device", "host RSS", "activations", "offloaded", "step", "samples/s",
           "memory saved", "time lost", "loss diff", "grad diff", "check"]


@pytest.fixture(autouse=True)
def one_thread_workers(monkeypatch):
    """Workers inherit the environment: one intra-op thread each, or the shared 2-core machine thrashes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(PERTURB_ENV, raising=False)


def table(markdown: str) -> dict[str, dict[str, str]]:
    """The rows of the comparison table, by variant."""
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    parsed = [dict(zip(COLUMNS, (cell.strip() for cell in row.strip("|").split("|")))) for row in rows]
    return {row["variant"]: row for row in parsed}


def test_variant_config_replaces_checkpointing_and_keeps_the_rest(tmp_path):
    base = {
        "seed_everything": True,
        "ckpt_path": "last.ckpt",
        "model": {"class_path": "lightning_ckpt.demos.GPT"},
        "trainer": {"max_steps": 1000, "accumulate_grad_batches": 2, "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
            {"class_path": "lightning_ckpt.GradientCheckpointing",
             "init_args": {"layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 4, "mode": "selective"}},
            {"class_path": "lightning_ckpt.MemoryMonitor", "init_args": {"log_every_n_steps": 50}},
        ]},
    }
    none = variant_config(base, "none", 3, tmp_path, seed=7)
    offload = variant_config(base, "offload", 3, tmp_path, seed=7)
    paths = [c["class_path"] for c in offload["trainer"]["callbacks"]]
    assert paths == ["lightning.pytorch.callbacks.LearningRateMonitor", "lightning_ckpt.GradientCheckpointing",
                     "lightning_ckpt.monitor.MemoryMonitor", "lightning_ckpt.compare.FirstStepRecorder"]
    assert offload["trainer"]["callbacks"][1]["init_args"] == {
        "layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 1, "mode": "selective", "offload": True}
    assert "lightning_ckpt.GradientCheckpointing" not in [c["class_path"] for c in none["trainer"]["callbacks"]]
    for config in (none, offload):
        assert config["seed_everything"] == 7 and "ckpt_path" not in config
        assert config["trainer"]["max_steps"] == 3 and config["trainer"]["accumulate_grad_batches"] == 2
        assert config["model"] == base["model"]
    assert base["trainer"]["callbacks"][1]["init_args"]["every_n_layers"] == 4  # the base is left alone
    with pytest.raises(ValueError, match="every_3rd"):
        variant_config(base, "every_3rd", 3, tmp_path, seed=7)


def test_a_wrong_small_gradient_is_not_hidden_by_a_large_one():
    ref = {"loss": 2.0, "grads": {"big": torch.tensor([1000.0]), "small": torch.tensor([1e-3, -2e-3])}}
    same = {"loss": 2.0, "grads": {k: v.clone() for k, v in ref["grads"].items()}}
    assert first_step_difference(ref, same, rtol=1e-3, atol=1e-6) == (0.0, 0.0, None)

    wrong = {"loss": 2.0, "grads": {"big": torch.tensor([1000.0]), "small": torch.tensor([1e-3, -1e-3])}}
    loss_diff, grad_diff, problem = first_step_difference(ref, wrong, rtol=1e-3, atol=1e-6)
    assert problem == "gradient of small" and grad_diff == pytest.approx(1e-3)

    off_loss = {"loss": 2.1, "grads": same["grads"]}
    assert first_step_difference(ref, off_loss, rtol=1e-3, atol=1e-6)[2] == "loss"
    assert "different parameters" in first_step_difference(ref, {"loss": 2.0, "grads": {"big": ref["grads"]["big"]}},
                                                           rtol=1e-3, atol=1e-6)[2]


def test_bad_arguments_exit_with_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(TINY), "--variants", "none,every_3rd"])
    assert exit_info.value.code == 2 and "every_3rd" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(missing)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2  # argparse's usage error, not a crash (1) or a traceback
    assert err.startswith("usage: lightning-ckpt compare") and f"--config {missing}: no such file" in err


def test_compare_tiny_config_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(TINY), "--steps", "2", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    for i, name in enumerate(["none", "every_layer", "every_2nd", "every_4th", "offload"], 1):
        assert f"[{i}/5] {name}" in printed  # progress, one line per variant

    markdown = (out / "compare.md").read_text()
    assert markdown in printed
    rows = table(markdown)
    assert list(rows) == ["none", "every_layer", "every_2nd", "every_4th", "offload"]
    assert [rows[n]["layers"] for n in rows] == ["0", "4", "2", "1", "4"]  # tiny.yaml: 4 blocks
    activations = {n: float(r["activations"]) for n, r in rows.items()}
    assert activations["none"] > activations["every_4th"] > activations["every_2nd"] > activations["every_layer"] > 0
    for name in ["every_layer", "every_2nd", "every_4th", "offload"]:
        row = rows[name]
        assert row["check"] == "ok"
        assert float(row["grad diff"]) <= 1e-6 and float(row["loss diff"]) <= 1e-6
        assert row["memory saved"].endswith("%)") and row["time lost"].endswith("%")
        assert math.isfinite(float(row["step"])) and float(row["samples/s"]) > 0
    assert rows["none"]["check"] == "baseline" and rows["none"]["peak device"] == "n/a"  # CPU run
    saved = float(rows["every_layer"]["memory saved"].split()[0])
    assert saved == pytest.approx(activations["none"] - activations["every_layer"], rel=1e-2)

    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "every_2nd" / "metrics.csv").exists() and not (out / "every_2nd" / "first_step.pt").exists()


def test_compare_flags_a_planted_wrong_gradient_and_exits_non_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(PERTURB_ENV, "every_layer")  # test hook: this variant corrupts one gradient element
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(TINY), "--steps", "1", "--variants", "every_layer",
                     "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "beyond tolerance" in captured.err
    rows = table((out / "compare.md").read_text())
    assert list(rows) == ["none", "every_layer"]
    assert rows["every_layer"]["check"] == "**MISMATCH: gradient of model.tok_emb.weight**"
    assert float(rows["every_layer"]["grad diff"]) > 1e-3
    assert float(rows["every_layer"]["loss diff"]) == 0  # the forward is right; only the gradient is wrong
