"""Tests marked ``accelerator`` need a GPU (or another ``torch.accelerator`` device); they skip cleanly without one.

Run just them with ``python -m pytest -m accelerator`` (``benchmarks/accelerator_check.py`` does, then benchmarks).
"""

from __future__ import annotations

import pytest
import torch


def has_accelerator() -> bool:
    """Whether this machine has a device that the accelerator tests can run on (CUDA, for their memory counters)."""
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs an accelerator (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("accelerator") is not None:
            item.add_marker(skip)
