"""The package's layout: the import rules between its folders, and the dotted paths users' configs name.

The rules, read from every import in the source (top level, in functions, under ``TYPE_CHECKING``):

- ``lightning_ckpt.core`` is plain PyTorch: besides ``core`` itself it imports only the standard library, torch,
  numpy and psutil (so no ``lightning``, ``lightning_fabric`` or ``pytorch_lightning``, and no package module outside it);
- inside ``core``, imports run one way through its three folders, ``plan`` (choosing) -> ``measure`` (what a step holds
  and costs) -> ``checkpoint`` (how to checkpoint): ``checkpoint`` imports neither ``measure`` nor ``plan``, and
  ``measure`` does not import ``plan``; every ``core`` module but ``core`` itself lives in one of the three;
- ``callbacks`` and ``strategies`` never import ``commands``, and ``callbacks`` never imports ``strategies``;
- nothing outside ``commands`` imports ``commands``; ``import lightning_ckpt`` pulls in neither commands nor demos;
- there is no import cycle;
- every module lives in one of the layer folders, except the package itself and ``demos_hf`` (kept for old configs).

``tests/`` mirrors the package: each test file sits in the folder of the module it mainly tests (``tests/core/plan/``
for ``lightning_ckpt/core/plan/``), the project-wide ones (layout, docs, errors, configs, accelerator) and the shared
helpers (``helpers.py``, ``_dist_helpers.py``, ``conftest.py``, ...) at its top level. Test files are imported by their
name (pytest's default import mode, and ``from helpers import ...``), so no two share one, and a test file imports
another only from its own folder.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_ckpt

PACKAGE_DIR = Path(lightning_ckpt.__file__).parent
ROOT = PACKAGE_DIR.parent
LAYERS = ("core", "callbacks", "strategies", "commands", "demos")
#: The folders of ``core``, lowest first: each may import the ones before it, never the ones after.
CORE_FOLDERS = ("checkpoint", "measure", "plan")
#: Modules outside the layer folders: the public names, and the path that configs written before ``demos/`` name.
OUTSIDE_LAYERS = {"lightning_ckpt", "lightning_ckpt.demos_hf"}
#: Paths that user configs and code already use (issue 14); they must keep loading whatever the layout.
KEPT_PATHS = ["lightning_ckpt.GradientCheckpointing", "lightning_ckpt.MemoryMonitor", "lightning_ckpt.demos.GPT",
              "lightning_ckpt.demos.CountingDataModule", "lightning_ckpt.demos_hf.LoraCausalLM",
              "lightning_ckpt.demos_hf.TokenDataModule", *(f"lightning_ckpt.{name}" for name in lightning_ckpt.__all__)]


# ------------------------------------------------------------------------------------------------
# The import graph
# ------------------------------------------------------------------------------------------------


def package_modules() -> dict[str, Path]:
    """``{"lightning_ckpt": .../__init__.py,
    "lightning_ckpt.core.checkpoint.wrapping": .../core/checkpoint/wrapping.py, ...}``."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
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


def imports_of(module: str, path: Path) -> set[str]:
    return imported_names(module, path.read_text(), is_package=path.name == "__init__.py")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. Only explicit imports count: the package ``__init__`` that
    Python runs before any submodule is an edge only where a module names ``lightning_ckpt`` itself."""
    modules = package_modules()
    return {name: imports_of(name, path) & set(modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, a]``), or ``None`` when it is acyclic."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        return list(reversed(err.args[1]))
    return None


def layer(module: str) -> str | None:
    """``"core"`` for ``lightning_ckpt.core.checkpoint.wrapping``; ``None`` for a module outside the layer folders."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def core_folder(module: str) -> str | None:
    """``"checkpoint"`` for ``lightning_ckpt.core.checkpoint.wrapping``; ``None`` outside ``core``'s folders."""
    parts = module.split(".")
    return parts[2] if layer(module) == "core" and len(parts) > 2 and parts[2] in CORE_FOLDERS else None


