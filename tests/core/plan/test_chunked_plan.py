"""The planner and the chunked LM head + loss (issue 32): chosen under a budget only it reaches, not under a loose
one, by its price where both fit; its predicted peak against an independent count (``benchmarks/_peak.py``: the
storages alive after each op, activation gradients included)."""

from __future__ import annotations

import pytest
import torch

from helpers import counted_peak
from lightning_ckpt import plan_checkpointing
from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss, chunk_loss_of
from lightning_ckpt.demos import Transformer

VOCAB, WIDTH, LENGTH, BATCH, CHUNK = 2048, 32, 64, 4, 64
TOKENS = BATCH * LENGTH
IDX = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))


def gpt(chunk=None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(VOCAB, LENGTH, n_layer=4, n_embd=WIDTH, n_head=4, dropout=0.0)
    if chunk is not None:
        chunk_causal_lm_loss(model, chunk)
    return model


def step(model: Transformer):
    return lambda: model(IDX[:, :-1], IDX[:, 1:])


def plan_for(budget, chunk_loss):
    model = gpt(CHUNK)  # the chunk size the planner measures with: the module's own
    # priced by FLOPs: the tests compare the plans' recompute FLOPs, the head's second forward among them
    plan = plan_checkpointing(model, step(model), budget, chunk_loss=chunk_loss, time_layers=False)
    assert chunk_loss_of(model) == CHUNK  # left as it was
    return plan


def counted(plan) -> int:
    model = gpt()
    plan.apply(model)
    return counted_peak(model, step(model))


def test_a_budget_only_the_chunked_head_reaches_gets_it_and_the_count_holds_it():
    budget = 3 * 2**20  # unchunked, every layer checkpointed still peaks at 6.2 MiB (the logits: 2 MiB a copy)
    with pytest.raises(ValueError, match=r"least reachable is 6\.2 MiB"):
        plan_for(budget, chunk_loss=False)
    plan = plan_for(budget, chunk_loss=None)
    assert plan.chunk_tokens == CHUNK
    assert plan.recompute_flops >= 2 * TOKENS * WIDTH * VOCAB  # the head's forward, run again in the backward
    assert plan.baseline_peak_bytes == plan_for(1.0, chunk_loss=False).baseline_peak_bytes  # of the unchunked step
    seen = counted(plan)
    assert plan.peak_bytes <= budget and seen <= budget
    assert seen == pytest.approx(plan.peak_bytes, rel=0.05)
    assert "LM head and loss in chunks of 64 tokens" in str(plan)


def test_a_loose_budget_keeps_the_head_unchunked():
    plan = plan_for(1.0, chunk_loss=None)
    assert plan.chunk_tokens is None and plan.recompute_flops == 0
    assert set(plan.layers.values()) == {"none"}


@pytest.mark.parametrize("budget", [7 * 2**20, 5 * 2**20])
def test_where_both_fit_the_cheaper_is_kept(budget):
    plain, chunked = plan_for(budget, False) if budget > 6.3 * 2**20 else None, plan_for(budget, True)
    best = plan_for(budget, None)
    assert chunked.chunk_tokens == CHUNK
    if plain is None:  # only the chunked head fits: its plan, with the unchunked step's baselines
        assert (best.layers, best.chunk_tokens, best.peak_bytes, best.recompute_flops) == (
            chunked.layers, CHUNK, chunked.peak_bytes, chunked.recompute_flops)
    else:
        assert best.recompute_flops == min(plain.recompute_flops, chunked.recompute_flops)
        assert best.chunk_tokens == (CHUNK if chunked.recompute_flops < plain.recompute_flops else None)


def test_the_chunked_head_removes_the_logits_from_the_counted_peak_and_is_predicted_within_5_percent():
    plain, chunked = plan_for(1.0, chunk_loss=False), plan_for(1.0, chunk_loss=True)
    seen_plain, seen_chunked = counted(plain), counted(chunked)
    logits = TOKENS * VOCAB * 4  # fp32, 2 MiB: the unchunked step holds the logits and their log-softmax
    assert seen_chunked <= seen_plain - 2 * logits
    assert chunked.recompute_flops == 2 * TOKENS * WIDTH * VOCAB  # no layer recomputed: the head's forward, once
    assert seen_plain == pytest.approx(plain.peak_bytes, rel=0.05)
    assert seen_chunked == pytest.approx(chunked.peak_bytes, rel=0.05)
    print(f"counted {seen_plain} -> {seen_chunked} B; predicted {plain.peak_bytes} -> {chunked.peak_bytes} B")


def test_chunk_loss_true_on_a_model_without_a_known_loss_plans_as_before_and_says_so(caplog):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    x = torch.randn(4, 8)
    with caplog.at_level("INFO", logger="lightning_ckpt"):
        plan = plan_checkpointing(model, lambda: model(x).square().mean(), 1.0, layer_cls=torch.nn.Linear,
                                  chunk_loss=True)
    assert plan.chunk_tokens is None and "found no loss it can chunk in Sequential" in caplog.text
    with pytest.raises(TypeError, match="chunk_loss"):
        plan_checkpointing(model, lambda: model(x).sum(), 1.0, layer_cls=torch.nn.Linear, chunk_loss="auto")
