"""Two-process (gloo, spawn) runs of the demo GPT with its MLPs tiled, or its norms lean, for ``test_tiling.py`` and
``test_lean.py``.

Each scenario trains 2 steps under DDP or FSDP2 (``fsdp_ckpt``: each block its own unit, the tiles inside it) with
``GradientCheckpointing(every_n_layers=2, tile_mlp=...)`` (or ``lean_layers=True``) and returns, rank by rank, the first step's gradients
(unsharded) and how many rows each call of each block's first MLP ``Linear`` saw in the first step (its output
is saved, so every recompute runs it).
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
    DATA_ARGS, GPT_ARGS, WORLD_SIZE, SeededGPT, free_port, leave_process_group, spawn_ranks)

from lightning_ckpt import GradientCheckpointing  # noqa: E402
from lightning_ckpt.demos import CountingDataModule  # noqa: E402

TILE = 4  # 16-token sequences: 4 tiles


class FirstStep(Callback):
    """The first step's gradients (unsharded: a collective under FSDP2) and the rows of each call of each block's
    first MLP Linear in that step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.rows: dict[int, list[int]] = {}
        self._done = False

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        for i, block in enumerate(pl_module.model.blocks):
            self.rows[i] = []
            block.mlp[0].register_forward_hook(
                lambda module, args, out, i=i: None if self._done else self.rows[i].append(args[0].shape[-2]))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self._done:
            return
        from torch.distributed.tensor import DTensor

        self.grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                      for name, p in pl_module.named_parameters() if p.grad is not None}
        self._done = True


def _fit(strategy: Any, tile: bool, lean: bool = False) -> dict[str, Any]:
    seed_everything(0)
    model = SeededGPT(**GPT_ARGS)
    record = FirstStep()
    callbacks = [GradientCheckpointing(every_n_layers=2, tile_mlp=tile, tile_tokens=TILE if tile else None,
                                       lean_layers=lean), record]
    trainer = Trainer(strategy=strategy, callbacks=callbacks, accelerator="cpu", devices=WORLD_SIZE, max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, CountingDataModule(**DATA_ARGS))
    return {"grads": record.grads, "rows": record.rows}


def _run(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy_name, variant = name.split("-")  # variant: plain, tiled or lean
    strategy = DDPStrategy() if strategy_name == "ddp" else "fsdp_ckpt"
    try:
        return _fit(strategy, variant == "tiled", variant == "lean")
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
