"""The Lightning callbacks. They decide *when*; what they compute lives in :mod:`lightning_ckpt.core`."""

from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor

__all__ = ["GradientCheckpointing", "MemoryMonitor"]
