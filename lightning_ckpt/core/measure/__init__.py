"""What a step holds and costs: counting bytes and FLOPs, measuring each layer's costs, and the time model.

Profiling counters (:mod:`~lightning_ckpt.core.measure.profiling`), what ``MemoryMonitor`` computes
(:mod:`~lightning_ckpt.core.measure.memory_stats`), the layer cost records (:mod:`~lightning_ckpt.core.measure.costs`)
and their measurement (:mod:`~lightning_ckpt.core.measure.layer_costs`; a layer's re-run,
:mod:`~lightning_ckpt.core.measure.rerun`, and which layers share one, :mod:`~lightning_ckpt.core.measure.rerun_key`),
op-level curves, device profiles and timing,
costs fitted over batch shapes, the longest batch and fake tensors on a real step's branches.

May import :mod:`lightning_ckpt.core.checkpoint` (what it measures is checkpointed layers), never
:mod:`lightning_ckpt.core.plan`.
"""

__all__: list[str] = []  # the submodules are the API; this package itself offers no names
