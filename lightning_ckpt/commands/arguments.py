"""Arguments that ``lightning-ckpt plan`` and ``lightning-ckpt compare`` share: ``--config``, budgets, bytes and
``--device``.

Example::

    >>> parse_bytes_arg("80GiB")
    85899345920
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Optional

from lightning_ckpt.core.checkpoint.selection import parse_memory_budget
from lightning_ckpt.core.measure.device_profile import PRESET_NAMES

__all__ = [
    "add_config_argument",
    "add_device_argument",
    "check_config_argument",
    "check_device_argument",
    "parse_budget_arg",
    "parse_bytes_arg",
]


def parse_budget_arg(text: str) -> float | int | str:
    """``--memory-budget`` text as :func:`~lightning_ckpt.core.checkpoint.selection.parse_memory_budget` takes it.

    Example::

        >>> parse_budget_arg("0.3"), parse_budget_arg("2GiB"), parse_budget_arg("500000000")
        (0.3, 2147483648, 500000000)
    """
    text = text.strip()
    value: float | int | str = text
    if re.fullmatch(r"\d+", text):
        value = int(text)
    elif re.fullmatch(r"\d*\.\d+(e-?\d+)?|\d+e-?\d+", text):
        value = float(text)
    parsed = parse_memory_budget(value)
    assert parsed is not None
    return parsed


def parse_bytes_arg(text: str) -> int:
    """``--device-memory`` text (``80GiB``, ``40e9``, ``1000000``) as bytes.

    Example::

        >>> parse_bytes_arg("80GiB"), parse_bytes_arg("40e9")
        (85899345920, 40000000000)
    """
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?e\d+", text):
        return int(float(text))
    parsed = parse_memory_budget(int(text) if text.isdigit() else text)
    if not isinstance(parsed, int):
        raise ValueError(f"{text!r} is not a number of bytes")
    return parsed


def add_device_argument(parser: argparse.ArgumentParser, what: str, default: str) -> None:
    """``--device NAME|auto``, as ``plan`` and ``compare`` take it: ``what`` it does and what its ``default`` means.
    The parser must not allow abbreviations (``--device`` is a prefix of ``--device-memory``)."""
    parser.add_argument("--device", default=None,
                        help=f"{what}: a preset ({', '.join(PRESET_NAMES)}) or 'auto' (measure the device the step"
                             f" runs on); {default}")


def check_device_argument(parser: argparse.ArgumentParser, device: Optional[str]) -> None:
    """A usage error (exit 2) unless ``device`` is ``None``, ``"auto"`` or a preset name."""
    if device is not None and device != "auto" and device not in PRESET_NAMES:
        parser.error(f"--device {device}: pass a preset ({', '.join(PRESET_NAMES)}) or 'auto'")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--config X.yaml``, the LightningCLI config a command runs or measures."""
    parser.add_argument("--config", type=Path, help="LightningCLI YAML config (model, data, trainer)")


def check_config_argument(parser: argparse.ArgumentParser, config: Optional[Path], command: str) -> None:
    """A usage error (exit 2) unless ``config`` names a file; ``command`` (``"plan"``) is what the run is for."""
    if config is None:
        parser.error(f"--config is required: pass the LightningCLI YAML of the run to {command}, e.g. --config"
                     " configs/tiny.yaml")
    if not config.is_file():
        parser.error(f"--config {config}: no such file; pass the path of a LightningCLI YAML config")
