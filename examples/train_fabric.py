"""Train the demo Transformer in a Lightning Fabric loop, with a memory budget held on batches of varying length.

The loop of the guide "Lightning Fabric" (docs/guides/fabric.md): ``FabricCheckpointing`` sets the model up with
Fabric, runs the budget cycle per batch and logs the MemoryMonitor's figures through ``fabric.log_dict``.

    python examples/train_fabric.py --budget 700000 --steps 30
    python examples/train_fabric.py --no-checkpointing --steps 30        # the baseline
    python examples/train_fabric.py --strategy ddp --devices 2 --steps 30  # on 2 processes (CPU: gloo)
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_ckpt import FabricCheckpointing
from lightning_ckpt.demos import Transformer, counting_sequences


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of token ids ``[batch, length + 1]``."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def main(args: Optional[list[str]] = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=700_000, help="activation bytes a step may peak at")
    parser.add_argument("--no-checkpointing", action="store_true", help="the baseline, without FabricCheckpointing")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    opts = parser.parse_args(args)

    fabric = Fabric(accelerator="cpu", devices=opts.devices, strategy=opts.strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = Transformer(vocab_size=32, block_size=64, n_layer=opts.layers, n_embd=32, n_head=2, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = None if opts.no_checkpointing else FabricCheckpointing(fabric, memory_budget=opts.budget, loss_fn=loss_of,
                                                                  max_length=33)
    model, optimizer = ckpt.setup(model, optimizer) if ckpt is not None else fabric.setup(model, optimizer)
    lengths = [8, 32, 16, 24]
    losses = []
    for step in range(opts.steps):
        ids = counting_sequences(4, lengths[(step + fabric.global_rank) % len(lengths)] + 1, 32, seed=step)
        if ckpt is None:
            loss = loss_of(model, ids)
            fabric.backward(loss)
        else:
            with ckpt.step(ids):
                loss = loss_of(model, ids)
                ckpt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    fabric.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {opts.steps} steps")
    plans = {}
    if ckpt is not None:
        plans = {size: plan.layers for size, plan in ckpt.plans.items()}
        for size, layers in sorted(plans.items()):
            fabric.print(f"  batches up to {size} tokens: {layers}")
        ckpt.teardown()
    return {"losses": losses, "plans": plans}


if __name__ == "__main__":
    main()
