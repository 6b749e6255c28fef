"""Every code block of the documentation runs: the pages under ``docs/`` and the README.

- ``python``: the blocks of one page run in order in one namespace, as a reader pasting them one after the other
  would, in a fresh interpreter per page;
- ``bash``: each block runs in a shell from a scratch folder that holds the repository's ``configs/``, with
  ``lightning-ckpt`` and ``python`` being this interpreter and this checkout;
- ``yaml``: parsed; every ``class_path`` imports, and each of its ``init_args`` is a parameter of that class.

A block right after the line ``<!-- docs-test: skip: REASON -->`` (an HTML comment: it shows in the page source, not
on the site) is not run. The few such blocks install packages, need a GPU or take minutes; REASON says which, and
names the test that runs the same thing where one does (``tests/test_x.py::test_name``, which must exist).

The README's links must each lead to a page of the site (a file in mkdocs.yml's ``nav``, and its heading when the
link has an anchor).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md"])
SKIP = re.compile(r"<!-- docs-test: skip: (?P<reason>.+?) -->")
FENCE = re.compile(r"^```(?P<lang>\S*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
LANGUAGES = ("python", "bash", "yaml")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, when the page says not to run it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.fullmatch(before.strip())
        found.append(Block(page, line, match["lang"], match["code"], skip["reason"] if skip else None))
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUN = [block for block in ALL if block.skip is None]
PYTHON_PAGES = sorted({block.page for block in RUN if block.lang == "python"})


def test_the_documentation_has_its_blocks():
    # A parser that found nothing would pass every test below.
    assert len(PAGES) >= 12 and sum(block.lang == "python" for block in RUN) >= 10
    assert {block.lang for block in RUN} == set(LANGUAGES)


def test_every_block_has_a_language_this_test_runs():
    odd = [f"{block.where}: ```{block.lang}" for block in ALL if block.lang not in LANGUAGES]
    assert not odd, f"name the block's language ({', '.join(LANGUAGES)}) so that it is run: {odd}"


def test_every_skipped_block_says_why_and_names_real_tests():
    skipped = [block for block in ALL if block.skip is not None]
    assert 0 < len(skipped) <= 12, [block.where for block in skipped]  # the few, not a way around this test
    for block in skipped:
        assert len(block.skip) > 10, block.where
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", block.skip):
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), (block.where, path, name)


def test_no_stray_markers():
    # A marker that does not sit right above a block (a typo, a blank block moved away) would skip nothing.
    for page in PAGES:
        markers = len(re.findall(r"docs-test", page.read_text()))
        assert markers == sum(block.skip is not None for block in blocks(page)), page


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["MPLBACKEND"] = "Agg"
    return env


@pytest.fixture
def shell(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A scratch folder with the repository's configs, and a PATH where ``python`` and ``lightning-ckpt`` are ours."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in {"python": f'exec "{sys.executable}" "$@"',
                          "lightning-ckpt": f'exec "{sys.executable}" -m lightning_ckpt.commands.cli "$@"'}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "examples", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    return work, _env(bin_dir)


RUNNER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the block at {where} failed")
"""


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_python_blocks_run(page, shell):
    work, env = shell
    code = [(block.where, block.code) for block in RUN if block.page == page and block.lang == "python"]
    (work / "blocks.json").write_text(json.dumps(code))
    run = subprocess.run([sys.executable, "-c", RUNNER, "blocks.json"], check=False, cwd=work, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


@pytest.mark.parametrize("block", [b for b in RUN if b.lang == "bash"], ids=lambda block: block.where)
def test_shell_blocks_run(block, shell):
    work, env = shell
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], check=False, cwd=work, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


def _import(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("block", [b for b in RUN if b.lang == "yaml"], ids=lambda block: block.where)
def test_yaml_blocks_name_real_classes_and_options(block):
    def check(node: object) -> int:
        if isinstance(node, list):
            return sum(check(item) for item in node)
        if not isinstance(node, dict):
            return 0
        count = sum(check(value) for value in node.values())
        if "class_path" in node:
            parameters = inspect.signature(_import(node["class_path"])).parameters
            unknown = set(node.get("init_args", {})) - set(parameters)
            assert not unknown, f"{block.where}: {node['class_path']} takes no {sorted(unknown)}"
            count += 1
        return count

    assert check(yaml.safe_load(block.code)) > 0, f"{block.where}: no class_path to check"


# --- the README's links lead into the site -------------------------------------------------------------------------


def _nav_files(node: object) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(_nav_files(item) for item in node))
    if isinstance(node, dict):
        return set().union(*(_nav_files(value) for value in node.values()))
    return set()


def _anchors(page: Path) -> set[str]:
    # The ids Python-Markdown's toc extension gives headings: lower case, punctuation dropped, spaces to dashes.
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


def test_every_readme_link_is_a_page_of_the_site():
    nav = _nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert len(links) >= 8
    for link in links:
        assert not link.startswith(("http:", "https:")), f"{link}: link a page of docs/, as the other links do"
        target, _, anchor = link.partition("#")
        path = (ROOT / target).resolve()
        assert path.is_file(), link
        relative = path.relative_to(DOCS).as_posix()  # raises for anything outside docs/
        if path.suffix == ".md":
            assert relative in nav, f"{link}: not in mkdocs.yml's nav"
            assert not anchor or anchor in _anchors(path), f"{link}: no such heading ({sorted(_anchors(path))})"