def imports_upward_in_core(name: str, imported: str) -> bool:
    """Whether ``name`` imports a ``core`` folder above its own (``checkpoint`` -> ``measure``, say)."""
    low, high = core_folder(name), core_folder(imported)
    return low is not None and high is not None and CORE_FOLDERS.index(high) > CORE_FOLDERS.index(low)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every edge the rules above forbid (``lightning`` edges come from the source)."""
    bad = []
    for name, imports in graph.items():
        for imported in sorted(imports):
            if layer(name) == "core" and layer(imported) != "core":
                bad.append(f"{name} -> {imported}")
            elif layer(name) in ("callbacks", "strategies") and layer(imported) == "commands":
                bad.append(f"{name} -> {imported}")
            elif layer(name) == "callbacks" and layer(imported) == "strategies":
                bad.append(f"{name} -> {imported}")
            elif layer(name) != "commands" and layer(imported) == "commands":
                bad.append(f"{name} -> {imported}")
            elif name == "lightning_ckpt" and layer(imported) == "demos":
                bad.append(f"{name} -> {imported}")
            elif imports_upward_in_core(name, imported):
                bad.append(f"{name} -> {imported}")
    return bad


def test_find_cycle_finds_a_cycle_and_passes_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                ["c", "a", "b", "c"])


def test_imported_names_sees_lazy_and_relative_imports():
    # Function-level imports are where the two former cycles (callback <-> strategies, cli <-> compare) hid.
    source = ("import torch\nfrom . import wrapping\nfrom .selection import is_inside\n"
              "def setup():\n    from lightning_ckpt.strategies import CheckpointingDDPStrategy\n")
    assert imported_names("lightning_ckpt.core.checkpoint.placement", source) == {
        "torch", "lightning_ckpt.core.checkpoint", "lightning_ckpt.core.checkpoint.wrapping",
        "lightning_ckpt.core.checkpoint.selection", "lightning_ckpt.core.checkpoint.selection.is_inside",
        "lightning_ckpt.strategies",
        "lightning_ckpt.strategies.CheckpointingDDPStrategy"}
    assert "lightning_ckpt.callbacks.memory_monitor" in imported_names(
        "lightning_ckpt.callbacks", "from .memory_monitor import M", is_package=True)


def test_violations_names_each_forbidden_edge():
    graph = {"lightning_ckpt.core.plan.planner": {"lightning_ckpt.core.checkpoint.wrapping",
                                                  "lightning_ckpt.callbacks"},
             "lightning_ckpt.callbacks.memory_monitor": {"lightning_ckpt.strategies",
                                                         "lightning_ckpt.core.measure.profiling"},
             "lightning_ckpt.strategies.ddp": {"lightning_ckpt.commands.cli", "lightning_ckpt.callbacks"},
             "lightning_ckpt.demos": {"lightning_ckpt.commands.plan"},
             "lightning_ckpt": {"lightning_ckpt.demos.hf", "lightning_ckpt.core.plan.planner"},
             "lightning_ckpt.commands.cli": {"lightning_ckpt.commands.compare", "lightning_ckpt.strategies"}}
    assert violations(graph) == [
        "lightning_ckpt.core.plan.planner -> lightning_ckpt.callbacks",
        "lightning_ckpt.callbacks.memory_monitor -> lightning_ckpt.strategies",
        "lightning_ckpt.strategies.ddp -> lightning_ckpt.commands.cli",
        "lightning_ckpt.demos -> lightning_ckpt.commands.plan",
        "lightning_ckpt -> lightning_ckpt.demos.hf",
    ]


def test_the_package_import_graph_follows_the_layers_and_is_acyclic():
    graph = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    assert violations(graph) == []
    # The edges the layers exist for are really there (a graph read wrongly would pass the rules empty).
    assert "lightning_ckpt.core.checkpoint.wrapping" in graph["lightning_ckpt.callbacks.gradient_checkpointing"]
    assert "lightning_ckpt.core.measure.layer_costs" in graph["lightning_ckpt.core.plan.planner"]
    assert "lightning_ckpt.core.checkpoint.wrapping" in graph["lightning_ckpt.core.measure.layer_costs"]
    assert any(layer(n) == "callbacks" for name in graph if layer(name) == "strategies" for n in graph[name])
    assert any(layer(n) == "core" for n in graph["lightning_ckpt.commands.plan.measure"])


def test_every_module_is_in_a_layer_folder():
    outside = sorted(name for name in package_modules() if layer(name) is None)
    assert outside == sorted(OUTSIDE_LAYERS)


def test_every_core_module_is_in_one_of_cores_folders():
    core = [name for name in package_modules() if layer(name) == "core"]
    assert {core_folder(name) for name in core} == {None, *CORE_FOLDERS}
    assert [name for name in core if core_folder(name) is None] == ["lightning_ckpt.core"]


def test_violations_names_an_upward_import_inside_core_and_passes_downward_ones():
    modules = set(package_modules())

    def edges(module: str, source: str) -> set[str]:
        return imported_names(module, source) & modules - {module}

    # Upward: checkpoint -> measure (top level), checkpoint -> plan (in a function), measure -> plan (relative).
    upward = {
        "lightning_ckpt.core.checkpoint.offload": edges(
            "lightning_ckpt.core.checkpoint.offload",
            "from lightning_ckpt.core.measure.profiling import report_held\n"
            "def f():\n    from lightning_ckpt.core.plan import planner\n"),
        "lightning_ckpt.core.measure.costs": edges("lightning_ckpt.core.measure.costs",
                                                   "from ..plan.solver import held_peak\n"),
    }
    assert violations(upward) == [
        "lightning_ckpt.core.checkpoint.offload -> lightning_ckpt.core.measure.profiling",
        "lightning_ckpt.core.checkpoint.offload -> lightning_ckpt.core.plan",
        "lightning_ckpt.core.checkpoint.offload -> lightning_ckpt.core.plan.planner",
        "lightning_ckpt.core.measure.costs -> lightning_ckpt.core.plan.solver",
    ]
    # Downward and within a folder: plan -> measure and checkpoint, measure -> checkpoint, checkpoint -> checkpoint.
    downward = {
        "lightning_ckpt.core.plan.planner": edges(
            "lightning_ckpt.core.plan.planner",
            "from lightning_ckpt.core.measure import layer_costs\n"
            "from ..checkpoint.wrapping import apply_checkpointing\nfrom .solver import solve\n"),
        "lightning_ckpt.core.measure.profiling": edges(
            "lightning_ckpt.core.measure.profiling",
            "from lightning_ckpt.core.checkpoint.storages import storage_key\n"),
        "lightning_ckpt.core.checkpoint.compress": edges(
            "lightning_ckpt.core.checkpoint.compress", "from lightning_ckpt.core.checkpoint import offload\n"),
    }
    assert all(downward.values()) and violations(downward) == []


# What plain-PyTorch code may import: Python's standard library, torch and the core's two small helpers.
CORE_ALLOWED = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "psutil"}


def outside_core_imports(module: str, source: str) -> list[str]:
    """The names ``module`` imports that are neither in ``core`` nor in :data:`CORE_ALLOWED`, sorted."""
    return sorted(name for name in imported_names(module, source)
                  if layer(name) != "core" and name.split(".")[0] not in CORE_ALLOWED)


def test_outside_core_imports_rejects_every_lightning_package_and_anything_unlisted():
    source = ("import math, torch.nn\nfrom . import wrapping\nimport psutil\n"
              "from lightning_fabric.utilities.rank_zero import rank_zero_warn\n"
              "def f():\n    import pytorch_lightning\n    import lightning.pytorch\n    import yaml\n")
    assert outside_core_imports("lightning_ckpt.core.plan.budget", source) == [
        "lightning.pytorch", "lightning_fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero.rank_zero_warn",
        "pytorch_lightning", "yaml"]


def test_the_core_imports_only_the_standard_library_torch_numpy_and_psutil():
    modules = package_modules()
    core = [name for name in modules if layer(name) == "core"]
    assert "lightning_ckpt.core.checkpoint.placement" in core and "lightning_ckpt.core.plan.planner" in core
    for name in core:
        outside = outside_core_imports(name, modules[name].read_text())
        assert outside == [], f"{name} imports {outside}: core may import only torch, numpy, psutil and the stdlib"


@pytest.mark.parametrize("module", ["lightning_ckpt.callbacks.gradient_checkpointing", "lightning_ckpt.strategies",
                                    "lightning_ckpt.commands.cli", "lightning_ckpt.commands.compare"])
def test_the_former_cycle_ends_import_first_in_a_fresh_interpreter(module):
    """The acyclic graph above is the proof; this checks the two former cycles' ends as a user would import them."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# The paths users name
