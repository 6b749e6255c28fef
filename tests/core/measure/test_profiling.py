"""The counters themselves: bytes saved for backward (counting keeps nothing alive) and the FLOPs of a recompute."""

from __future__ import annotations

import gc
import inspect
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

from lightning_ckpt.core.measure.profiling import SAC_HOOKS_WARNING, OpCostMode, SavedTensorCounter, count_flops
from lightning_ckpt.core.plan.planner import plan_checkpointing

aten = torch.ops.aten


def test_counting_keeps_no_saved_output_alive():
    """tanh saves its own output: a counter that handed back the same tensor would make a cycle through grad_fn."""
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorCounter() as saved:
        y = torch.tanh(x)
    assert saved.bytes == 4000
    y.sum().backward(retain_graph=True)
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x) ** 2)
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None


def test_a_storage_freed_then_made_again_at_its_address_is_counted_again():
    """The GPU run of the accelerator tests counted 4 of 48 offloaded layer inputs: the caching allocator put each new
    input where a freed one had been, and the counter keyed storages by address. Here the CPU allocator reuses the
    address of a freed 4,000-byte output; each of the saved outputs is counted (by hand: n x 1000 float32). The
    allocator promises no reuse, so the loop runs until it has reused one (it did within 3 in most runs, not all)."""
    pointers: list[int] = []
    with SavedTensorCounter() as saved:
        while len(pointers) < 64 and len(set(pointers)) == len(pointers):
            x = torch.randn(1000, requires_grad=True)
            y = x.exp()  # saves its output
            pointers.append(y.data_ptr())
            y.sum().backward()
            del x, y
    assert len(set(pointers)) < len(pointers), "the allocator gave each output a new address: nothing shown here"
    assert saved.bytes == len(pointers) * 4000


def test_an_outer_counter_still_sees_what_an_inner_one_counts():
    """Saved-tensor hooks do not nest (the innermost pair wins); the inner counter reports what it saw."""
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorCounter() as outer:
        with SavedTensorCounter() as inner:
            y = torch.tanh(x)
        z = torch.tanh(y)
    assert inner.bytes == 4000
    assert outer.bytes == 8000  # y (saved by tanh inside) and z, once each
    assert z.requires_grad


class ExpTanh(nn.Module):
    """Element-wise ops only: what torch's ``FlopCounterMode`` counts as free, yet a recompute runs them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.exp(x))


def test_element_wise_ops_cost_one_flop_per_output_element():
    x = torch.randn(4, 8, requires_grad=True)
    layer = ExpTanh()
    assert count_flops(lambda: layer(x)) == 0  # torch's counter: no formula for them
    with OpCostMode() as cost:
        layer(x)
    assert all(flops == 0 for flops, op in cost.log if op.is_view)  # e.g. the detach of a saved output
    assert [(flops, op.overloadpacket) for flops, op in cost.log if not op.is_view] == [(32, aten.exp), (32, aten.tanh)]
    assert cost.total == 64


def test_the_plan_prices_recomputing_element_wise_layers():
    """Two element-wise layers; each holds its exp and tanh outputs un-checkpointed (2 x 128 bytes), its input fully
    checkpointed (128 bytes). The second one's backward has 5 x 128 + 8 bytes alive at once (its input, exp and tanh
    outputs and the two gradients it makes; its output's gradient is the sum's expanded scalar, made inside the
    backward as in the step, 8 B in the re-run) while the first holds 256 bytes, or 128 checkpointed: a budget of 896
    bytes means the first fully checkpointed, its exp and tanh (32 elements each) recomputed."""
    torch.manual_seed(0)
    model = nn.Sequential(ExpTanh(), ExpTanh())
    x = torch.randn(4, 8, requires_grad=True)
    plan = plan_checkpointing(model, lambda: model(x).sum(), 896, layer_cls=ExpTanh, modes=("full",))
    assert plan.baseline_bytes == 2 * 256 and [c.backward_peak for c in plan.costs][1] == 5 * 128 + 8
    assert plan.layers == {"0": "full", "1": "none"} and plan.peak_bytes == 128 + 5 * 128 + 8
    assert plan.recompute_flops == 32 + 32


@pytest.mark.skipif("respect_saved_tensors_hooks" not in inspect.signature(torch.utils.checkpoint.checkpoint).parameters,
                    reason="this torch has no such warning (it came with respect_saved_tensors_hooks, torch 2.14)")
def test_counting_a_selective_region_does_not_print_torch_s_hooks_warning_and_a_user_s_hooks_still_do():
    from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
    from lightning_ckpt.demos import Block

    torch.manual_seed(0)
    model = nn.Sequential(Block(16, 2), Block(16, 2))
    apply_checkpointing(model, layer_cls=Block, mode="selective")
    x = torch.randn(2, 8, 16)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        with SavedTensorCounter(exclude=model.parameters()) as counted:
            model(x).sum().backward()
    assert [str(w.message) for w in ours if issubclass(w.category, FutureWarning)] == []
    assert counted.bytes > 0
    with warnings.catch_warnings(record=True) as users:
        warnings.simplefilter("always")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(x).sum().backward()
    assert any(re.match(SAC_HOOKS_WARNING, str(w.message)) for w in users)  # not silenced outside our counter
