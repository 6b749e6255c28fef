"""The plain-PyTorch core: what and how to checkpoint. Nothing here imports Lightning or anything above it.

- :mod:`~lightning_ckpt.core.selection`: which modules (layer classes, every n-th, memory budgets);
- :mod:`~lightning_ckpt.core.wrapping`: apply and remove checkpointing, identity-preserving;
- :mod:`~lightning_ckpt.core.layer_state`: buffers a layer updates in forward, restored for the recompute;
- :mod:`~lightning_ckpt.core.policies`: selective checkpointing (which op outputs are kept);
- :mod:`~lightning_ckpt.core.offload`: saved tensors in pinned host memory, on side streams;
- :mod:`~lightning_ckpt.core.tiling`: a layer's MLP over tiles of tokens, each under checkpoint (``tile_mlp``);
- :mod:`~lightning_ckpt.core.profiling`: bytes held for backward and FLOPs;
- :mod:`~lightning_ckpt.core.memory_stats`: what ``MemoryMonitor`` measures and computes (probes, reductions over
  ranks, the memory breakdown);
- :mod:`~lightning_ckpt.core.planner`: the memory-budget planner's entry points (``plan_checkpointing``,
  ``make_plan``, predictions), built on :mod:`~lightning_ckpt.core.costs` (what a layer holds and costs),
  :mod:`~lightning_ckpt.core.measure` (measuring it), :mod:`~lightning_ckpt.core.op_curve` (op-level choices),
  :mod:`~lightning_ckpt.core.solver` (the cheapest choices that fit), :mod:`~lightning_ckpt.core.timing` and
  :mod:`~lightning_ckpt.core.device_profile` (the time model) and :mod:`~lightning_ckpt.core.plan` (the result);
- :mod:`~lightning_ckpt.core.budget`: what ``GradientCheckpointing`` computes for a budget (``"auto"``, static
  memory, one plan for every rank);
- :mod:`~lightning_ckpt.core.placement`: checkpointing inside FSDP units, never around them.
"""

__all__: list[str] = []  # the submodules are the API; this package itself offers no names
