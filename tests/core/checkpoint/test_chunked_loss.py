"""The chunked LM head + loss (issue 32): the same loss and gradients as the unchunked head, no ``tokens x vocab``
tensor kept for backward, and the models it applies to (Transformers with PEFT, litgpt, the demo GPT)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt import apply_checkpointing, lm_loss, remove_checkpointing
from lightning_ckpt.core.checkpoint.chunked_loss import (
    chunk_causal_lm_loss,
    chunk_loss_of,
    chunked_models,
    head_of,
    in_lm_loss,
    unchunk_causal_lm_loss,
)

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
    with pytest.raises(ValueError) as info:
        lm_loss(hidden, head, labels.flatten()[:-1])
    assert str(info.value) == ("`lm_loss` got 26 hidden states and 25 labels. Pass one label per hidden state: labels"
                               " [batch, seq] for hidden [batch, seq, width], shifted as for the loss (hidden[:, :-1]"
                               " with labels[:, 1:]).")


def test_no_tokens_give_the_mean_of_nothing_and_a_zero_sum_over_num_items():
    head = nn.Linear(WIDTH, VOCAB)
    hidden, labels = torch.randn(0, WIDTH, requires_grad=True), torch.zeros(0, dtype=torch.long)
    # as cross_entropy: the mean over no labels is 0 / 0
    assert torch.isnan(lm_loss(hidden, head, labels)) and torch.isnan(F.cross_entropy(head(hidden), labels))
    summed = lm_loss(hidden, head, labels, num_items_in_batch=4)  # a micro-batch of padding only: 0 / 4
    assert summed.item() == 0.0
    summed.backward()  # in the graph, so a step of only padding runs its backward
    assert hidden.grad.shape == (0, WIDTH)


@pytest.mark.accelerator
def test_labels_and_num_items_on_the_host_are_moved_to_the_device_of_the_hidden_states():
    head, hidden, labels = _problem()
    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum") / 41
    device = torch.device("cuda")
    # the labels as a host dataloader gives them, num_items_in_batch a 1-element host tensor (not a 0-D one, which
    # torch would take as a scalar on any device)
    loss = lm_loss(hidden.detach().to(device), copy.deepcopy(head).to(device), labels,
                   num_items_in_batch=torch.tensor([41]), chunk_tokens=4)
    assert loss.device.type == "cuda" and torch.allclose(loss.cpu(), ref.detach(), rtol=1e-5, atol=0)


class _Recording(nn.Module):
    """A head that records, at each call, whether lm_loss's chunk is running it."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(in_lm_loss())
        return self.head(x)


def test_in_lm_loss_is_true_exactly_while_a_chunk_runs_its_head():
    head, hidden, labels = _problem()
    recording = _Recording(head)
    assert not in_lm_loss()
    loss = lm_loss(hidden, recording, labels, chunk_tokens=10)  # 26 tokens: chunks of 10, 10 and 6
    assert recording.seen == [True] * 3 and not in_lm_loss()
    loss.backward()  # each chunk's head recomputed, inside its chunk again
    assert recording.seen == [True] * 6 and not in_lm_loss()
    lm_loss(hidden, recording, labels, chunk_tokens=26)  # a second loss starts from nothing running
    recording(hidden)  # the head called by its model, outside lm_loss
    assert recording.seen[6:] == [True, False] and not in_lm_loss()


def test_frozen_head_gets_no_gradient_and_the_same_hidden_gradient():
    head, hidden, labels = _problem()
    head.requires_grad_(False)
    ref = torch.autograd.grad(F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten()), hidden)[0]
    loss = lm_loss(hidden, head, labels, chunk_tokens=5)
    loss.backward()
    assert head.weight.grad is None and _rel(hidden.grad, ref) <= 1e-6


# ------------------------------------------------------------------------------------------------ the models


