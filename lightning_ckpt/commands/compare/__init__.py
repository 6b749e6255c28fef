"""``lightning-ckpt compare``: the same run with and without checkpointing, side by side."""

from lightning_ckpt.commands.compare.run import main

__all__ = ["main"]
