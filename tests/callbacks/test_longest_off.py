"""Issue 42, item 4: planning the longest batch before the first step can be turned off (``max_length=0``).

With a budget, the longest batch (``max_length``, else the model's own limit) is planned before the first step by
running the user's ``training_step`` (or Fabric's ``loss_fn``) on fake tensors: whatever that step keeps (a list of
losses) gets a fake tensor, which nothing can read after fit. ``max_length=0`` runs nothing before the first step;
each batch is planned as it comes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import token_batches
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from torch._subclasses import FakeTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.callbacks.fabric import FabricCheckpointing
from lightning_ckpt.demos import GPT

BLOCK = 32  # the model's limit: the longest batch is planned at 32 unless turned off
LENGTHS = [8, 16, 8]


class LossKeepingGPT(GPT):
    """The demo GPT keeping every loss its training_step returns, as a user's list of losses."""

    def __init__(self) -> None:
        super().__init__(vocab_size=32, block_size=BLOCK, n_layer=4, n_embd=32, n_head=2)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(LENGTHS)


def fit(callback: GradientCheckpointing) -> LossKeepingGPT:
    torch.manual_seed(0)
    model = LossKeepingGPT()
    trainer = Trainer(max_steps=len(LENGTHS), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(model, DataLoader(batches(), batch_size=None))
    return model


def test_max_length_0_runs_no_training_step_on_fake_tensors(caplog):
    caplog.set_level(logging.INFO)
    planned = fit(GradientCheckpointing(memory_budget=0.5))  # the default: the model's limit, planned before
    assert sum(isinstance(loss, FakeTensor) for loss in planned.losses) == 1
    assert any("on fake tensors, through your training_step" in r.getMessage() for r in caplog.records)
    caplog.clear()
    callback = GradientCheckpointing(memory_budget=0.5, max_length=0)
    model = fit(callback)
    assert len(model.losses) == len(LENGTHS) and not any(isinstance(loss, FakeTensor) for loss in model.losses)
    assert torch.stack(model.losses).isfinite().all()  # the user's list reads after fit
    assert not any("fake tensors" in r.getMessage() for r in caplog.records)
    # every batch planned as it came: the plans are those of the sizes seen, none for length 32
    assert sorted(plan_size.length for plan_size in callback.driver.cycle.sizes.values()) == [8, 16]


def test_max_length_takes_0_and_refuses_a_negative_length():
    assert GradientCheckpointing(memory_budget=0.5, max_length=0).max_length == 0
    with pytest.raises(ValueError) as info:
        GradientCheckpointing(memory_budget=0.5, max_length=-1)
    assert str(info.value) == ("`max_length` is the longest sequence the run will see, in tokens: pass an int >= 1 (or"
                               " None: the model's block_size / max_position_embeddings; or 0: plan no longest batch"
                               " before the first step), got -1.")


def test_fabric_with_max_length_0_calls_no_loss_fn_on_fake_tensors():
    calls: list[bool] = []

    def loss_fn(module, batch):
        calls.append(isinstance(batch[0], FakeTensor))
        return module(*batch)

    for max_length, fake_calls in [(None, 1), (0, 0)]:
        calls.clear()
        fabric = Fabric(accelerator="cpu", devices=1)
        ckpt = FabricCheckpointing(fabric, loss_fn=loss_fn, memory_budget=0.5, max_length=max_length)
        torch.manual_seed(0)
        gpt = GPT(vocab_size=32, block_size=BLOCK, n_layer=4, n_embd=32, n_head=2)
        model, optimizer = ckpt.setup(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1))
        for batch in batches():
            with ckpt.step(batch):
                ckpt.backward(loss_fn(model, batch))
            calls.append(False)  # the real step
        ckpt.teardown()
        assert calls.count(True) == fake_calls, (max_length, calls)
