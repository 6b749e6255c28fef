"""Lean layers (``lean_layers``, :mod:`lightning_ckpt.core.checkpoint.lean`): norms recompute in backward, gated MLPs
keep gate and up only, and training is the same to the bit.

- :class:`GatedProduct`: gradients equal autograd's bit for bit (SiLU, GELU tanh and exact, fp32 and bf16) and a
  hand-derived formula in float64; it saves gate and up, not ``act(gate)``; its backward peak is one
  ``[tokens, intermediate]`` tensor under autograd's, counted by hand;
- a norm under nested checkpoint keeps nothing for backward but its input, counted by hand;
- whole models (Transformers' Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma2, PEFT LoRA on the MLP, litgpt's LLaMA and
  Gemma MLPs), checkpointed and not, fp32 and bf16 autocast: the loss and every gradient equal;
- apply and remove: what each model makes lean, restored exactly, idempotent, composed with tiles either way,
  refusals before anything changes; the callback, Fabric and ``plan --lean-layers``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_ckpt import GradientCheckpointing, apply_checkpointing
from lightning_ckpt.core.checkpoint.lean import GatedProduct, LeanForward, apply_lean, is_lean, lean_names, remove_lean
from lightning_ckpt.core.checkpoint.tiling import apply_tiling, remove_tiling, tiled_names
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import Transformer

from helpers import LiveStorages, grad_storages

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB, SEQ, HIDDEN, INTER = 64, 24, 32, 48
ACTS = {"silu": ("silu", {}), "gelu-tanh": ("gelu", {"approximate": "tanh"}), "gelu": ("gelu", {"approximate": "none"})}


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    op, kwargs = ACTS[name]
    return getattr(torch.nn.functional, op)(x, **kwargs)


# ------------------------------------------------------------------------------------------------ GatedProduct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", list(ACTS))
def test_gated_product_gradients_are_autograd_s_to_the_bit(act, dtype):
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(7, 33, dtype=dtype) for _ in range(3))
    results = []
    for lean in (False, True):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = GatedProduct.apply(g, u, *ACTS[act]) if lean else _act(act, g) * u
        out.backward(grad)
        results.append((out.detach(), g.grad, u.grad))
    for plain, lean in zip(*results):
        assert lean.dtype == dtype and torch.equal(plain, lean)


def test_gated_product_gradients_against_the_formula_by_hand():
    """float64: d/d up = grad * silu(gate); d/d gate = grad * up * s (1 + gate (1 - s)), s = sigmoid(gate)."""
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(5, 9, dtype=torch.float64) for _ in range(3))
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    GatedProduct.apply(g, u, "silu", {}).backward(grad)
    s = 1 / (1 + torch.exp(-gate))
    torch.testing.assert_close(u.grad, grad * gate * s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g.grad, grad * up * s * (1 + gate * (1 - s)), rtol=1e-12, atol=1e-12)


def test_gated_product_saves_gate_and_up_and_its_backward_peak_is_one_tensor_lower():
    """fp32, [T, I] gate and up (made inside, so counted), loss = (product * w).sum() with a fixed w.

    Saved: autograd's ``silu(gate) * up`` keeps gate (for SiLU), silu(gate) and up (for the product): 3 T I 4 bytes;
    the lean product keeps gate and up: 2 T I 4.

    Peak, by hand (the product itself is not kept: ``* w`` saves only w): plain, in the product's backward: gate, silu(gate), up, its
    gradient, and the two it makes (6 T I 4, plus the loss's two scalars); lean: gate, up, the gradient, grad * up
    (turned into gate's in place) and silu(gate) (turned into up's in place): 5 T I 4.
    """
    T, I = 64, 40
    torch.manual_seed(0)
    a, b, w = torch.randn(T, I), torch.randn(T, I), torch.randn(T, I)
    saved, peaks = [], []
    for lean in (False, True):
        with LiveStorages() as live:
            gate, up = (a * 1).requires_grad_(), (b * 1).requires_grad_()
            with SavedTensorCounter(exclude=[w]) as counter:  # `* w` saves w
                loss = ((GatedProduct.apply(gate, up, "silu", {}) if lean else nn.functional.silu(gate) * up) * w).sum()
            loss.backward()
        saved.append(counter.bytes)
        peaks.append(live.peak())
    assert saved == [3 * T * I * 4, 2 * T * I * 4]
    assert peaks[0] - peaks[1] == T * I * 4
    assert peaks[1] == 5 * T * I * 4 + 8


# ------------------------------------------------------------------------------------------------ norms


def test_a_lean_norm_keeps_nothing_but_its_input_and_recomputes_in_backward():
    """An HF LlamaRMSNorm (fp32, its weight trained) on [T, H]: by hand it saves the input x (for ``pow``), the
    rsqrt [T, 1] (for ``x * rsqrt``; x is saved once), ``x * rsqrt`` (for the weight's product) and the weight, which
    is left out here: (T H + T + T H) 4 bytes. Lean: x alone, T H 4 (the input, which the layer keeps anyway); its
    backward runs the norm's forward ops once more."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    T, H = 16, 12
    torch.manual_seed(0)
    norm = LlamaRMSNorm(H)
    x = torch.randn(T, H, requires_grad=True)
    counts = []
    for lean in (False, True):
        if lean:
            norm.forward = LeanForward(norm, None)  # what apply_lean installs on a decoder layer's norm
        with SavedTensorCounter(exclude=[norm.weight]) as counter:
            out = norm(x)
        counts.append(counter.bytes)
        ran: list[str] = []
        with _Ops(ran):
            out.backward(torch.ones_like(out))
        if lean:
            assert ran.count("rsqrt") == 1  # the recompute
        else:
            assert "rsqrt" not in ran
    assert counts == [(T * H + T + T * H) * 4, T * H * 4]


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the aten ops run while active."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------ whole models

HF_FAMILIES = {  # name: (config class, model class, its MLP made lean)
    "llama": ("LlamaConfig", "LlamaForCausalLM", True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", True),
    "mistral": ("MistralConfig", "MistralForCausalLM", True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", True),  # GELU tanh
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", False),  # one gate_up_proj: its norms only
}


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_model(family: str) -> nn.Module:
    config_cls, model_cls, _ = HF_FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, use_cache=False)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train()


def hf_lora() -> nn.Module:
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(hf_model("llama"), config).train()


def litgpt_model(mlp: str) -> nn.Module:
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config(n_layer=2, n_embd=HIDDEN, n_head=4, n_query_groups=2, block_size=SEQ, vocab_size=VOCAB,
                           padded_vocab_size=VOCAB, bias=False, intermediate_size=INTER, mlp_class_name=mlp,
                           norm_class_name="RMSNorm", parallel_residual=False, gelu_approximate="tanh")
    torch.manual_seed(0)
    return litgpt.GPT(config).train()


def hf_loss(model: nn.Module) -> torch.Tensor:
    return model(input_ids=ids(), labels=ids(3)).loss


def litgpt_loss(model: nn.Module) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids()).flatten(0, 1), ids(3).flatten())


def _hf_names(family: str, prefix: str = "model") -> list[str]:
    norms = (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
             if family == "gemma2" else ["input_layernorm", "post_attention_layernorm"])
    return sorted([*(f"{prefix}.layers.{i}.{c}" for i in (0, 1)
                     for c in [*norms, *(["mlp"] if HF_FAMILIES[family][2] else [])]), f"{prefix}.norm"])


CASES = {  # name: (build, loss, the names made lean, sorted)
    **{f: (lambda f=f: hf_model(f), hf_loss, _hf_names(f)) for f in HF_FAMILIES},
    "llama-lora": (hf_lora, hf_loss, _hf_names("llama", "base_model.model.model")),
    **{f"litgpt-{m}": (lambda m=m: litgpt_model(m), litgpt_loss,
                       sorted([*(f"transformer.h.{i}.{c}" for i in (0, 1) for c in ("norm_1", "norm_2", "mlp")),
                               "transformer.ln_f"])) for m in ("LLaMAMLP", "GemmaMLP")},
}


def _step(model: nn.Module, loss_fn, autocast: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(model)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("case", list(CASES))
def test_lean_models_train_to_the_bit_as_they_are_in_a_checkpointed_layer_and_a_plain_one(case, autocast):
    build, loss_fn, names = CASES[case]
    plain, lean = build(), build()
    for model in (plain, lean):
        apply_checkpointing(model, every_n_layers=2)  # the first layer checkpointed, the second not
    assert sorted(apply_lean(lean)) == sorted(lean_names(lean)) == names
    expected, got = _step(plain, loss_fn, autocast), _step(lean, loss_fn, autocast)
    assert len(got) == len(expected) > 10
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_the_lean_mlp_saves_one_intermediate_less_per_layer_in_a_model():
    """Llama, fp32, no layer checkpointed: the MLP's silu(gate) is not saved, [2 x SEQ, INTER] floats a layer; the
    two norms' ``x * rsqrt`` and rsqrt ([2 x SEQ, HIDDEN] and [2 x SEQ, 1] floats) are not either, the final norm's
    too; their inputs were saved already (by the attention's or the MLP's projections, or the norm before)."""
    model = hf_model("llama")
    counts = []
    for lean in (False, True):
        if lean:
            apply_lean(model)
        with SavedTensorCounter(exclude=list(model.parameters())) as counter:
            hf_loss(model)
        counts.append(counter.bytes)
    tokens = 2 * SEQ
    assert counts[0] - counts[1] == 2 * tokens * INTER * 4 + 5 * tokens * (HIDDEN + 1) * 4


# ------------------------------------------------------------------------------------------------ apply, remove


def test_remove_restores_every_forward_and_applying_again_changes_nothing():
    model = hf_model("llama")
    mlp = model.model.layers[0].mlp
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_lean(model)
    assert isinstance(mlp.__dict__["forward"], LeanForward) and is_lean(mlp)
    assert apply_lean(model) == names and mlp.forward.original is None  # not wrapped twice
    assert remove_lean(model) == names
    assert lean_names(model) == [] and not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert remove_lean(model) == []


def test_an_mlp_it_cannot_make_lean_exactly_is_left_as_it_is():
    """Another activation (ReLU), or a forward someone else set: left whole; the norms are still made lean."""
    model = hf_model("llama")
    model.model.layers[0].mlp.act_fn = nn.ReLU()
    own = model.model.layers[1].mlp.forward = lambda x: x  # noqa: E731
    names = apply_lean(model)
    assert "model.layers.0.mlp" not in names and "model.layers.1.mlp" not in names
    assert "model.layers.0.input_layernorm" in names and model.model.layers[1].mlp.forward is own


def test_tiles_and_lean_compose_either_way_and_train_to_the_bit_as_tiles_alone():
    reference = hf_model("llama")
    apply_tiling(reference, tile_tokens=10)
    expected = _step(reference, hf_loss, False)
    for order in ("tiles first", "lean first"):
        model = hf_model("llama")
        steps = [lambda: apply_tiling(model, tile_tokens=10), lambda: apply_lean(model)]
        for apply in steps if order == "tiles first" else steps[::-1]:
            apply()
        mlp = model.model.layers[0].mlp
        assert type(mlp.forward).__name__ == "TiledForward" and isinstance(mlp.forward.original, LeanForward), order
        assert all(torch.equal(a, b) for a, b in zip(expected, _step(model, hf_loss, False))), order
        assert lean_names(model) == apply_lean(model)
        remove_tiling(model)
        assert isinstance(mlp.__dict__["forward"], LeanForward)  # lean stays without the tiles
        apply_tiling(model, tile_tokens=10)
        remove_lean(model)
        assert tiled_names(model) and mlp.forward.original is None  # the tiles stay without lean
        remove_tiling(model)
        assert not any("forward" in m.__dict__ for m in model.modules())


def test_eval_and_no_grad_run_the_module_s_own_forward():
    model = hf_model("llama")
    apply_lean(model)
    ran: list[str] = []
    with torch.no_grad(), _Ops(ran):
        model(ids())
    model.eval()
    with _Ops(ran):
        model(ids())
    assert ran.count("silu") == 4  # the MLPs' own act_fn, twice a pass; no checkpoint or Function in the way


def test_a_model_with_nothing_to_make_lean_is_refused_with_what_to_pass():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError) as info:
        apply_lean(model)
    assert str(info.value) == (
        "lean_layers=True found no norm or gated MLP it knows in Sequential (it knows the decoder layers of"
        " Transformers' Llama, Mistral, Qwen2/3, Gemma/2/3 and litgpt's Block). Pass lean_layers=False.")
    with pytest.raises(TypeError, match="`apply_lean` takes an `nn.Module`, got str"):
        apply_lean("model")
    assert not any("forward" in m.__dict__ for m in model.modules())


# ------------------------------------------------------------------------------------------------ the options


def test_the_callback_makes_layers_lean_while_it_runs_and_trains_as_without():
    from lightning.pytorch import Callback, Trainer

    from lightning_ckpt.demos.hf import CausalLM, TokenDataModule

    assert GradientCheckpointing().lean_layers is False
    with pytest.raises(TypeError, match=r"`lean_layers` is True or False, got 'yes'\. Pass True"):
        GradientCheckpointing(lean_layers="yes")

    class Seen(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lean = lean_names(pl_module)

    weights = []
    for lean in (False, True):
        torch.manual_seed(0)
        model = CausalLM(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=INTER, max_position_embeddings=SEQ)
        seen = Seen()
        trainer = Trainer(max_steps=2, callbacks=[GradientCheckpointing(lean_layers=lean), seen], accelerator="cpu",
                          devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(model, TokenDataModule(vocab_size=VOCAB, seq_len=SEQ, batch_size=2, num_samples=4))
        assert len(seen.lean) == (7 if lean else 0)
        assert lean_names(model) == []  # undone at the end of fit
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_setting_lean_layers_on_a_running_callback_applies_or_removes_it():
    from lightning_ckpt.demos.hf import CausalLM

    model = CausalLM(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=INTER, max_position_embeddings=SEQ)
    model.configure_model()
    callback = GradientCheckpointing(lean_layers=True)
    callback._attach(model)
    assert len(lean_names(model)) == 7 and callback.checkpointed_layers
    callback.lean_layers = False
    assert lean_names(model) == [] and callback.checkpointed_layers
    callback.lean_layers = True
    assert len(lean_names(model)) == 7
    callback.remove()
    assert lean_names(model) == [] and checkpointed_names(model) == []


def test_a_callback_that_cannot_apply_leaves_nothing_lean_and_one_that_checkpoints_nothing_still_toggles_lean():
    from lightning_ckpt import remove_checkpointing
    from lightning_ckpt.demos.hf import CausalLM

    model = CausalLM(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=INTER, max_position_embeddings=SEQ)
    model.configure_model()
    with pytest.raises(ValueError, match="Conv2d"):
        GradientCheckpointing(layer_cls=nn.Conv2d, lean_layers=True)._attach(model)  # no Conv2d to checkpoint
    assert lean_names(model) == [] and checkpointed_names(model) == []
    callback = GradientCheckpointing(lean_layers=True)
    callback._attach(model)
    remove_checkpointing(model)  # as a budget's plan that checkpoints no layer leaves it
    callback.lean_layers = False
    assert lean_names(model) == []


def test_fabric_checkpointing_takes_lean_layers():
    from lightning.fabric import Fabric

    from lightning_ckpt import FabricCheckpointing

    ckpt = FabricCheckpointing(Fabric(accelerator="cpu", devices=1), lean_layers=True)
    model = ckpt.setup(hf_model("llama"))
    assert lean_names(model.module) == sorted(_hf_names("llama"), key=[n for n, _ in model.module.named_modules()].index)
    ckpt.teardown()
    assert lean_names(model.module) == []


def test_plan_with_lean_layers_measures_every_setting_lean(tmp_path):
    """``plan`` on configs/hf_lora.yaml: with ``--lean-layers true``, or the config's own ``lean_layers: true``,
    plan.json and the report say so, and every layer fully checkpointed peaks lower than without; ``--lean-layers
    false`` overrides the config's."""
    from pathlib import Path

    from lightning_ckpt.commands.plan import main as plan_main

    config = Path(__file__).parents[3] / "configs" / "hf_lora.yaml"
    lean_config = tmp_path / "hf_lora_lean.yaml"
    lean_config.write_text(config.read_text().replace(
        "        layer_cls: transformers.models.llama.modeling_llama.LlamaDecoderLayer\n",
        "        layer_cls: transformers.models.llama.modeling_llama.LlamaDecoderLayer\n        lean_layers: true\n"))
    peaks = {}
    for name, path, extra, lean in [("flag", config, ["--lean-layers", "true"], True), ("plain", config, [], False),
                                    ("config", lean_config, [], True),
                                    ("overridden", lean_config, ["--lean-layers", "false"], False)]:
        out = tmp_path / name
        assert plan_main(["--config", str(path), "--fake", *extra, "--output-dir", str(out)]) == 0
        report = json.loads((out / "plan.json").read_text())
        assert report["lean_layers"] is lean, name
        assert ("its norms and gated MLP lean (lean_layers)" in (out / "plan.md").read_text()) is lean, name
        peaks[name] = {s["name"]: s["peak_bytes"] for s in report["settings"]}["every_layer"]
    assert peaks["flag"] == peaks["config"] < peaks["plain"] == peaks["overridden"]


def test_an_own_forward_on_a_norm_is_what_lean_runs_and_remove_restores_it_tiled_or_not():
    for tiles in (False, True):
        model = hf_model("llama")
        norm = model.model.layers[0].input_layernorm
        calls = []
        own = norm.forward = lambda x: (calls.append(x.shape), type(norm).forward(norm, x))[1]  # noqa: E731
        if tiles:
            apply_tiling(model, tile_tokens=SEQ)
        apply_lean(model)
        _step(model, hf_loss, False)
        assert calls == [(2, SEQ, HIDDEN)] * 2, tiles  # the forward, and the norm's recompute in backward
        remove_lean(model)
        if tiles:
            assert norm.forward.original is own
            remove_tiling(model)
        assert norm.forward is own


def test_applying_again_makes_lean_what_was_made_whole_since():
    model = hf_model("llama")
    names = apply_lean(model)
    del model.model.layers[1].mlp.forward  # made whole by hand, after the first layer's modules
    assert apply_lean(model) == names and is_lean(model.model.layers[1].mlp)


def test_other_activations_and_a_broadcast_up_run_as_the_class_computes_them():
    """nn.GELU (exact and tanh) through the lean product, and through the class's own arithmetic where the up
    projection differs from the gate's: in dtype (float64), or in shape (one column, broadcast over the
    intermediate); an MLP without ``act_fn`` left whole. Each trains to the bit as the same model without lean."""
    def variants(model: nn.Module) -> None:
        layers = model.model.layers
        torch.manual_seed(5)
        layers[0].mlp.act_fn = nn.GELU()
        layers[0].mlp.up_proj = nn.Sequential(layers[0].mlp.up_proj, _To(torch.float64))
        layers[0].mlp.down_proj = nn.Sequential(_To(torch.float32), layers[0].mlp.down_proj)
        layers[1].mlp.act_fn = nn.GELU(approximate="tanh")
        layers[1].mlp.up_proj = nn.Linear(HIDDEN, 1, bias=False)

    plain, lean = hf_model("llama"), hf_model("llama")
    variants(plain), variants(lean)
    assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(apply_lean(lean))
    assert all(torch.equal(a, b) for a, b in zip(_step(plain, hf_loss, False), _step(lean, hf_loss, False)))
    bare = hf_model("llama")
    del bare.model.layers[0].mlp.act_fn
    assert "model.layers.0.mlp" not in apply_lean(bare)


class _To(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def test_same_gelu_variants_through_the_lean_product():
    """Where gate and up agree, nn.GELU's exact and tanh forms go through the lean product, to the bit."""
    plain, lean = hf_model("llama"), hf_model("llama")
    for model in (plain, lean):
        model.model.layers[0].mlp.act_fn = nn.GELU(approximate="tanh")
        model.model.layers[1].mlp.act_fn = nn.GELU()
    apply_lean(lean)
    assert "GatedProductBackward" in _graph_names(hf_loss(lean))
    assert all(torch.equal(a, b) for a, b in zip(_step(plain, hf_loss, False), _step(lean, hf_loss, False)))


def test_a_lean_mlp_takes_the_hidden_states_by_keyword_too():
    model = hf_model("llama")
    apply_lean(model)
    mlp, x = model.model.layers[0].mlp, torch.randn(2, 5, HIDDEN)
    assert torch.equal(mlp(x=x), type(mlp).forward(mlp, x))
    norm = model.model.layers[0].input_layernorm
    assert torch.equal(norm(hidden_states=x), type(norm).forward(norm, x))
    model.eval()
    assert torch.equal(norm(hidden_states=x), type(norm).forward(norm, x))


def _graph_names(tensor: torch.Tensor) -> set[str]:
    names, todo, seen = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_in_eval_with_grad_the_module_s_own_forward_runs():
    model = hf_model("llama")
    apply_lean(model)
    assert "GatedProductBackward" in _graph_names(model(ids()).logits)
    model.eval()
    assert "GatedProductBackward" not in _graph_names(model(ids()).logits)


@pytest.mark.parametrize("options", [dict(mode="selective"), dict(offload=True), dict(compress="bf16")],
                         ids=["selective", "offload", "compress"])
def test_lean_layers_train_to_the_bit_under_selective_checkpoint_offload_and_compression(options):
    plain, lean = hf_model("llama"), hf_model("llama")
    for model in (plain, lean):
        apply_checkpointing(model, **options)
    apply_lean(lean)
    assert all(torch.equal(a, b) for a, b in zip(_step(plain, hf_loss, False), _step(lean, hf_loss, False)))


def test_lean_layers_reach_a_budget_plain_layers_cannot_and_hold_it_on_every_step():
    """A Llama of 4 layers at 4 x 64 tokens, every layer checkpointed: the least reachable peak (what a refused
    budget's message says) is lower with lean layers. A budget between the two is refused without lean layers and held
    with them on every step (the measuring step and the plan's all run lean), and the weights after the fit equal
    those of every layer checkpointed without a budget (all of it is exact). (The least figures depend on the
    transformers release: 4.57 hands SDPA a [T, T] mask where 5.x passes ``is_causal``.)"""
    from lightning.pytorch import Callback, Trainer

    from helpers import StepPeaks, least_reachable_bytes
    from lightning_ckpt.demos.hf import CausalLM, TokenDataModule

    class Seen(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lean.append(len(lean_names(pl_module)))

    def fit(callback: GradientCheckpointing, seen: Seen, peaks: StepPeaks) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = CausalLM(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=64)
        seen.lean = []
        trainer = Trainer(max_steps=3, callbacks=[callback, seen, peaks], accelerator="cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, TokenDataModule(vocab_size=VOCAB, seq_len=64, batch_size=4, num_samples=12))
        return [p.detach().clone() for p in model.parameters()]

    least = {}
    for lean in (False, True):
        with pytest.raises(ValueError) as refused:
            fit(GradientCheckpointing(memory_budget="2KiB", lean_layers=lean, chunk_loss=False, time_layers=False),
                Seen(), StepPeaks())
        least[lean] = least_reachable_bytes(str(refused.value))
    assert least[True] < least[False]
    budget = (least[True] + least[False]) // 2
    with pytest.raises(ValueError) as refused:
        fit(GradientCheckpointing(memory_budget=budget, chunk_loss=False, time_layers=False), Seen(), StepPeaks())
    assert least_reachable_bytes(str(refused.value)) == least[False]
    seen, peaks = Seen(), StepPeaks()
    callback = GradientCheckpointing(memory_budget=budget, lean_layers=True, chunk_loss=False, time_layers=False)
    weights = fit(callback, seen, peaks)
    assert seen.lean == [13] * 3  # 4 layers' two norms and MLP, the final norm
    assert callback.plan is not None and len(peaks.peaks) == 3 and max(peaks.peaks) <= budget, peaks.peaks
    expected = fit(GradientCheckpointing(), Seen(), StepPeaks())
    assert all(torch.equal(a, b) for a, b in zip(expected, weights))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_under_ddp_and_fsdp2_lean_gradients_equal_the_plain_ones_to_the_bit(token_wise_dist, strategy):
    """The demo GPT (its norms lean; its MLP is not gated), one block of two checkpointed, 2 processes."""
    plain, lean = token_wise_dist[f"{strategy}-plain"], token_wise_dist[f"{strategy}-lean"]
    for rank in range(2):
        assert "error" not in plain[rank] and "error" not in lean[rank], (plain[rank], lean[rank])
        assert lean[rank]["rows"] == plain[rank]["rows"] == {0: [16, 16], 1: [16]}
        want, got = plain[rank]["grads"], lean[rank]["grads"]
        assert got.keys() == want.keys() and len(want) > 0
        assert all(torch.equal(got[name], want[name]) for name in want)


def test_under_torch_compile_lean_layers_train_to_the_bit_as_the_compiled_model_without():
    """Dynamo traces the nested checkpoint and GatedProduct (its backward's in-place ``grad_input=``) as they run."""
    plain, lean = hf_model("llama"), hf_model("llama")
    apply_lean(lean)
    expected = _step(torch.compile(plain), hf_loss, False)
    got = _step(torch.compile(lean), hf_loss, False)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
