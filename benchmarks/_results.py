"""Write one benchmark's section into benchmarks/RESULTS.md, leaving the other sections as they are."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n\nEach section is written by the script it names; rerun the script to refresh it.\n"


def machine() -> str:
    """One line saying where a measurement was taken."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    return f"{device}; torch {torch.__version__}; Python {platform.python_version()}"


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between the markers for ``name`` in RESULTS.md."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