def _saved_shapes(fn) -> tuple[object, list[tuple[int, ...]]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _vocab_shaped(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The saved tensors with a vocabulary dimension that are not the head's weight: logits, log-softmax."""
    return [s for s in shapes if VOCAB in s and s != (VOCAB, WIDTH) and s != (VOCAB,)]


def _llama(peft_targets=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if peft_targets is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets,
                                                           init_lora_weights=False, task_type="CAUSAL_LM"))
    return model.train()


def _ids(tokens: int = 12):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, tokens), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _trainable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("peft_targets", [None, ["q_proj", "v_proj"], ["q_proj", "lm_head"]],
                         ids=["llama", "peft lora, frozen head", "peft lora on the head"])
@pytest.mark.parametrize("num_items", [None, 9])
def test_transformers_causal_lm_with_labels_trains_the_same_without_logits(peft_targets, num_items):
    reference = _llama(peft_targets)
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ref_out = reference(input_ids=ids, labels=labels, **extra)
    ref_out.loss.backward()
    assert apply_checkpointing(model, chunk_loss=True)  # the decoder layers, and the loss
    assert chunk_causal_lm_loss(model, chunk_tokens=5)  # 24 tokens: 5 chunks, the last of 4
    out, shapes = _saved_shapes(lambda: model(input_ids=ids, labels=labels, **extra))
    assert not _vocab_shaped(shapes)
    assert out.logits is None
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-6, atol=0)
    out.loss.backward()
    want, got = _trainable_grads(reference), _trainable_grads(model)
    assert got.keys() == want.keys() and any("lm_head" in n for n in got) == (peft_targets != ["q_proj", "v_proj"])
    for name in want:
        assert _rel(got[name], want[name]) <= 1e-6, name
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False, **extra)
    assert as_tuple[1] is None and torch.allclose(as_tuple[0], ref_out.loss, rtol=1e-6, atol=0)
    # without labels, the model's own forward: the logits
    assert model(input_ids=ids).logits.shape == (2, 12, VOCAB)
    remove_checkpointing(model)
    inner = model.get_base_model() if peft_targets is not None else model
    assert "forward" not in inner.__dict__ and chunk_loss_of(inner) is None


def test_transformers_model_changing_logits_before_the_loss_is_refused():
    model = _llama()
    chunk_causal_lm_loss(model)
    ids, labels = _ids()
    # as Cohere's logit_scale or Gemma-2's soft-capping: what reaches the loss is not what the head returned
    model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError) as info:
        model(input_ids=ids, labels=labels)
    assert str(info.value) == (
        "lightning_ckpt: chunk_loss cannot chunk LlamaForCausalLM's loss: its forward changes the logits between the"
        " head and the loss (soft-capping or scaling). Pass chunk_loss=False for this model: its loss then stays whole.")
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__  # both restored


def test_transformers_shift_labels_given_to_the_forward_are_the_loss_s_labels():
    """Packed or context-parallel batches pass ``shift_labels``, already shifted: Transformers' loss takes them as they
    are, and so must the chunked one (shifting ``labels`` again would train on other targets)."""
    reference = _llama()
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    shift_labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(2))
    shift_labels[1, 7:] = -100
    with torch.no_grad():
        logits = reference(input_ids=ids).logits
    # by hand: token t's logits against shift_labels[t], the 12 + 7 = 19 labels that are not -100
    by_hand = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
    assert int((shift_labels != -100).sum()) == 19
    assert not torch.allclose(by_hand, F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))
    chunk_causal_lm_loss(model, chunk_tokens=5)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels, shift_labels=shift_labels).loss
    assert torch.allclose(loss, by_hand, rtol=1e-6, atol=0)


def _chunked_head_calls(model: nn.Module, fn) -> int:
    """How many times ``fn`` runs ``model``'s LM head inside lm_loss's chunks (the forward's, not the recompute's)."""
    calls = []
    handle = head_of(model).register_forward_hook(lambda *_: calls.append(in_lm_loss()))
    try:
        with torch.no_grad():
            fn()
    finally:
        handle.remove()
    return sum(calls)


