"""The longest batch a run will see, measured before the first step on fake tensors (no memory).

A memory budget is a promise for every batch; the batch that tests it is the longest. Where that length is known
(``GradientCheckpointing(max_length=...)``, else the model's ``block_size`` / ``max_position_embeddings``, see
:func:`length_limit`), a batch of that length is made from a real one (:func:`batch_of_length`) and one fully
checkpointed training step is measured on it under ``FakeTensorMode`` (:func:`measure_fake_step`): the weights and
buffers are swapped for fake copies for the step, so nothing is allocated and nothing of the module changes. The
planner then says, before anything is trained, whether the budget can hold that batch.

Plain PyTorch: the callback decides when (:mod:`~lightning_ckpt.callbacks.gradient_checkpointing`); ``lightning-ckpt
plan --lengths`` makes its batches with the same :func:`batch_of_length`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ckpt.core.checkpoint.selection import LayerClassArg
from lightning_ckpt.core.measure.costs import PLAN_MODES
from lightning_ckpt.core.measure.fake_values import real_branches
from lightning_ckpt.core.measure.layer_costs import StepCosts, measure_step

#: Hyperparameters and model-config attributes that bound the sequence length a model takes (position tables).
_LENGTH_LIMITS = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def length_limit(module: nn.Module) -> Optional[tuple[str, int]]:
    """``(name, value)`` of what bounds the sequence length ``module`` takes: a hyperparameter (``block_size``, as
    the demo GPT's position table) or a model's ``config`` attribute (Hugging Face, litgpt); ``None`` when nothing
    says.

    Example::

        >>> from lightning_ckpt.demos import GPT
        >>> length_limit(GPT(block_size=32))
        ('block_size', 32)
    """
    sources = [getattr(module, "hparams", {})]
    sources += [vars(m.config) for m in module.modules() if hasattr(getattr(m, "config", None), "__dict__")]
    for source in sources:
        for name in _LENGTH_LIMITS:
            value = source.get(name) if isinstance(source, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return name, value
    return None


def longest_length(module: nn.Module, max_length: Optional[int]) -> Optional[tuple[int, str]]:
    """``(length, where it came from)``: ``max_length`` when given, else the model's :func:`length_limit`; ``None``
    when neither says. A ``max_length`` above the model's limit is a ``ValueError`` naming both.

    Example::

        >>> from lightning_ckpt.demos import GPT
        >>> longest_length(GPT(block_size=32), None), longest_length(GPT(block_size=32), 16)
        ((32, "the model's block_size"), (16, 'max_length'))
    """
    limit = length_limit(module)
    if max_length is None:
        return None if limit is None else (limit[1], f"the model's {limit[0]}")
    if limit is not None and max_length > limit[1]:
        name, value = limit
        raise ValueError(f"`max_length={max_length}` is longer than the model can take: its {name} is {value} (its"
                         f" position table ends there). Pass max_length={value} or less (or leave it out: the"
                         f" {name} is then the longest length), or build the model with a larger {name}.")
    return max_length, "max_length"


def _token_ids(leaves: Sequence[Any]) -> Optional[torch.Tensor]:
    """The batch's token ids: its first 2-D integer tensor (batch x length), or ``None``."""
    integer = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in integer), None)


def sequence_length_of(batch: Any) -> Optional[int]:
    """The sequence length of ``batch``: dim 1 of its token ids (its first 2-D integer tensor); ``None`` without one.

    Example::

        >>> sequence_length_of({"mask": torch.ones(2, 5), "input_ids": torch.zeros(2, 7, dtype=torch.long)})
        7
    """
    tokens = _token_ids(tree_flatten(batch)[0])
    return None if tokens is None else tokens.shape[1]


def batch_of_length(batch: Any, length: int) -> Optional[Any]:
    """``batch`` at sequence length ``length`` (>= 1): every tensor whose dim 1 is the token ids' length (the ids,
    labels, masks) cut to ``length`` or tiled along dim 1 up to it; other leaves as they are. ``None`` when the
    batch has no token ids (see :func:`sequence_length_of`).

    Example::

        >>> ids, y = torch.arange(6).view(2, 3), torch.ones(2, 3, 4)
        >>> longer, y8 = batch_of_length((ids, y), 8)
        >>> longer.tolist(), tuple(y8.shape), batch_of_length((ids, y), 2)[0].tolist()
        ([[0, 1, 2, 0, 1, 2, 0, 1], [3, 4, 5, 3, 4, 5, 3, 4]], (2, 8, 4), [[0, 1], [3, 4]])
    """
    leaves, spec = tree_flatten(batch)
    tokens = _token_ids(leaves)
    if tokens is None:
        return None
    have = tokens.shape[1]

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != have:
            return t
        times = -(-length // have)
        tiled = t.repeat(1, times, *[1] * (t.dim() - 2)) if times > 1 else t
        return tiled[:, :length].clone()  # a copy: a slice would keep (and count) the whole storage

    return tree_unflatten([resize(t) for t in leaves], spec)


def measure_fake_step(module: nn.Module, step: Callable[[Any], Any], batch: Any, layer_cls: LayerClassArg = None,
                      modes: Sequence[str] = PLAN_MODES) -> StepCosts:
    """:func:`~lightning_ckpt.core.measure.layer_costs.measure_step` of ``step(batch)`` on fake tensors: ``batch``, the weights
    and the buffers of ``module`` become fake copies for the step, so nothing is allocated and the module (its
    weights, their gradients, its buffers) is left as it was. ``step`` returns the loss.

    Raises what the step raises where fake tensors cannot run it (data-dependent shapes, an op without a fake
    kernel, ...).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> before = model[0].weight.clone()
        >>> costs = measure_fake_step(model, lambda x: model(x).sum(), torch.randn(1000, 4), layer_cls=nn.Tanh)
        >>> costs.costs[0].full_bytes, costs.outside_bytes  # 1000 x 8 float32 in; 1000 x (4 + 8) float32 outside
        (32000, 48000)
        >>> torch.equal(model[0].weight, before), model[0].weight.grad is None
        (True, True)
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        # requires_grad kept, so the step's graph (and what it saves for backward) is the real one.
        fakes = {name: fake_mode.from_tensor(t).requires_grad_(t.requires_grad)
                 for name, t in (*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False))}
        fake_batch = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
    # the real values of the batch's and the buffers' integer tensors, for the branches a real step takes
    reals = dict(zip(tree_flatten(fake_batch)[0], tree_flatten(batch)[0]))
    reals.update((fakes[name], t) for name, t in module.named_buffers(remove_duplicate=False))
    with _reparametrize_module(module, fakes, tie_weights=True), fake_mode, real_branches(reals):
        # as the callback's measuring step records it: the ops outside the layers are not timed there
        return measure_step(module, lambda: step(fake_batch), layer_cls, modes, outside_ops=False,
                            time_layers=False)


__all__ = ["batch_of_length", "length_limit", "longest_length", "measure_fake_step", "sequence_length_of"]
