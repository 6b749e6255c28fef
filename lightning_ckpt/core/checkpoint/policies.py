"""Selective (op-level) checkpointing: which op outputs a checkpointed layer keeps, which it recomputes.

``mode="selective"`` keeps the outputs of compute-heavy ops and recomputes the cheap ones
(:func:`selective_context_fn`); the planner's op-level choices keep the ops at given positions
(:func:`keep_ops_context_fn`). Built on torch's selective-checkpoint contexts. Plain PyTorch; nothing here
imports Lightning.

Example::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> y = checkpoint(mlp, x, use_reentrant=False, context_fn=selective_context_fn)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_ckpt.core.checkpoint.storages import report_held

__all__ = ["COMPUTE_HEAVY_OPS", "keep_ops_context_fn", "save_compute_heavy", "selective_context_fn"]

_aten = torch.ops.aten


def _compute_heavy_ops() -> frozenset[Any]:
    names = (
        "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    # Some attention kernels exist only in some torch builds.
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


COMPUTE_HEAVY_OPS = _compute_heavy_ops()


def save_compute_heavy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Policy: keep matmul/attention/convolution outputs, recompute everything else."""
    if op not in COMPUTE_HEAVY_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return _kept(ctx)


def _kept(ctx: Any) -> CheckpointPolicy:
    # torch shows the policy the op's output (in the forward, the only time it asks): report it, since byte
    # counters cannot see what this cache holds otherwise.
    if getattr(ctx, "op_output", None) is not None:
        for tensor in tree_leaves(ctx.op_output):
            if isinstance(tensor, torch.Tensor):
                report_held(tensor, "kept")
    return CheckpointPolicy.MUST_SAVE


def selective_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` implementing :func:`save_compute_heavy`."""
    return create_selective_checkpoint_contexts(save_compute_heavy)


def keep_ops_context_fn(keep: Iterable[int], ops: Sequence[str]) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` that keeps the outputs of the ops at positions ``keep`` and recomputes all others.

    A position counts the ops a policy sees in one call of the checkpointed function, from 0. ``ops[i]`` names
    the op expected at position ``i`` (``"aten.addmm.default"``), as recorded when the choice was made: from the
    first op that differs (a forward that took another branch), every op is recomputed, which is always correct.

    Example::

        >>> from torch.utils.checkpoint import checkpoint
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> context_fn = keep_ops_context_fn([1], ["aten.t.default", "aten.addmm.default", "aten.tanh.default"])
        >>> y = checkpoint(mlp, x, use_reentrant=False, context_fn=context_fn)  # keeps the first matmul's output
    """
    kept, expected = frozenset(keep), list(ops)

    def context_fn() -> tuple[Any, Any]:
        # Ops matched so far (-1 once one differs). torch asks the policy in the forward only: the recompute
        # takes the cache's entries in order and never calls it (tests/core/measure/test_op_level.py checks this).
        seen = [0]

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            i = seen[0]
            seen[0] = i + 1 if i >= 0 and i < len(expected) and str(op) == expected[i] else -1
            return _kept(ctx) if seen[0] > 0 and i in kept else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn
