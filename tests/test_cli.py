"""The ``lightning-ckpt`` command and the package's import graph: the CLI on top, no import cycles."""

from __future__ import annotations

import ast
import graphlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_ckpt

PACKAGE_DIR = Path(lightning_ckpt.__file__).parent
CONFIGS = Path(__file__).parents[1] / "configs"
ARGS_WARNING = "args parameter is intended to run from within Python"
#: Modules that must stay plain PyTorch (house rule): they never import Lightning, even lazily.
PLAIN_PYTORCH = {"selection", "planner", "wrapping", "offload", "policies", "profiling", "layer_state", "placement"}


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
# The import graph
# ------------------------------------------------------------------------------------------------


def package_modules() -> dict[str, Path]:
    """``{"lightning_ckpt": .../__init__.py, "lightning_ckpt.callback": .../callback.py, ...}``."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module name ``module`` imports anywhere in ``source``: top level, in functions, under TYPE_CHECKING.

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a submodule); relative imports are resolved.
    """
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. Only explicit imports count: the package ``__init__`` that
    Python runs before any submodule is an edge only where a module names ``lightning_ckpt`` itself."""
    modules = package_modules()
    return {name: imports_of(name, path) & set(modules) - {name} for name, path in modules.items()}


def imports_of(module: str, path: Path) -> set[str]:
    return imported_names(module, path.read_text(), is_package=path.name == "__init__.py")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, a]``), or ``None`` when it is acyclic."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        return list(reversed(err.args[1]))
    return None


def test_find_cycle_finds_a_cycle_and_passes_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                ["c", "a", "b", "c"])


def test_imported_names_sees_lazy_and_relative_imports():
    # Function-level imports are where the two former cycles (callback <-> strategies, cli <-> compare) hid.
    source = ("import torch\nfrom . import wrapping\nfrom .selection import is_inside\n"
              "def setup():\n    from lightning_ckpt.strategies import check_lightning_strategy\n")
    assert imported_names("lightning_ckpt.callback", source) == {
        "torch", "lightning_ckpt", "lightning_ckpt.wrapping", "lightning_ckpt.selection",
        "lightning_ckpt.selection.is_inside", "lightning_ckpt.strategies",
        "lightning_ckpt.strategies.check_lightning_strategy"}
    assert "lightning_ckpt.monitor" in imported_names("lightning_ckpt", "from .monitor import M", is_package=True)


def test_the_package_import_graph_is_acyclic_and_the_cli_is_on_top():
    graph = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    # The two former cycles, one direction each.
    assert "lightning_ckpt.callback" in graph["lightning_ckpt.strategies"]
    assert "lightning_ckpt.strategies" not in graph["lightning_ckpt.callback"]
    assert "lightning_ckpt.compare" in graph["lightning_ckpt.cli"]
    assert "lightning_ckpt.cli" not in graph["lightning_ckpt.compare"]
    assert not [name for name, imports in graph.items() if "lightning_ckpt.cli" in imports]


def test_plain_pytorch_modules_never_import_lightning():
    modules = package_modules()
    plain = {f"lightning_ckpt.{name}" for name in PLAIN_PYTORCH} & set(modules)
    assert "lightning_ckpt.placement" in plain
    for name in sorted(plain):
        lightning = sorted(n for n in imports_of(name, modules[name]) if n.split(".")[0] == "lightning")
        assert lightning == [], f"{name} imports {lightning}"


@pytest.mark.parametrize("module", ["lightning_ckpt.callback", "lightning_ckpt.strategies", "lightning_ckpt.cli",
                                    "lightning_ckpt.compare"])
def test_the_former_cycle_ends_import_first_in_a_fresh_interpreter(module):
    """The acyclic graph above is the proof; this checks the two former cycles' ends as a user would import them."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_names_moved_out_of_strategies_are_still_importable_from_there():
    from lightning_ckpt import callback, placement, strategies

    assert strategies.check_checkpointing_placement is placement.check_checkpointing_placement
    assert strategies.fsdp_units is placement.fsdp_units
    assert strategies.check_lightning_strategy is callback.check_lightning_strategy
    assert strategies.find_checkpointing_callback is callback.find_checkpointing_callback
