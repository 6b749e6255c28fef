"""The ``lightning-ckpt`` console script: ``fit`` through LightningCLI, ``compare`` and ``plan`` to their own parsers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


CONFIGS = Path(__file__).parents[2] / "configs"
ARGS_WARNING = "args parameter is intended to run from within Python"


# ------------------------------------------------------------------------------------------------
# The console script
# ------------------------------------------------------------------------------------------------


def console_script() -> str:
    """The installed ``lightning-ckpt`` next to this interpreter (``pip install -e .`` puts it there)."""
    script = Path(sys.executable).with_name("lightning-ckpt")
    found = str(script) if script.exists() else shutil.which("lightning-ckpt")
    if found is None:
        pytest.skip("the `lightning-ckpt` console script is not installed (pip install -e .)")
    return found


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([console_script(), *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_console_script_fit_trains_without_a_warning_of_ours(tmp_path):
    proc = run_script("fit", "--config", str(CONFIGS / "tiny.yaml"), "--trainer.max_steps=1", "--trainer.logger=false",
                      "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert ARGS_WARNING not in output
    assert "`max_steps=1` reached" in output
    assert "checkpointing 2 layers (model.blocks.0, model.blocks.2)" in output
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())  # the config the run parsed from the command line
    assert saved["trainer"]["max_steps"] == 1 and saved["model"]["init_args"]["n_layer"] == 4


def test_console_script_dispatches_compare_to_its_own_parser(tmp_path):
    proc = run_script("compare", "--config", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert proc.returncode == 2  # argparse's usage error, not LightningCLI's
    assert "lightning-ckpt compare: error: --config" in proc.stderr and "missing.yaml: no such file" in proc.stderr
    assert ARGS_WARNING not in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------
# Budgets as LightningCLI users write them
# ------------------------------------------------------------------------------------------------


def budget_config(tmp_path: Path, budget: object) -> Path:
    """tiny.yaml with its GradientCheckpointing given ``memory_budget: budget`` (and no every_n_layers)."""
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    init_args = config["trainer"]["callbacks"][0]["init_args"]
    init_args.pop("every_n_layers")
    init_args["memory_budget"] = budget
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("budget", [5555996, "5555996"])
def test_a_whole_number_budget_in_yaml_is_bytes_for_fit_and_plan(tmp_path, budget):
    """jsonargparse hands ``memory_budget: 5555996`` to the callback as the float 5555996.0: it must plan for 5,555,996
    bytes, in ``fit`` (the callback's plan) and in ``plan`` (plan.json), not refuse it as a fraction out of range."""
    from lightning_ckpt import GradientCheckpointing
    from lightning_ckpt.commands.cli_builder import run_cli
    from lightning_ckpt.commands.plan import main as plan_main

    config = budget_config(tmp_path, budget)
    cli = run_cli(["fit", "--config", str(config), "--trainer.max_steps=2", "--trainer.logger=false",
                   "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                   f"--trainer.default_root_dir={tmp_path}"])
    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, GradientCheckpointing))
    assert cli.trainer.global_step == 2
    assert callback.plan is not None and callback.plan.budget_bytes == 5555996

    assert plan_main(["--config", str(config), "--output-dir", str(tmp_path / "plan")]) == 0
    report = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert report["memory_budget"] == 5555996 and report["plan"]["budget_bytes"] == 5555996
