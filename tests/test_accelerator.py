"""Paths that only exist on an accelerator: device peak memory in MemoryMonitor, bf16 autocast under checkpointing.

Every test here is marked ``accelerator`` and skips without one (tests/conftest.py);
``python benchmarks/accelerator_check.py`` runs them with the other accelerator tests and the offload benchmark.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from helpers import loss_and_grads
from lightning_ckpt import GradientCheckpointing, MemoryMonitor, apply_checkpointing
from lightning_ckpt.core.checkpoint.offload import DeviceStreams, OffloadEngine, use_engine
from lightning_ckpt.core.measure.memory_stats import GIB, PEAK_ALLOCATED, PEAK_RESERVED, STEP_SEC
from lightning_ckpt.demos import GPT, Block, CountingDataModule

pytestmark = pytest.mark.accelerator
SPIKE_BYTES = 512 * 2**20
SPIKE_STEP = 2  # global step (0-based) of the training step that allocates the spike


class SpikyGPT(GPT):
    """A tiny GPT whose third training step briefly allocates 512 MiB on the device."""

    def training_step(self, batch, batch_idx):
        if self.global_step == SPIKE_STEP:
            spike = torch.ones(SPIKE_BYTES // 4, device=self.device)
            del spike
        return super().training_step(batch, batch_idx)


def test_monitor_logs_device_peaks_and_resets_them_every_interval(tmp_path):
    seed_everything(0)
    logger = CSVLogger(tmp_path, name="peaks")
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=6, log_every_n_steps=2, logger=logger,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=[GradientCheckpointing(layer_cls=Block), MemoryMonitor()])
    trainer.fit(SpikyGPT(block_size=32, n_layer=2, n_embd=32), CountingDataModule(block_size=32, num_samples=256))
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get(STEP_SEC)]
    assert len(rows) >= 3  # steps 1-2, 3-4, 5-6
    peaks = [r[PEAK_ALLOCATED] * GIB for r in rows[:3]]
    assert all(0 < r[PEAK_ALLOCATED] <= r[PEAK_RESERVED] for r in rows[:3])
    # the spike is in the second interval only: the counters were reset after the first log and again after the second
    assert peaks[1] >= SPIKE_BYTES
    assert peaks[0] < SPIKE_BYTES / 2 and peaks[2] < SPIKE_BYTES / 2, peaks


@pytest.mark.parametrize("offload", [False, True])
def test_bf16_autocast_checkpointing_keeps_loss_and_gradients(offload):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_ckpt.demos import Transformer

    device = torch.device("cuda", torch.cuda.current_device())
    seq, width, batch = 256, 512, 8  # 4 MiB per block input in float32: above the offload threshold
    idx = torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    with use_engine(OffloadEngine(DeviceStreams(device))) as engine:
        for checkpointed in (False, True):
            torch.manual_seed(0)
            model = Transformer(32, seq, 6, width, n_head=8, dropout=0.1).to(device)
            if checkpointed:
                apply_checkpointing(model, layer_cls=Block, offload=offload)
            with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", dtype=torch.bfloat16):
                results.append(loss_and_grads(model, idx))
        torch.cuda.synchronize()
    assert engine.stats.to_host_copies == (6 if offload else 0)  # one input per block, each above the threshold
    (loss, grads), (ckpt_loss, ckpt_grads) = results
    assert grads[next(iter(grads))].dtype == torch.float32  # fp32 weights, bf16 compute
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(ckpt_grads[name], grads[name], rtol=0, atol=0, msg=name)


def test_compare_on_the_accelerator_reports_device_peaks_and_exact_gradients(tmp_path, capsys):
    """`lightning-ckpt compare` with the tiny config moved to the GPU: device peaks in the table, every layer
    checkpointed peaks lower than none, and step-1 gradients equal."""
    import json

    import yaml

    from lightning_ckpt.commands.cli import main as cli_main

    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "tiny.yaml").read_text())
    config["trainer"]["accelerator"] = "cuda"
    path = tmp_path / "tiny_cuda.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(path), "--variants", "none,every_layer,offload", "--steps", "4",
                     "--rounds", "1", "--warmup", "1", "--output-dir", str(out)])
    assert code == 0
    variants = {v["name"]: v for v in json.loads((out / "compare.json").read_text())["variants"]}
    assert all(v["peak_allocated_gib"] and v["peak_allocated_gib"] > 0 for v in variants.values())
    assert variants["every_layer"]["peak_allocated_gib"] < variants["none"]["peak_allocated_gib"]
