"""Gradient (activation) checkpointing for PyTorch Lightning."""

from lightning_ckpt.callback import GradientCheckpointing
from lightning_ckpt.monitor import MemoryMonitor
from lightning_ckpt.strategies import CheckpointingDDPStrategy, CheckpointingFSDPStrategy
from lightning_ckpt.wrapping import apply_checkpointing, remove_checkpointing

__all__ = [
    "CheckpointingDDPStrategy",
    "CheckpointingFSDPStrategy",
    "GradientCheckpointing",
    "MemoryMonitor",
    "apply_checkpointing",
    "remove_checkpointing",
]
__version__ = "0.1.0"
