"""The chunked LM head + loss (issue 32): the same loss and gradients as the unchunked head, no ``tokens x vocab``
tensor kept for backward, and the models it applies to (Transformers with PEFT, litgpt, the demo GPT)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt import apply_checkpointing, lm_loss, remove_checkpointing
from lightning_ckpt.core.chunked_loss import chunk_causal_lm_loss, chunk_loss_of, unchunk_causal_lm_loss

VOCAB, WIDTH = 97, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _problem(tokens: int = 26, dtype: torch.dtype = torch.float32, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(WIDTH, VOCAB, bias=bias).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    hidden = torch.randn(2, tokens // 2, WIDTH, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, tokens // 2), generator=gen)
    labels[0, :3] = -100  # padding, ignored
    labels[1, -1] = -100
    return head, hidden, labels


def _grads(loss: torch.Tensor, head: nn.Module, hidden: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in head.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, [hidden, *params]))


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 26, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_fp32_grads_equal_the_unchunked_head(chunk, bias):
    head, hidden, labels = _problem(bias=bias)
    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    ref_grads = _grads(ref, head, hidden)
    loss = lm_loss(hidden, head, labels, chunk_tokens=chunk)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    for got, want in zip(_grads(loss, head, hidden), ref_grads):
        assert _rel(got, want) <= 1e-6


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
def test_ignore_index_label_smoothing_and_num_items_in_batch(smoothing, num_items):
    """Transformers' normalisation: the sum over counted labels divided by ``num_items_in_batch`` (gradient
    accumulation counts the tokens of all micro-batches), else the mean over counted labels only."""
    head, hidden, labels = _problem()
    if num_items == "tensor":
        num_items = torch.tensor(41)
    counted = int((labels != -100).sum())
    assert counted == 22  # 26 tokens, 4 ignored
    logits = head(hidden).flatten(0, 1)
    if num_items is None:
        ref = F.cross_entropy(logits, labels.flatten(), label_smoothing=smoothing)
    else:
        ref = F.cross_entropy(logits, labels.flatten(), label_smoothing=smoothing, reduction="sum") / num_items
    loss = lm_loss(hidden, head, labels, label_smoothing=smoothing, num_items_in_batch=num_items, chunk_tokens=4)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    for got, want in zip(_grads(loss, head, hidden), _grads(ref, head, hidden)):
        assert _rel(got, want) <= 1e-6


def test_a_chunk_of_ignored_labels_only_counts_nothing():
    head, hidden, labels = _problem()
    labels[0] = -100  # the first 13 tokens, three chunks of 4 and one more, ignored
    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    assert torch.allclose(lm_loss(hidden, head, labels, chunk_tokens=4), ref, rtol=1e-6, atol=0)


def test_other_ignore_index():
    head, hidden, labels = _problem()
    labels[labels == -100] = 3
    labels[0, 5] = 3
    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=3)
    assert torch.allclose(lm_loss(hidden, head, labels, ignore_index=3, chunk_tokens=6), ref, rtol=1e-6, atol=0)


def test_bf16_error_against_fp32_no_larger_than_the_unchunked_path():
    head32, hidden32, labels = _problem(tokens=64)
    ref = F.cross_entropy(head32(hidden32).flatten(0, 1), labels.flatten())
    ref_grads = _grads(ref, head32, hidden32)
    head = copy.deepcopy(head32).to(torch.bfloat16)
    hidden = hidden32.detach().to(torch.bfloat16).requires_grad_()
    unchunked = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    chunked = lm_loss(hidden, head, labels, chunk_tokens=16)
    err_unchunked, err_chunked = abs(float(unchunked.detach()) - float(ref.detach())), abs(float(chunked.detach()) - float(ref.detach()))
    assert err_chunked <= err_unchunked
    for got, plain, want in zip(_grads(chunked, head, hidden), _grads(unchunked, head, hidden), ref_grads):
        assert _rel(got, want) <= _rel(plain, want)


def _saved_numels(fn) -> list[int]:
    """The element counts of the tensors autograd keeps for backward while ``fn`` runs (outside any checkpoint)."""
    seen: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_nothing_of_tokens_x_vocab_is_kept_for_backward():
    head, hidden, labels = _problem()
    unchunked = _saved_numels(lambda: F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten()))
    assert max(unchunked) == 26 * VOCAB  # the logits (or their log-softmax), kept by the plain head
    assert max(_saved_numels(lambda: lm_loss(hidden, head, labels, chunk_tokens=4))) <= 26 * WIDTH


def test_chunk_tokens_must_be_positive_and_shapes_match():
    head, hidden, labels = _problem()
    with pytest.raises(ValueError, match="positive"):
        lm_loss(hidden, head, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="26 hidden states and 25 labels"):
        lm_loss(hidden, head, labels.flatten()[:-1])


def test_frozen_head_gets_no_gradient_and_the_same_hidden_gradient():
    head, hidden, labels = _problem()
    head.requires_grad_(False)
    ref = torch.autograd.grad(F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten()), hidden)[0]
    loss = lm_loss(hidden, head, labels, chunk_tokens=5)
    loss.backward()
    assert head.weight.grad is None and _rel(hidden.grad, ref) <= 1e-6
