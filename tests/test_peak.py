"""The step's activation peak: what a plan predicts, what its budget bounds, and an independent count of it.

The count is ``benchmarks/_peak.py``: a dispatch mode that sees every op of the forward, the backward and the
recompute, and adds up the storages made during the step that are alive after each op. It uses none of the
package's counters.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from lightning_ckpt.core.planner import LayerCost, Option, held_peak, make_plan, measure_step, plan_checkpointing, solve
from lightning_ckpt.demos import Transformer
from helpers import counted_peak as step_peak

VOCAB, LENGTH, BATCH = 64, 64, 4


def gpt() -> Transformer:
    torch.manual_seed(0)
    return Transformer(VOCAB, LENGTH, n_layer=6, n_embd=64, n_head=4, dropout=0.1)


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))


def loss_of(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def counted_peak(layers: dict[str, str], kept_ops: dict[str, list[int]] | None = None) -> int:
    """The step's activation peak counted by ``_peak.py``, with ``layers`` checkpointed as planned."""
    model, idx = gpt(), batch()
    plan = make_plan(COSTS, OUTSIDE, 1.0)  # a plan object to apply: its choices are replaced below
    plan.layers, plan.kept_ops, plan.offloaded = layers, kept_ops or {}, []
    plan.apply(model)
    return step_peak(model, lambda: loss_of(model, idx))


_model = gpt()
_measured = measure_step(_model, lambda: loss_of(_model, batch()), modes=("full", "selective", "ops"))
COSTS, OUTSIDE, HEAD = _measured.costs, _measured.outside_bytes, _measured.head_bytes


@pytest.mark.parametrize("share", [0.05, 0.35, 0.7, 1.0])
def test_a_byte_budget_bounds_the_counted_peak_and_the_plan_predicts_it_within_2_percent(share):
    full = counted_peak({c.name: "full" for c in COSTS})
    none = counted_peak({c.name: "none" for c in COSTS})
    budget = int(full + share * (none - full))
    plan = make_plan(COSTS, OUTSIDE, budget, head_bytes=HEAD)
    counted = counted_peak(plan.layers, plan.kept_ops)
    assert counted <= budget, (share, counted, budget)
    assert plan.peak_bytes == pytest.approx(counted, rel=0.02)
    assert plan.planned_bytes < plan.peak_bytes  # the backward, not the end of the forward, is the peak here


def test_full_checkpointing_peaks_in_the_last_layer_s_backward_not_at_the_end_of_the_forward():
    full = counted_peak({c.name: "full" for c in COSTS})
    held = OUTSIDE + sum(c.full_bytes for c in COSTS)
    # The last layer's backward: the embeddings' bytes, the first five layers' inputs, and the last layer's backward.
    by_hand = (OUTSIDE - HEAD) + sum(c.full_bytes for c in COSTS[:-1]) + COSTS[-1].transient_bytes
    assert full > 2 * held
    assert by_hand == pytest.approx(full, rel=0.01)


def test_plan_checkpointing_bounds_the_peak_and_a_fraction_is_of_the_peak_without_checkpointing():
    model = gpt()
    plan = plan_checkpointing(model, lambda: loss_of(model, batch()), 0.5)
    none = counted_peak({c.name: "none" for c in COSTS})
    assert plan.baseline_peak_bytes == pytest.approx(none, rel=0.02)
    assert plan.budget_bytes == int(0.5 * plan.baseline_peak_bytes)
    assert counted_peak(plan.layers, plan.kept_ops) <= plan.budget_bytes


def _brute_force(options, need, transients):
    allowed = sum(o[0].device_bytes for o in options) - need
    fits = [c for c in itertools.product(*options)
            if held_peak([o.device_bytes for o in c], transients) <= allowed]
    return min((sum(o.flops for o in c) for c in fits), default=None)


def test_solve_with_the_backward_s_bounds_is_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(300):
        options = []
        for _ in range(4):
            none = rng.randint(50, 200)
            options.append([Option("none", none, 0)] + [Option("full", rng.randint(0, none - 1), rng.randint(1, 100))
                                                        for _ in range(2)])
        transients = [o[0].device_bytes + rng.randint(0, 150) for o in options]
        need = rng.randint(-50, 500)
        best = _brute_force(options, need, transients)
        try:
            chosen = solve(options, need, transients=transients)
        except ValueError:
            assert best is None
            continue
        assert best is not None
        assert held_peak([o.device_bytes for o in chosen], transients) <= sum(o[0].device_bytes for o in options) - need
        assert sum(o.flops for o in chosen) == best


def test_the_refusal_names_the_layer_whose_backward_sets_the_floor():
    a = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0, full_flops=50,
                  selective_flops=5)
    wide = LayerCost("wide", "Block", none_bytes=1000, full_bytes=10, selective_bytes=400, offloadable_bytes=0,
                     full_flops=500, selective_flops=50, transient_bytes=1500)
    c = LayerCost("c", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0, full_flops=50,
                  selective_flops=5)
    # Without checkpointing: the backward of `wide` has 1500 B alive while `a` holds 100 B: 1600 B.
    # At least: `a` holds its 10 B input: 1510 B.
    with pytest.raises(ValueError) as err:
        make_plan([a, wide, c], 0, 0.9)
    text = str(err.value)
    assert "at most 1.4 KiB (90.0% of the 1.6 KiB peak without checkpointing)" in text
    assert "the least reachable is 1.5 KiB (94.4%)" in text
    assert "the backward of `wide` sets that floor: it has 1.5 KiB alive at once" in text
    assert "pass a budget of at least 0.944 (or 1510 bytes)" in text
    plan = make_plan([a, wide, c], 0, 1510)
    assert plan.layers == {"a": "full", "wide": "none", "c": "none"}
    assert plan.peak_bytes == 1510
