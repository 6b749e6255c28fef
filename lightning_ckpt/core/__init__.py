"""The plain-PyTorch core: what and how to checkpoint. Nothing here imports Lightning or anything above it.

- :mod:`~lightning_ckpt.core.selection`: which modules (layer classes, every n-th, memory budgets);
- :mod:`~lightning_ckpt.core.wrapping`: apply and remove checkpointing, identity-preserving;
- :mod:`~lightning_ckpt.core.layer_state`: buffers a layer updates in forward, restored for the recompute;
- :mod:`~lightning_ckpt.core.policies`: selective checkpointing (which op outputs are kept);
- :mod:`~lightning_ckpt.core.offload`: saved tensors in pinned host memory, on side streams;
- :mod:`~lightning_ckpt.core.profiling`: bytes held for backward and FLOPs;
- :mod:`~lightning_ckpt.core.memory_stats`: what ``MemoryMonitor`` measures and computes (probes, reductions over
  ranks, the memory breakdown);
- :mod:`~lightning_ckpt.core.op_curve`, :mod:`~lightning_ckpt.core.planner`,
  :mod:`~lightning_ckpt.core.device_profile`: the memory-budget planner and its time model;
- :mod:`~lightning_ckpt.core.budget`: what ``GradientCheckpointing`` computes for a budget (``"auto"``, static
  memory, one plan for every rank);
- :mod:`~lightning_ckpt.core.placement`: checkpointing inside FSDP units, never around them.
"""
