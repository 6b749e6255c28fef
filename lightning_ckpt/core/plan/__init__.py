"""Choosing: the memory-budget planner, its solver, the plan it returns, and the budget arithmetic around it.

:mod:`~lightning_ckpt.core.plan.planner` (``plan_checkpointing``, ``make_plan``),
:mod:`~lightning_ckpt.core.plan.solver` (the cheapest choices that fit),
:mod:`~lightning_ckpt.core.plan.checkpoint_plan` (``CheckpointPlan``),
:mod:`~lightning_ckpt.core.plan.budget` (what ``GradientCheckpointing`` computes for a budget) and
:mod:`~lightning_ckpt.core.plan.budget_cycle` (one plan per batch size).

The top of ``core``: may import :mod:`lightning_ckpt.core.measure` and :mod:`lightning_ckpt.core.checkpoint`.
"""

__all__: list[str] = []  # the submodules are the API; this package itself offers no names
