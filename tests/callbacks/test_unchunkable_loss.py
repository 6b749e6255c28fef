"""Issue 42, item 2: a model whose loss cannot be chunked (Gemma 2's final logit soft-capping) under a budget.

``chunk_loss=None`` lets a budget's plan chunk the LM head and loss; a model that changes its logits between the head
and the loss cannot be chunked (the chunks take the head's output as the logits). Before, the fake step of the
longest batch failed on it ("could not measure the longest batch ... the budget is checked on each batch as it comes",
which was false) and the first step stopped with "chunk_loss cannot chunk Gemma2ForCausalLM's loss". Now ``None``
means whole for such a model, said once; ``True`` is refused before anything is trained.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.chunked_loss import LossNotChunkable, chunked_models, logits_changed_by
from lightning_ckpt.core.plan.planner import plan_checkpointing

transformers = pytest.importorskip("transformers")

VOCAB, LONGEST = 128, 64
LENGTHS = [16, 32, 24, 32]


def gemma2(softcapping: float | None = 30.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       max_position_embeddings=LONGEST, final_logit_softcapping=softcapping,
                                       attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(config).train()


class Gemma2(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gemma2()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        if not isinstance(loss, torch._subclasses.FakeTensor):
            self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(callbacks: list) -> Gemma2:
    data = [torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(i))
            for i, length in enumerate(LENGTHS)]
    module = Gemma2()
    trainer = Trainer(max_steps=len(data), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, DataLoader(data, batch_size=None))
    return module


def test_gemma2_s_soft_capping_is_known_before_running():
    assert logits_changed_by(gemma2()) == "final_logit_softcapping=30.0"
    assert logits_changed_by(gemma2(softcapping=None)) is None
    assert chunked_models(gemma2()) == [] and chunked_models(gemma2(softcapping=None)) == [""]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_budget_with_chunk_loss_none_trains_gemma2_unchunked_said_once(caplog):
    reference = fit([])
    caplog.set_level(logging.INFO)
    callback = GradientCheckpointing(memory_budget=0.5)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        module = fit([callback])
    assert not [w for w in warned if "GradientCheckpointing" in str(w.message)], [str(w.message) for w in warned]
    said = [r.getMessage() for r in caplog.records if "stays whole" in r.getMessage()]
    assert said == ["GradientCheckpointing: chunk_loss=None: Gemma2ForCausalLM's loss stays whole: its"
                    " final_logit_softcapping=30.0 changes the logits between the LM head and the loss, which a head"
                    " run in chunks cannot reproduce."]
    assert callback.plans and all(plan.chunk_tokens is None for plan in callback.plans.values())
    assert any(mode != "none" for plan in callback.plans.values() for mode in plan.layers.values())
    # the longest batch was planned before the first step (nothing failed there), and training is unchanged
    assert any("the budget holds the longest batch" in r.getMessage() for r in caplog.records)
    assert torch.equal(torch.stack(module.losses), torch.stack(reference.losses))


def test_chunk_loss_true_on_gemma2_is_refused_before_anything_is_trained():
    callback = GradientCheckpointing(memory_budget=0.5, chunk_loss=True)
    with pytest.raises(LossNotChunkable, match="Pass chunk_loss=False for this model") as info:
        fit([callback])
    assert "Gemma2ForCausalLM's loss: its forward changes the logits between the head and the loss" in str(info.value)


def test_plan_checkpointing_keeps_gemma2_s_loss_whole(caplog):
    caplog.set_level(logging.INFO)
    model = gemma2()
    batch = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    plan = plan_checkpointing(model, lambda: model(input_ids=batch, labels=batch).loss, 0.5, chunk_loss=None)
    assert plan.chunk_tokens is None
    assert any("chunk_loss=None: Gemma2ForCausalLM's loss stays whole" in r.getMessage() for r in caplog.records)


class ScaledLlama(LightningModule):
    """A Transformers Llama whose head's output is doubled by a hook: its config says nothing of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=LONGEST)
        self.model = transformers.LlamaForCausalLM(config).train()
        self.model.lm_head.register_forward_hook(lambda module, args, out: out * 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_loss_found_unchunkable_on_the_fake_step_stays_whole_said_once(caplog):
    caplog.set_level(logging.INFO)
    callback = GradientCheckpointing(memory_budget=0.5)
    data = [torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(i))
            for i, length in enumerate(LENGTHS)]
    trainer = Trainer(max_steps=len(data), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(ScaledLlama(), DataLoader(data, batch_size=None))
    assert trainer.global_step == len(LENGTHS)
    said = [r.getMessage() for r in caplog.records if "stays whole" in r.getMessage()]
    assert said == ["GradientCheckpointing: chunk_loss=None: LlamaForCausalLM's loss stays whole: its forward changes"
                    " the logits between the LM head and the loss, which a head run in chunks cannot reproduce."]
    assert all(plan.chunk_tokens is None for plan in callback.plans.values())
    assert not any("could not measure the longest batch" in r.getMessage() for r in caplog.records)