def test_transformers_chunks_of_the_size_asked_any_way_the_forward_is_called():
    reference = _llama()
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=labels)
        ref_tuple = reference(input_ids=ids, labels=labels, return_dict=False)
    assert chunk_causal_lm_loss(model, chunk_tokens=5) == [""] and chunk_loss_of(model) == 5
    # 2 x 12 tokens in chunks of 5: 5 chunks (the last of 4)
    assert _chunked_head_calls(model, lambda: model(input_ids=ids, labels=labels)) == 5
    with torch.no_grad():
        # labels passed by position (input_ids, attention_mask, position_ids, the cache, inputs_embeds, labels)
        positional = model(ids, None, None, None, None, labels)
        keyword = model(ids, labels=labels)
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        logits = model(ids).logits  # no labels, by position: the model's own forward
    for out in (positional, keyword):
        assert out.logits is None and torch.allclose(out.loss, ref.loss, rtol=1e-6, atol=0)
    assert len(as_tuple) == len(ref_tuple) == 3 and as_tuple[1] is None  # (loss, logits, cache): the cache kept
    assert torch.equal(logits, ref.logits)
    assert unchunk_causal_lm_loss(model) == [""] and chunk_loss_of(model) is None


def test_transformers_ignore_index_given_to_the_forward_reaches_the_chunked_loss():
    reference = _llama()
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    labels[labels == -100] = 3  # padding marked 3, as a tokenizer whose pad id is 3 would
    with torch.no_grad():
        logits = reference(input_ids=ids).logits
    # by hand: token t predicts labels[t + 1], the labels that are 3 not counted
    by_hand = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=3)
    chunk_causal_lm_loss(model, chunk_tokens=5)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels, ignore_index=3).loss
    assert torch.allclose(loss, by_hand, rtol=1e-6, atol=0)


def test_transformers_model_keeps_its_own_forward_loss_function_and_head_forward():
    """Forwards set on the instance (accelerate's hooks, a user's wrapper) and a loss_function the user set: the chunked
    call runs through them, and each is given back as it was."""
    reference = _llama()
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    calls = {"forward": 0, "head": 0}
    class_forward, class_head_forward = model.forward, model.lm_head.forward

    def own_forward(*args, **kwargs):
        calls["forward"] += 1
        return class_forward(*args, **kwargs)

    def own_head_forward(hidden):
        calls["head"] += 1
        return class_head_forward(hidden)

    def own_loss(*args, **kwargs):
        raise AssertionError("the chunked loss replaces the model's loss function while it runs")

    model.forward, model.lm_head.forward, model.loss_function = own_forward, own_head_forward, own_loss
    chunk_causal_lm_loss(model, chunk_tokens=5)
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=labels).loss
        loss = model(input_ids=ids, labels=labels).loss
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    assert calls == {"forward": 1, "head": 5}  # the model's forward once; its head's for each of the 5 chunks
    assert model.lm_head.__dict__["forward"] is own_head_forward and model.__dict__["_loss_function"] is own_loss
    unchunk_causal_lm_loss(model)
    assert model.__dict__["forward"] is own_forward


def test_logits_changed_by_reads_the_config_and_its_text_config_and_takes_0_for_off():
    from types import SimpleNamespace

    from lightning_ckpt.core.checkpoint.chunked_loss import logits_changed_by

    def model(config=None) -> nn.Module:
        module = nn.Linear(2, 2)
        if config is not None:
            module.config = config
        return module

    assert logits_changed_by(model()) is None  # no config at all (the demo GPT, a plain module)
    assert logits_changed_by(model(SimpleNamespace(final_logit_softcapping=30.0))) == "final_logit_softcapping=30.0"
    assert logits_changed_by(model(SimpleNamespace(final_logit_softcapping=0, logit_scale=1.0))) is None  # off, same
    assert logits_changed_by(model(SimpleNamespace(logit_scale=0.5))) == "logit_scale=0.5"
    # a multimodal config: the field is on its text config (Transformers' get_text_config)
    text = SimpleNamespace(final_logit_softcapping=30.0)
    composite = SimpleNamespace(get_text_config=lambda: text)
    assert logits_changed_by(model(composite)) == "final_logit_softcapping=30.0"


