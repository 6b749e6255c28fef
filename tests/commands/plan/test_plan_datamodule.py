"""Issue 42, item 3: ``lightning-ckpt plan`` builds the config's datamodule with real tensors.

A datamodule that makes its tensors in ``__init__`` and reads them there (``.item()``) trains with ``fit``; ``plan``
built it under fake tensors (or on the meta device) and exited 2 with "Tensor.item() cannot be called on meta
tensors". Data is cheap to build for real: only the model needs fake tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.demos import counting_sequences

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


class TensorsInInit(LightningDataModule):
    """The tiny config's data, made in ``__init__`` and read there: its largest token id, as a Python int."""

    def __init__(self, vocab_size: int = 32, block_size: int = 32, batch_size: int = 8) -> None:
        super().__init__()
        self.seqs = counting_sequences(64, block_size + 1, vocab_size, 0)
        self.largest = int(self.seqs.max().item())  # a value: fake and meta tensors have none
        assert self.largest < vocab_size
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.seqs[:, :-1], self.seqs[:, 1:]), batch_size=self.batch_size)


def config(tmp_path: Path) -> Path:
    text = (CONFIGS / "tiny.yaml").read_text()
    data = text.index("data:")
    path = tmp_path / "tensors_in_init.yaml"
    path.write_text(text[:data] + f"data:\n  class_path: {__name__}.TensorsInInit\n  init_args:\n    vocab_size: 32\n"
                                   "    block_size: 32\n    batch_size: 8\n")
    return path


@pytest.mark.parametrize("fake", [False, True])
def test_plan_runs_on_a_datamodule_that_reads_its_tensors_in_init(fake, tmp_path, capsys):
    out = tmp_path / "out"
    rc = plan_main(["--config", str(config(tmp_path)), "--memory-budget", "0.5", "--output-dir", str(out),
                    *(["--fake"] if fake else [])])
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "plan.json").read_text())
    assert data["batch_size"] == 8 and len(data["layers"]) == 4
    assert data["plan"] is not None and data["plan"]["budget_bytes"] > 0
