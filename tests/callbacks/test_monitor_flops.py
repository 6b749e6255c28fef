"""MemoryMonitor's ``compute/recompute_flops_share``: checkpointing's recomputed FLOPs over the step's, counted on
logging steps only, against counts made without the monitor's recompute marker."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_ckpt import GradientCheckpointing
import lightning_ckpt.callbacks.memory_monitor as monitor_module
from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor
import lightning_ckpt.core.measure.memory_stats as memory_stats
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
from lightning_ckpt.core.measure.memory_stats import RECOMPUTE_FLOPS_SHARE, RecomputeCostMode
from lightning_ckpt.core.measure.profiling import count_cost
from lightning_ckpt.demos import GPT, Block, CountingDataModule, counting_sequences
from test_monitor import one_thread  # noqa: F401 - autouse: one intra-op thread on this small, shared machine

VOCAB, SEQ, BATCH = 32, 16, 8


def gpt() -> GPT:
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_embd=32, n_head=2, dropout=0.1)


def fit(tmp_path, callbacks: list, max_steps: int = 2, log_every_n_steps: int = 1) -> MemoryMonitor:
    monitor = MemoryMonitor(log_every_n_steps=log_every_n_steps)
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path, name="flops"),
                      callbacks=[*callbacks, monitor], enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(gpt(), CountingDataModule(vocab_size=VOCAB, block_size=SEQ, batch_size=BATCH, num_samples=4 * BATCH))
    return monitor


def step_cost(mode: str | None) -> int:
    """FLOPs (as the planner counts them) of one training step's forward and backward, every Block checkpointed in
    ``mode`` (``None``: not checkpointed); no recompute marker involved."""
    model = gpt()
    if mode is not None:
        apply_checkpointing(model, layer_cls=Block, mode=mode)
    tokens = counting_sequences(BATCH, SEQ + 1, VOCAB)
    batch = (tokens[:, :-1], tokens[:, 1:])
    return count_cost(lambda: model.training_step(batch, 0).backward())


@pytest.mark.filterwarnings("ignore:You are trying to")
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_share_is_the_recomputed_flops_over_the_step_flops(tmp_path, mode):
    monitor = fit(tmp_path, [GradientCheckpointing(layer_cls=Block, every_n_layers=1, mode=mode)])
    plain, checkpointed = step_cost(None), step_cost(mode)
    recomputed = checkpointed - plain
    assert recomputed > 0.005 * plain  # full: about a third of the forward; selective: the cheap ops only
    # Lightning's own few scalar ops per step (logging the loss) are the only FLOPs not in the counts above.
    assert monitor.metrics[RECOMPUTE_FLOPS_SHARE] == pytest.approx(recomputed / checkpointed, rel=1e-5)


def test_share_of_full_checkpointing_is_larger_than_selective_and_0_without(tmp_path):
    shares = {mode: fit(tmp_path, [GradientCheckpointing(layer_cls=Block, mode=mode)]).metrics[RECOMPUTE_FLOPS_SHARE]
              for mode in ("full", "selective")}
    assert fit(tmp_path, []).metrics[RECOMPUTE_FLOPS_SHARE] == 0.0
    assert 0 < shares["selective"] < shares["full"] < 0.5


def test_flops_are_counted_on_logging_steps_only(tmp_path, monkeypatch):
    entered: list[int] = []

    class Spy(RecomputeCostMode):
        def __enter__(self):
            entered.append(trainer_steps[-1])
            return super().__enter__()

    trainer_steps: list[int] = []

    class StepOf(GradientCheckpointing):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trainer_steps.append(trainer.global_step + 1)  # the optimizer step this batch belongs to
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    monkeypatch.setattr(memory_stats, "RecomputeCostMode", Spy)
    monkeypatch.setattr(monitor_module, "FLOP_COUNT_EVERY", 4)
    monitor = fit(tmp_path, [StepOf(layer_cls=Block)], max_steps=11, log_every_n_steps=2)
    assert trainer_steps == list(range(1, 12))
    # logging steps 2, 4, ..., 10; counted on 2, then not before 2 + 4: on 6 and 10
    assert entered == [2, 6, 10]
    assert 0 < monitor.metrics[RECOMPUTE_FLOPS_SHARE] < 1


def test_nothing_is_counted_without_a_logger(tmp_path, monkeypatch):
    entered = []
    monkeypatch.setattr(RecomputeCostMode, "__enter__", lambda self: entered.append(self))
    monitor = MemoryMonitor(log_every_n_steps=1)
    Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=[monitor], enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path).fit(
        gpt(), CountingDataModule(vocab_size=VOCAB, block_size=SEQ, batch_size=BATCH, num_samples=4 * BATCH))
    assert entered == [] and monitor.summary["steps"] == 3