def test_a_model_with_an_lm_head_that_is_neither_transformers_nor_litgpt_is_left_as_it_is():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(WIDTH, VOCAB)

        def forward(self, hidden):
            return self.lm_head(hidden)

    model = Custom()
    assert chunked_models(model) == [] and chunk_causal_lm_loss(model) == []
    assert "forward" not in model.__dict__ and chunk_loss_of(model) is None
    llama = _llama(["q_proj", "v_proj"])  # PEFT: the causal LM inside its wrappers
    assert chunked_models(llama) == ["base_model.model"] and head_of(llama.get_base_model()) is llama.get_base_model().lm_head


def test_litgpt_gpt_with_targets_returns_the_same_loss_without_logits():
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    reference = litgpt.GPT(litgpt.Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                                         block_size=16, bias=True))
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    ref = F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten())
    ref.backward()
    assert apply_checkpointing(model, chunk_loss=True) and chunk_causal_lm_loss(model, chunk_tokens=7) == [""]
    loss, shapes = _saved_shapes(lambda: model(ids, targets=labels))
    assert not _vocab_shaped(shapes)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    loss.backward()
    want, got = _trainable_grads(reference), _trainable_grads(model)
    for name in want:
        assert _rel(got[name], want[name]) <= 1e-6, name
    assert model(ids).shape == (2, 12, VOCAB)


def test_litgpt_gpt_chunks_of_the_size_asked_through_its_own_forward_and_without_targets_is_itself():
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    reference = litgpt.GPT(litgpt.Config(n_layer=1, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                                         block_size=16, bias=True))
    model = copy.deepcopy(reference)
    ids, labels = _ids()
    calls = [0]
    class_forward = model.forward

    def own_forward(*args, **kwargs):
        calls[0] += 1
        return class_forward(*args, **kwargs)

    model.forward = own_forward
    assert chunk_causal_lm_loss(model, chunk_tokens=7) == [""]
    # 24 tokens in chunks of 7: 4 chunks, through the instance's own forward once
    assert _chunked_head_calls(model, lambda: model(ids, targets=labels)) == 4 and calls[0] == 1
    with torch.no_grad():
        split = model(ids, lm_head_chunk_size=4)  # litgpt's own keyword, no targets: its own forward, as given
        assert isinstance(split, list) and len(split) == 3
        assert torch.equal(torch.cat(split, dim=1), reference(ids))
    assert unchunk_causal_lm_loss(model) == [""] and model.__dict__["forward"] is own_forward


def test_litgpt_gpt_soft_capping_its_logits_is_refused_and_left_as_it_was():
    """Gemma-2 style ``final_logit_softcapping``: litgpt caps the head's logits before returning them, so the hidden
    states through the head are not what the loss would see; chunking them would train on uncapped logits."""
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    model = litgpt.GPT(litgpt.Config(n_layer=1, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                                     block_size=16, bias=True, final_logit_softcapping=2.0))
    ids, labels = _ids()
    logits = model(ids)
    assert float(logits.detach().abs().max()) < 2.0  # capped: 2 tanh(x / 2)
    chunk_causal_lm_loss(model, chunk_tokens=5)
    with pytest.raises(RuntimeError, match="changes the logits between the head and the loss") as info:
        model(ids, targets=labels)
    assert str(info.value).startswith("lightning_ckpt: chunk_loss cannot chunk GPT's loss: its forward changes the"
                                      " logits between the head and the loss (soft-capping or scaling). Pass"
                                      " chunk_loss=False for this model: its loss then stays whole.")
    assert "forward" not in model.lm_head.__dict__  # the head is given back
    assert torch.equal(model(ids), logits)  # without targets: the model's own forward, capped


