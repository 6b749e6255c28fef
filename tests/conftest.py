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


@pytest.fixture(scope="session")
def token_wise_dist(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 2-process runs of ``_tile_dist.py`` that ``test_tiling.py`` and ``test_lean.py`` share, in one spawn: the
    demo GPT plain, with its MLPs tiled and with its norms lean, under DDP and FSDP2."""
    from _tile_dist import run

    names = [f"{strategy}-{variant}" for strategy in ("ddp", "fsdp") for variant in ("plain", "tiled", "lean")]
    return run(names, tmp_path_factory.mktemp("token_wise_dist"))
