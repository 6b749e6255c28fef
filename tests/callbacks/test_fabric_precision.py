"""Issue 42, item 7: FabricCheckpointing with a budget under a precision that arms Fabric's backward hook.

``bf16-mixed`` and ``16-mixed`` give Fabric a backward of its own, and Fabric then refuses any backward through the
model's outputs outside ``fabric.backward``. A measuring step computes the head's backward peak with
``torch.autograd.grad`` from the loss before the loop's backward, and that stopped the first step: "The current
strategy and precision selection requires you to call `fabric.backward(loss)` instead of `loss.backward()`". Also:
``measured_steps``, a public count of measuring steps, on the callback and on FabricCheckpointing.
"""

from __future__ import annotations

import pytest
import torch

from helpers import token_batches
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.callbacks.fabric import FabricCheckpointing
from lightning_ckpt.demos import GPT

# Buckets (tokens rounded up to a power of two, 4 rows): 32, 64, 32, 128, 64: three sizes measured, then covered.
LENGTHS = [8, 16, 8, 32, 16]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(LENGTHS)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=32, n_layer=4, n_embd=32, n_head=2, dropout=0.1)


def losses(precision: str, **options) -> tuple[list[torch.Tensor], FabricCheckpointing | None]:
    """The loop of the Fabric guide, with FabricCheckpointing(**options) unless ``options`` is empty; on the CPU, or
    for ``16-mixed`` on a GPU (the CPU has no fp16 autocast: Fabric takes bf16 there)."""
    fabric = Fabric(accelerator="cuda" if precision == "16-mixed" else "cpu", devices=1, precision=precision)
    model = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = FabricCheckpointing(fabric, **options) if options else None
    model, optimizer = ckpt.setup(model, optimizer) if ckpt else fabric.setup(model, optimizer)
    out = []
    torch.manual_seed(1)
    for batch in map(fabric.to_device, batches()):
        if ckpt is None:
            loss = model(*batch)
            fabric.backward(loss)
        else:
            with ckpt.step(batch):
                loss = model(*batch)
                ckpt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.detach().float().cpu())
    if ckpt is not None:
        ckpt.teardown()
    return out, ckpt


@pytest.mark.parametrize("precision", ["bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.accelerator)])
def test_a_fabric_budget_trains_under_mixed_precision_as_the_loop_without_it(precision):
    reference, _ = losses(precision)
    got, ckpt = losses(precision, memory_budget=0.5)
    # Before: RuntimeError at the first step ("requires you to call `fabric.backward(loss)`").
    assert torch.equal(torch.stack(got), torch.stack(reference)), (got, reference)
    assert ckpt.measured_steps == 3 and sorted(ckpt.plans) == [32, 64, 128]
    assert any(mode != "none" for mode in ckpt.plans[128].layers.values())


def test_fabric_backward_is_still_required_of_the_loop_itself():
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    ckpt = FabricCheckpointing(fabric, memory_budget=0.5)
    model = ckpt.setup(gpt())
    batch = batches()[0]
    with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)`"):
        with ckpt.step(batch):
            ckpt.backward(model(*batch))  # the measuring step: its own backward of the head passes
            model(*batch).backward()  # the loop's own loss.backward() is still refused


def test_the_callback_counts_its_measuring_steps():
    callback = GradientCheckpointing(memory_budget=0.5, max_length=0)
    assert callback.measured_steps == 0
    trainer = Trainer(max_steps=len(LENGTHS), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(gpt(), DataLoader(batches(), batch_size=None))
    assert callback.measured_steps == 3 and sorted(callback.plans) == [32, 64, 128]
    with pytest.raises(AttributeError):
        callback.measured_steps = 0  # read-only