@pytest.mark.parametrize("chunked", [False, True])
def test_demo_gpt_training_step_loss(chunked):
    from lightning_ckpt.demos import GPT

    torch.manual_seed(0)
    reference = GPT(vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=WIDTH, n_head=2, dropout=0.0)
    module = copy.deepcopy(reference)
    ids, labels = _ids()
    ref = F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten())
    ref.backward()
    apply_checkpointing(module, chunk_loss=chunked)
    if chunked:
        assert chunk_causal_lm_loss(module, chunk_tokens=5) == ["model"]
        assert "forward" not in module.model.__dict__ and chunk_loss_of(module.model) == 5  # it reads its chunk itself
        assert head_of(module.model) is module.model.head
    loss, shapes = _saved_shapes(lambda: module.training_step((ids, labels), 0))
    assert bool(_vocab_shaped(shapes)) is not chunked
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    loss.backward()
    want, got = _trainable_grads(reference), _trainable_grads(module)
    for name in want:
        assert _rel(got[name], want[name]) <= 1e-6, name


def test_unsupported_model_keeps_its_loss_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr("lightning_ckpt.core.checkpoint.say_once._said", set())  # said once per process: whatever ran before
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with caplog.at_level("INFO", logger="lightning_ckpt"):
        apply_checkpointing(model, layer_cls=nn.Linear, chunk_loss=True)
    assert "found no loss it can chunk in Sequential" in caplog.text
    assert unchunk_causal_lm_loss(model) == []


@pytest.mark.parametrize("chunk_loss", [True, False, None])
def test_the_callback_chunks_the_loss_only_when_asked_and_undoes_it(chunk_loss):
    from lightning.pytorch import Trainer

    from lightning_ckpt import GradientCheckpointing
    from lightning_ckpt.core.checkpoint.chunked_loss import DEFAULT_CHUNK_TOKENS
    from lightning_ckpt.demos import GPT

    module = GPT(vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=WIDTH, n_head=2)
    callback = GradientCheckpointing(chunk_loss=chunk_loss)
    callback.setup(Trainer(logger=False, accelerator="cpu", devices=1), module, "fit")
    module.configure_model()  # the demo GPT has one: the callback applies right after it, as under a Trainer
    assert chunk_loss_of(module.model) == (DEFAULT_CHUNK_TOKENS if chunk_loss else None)
    callback.teardown(None, module, "fit")
    assert chunk_loss_of(module.model) is None
    with pytest.raises(TypeError, match="chunk_loss"):
        GradientCheckpointing(chunk_loss="yes")


def test_under_bf16_autocast_the_head_weight_gradient_is_as_far_from_fp32_as_the_unchunked_one():
    """Under autocast each chunk's weight gradient is a bf16 product. Summed in the weight's fp32 (each chunk casts
    the weight outside autocast's cache) its error against fp32 is the unchunked head's, on average over six seeds
    (64 tokens in 8 chunks: 3.08e-3 against 3.13e-3); summed in bf16 through one cached copy it was 4.54e-3. The loss
    and every other gradient are the unchunked path's."""
    import transformers

    plain_errors, chunked_errors = [], []
    for seed in range(6):
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(seed)
        reference = transformers.LlamaForCausalLM(config).train()
        ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed + 10))
        model, fp32 = copy.deepcopy(reference), copy.deepcopy(reference)
        with torch.autocast("cpu", torch.bfloat16):
            plain = reference(input_ids=ids, labels=ids).loss
        plain.backward()
        chunk_causal_lm_loss(model, chunk_tokens=8)
        with torch.autocast("cpu", torch.bfloat16):
            chunked = model(input_ids=ids, labels=ids).loss
        chunked.backward()
        fp32(input_ids=ids, labels=ids).loss.backward()
        assert torch.allclose(chunked, plain, rtol=1e-6, atol=0)
        want, got, exact = _trainable_grads(reference), _trainable_grads(model), _trainable_grads(fp32)
        assert all(_rel(got[n], want[n]) <= 1e-6 for n in want if n != "lm_head.weight")
        plain_errors.append(_rel(want["lm_head.weight"], exact["lm_head.weight"]))
        chunked_errors.append(_rel(got["lm_head.weight"], exact["lm_head.weight"]))
    assert sum(chunked_errors) <= sum(plain_errors)
