"""The plain-PyTorch core: what and how to checkpoint. Nothing here imports Lightning or anything above it.

Three folders, imports running one way (``tests/test_layout.py`` checks every import):
:mod:`~lightning_ckpt.core.plan` (choosing) may import :mod:`~lightning_ckpt.core.measure` (what a step holds and
costs), which may import :mod:`~lightning_ckpt.core.checkpoint` (how to checkpoint), which imports neither.

- :mod:`~lightning_ckpt.core.checkpoint.selection`: which modules (layer classes, every n-th, memory budgets);
- :mod:`~lightning_ckpt.core.checkpoint.wrapping`: apply and remove checkpointing, identity-preserving;
- :mod:`~lightning_ckpt.core.checkpoint.layer_state`: buffers a layer updates in forward, restored for the recompute;
- :mod:`~lightning_ckpt.core.checkpoint.policies`: selective checkpointing (which op outputs are kept);
- :mod:`~lightning_ckpt.core.checkpoint.offload`: saved tensors in pinned host memory, on side streams
  (:mod:`~lightning_ckpt.core.checkpoint.host_pool`, :mod:`~lightning_ckpt.core.checkpoint.streams`,
  :mod:`~lightning_ckpt.core.checkpoint.saved_copies`);
- :mod:`~lightning_ckpt.core.checkpoint.tiling`: a layer's MLP over tiles of tokens, each under checkpoint
  (``tile_mlp``);
- :mod:`~lightning_ckpt.core.checkpoint.lean`: a layer's norms and gated MLP holding less for backward, exactly
  (``lean_layers``);
- :mod:`~lightning_ckpt.core.checkpoint.placement`: checkpointing inside FSDP units, never around them;
- :mod:`~lightning_ckpt.core.measure.profiling`: bytes held for backward and FLOPs;
- :mod:`~lightning_ckpt.core.measure.memory_stats`: what ``MemoryMonitor`` measures and computes (probes, reductions
  over ranks, the memory breakdown);
- :mod:`~lightning_ckpt.core.plan.planner`: the memory-budget planner's entry points (``plan_checkpointing``,
  ``make_plan``, predictions), built on :mod:`~lightning_ckpt.core.measure.costs` (what a layer holds and costs),
  :mod:`~lightning_ckpt.core.measure.layer_costs` (measuring it), :mod:`~lightning_ckpt.core.measure.op_curve`
  (op-level choices), :mod:`~lightning_ckpt.core.plan.solver` (the cheapest choices that fit),
  :mod:`~lightning_ckpt.core.measure.timing` and :mod:`~lightning_ckpt.core.measure.device_profile` (the time model)
  and :mod:`~lightning_ckpt.core.plan.checkpoint_plan` (the result);
- :mod:`~lightning_ckpt.core.plan.budget`: what ``GradientCheckpointing`` computes for a budget (``"auto"``, static
  memory, one plan for every rank).
"""

__all__: list[str] = []  # the submodules are the API; this package itself offers no names