# ------------------------------------------------------------------------------------------------


def load_path(path: str) -> object:
    """The module or attribute at dotted ``path``, as jsonargparse resolves a ``class_path``."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as err:
        if err.name != path:
            raise
    module, _, attribute = path.rpartition(".")
    return getattr(load_path(module), attribute)


def config_values(node: object) -> list[str]:
    """Every string anywhere in a parsed YAML config."""
    if isinstance(node, dict):
        return [v for key, value in node.items() for v in [str(key), *config_values(value)]]
    if isinstance(node, list):
        return [v for item in node for v in config_values(item)]
    return [node] if isinstance(node, str) else []


def named_paths() -> dict[str, set[str]]:
    """Dotted ``lightning_ckpt.`` paths -> the files that name them: every config, the README and the docs pages."""
    found: dict[str, set[str]] = {}
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        for value in config_values(yaml.safe_load(config.read_text())):
            for path in re.findall(r"\blightning_ckpt(?:\.\w+)+", value):
                found.setdefault(path, set()).add(config.name)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path in re.findall(r"\blightning_ckpt(?:\.\w+)+", page.read_text()):
            found.setdefault(path.rstrip("."), set()).add(str(page.relative_to(ROOT)))
    return found


def test_the_configs_and_readme_name_paths_that_this_test_loads():
    found = named_paths()
    by_file = {f for files in found.values() for f in files}
    assert {"tiny.yaml", "hf_lora.yaml", "README.md"} <= by_file
    assert "lightning_ckpt.GradientCheckpointing" in found and "lightning_ckpt.demos.GPT" in found


def test_load_path_fails_for_a_path_that_does_not_exist():
    assert (load_path("lightning_ckpt.core.checkpoint.wrapping.apply_checkpointing")
            is lightning_ckpt.apply_checkpointing)
    for missing in ("lightning_ckpt.callback.GradientCheckpointing", "lightning_ckpt.demos.NoSuchModel"):
        with pytest.raises((ImportError, AttributeError)):
            load_path(missing)


@pytest.mark.parametrize("path", sorted(set(KEPT_PATHS) | set(named_paths())))
def test_every_named_path_loads(path):
    if path.startswith("lightning_ckpt.demos_hf") or path.startswith("lightning_ckpt.demos.hf"):
        pytest.importorskip("peft")
    assert load_path(path) is not None


def test_the_old_and_new_hf_demo_paths_are_one_class():
    pytest.importorskip("peft")
    from lightning_ckpt.demos.hf import LoraCausalLM

    assert load_path("lightning_ckpt.demos_hf.LoraCausalLM") is LoraCausalLM


def test_the_strategy_names_and_the_console_script_resolve():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["ddp_ckpt"]["strategy"] is lightning_ckpt.CheckpointingDDPStrategy
    assert StrategyRegistry["fsdp_ckpt"]["strategy"] is lightning_ckpt.CheckpointingFSDPStrategy
    scripts = re.search(r"\[project\.scripts\]\s*\n(.*?)\n", (ROOT / "pyproject.toml").read_text()).group(1)
    name, target = (part.strip().strip('"') for part in scripts.split("="))
    module, function = target.split(":")
    assert name == "lightning-ckpt" and callable(getattr(importlib.import_module(module), function))


# ------------------------------------------------------------------------------------------------
# The tests' layout
# ------------------------------------------------------------------------------------------------

TESTS_DIR = Path(__file__).resolve().parent


def test_the_test_folders_mirror_the_package_and_the_helpers_stay_on_top():
    files = sorted(TESTS_DIR.rglob("*.py"))
    folders = {path.parent.relative_to(TESTS_DIR) for path in files} - {Path(".")}
    assert Path("core/plan") in folders and Path("callbacks") in folders
    assert [str(f) for f in sorted(folders) if not (PACKAGE_DIR / f).is_dir()] == []
    nested = [path for path in files if path.parent != TESTS_DIR]
    assert all(path.name.startswith("test_") for path in nested), [str(p) for p in nested]
    names = [path.name for path in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_a_test_file_imports_other_test_files_only_from_its_own_folder():
    found = 0
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        for name in imported_names("", path.read_text()):
            if name.split(".")[0].startswith("test_"):
                found += 1
                assert (path.parent / f"{name.split('.')[0]}.py").is_file(), f"{path.relative_to(TESTS_DIR)}: {name}"
    assert found  # test_budget_cycle's costs by hand from test_cost_fit, say
