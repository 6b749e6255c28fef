"""A step measured on fake tensors holds what the same step holds on real tensors, on the client libraries' models.

This is the canary for a new release of Transformers (or litgpt): when a fake-tensor step starts to take another path
than a real one (Transformers 5 took a fake tensor for tracing and built the [B, 1, T, T] causal mask that a real step
leaves to SDPA's ``is_causal``), these tests fail first, naming the family, the length and the bytes, instead of a
budget being refused in some other test.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from lightning_ckpt.core.measure.layer_costs import measure_step
from lightning_ckpt.core.measure.longest import measure_fake_step
from lightning_ckpt.core.plan.planner import make_plan

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, use_cache=False)


def _hf(name: str, **extra) -> torch.nn.Module:
    config = getattr(transformers, f"{name}Config")(**SMALL, **extra)
    return getattr(transformers, f"{name}ForCausalLM")(config)


def _litgpt() -> torch.nn.Module:
    from litgpt import GPT, Config

    return GPT(Config(block_size=256, vocab_size=96, padded_vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                      intermediate_size=64))


FAMILIES = {
    "llama": lambda: _hf("Llama", attn_implementation="sdpa"),
    "llama-eager": lambda: _hf("Llama", attn_implementation="eager"),
    "qwen2": lambda: _hf("Qwen2", attn_implementation="sdpa"),
    "qwen3": lambda: _hf("Qwen3", attn_implementation="sdpa", head_dim=8),
    "mistral-sliding-window": lambda: _hf("Mistral", attn_implementation="sdpa", sliding_window=32),
    "gemma2": lambda: _hf("Gemma2", head_dim=8, sliding_window=32, query_pre_attn_scalar=8),
    "litgpt": _litgpt,
}


def _batch(family: str, length: int, padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(length))
    if family == "litgpt":
        return {"idx": ids}
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length // 2:] = 0
        batch["attention_mask"] = mask
    return batch


def _step(model: torch.nn.Module, family: str):
    if family == "litgpt":
        def litgpt_loss(batch):
            logits = model(batch["idx"])
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["idx"][:, 1:].flatten())
        return litgpt_loss
    return lambda batch: model(**batch).loss


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_fake_step_holds_what_the_real_step_holds(family, padded):
    if padded and family == "litgpt":
        pytest.skip("litgpt's GPT takes no attention mask")
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.train()
    step = _step(model, family)
    for length in (24, 64, 160):  # below, at twice and at five times Mistral's and Gemma2's window of 32
        batch = _batch(family, length, padded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fake = measure_fake_step(model, step, batch)
            real = measure_step(model, lambda: step(batch), outside_ops=False)
        fake_plan = make_plan(fake.costs, fake.outside_bytes, 1.0, head_bytes=fake.head_bytes,
                              head_peak_bytes=fake.head_peak_bytes)
        real_plan = make_plan(real.costs, real.outside_bytes, 1.0, head_bytes=real.head_bytes,
                              head_peak_bytes=real.head_peak_bytes)
        where = (f"{family} ({'padded' if padded else 'unpadded'}) at {length} tokens, transformers "
                 f"{transformers.__version__}, torch {torch.__version__}")
        assert fake.outside_bytes == real.outside_bytes, (
            f"{where}: a fake-tensor step holds {fake.outside_bytes:,} B outside the layers, a real one"
            f" {real.outside_bytes:,} B: the library takes another path on fake tensors (see core/measure/fake_values.py)")
        assert fake.costs == real.costs, f"{where}: the layers' costs differ between fake and real tensors"
        assert (fake.head_bytes, fake.head_peak_bytes) == (real.head_bytes, real.head_peak_bytes), where
        assert fake_plan.peak_bytes == real_plan.peak_bytes, where


def test_without_the_real_branches_transformers_5_counts_a_mask_the_real_step_never_builds(monkeypatch):
    """The bytes the fix removes, by hand: without it, a Llama's unpadded fake step on transformers 5 builds the
    causal mask a real step leaves to SDPA's ``is_causal``: [2, 1, T, T] bool (one byte each), which both layers take,
    so it is held outside them; each layer's attention also holds more for backward."""
    from lightning_ckpt.core.measure import fake_values

    if not hasattr(__import__("transformers.utils.import_utils", fromlist=["x"]), "is_fake_tensor"):
        pytest.skip("transformers 4.x takes no fake tensor for tracing")
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    model.train()
    step = _step(model, "llama")
    batch = _batch("llama", 64, padded=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        right = measure_fake_step(model, step, batch)
        monkeypatch.setattr(fake_values, "untraced_fakes", lambda: __import__("contextlib").nullcontext())
        wrong = measure_fake_step(model, step, batch)
    assert wrong.outside_bytes - right.outside_bytes == 2 * 1 * 64 * 64
    assert all(w.none_bytes > r.none_bytes for w, r in zip(wrong.costs, right.costs))


def test_without_a_cache_transformers_4_hands_sdpa_a_t_by_t_mask_where_5_hands_it_is_causal(monkeypatch):
    """What the Transformers guide tells long-sequence users: with the cache off (as while layers are checkpointed)
    and no attention mask, 4.x makes the packed-sequence mask from the position ids on every step, a [B, 1, T, T]
    bool mask, where 5.x passes SDPA ``is_causal``. The plan counts either, as the step runs."""
    handed = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        handed.append((None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype), is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = FAMILIES["llama"]()  # use_cache=False, two layers
    model(torch.randint(0, 96, (1, 64)))
    if int(transformers.__version__.split(".")[0]) < 5:
        assert handed == [(((1, 1, 64, 64), torch.bool), False)] * 2, transformers.__version__
    else:
        assert handed == [(None, True)] * 2, transformers.__version__


@pytest.mark.parametrize("family", ["llama", "gemma2", "litgpt"])
def test_lean_layers_hold_on_fake_tensors_what_they_hold_on_real_ones_and_less_than_before(family):
    """``lean_layers`` (norms under nested checkpoint, the gated MLP through its own autograd Function) is measured on
    fake tensors as it runs on real ones; its plan's peak is below the same model's without it."""
    from lightning_ckpt.core.checkpoint.lean import apply_lean

    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.train()
    step = _step(model, family)
    batch = _batch(family, 64, False)
    peaks = []
    for lean in (False, True):
        if lean:
            apply_lean(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fake = measure_fake_step(model, step, batch)
            real = measure_step(model, lambda: step(batch), outside_ops=False)
        assert (fake.costs, fake.outside_bytes) == (real.costs, real.outside_bytes), f"{family}, lean={lean}"
        peaks.append(make_plan(fake.costs, fake.outside_bytes, 1.0, head_bytes=fake.head_bytes,
                               head_peak_bytes=fake.head_peak_bytes).peak_bytes)
    assert peaks[1] < peaks[0]
