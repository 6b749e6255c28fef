"""The Lightning callbacks, and their driver for Fabric loops. They decide *when*; what they compute lives in :mod:`lightning_ckpt.core`."""

from lightning_ckpt.callbacks.fabric import FabricCheckpointing
from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor

__all__ = ["FabricCheckpointing", "GradientCheckpointing", "MemoryMonitor"]
