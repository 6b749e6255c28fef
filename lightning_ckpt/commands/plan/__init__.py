"""``lightning-ckpt plan``: what each checkpointing setting holds and recomputes, before a run."""

from lightning_ckpt.commands.plan.measure import main

__all__ = ["main"]
