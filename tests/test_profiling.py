"""The byte counter itself: it counts what autograd saves and keeps nothing alive."""

from __future__ import annotations

import gc
import weakref

import torch

from lightning_ckpt.profiling import SavedTensorCounter


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
