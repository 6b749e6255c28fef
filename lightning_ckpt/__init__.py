"""Gradient (activation) checkpointing for PyTorch Lightning."""

import logging

from lightning_ckpt.callbacks import FabricCheckpointing, GradientCheckpointing, MemoryMonitor
from lightning_ckpt.core.checkpoint.chunked_loss import lm_loss
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import CheckpointPlan, plan_checkpointing
from lightning_ckpt.strategies import CheckpointingDDPStrategy, CheckpointingFSDPStrategy

__all__ = [
    "CheckpointPlan",
    "CheckpointingDDPStrategy",
    "CheckpointingFSDPStrategy",
    "DeviceProfile",
    "FabricCheckpointing",
    "GradientCheckpointing",
    "MemoryMonitor",
    "apply_checkpointing",
    "lm_loss",
    "plan_checkpointing",
    "remove_checkpointing",
]
__version__ = "0.1.0"

# What the package decides on its own (the detected block, a cache turned off) is said at INFO, shown like
# Lightning's own messages unless the application configured logging itself.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False
