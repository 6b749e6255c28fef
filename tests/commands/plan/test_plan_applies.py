"""Issue 42, item 1: ``lightning-ckpt plan``'s plans are plans the callback applies, and they hold when trained.

Its plans (for the budget, at each length, at the plan's longest length) used to choose op-level (``"ops"``) layers,
which ``GradientCheckpointing(memory_budget=...)`` cannot apply: the run then checkpointed otherwise, and a GPTNeoX
trained at the advised length and budget peaked 1.096x it. The command plans with the callback's modes now
(``("full",)`` for a reentrant config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from helpers import StepPeaks
from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.demos import GPT, Block, counting_sequences

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"  # the demo GPT: 4 blocks, 32 positions, batch 8


def plan_json(tmp_path: Path, *args: str) -> dict:
    assert plan_main(["--config", str(TINY), "--fake", "--output-dir", str(tmp_path), *args]) == 0
    return json.loads((tmp_path / "plan.json").read_text())


def test_the_plan_for_the_budget_is_one_the_callback_chooses_and_applies(tmp_path):
    # both priced by FLOPs, so that they solve the same problem (measured times differ from run to run)
    data = plan_json(tmp_path, "--memory-budget", "0.5", "--trainer.callbacks.init_args.time_layers=false")
    assert data["priced_by"] == "recompute FLOPs"
    # Before: {"model.blocks.0": "ops", ...} on every block, which the callback cannot apply.
    assert set(data["plan"]["layers"].values()) <= {"none", "full", "selective"}, data["plan"]["layers"]
    assert "selective" in data["plan"]["layers"].values()
    # The callback on the same model and batch, at the same budget, chooses the same.
    callback = GradientCheckpointing(memory_budget=0.5, layer_cls=Block, time_layers=False)
    train(callback, length=32, steps=2)
    assert callback.plan.layers == data["plan"]["layers"]


def test_a_reentrant_config_is_planned_full_or_none(tmp_path):
    data = plan_json(tmp_path, "--memory-budget", "0.5", "--trainer.callbacks.init_args.use_reentrant=true")
    assert set(data["plan"]["layers"].values()) <= {"none", "full"}, data["plan"]["layers"]


def test_training_at_the_plan_s_longest_length_with_its_budget_holds_every_step(tmp_path):
    data = plan_json(tmp_path, "--lengths", "4,8,16", "--device-memory", "1100KiB",
                     "--trainer.callbacks.init_args.time_layers=false")
    longest = data["longest_plan"]
    budget, length = longest["plan"]["budget_bytes"], longest["length"]
    assert set(longest["plan"]["layers"].values()) <= {"none", "full", "selective"}
    callback = GradientCheckpointing(memory_budget=budget, layer_cls=Block, max_length=length, time_layers=False)
    peaks = train(callback, length, steps=3)
    assert callback.plan.layers == longest["plan"]["layers"]
    assert max(peaks) <= budget, (peaks, budget)


def train(callback: GradientCheckpointing, length: int, steps: int) -> list[int]:
    """The tiny config's model and data (batch 8, sequences of ``length``), ``steps`` steps; each step's peak."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=32, n_layer=4, n_embd=32, n_head=2)
    seqs = counting_sequences(8 * steps, length + 1, 32, 0)
    peaks = StepPeaks()
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, peaks])
    trainer.fit(model, DataLoader(TensorDataset(seqs[:, :-1], seqs[:, 1:]), batch_size=8))
    return peaks.peaks
