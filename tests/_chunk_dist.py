"""Two-process (gloo, spawn) runs of the demo GPT with the chunked LM head + loss, for ``test_chunked_dist.py``.

Each scenario trains a few steps under DDP or FSDP2 and returns the first step's gradients, the unsharded weights
and the head's calls per step
(with the head chunked: the forward's chunks and the backward's recompute of each), rank by rank.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).parent))
from _dist_helpers import (  # noqa: E402
    DATA_ARGS, GPT_ARGS, WORLD_SIZE, SeededGPT, free_port, full_weights, leave_process_group, spawn_ranks)

from lightning_ckpt import GradientCheckpointing  # noqa: E402
from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss, chunk_loss_of  # noqa: E402
from lightning_ckpt.demos import CountingDataModule  # noqa: E402

CHUNK = 16  # 4 x 16 tokens a rank and step: 4 chunks


class FrozenHeadGPT(SeededGPT):
    def _build(self):
        model = super()._build()
        model.head.requires_grad_(False)
        return model


class ChunkAndCount(Callback):
    """Sets the chunk size (the callback's is the default, larger than this batch) and counts the head's calls."""

    def __init__(self, chunk: bool) -> None:
        self.chunk, self.calls, self.chunk_seen, self.first_grads = chunk, [], None, None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.first_grads is None:  # the first step's gradients, unsharded (a collective under FSDP2)
            from torch.distributed.tensor import DTensor

            self.first_grads = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for name, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.chunk_by_callback = chunk_loss_of(pl_module.model)  # GradientCheckpointing(chunk_loss=...)'s own
        if self.chunk:
            chunk_causal_lm_loss(pl_module, CHUNK)
        self.chunk_seen = chunk_loss_of(pl_module.model)
        pl_module.model.head.register_forward_hook(lambda *_: self.calls.append(1))

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.calls.append(0)


def _fit(strategy: Any, chunk: bool, frozen: bool) -> dict[str, Any]:
    seed_everything(0)
    model = (FrozenHeadGPT if frozen else SeededGPT)(**GPT_ARGS)
    count = ChunkAndCount(chunk)
    callbacks = [GradientCheckpointing(chunk_loss=chunk), count]
    trainer = Trainer(strategy=strategy, callbacks=callbacks, accelerator="cpu", devices=WORLD_SIZE, max_steps=3,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, CountingDataModule(**DATA_ARGS))
    per_step, n = [], 0
    for c in count.calls:
        if c:
            n += 1
        else:
            per_step.append(n)
            n = 0
    return {"weights": full_weights(model), "head_calls": per_step, "chunk": count.chunk_seen,
            "first_grads": count.first_grads, "chunk_by_callback": count.chunk_by_callback}


def _run(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy_name, chunk, frozen = name.split("-")
    strategy = DDPStrategy() if strategy_name == "ddp" else "fsdp_ckpt"
    try:
        return _fit(strategy, chunk == "chunked", frozen == "frozen")
    except Exception as err:  # noqa: BLE001 - recorded for the test to show
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def _worker(rank: int, port: int, names: list[str], out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD_SIZE))
    for name in names:
        torch.save(_run(name), Path(out_dir) / f"{name}.rank{rank}.pt")
    leave_process_group()


def run(names: list[str], out_dir: Path, timeout: float = 600.0) -> dict[str, list[dict[str, Any]]]:
    return spawn_ranks(_worker, (free_port(), names, str(out_dir)), out_dir, names, timeout)
