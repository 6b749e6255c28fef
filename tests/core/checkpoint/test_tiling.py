"""Tiles of tokens (``tile_mlp``, :mod:`lightning_ckpt.core.checkpoint.tiling`): each decoder layer's MLP and norms, and the final norm,
run over tiles of the sequence, each under checkpoint, and train as untiled.

- fp32, no dropout: the loss equal, every gradient within 1e-6 relative of untiled, on Transformers' Llama, Qwen2,
  Qwen3, Mistral, Gemma, Gemma2, Gemma3 and Phi3, PEFT LoRA on a Llama's MLP, litgpt's GPT (two MLP kinds) and the
  demo GPT; the first layer checkpointed (its tiles run inside its recompute), the second not; each MLP's last
  ``Linear`` counted, call by call, with the rows it saw (a skipped or dropped tile changes the counts);
- the peak of the live-storage counter (``benchmarks/_peak.py``) against hand-computed bytes, tiled and untiled;
- dropout: tiles draw their own masks, the recompute replays them exactly, a run repeats from its seed;
- bf16 (autocast, and bf16 weights): the error against an fp32 reference no larger than untiled's;
- the options: ``apply_checkpointing``, ``GradientCheckpointing`` (a Trainer step), ``FabricCheckpointing``, and what
  they refuse, before changing anything; DDP and FSDP2 on 2 processes.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_ckpt import GradientCheckpointing, apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint.tiling import (TiledForward, apply_tiling, is_tiled, remove_tiling, restore_tiles, tile_size,
                                         tiled_names, tiles_of, validate_tile_tokens)
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.demos import Transformer

from helpers import LiveStorages, OwnMLP, grad_storages  # noqa: F401  (helpers puts benchmarks/ on the path for _peak)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
litgpt = pytest.importorskip("litgpt")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB, SEQ, BATCH, HIDDEN = 64, 40, 2, 32
TILE = 12  # 40 tokens: tiles of 12, 12, 12 and 4 (the last one shorter)
TILES = [12, 12, 12, 4]


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ the models


HF_FAMILIES = {  # name: (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def hf_model(family: str, attn: str = "eager") -> nn.Module:
    if not all(hasattr(transformers, name) for name in HF_FAMILIES[family]):
        pytest.skip(f"transformers {transformers.__version__} has no {HF_FAMILIES[family][1]}")
    config_cls, model_cls = (getattr(transformers, name) for name in HF_FAMILIES[family])
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn)
    torch.manual_seed(0)
    return model_cls(config).train()


def hf_lora() -> nn.Module:
    model = hf_model("llama")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)  # B is random, not zero: every adapter gets a gradient
    return peft.get_peft_model(model, config).train()


def hf_loss(model: nn.Module) -> torch.Tensor:
    return model(input_ids=ids(), labels=ids(3)).loss


def litgpt_model(kind: str) -> nn.Module:
    extra = (dict(mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False)
             if kind == "llama" else {})  # else litgpt's default: GptNeoxMLP, LayerNorm, parallel residual
    config = litgpt.Config(n_layer=2, n_embd=HIDDEN, n_head=4, n_query_groups=2, block_size=SEQ, vocab_size=VOCAB,
                           padded_vocab_size=VOCAB, bias=False, intermediate_size=64, **extra)
    torch.manual_seed(0)
    return litgpt.GPT(config).train()


def litgpt_loss(model: nn.Module) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids()).flatten(0, 1), ids(3).flatten())


def demo_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return Transformer(VOCAB, SEQ, 2, HIDDEN, 4, dropout).train()


def demo_loss(model: nn.Module) -> torch.Tensor:
    return model(ids(), ids(3))


#: name: (build, loss, the qualified names of each layer's MLP's last Linear, relative to the layer)
CASES = {
    **{family: (lambda f=family: hf_model(f), hf_loss, "mlp.gate_up_proj" if family == "phi3" else "mlp.gate_proj")
       for family in HF_FAMILIES},
    "llama-sdpa": (lambda: hf_model("llama", "sdpa"), hf_loss, "mlp.gate_proj"),
    "llama-lora": (hf_lora, hf_loss, "mlp.gate_proj"),
    "litgpt-llama": (lambda: litgpt_model("llama"), litgpt_loss, "mlp.fc_1"),
    "litgpt-neox": (lambda: litgpt_model("neox"), litgpt_loss, "mlp.fc"),
    "demo": (demo_model, demo_loss, "mlp.0"),
}


def layers_of(model: nn.Module) -> list[nn.Module]:
    for name in ("layers", "h", "blocks"):
        found = [m for n, m in model.named_modules() if n.endswith(f".{name}") or n == name]
        if found and isinstance(found[0], nn.ModuleList):
            return list(found[0])
    raise AssertionError("no layers")


class RowsSeen:
    """The rows (tokens along the sequence) of each call of each layer's MLP's first Linear (whose output is saved,
    so every recompute runs it: the last Linear's is not, and torch's recompute stops before it)."""

    def __init__(self, model: nn.Module, linear: str) -> None:
        self.rows: list[list[int]] = []
        self.handles = []
        for i, layer in enumerate(layers_of(model)):
            self.rows.append([])
            hook = lambda module, args, out, i=i: self.rows[i].append(args[0].shape[-2])  # noqa: E731
            self.handles.append(layer.get_submodule(linear).register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def loss_and_grads(model: nn.Module, loss_fn, seed: int = 123, seen: RowsSeen | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step from a fixed RNG state: the loss and every gradient; ``seen`` (when given) keeps the forward's rows in
    ``seen.forward`` and the backward's in ``seen.rows``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model)
    if seen is not None:
        seen.forward, seen.rows = seen.rows, [[] for _ in seen.rows]
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def relative_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    assert grads.keys() == ref.keys()
    return {name: float((grads[name] - ref[name]).norm() / ref[name].norm()) for name in ref}


# ------------------------------------------------------------------------------------------------ same training


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_mlps_train_as_untiled_in_a_checkpointed_layer_and_in_a_plain_one(case):
    build, loss_fn, linear = CASES[case]
    ref_loss, ref = loss_and_grads(build(), loss_fn)
    model = build()
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    # every second layer checkpointed: layer 0 is (its tiles run inside its recompute), layer 1 is not
    layers = apply_checkpointing(model, every_n_layers=2, tile_mlp=True, tile_tokens=TILE)
    assert len(layers) == 1 and len(layers_of(model)) == 2
    tiled = tiled_names(model)
    in_layers = {n for n, m in model.named_modules() if m in layers_of(model)}
    assert {name.rpartition(".")[0] for name in tiled if name.rpartition(".")[0] in in_layers} == in_layers
    outside = [name for name in tiled if name.rpartition(".")[0] not in in_layers]
    assert len(outside) == 1 and outside[0].endswith(("model.norm", "transformer.ln_f", "ln_f"))  # the final norm
    assert any(name.endswith(".mlp") for name in tiled) and len(tiled) >= 7  # the MLP and two norms, in each layer
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == classes
    seen = RowsSeen(model, linear)
    loss, grads = loss_and_grads(model, loss_fn, seen=seen)
    seen.remove()
    assert seen.forward == [TILES, TILES]
    # the backward, one tile at a time, the last first: layer 1 recomputes each tile; layer 0's recompute runs its
    # tiles in order, then their own recomputes (torch's may keep the last one's from the layer's recompute)
    assert seen.rows[1] == TILES[::-1]
    assert seen.rows[0][:len(TILES)] == TILES and seen.rows[0][len(TILES):] in (TILES[::-1], TILES[::-1][1:])
    assert torch.equal(loss, ref_loss)
    errors = relative_errors(grads, ref)
    assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])
    # removed: the module exactly as before, untiled
    remove_checkpointing(model)
    assert tiled_names(model) == [] and checkpointed_names(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    seen = RowsSeen(model, linear)
    loss_and_grads(model, loss_fn, seen=seen)
    assert seen.forward == [[SEQ], [SEQ]] and seen.rows == [[], []]  # whole, and nothing recomputed


def test_what_each_model_tiles():
    """In each layer, every child but the attention; in the model, the final norm (before the head)."""
    assert tiled_names_of(hf_model("llama")) == (["mlp", "input_layernorm", "post_attention_layernorm"], "model.norm")
    assert tiled_names_of(hf_model("phi3")) == (["mlp", "input_layernorm", "post_attention_layernorm"], "model.norm")
    assert tiled_names_of(hf_model("gemma2")) == (["mlp", "input_layernorm", "post_attention_layernorm",
                                                   "pre_feedforward_layernorm", "post_feedforward_layernorm"],
                                                  "model.norm")
    assert tiled_names_of(litgpt_model("llama")) == (["norm_1", "norm_2", "mlp"], "transformer.ln_f")
    # its post_attention_norm and post_mlp_norm are Identity: left
    assert tiled_names_of(litgpt_model("neox")) == (["norm_1", "norm_2", "mlp"], "transformer.ln_f")
    assert tiled_names_of(demo_model()) == (["ln1", "ln2", "mlp"], "ln_f")
    assert tiled_names_of(hf_lora())[1] == "base_model.model.model.norm"


def tiled_names_of(model: nn.Module) -> tuple[list[str], str]:
    """The tiled submodules of the first layer, relative to it, and the one tiled outside the layers."""
    first = layers_of(model)[0]
    names = apply_tiling(model)
    outside = [name for name in names if not any(m is first or m in layers_of(model)
                                                   for m in _parents(model, name))]
    assert len(outside) == 1, outside
    return tiled_names(first), outside[0]


def _parents(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


# ------------------------------------------------------------------------------------------------ the peak


def test_the_peak_holds_one_tiles_intermediates_instead_of_the_whole_sequences():
    """The demo GPT's MLP kind (Linear, GELU, Linear), alone, fp32; loss = out.square().sum(). By hand (4-byte floats):

    untiled, at the first backward matmul (the gradient of the GELU's output): the Linear's output h and the GELU's
    a (both saved, [T, I]), that gradient [T, I], the loss's gradient at the MLP's output [T, H], two scalars (the
    loss and its gradient): 3 T I 4 + T H 4 + 8.

    tiled (t tokens a tile, n tiles), at the last tile's gradient of its second Linear's weight: that tile's h, a and
    gradient of a (3 t I 4), the [T, H] output gradient, the other n-1 tiles' input gradients (waiting to be joined:
    (n-1) t H 4), the sums of the weight and bias gradients over the tiles so far (I H 4 + I 4 + H I 4 + H 4), the
    tile's own weight gradient (H I 4), the two scalars.
    """
    T, H, I, t = 256, 16, 64, 32
    n = T // t
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H))
    x = torch.randn(1, T, H, requires_grad=True)

    def peak_and_largest() -> tuple[int, int]:
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        with LiveStorages() as live:
            mlp(x).square().sum().backward()
        made = max(nbytes for _, nbytes in live.events)
        return live.peak(exclude=grad_storages(mlp) | {x.grad.untyped_storage().data_ptr()}), made

    untiled, largest = peak_and_largest()
    assert untiled == 3 * T * I * 4 + T * H * 4 + 8 == 213_000
    assert largest == T * I * 4  # [T, I] tensors exist
    apply_tiling(nn.ModuleDict({"mlp": mlp}), tile_cls=nn.Sequential, tile_tokens=t)
    tiled, largest = peak_and_largest()
    grads_summed = I * H * 4 + I * 4 + H * I * 4 + H * 4
    assert tiled == 3 * t * I * 4 + T * H * 4 + (n - 1) * t * H * 4 + grads_summed + H * I * 4 + 8 == 67_912
    assert largest == T * H * 4 < T * I * 4  # no [T, I] tensor ever exists: the largest is the [T, H] output
    assert untiled - tiled == 145_088


# ------------------------------------------------------------------------------------------------ dropout


def plain_tile_loop(model: nn.Module, tile: int) -> None:
    """Each MLP of ``model`` runs over tiles without checkpoint: a tiled forward's result, all held for backward."""
    for block in model.blocks:
        mlp = block.mlp
        mlp.forward = lambda x, mlp=mlp: torch.cat([nn.Sequential.forward(mlp, p) for p in x.split(tile, -2)], -2)


def test_dropout_tiles_draw_their_own_masks_and_the_recompute_replays_them_exactly():
    tiled = demo_model(dropout=0.2)
    apply_checkpointing(tiled, every_n_layers=2, tile_mlp=True, tile_tokens=TILE)
    reference = demo_model(dropout=0.2)
    plain_tile_loop(reference, TILE)  # the same masks, drawn tile by tile, nothing recomputed
    loss, grads = loss_and_grads(tiled, demo_loss)
    ref_loss, ref = loss_and_grads(reference, demo_loss)
    assert torch.equal(loss, ref_loss)
    errors = relative_errors(grads, ref)
    assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])
    # reproducible from the seed, and not the untiled run's masks
    again, _ = loss_and_grads(tiled, demo_loss)
    untiled, _ = loss_and_grads(demo_model(dropout=0.2), demo_loss)
    assert torch.equal(again, loss) and not torch.equal(untiled, loss)
    other_seed, _ = loss_and_grads(tiled, demo_loss, seed=7)
    assert not torch.equal(other_seed, loss)  # the masks are random, not switched off


# ------------------------------------------------------------------------------------------------ bf16


def errors_against(reference: tuple, result: tuple) -> tuple[float, float]:
    """The loss's absolute error and the gradients' relative error (all parameters together)."""
    (ref_loss, ref), (loss, grads) = reference, result
    diff = torch.cat([(grads[k] - ref[k]).flatten() for k in ref]).norm()
    return float((loss.float() - ref_loss).abs()), float(diff / torch.cat([ref[k].flatten() for k in ref]).norm())


@pytest.mark.parametrize("case", ["llama", "demo"])
@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16-weights"])
def test_under_bf16_the_error_against_fp32_is_no_larger_than_untiled(case, precision):
    """The loss is the same; of the gradients, the tiled modules' weight gradients differ: tiled, each is the sum of
    n partial gradients (one per tile), each rounded to bf16 on its own (summed in fp32 under autocast, whose cast
    weight each tile's recompute makes anew; in bf16 with bf16 weights); untiled, one product over the whole sequence
    is rounded once. Both are a bf16 rounding of sums accumulated in fp32 inside the matmul, so the errors are of one
    size, but n roundings of partial sums that partly cancel err by more than one rounding of their sum. Measured
    over all gradients, 4 tiles: 1.00x untiled's on the Llama (SwiGLU, no bias), 1.05x (autocast) and 1.06x (bf16
    weights) on the demo GPT's MLP with biases (whose MLP gradients alone reach 1.2-1.6x at 8 tiles of 5 tokens; the
    whole 1.14x at 14 tiles of 3). 1.1x at 4 tiles allows that and no error that is not one bf16 rounding per tile.
    """
    build, loss_fn, _ = CASES[case]
    reference = loss_and_grads(build(), loss_fn)

    def run(tiled: bool) -> tuple:
        model = build()
        if precision == "bf16-weights":
            model = model.to(torch.bfloat16)
        if tiled:
            apply_tiling(model, tile_tokens=10)  # 4 tiles
        if precision == "bf16-autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_and_grads(model, loss_fn)
        return loss_and_grads(model, loss_fn)

    untiled, tiled = errors_against(reference, run(False)), errors_against(reference, run(True))
    assert untiled[1] > 1e-4  # bf16 did round
    assert tiled[0] <= untiled[0] * 1.1 + 1e-7, (tiled, untiled)
    assert tiled[1] <= untiled[1] * 1.1, (tiled, untiled)


# ------------------------------------------------------------------------------------------------ options, refusals


def test_the_tile_size_follows_alsts_rule_by_default():
    assert [tile_size(n, 32) for n in (1, 32, 33, 40, 64, 65)] == [1, 32, 17, 20, 32, 22]
    assert tile_size(500_000, 4096) == math.ceil(500_000 / math.ceil(500_000 / 4096)) == 4066  # 123 tiles
    model = demo_model()
    apply_tiling(model)  # hidden 32: 40 tokens -> 2 tiles of 20
    seen = RowsSeen(model, "mlp.0")
    loss_and_grads(model, demo_loss, seen=seen)
    assert seen.forward == [[20, 20], [20, 20]] and seen.rows == [[20, 20], [20, 20]]


def test_tile_sizes_at_the_edges_and_the_tile_tokens_accepted():
    # no tokens, one feature: one token a tile (no division by zero, no tile of 0 or 2)
    assert [tile_size(0, 32), tile_size(-3, 32), tile_size(10, 1), tile_size(10, 0)] == [1, 1, 1, 1]
    assert validate_tile_tokens(1) == 1 and tile_size(7, 32, tile_tokens=1) == 1
    for bad in (0, True, 2.0, "8"):
        with pytest.raises(ValueError, match="pass an int >= 1"):
            validate_tile_tokens(bad)


class Scaled(nn.Module):
    """Token-wise, with a plain keyword argument and an extra positional one (neither a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, shift: float = 0.0, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale + shift


@pytest.mark.parametrize("shape", [(2, 9, 4), (9, 4), (4,), (2, 0, 4)], ids=["batch", "no batch", "1-d", "empty"])
def test_the_tiled_call_passes_every_argument_and_tiles_only_along_a_sequence(shape):
    """Arguments beyond the hidden states reach every tile and the whole call (eval, 1-d, empty); a [T, H] input is
    tiled too; an empty sequence runs whole."""
    torch.manual_seed(0)
    module = Scaled()
    x = torch.randn(*shape, requires_grad=True)
    expected = module(x, 0.5, scale=3.0)
    calls: list[int] = []
    module.fc.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[-2] if args[0].dim() > 1 else -1))
    apply_tiling(nn.ModuleDict({"m": module}), tile_cls=Scaled, tile_tokens=4)
    for training in (True, False):
        module.train(training)
        calls.clear()
        out = module(x, 0.5, scale=3.0)
        # to float rounding: a matmul over 4 rows may round otherwise than over 9 (seen on one CPU, not another)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        tiled = training and len(shape) >= 2 and shape[-2] > 0
        assert calls == ([4, 4, 1] if tiled else [calls[0]] if calls else []) and len(calls) == (3 if tiled else 1)


def test_an_own_forward_set_before_tiling_is_what_each_tile_runs_and_restore_keeps_it():
    torch.manual_seed(0)
    module = Scaled()
    module.forward = lambda x: Scaled.forward(module, x, scale=2.0)  # an instance forward: doubles
    holder = nn.ModuleDict({"m": module})
    apply_tiling(holder, tile_cls=Scaled, tile_tokens=4)
    x = torch.randn(1, 9, 4)
    assert torch.equal(module(x), Scaled.forward(module, x, scale=2.0))
    tiles = tiles_of(holder)
    own = module.forward.original
    del module.forward  # as a re-wrap leaves it: the class's forward
    module.forward = own
    restore_tiles(holder, tiles)
    assert is_tiled(module) and module.forward.tile_tokens == 4 and module.forward.original is own
    assert torch.equal(module(x), Scaled.forward(module, x, scale=2.0))


def test_eval_and_no_grad_run_the_module_whole():
    model = demo_model()
    apply_tiling(model, tile_tokens=TILE)
    seen = RowsSeen(model, "mlp.0")
    with torch.no_grad():
        model(ids())
    model.eval()
    model(ids())
    assert seen.rows == [[SEQ, SEQ], [SEQ, SEQ]]


class Expert(nn.Module):
    """A model's own token-wise MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class OwnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
        self.ffn = Expert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.ffn(x)


class OwnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([OwnBlock(), OwnBlock()])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x


def own_model() -> nn.Module:
    torch.manual_seed(0)
    return OwnModel()


def own_loss(model: nn.Module) -> torch.Tensor:
    return model(ids()).square().mean()


@pytest.mark.parametrize("tile_cls", [Expert, f"{__name__}.Expert", [Expert]])
def test_a_model_of_ones_own_is_tiled_through_the_class_it_names(tile_cls):
    ref_loss, ref = loss_and_grads(own_model(), own_loss)
    model = own_model()
    assert apply_checkpointing(model, tile_mlp=True, tile_cls=tile_cls, tile_tokens=TILE) == ["blocks.0", "blocks.1"]
    assert tiled_names(model) == ["blocks.0.ffn", "blocks.1.ffn"]
    seen = RowsSeen(model, "ffn.up")
    loss, grads = loss_and_grads(model, own_loss, seen=seen)
    assert seen.forward == [TILES, TILES] and all(rows[:len(TILES)] == TILES for rows in seen.rows)
    assert torch.equal(loss, ref_loss) and max(relative_errors(grads, ref).values()) <= 1e-6


def test_a_model_without_an_mlp_it_knows_is_refused_before_anything_changes():
    model = own_model()
    with pytest.raises(ValueError, match="found no MLP it knows.*Pass tile_cls="):
        apply_checkpointing(model, tile_mlp=True)
    assert checkpointed_names(model) == [] and tiled_names(model) == []
    with pytest.raises(ValueError, match="matches no submodule"):
        apply_checkpointing(model, tile_mlp=True, tile_cls=nn.GRU)
    with pytest.raises(ValueError, match="tile_mlp is False"):
        apply_checkpointing(model, tile_cls=Expert)
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_checkpointing(model, tile_mlp=True, tile_cls=Expert, tile_tokens=0)
    with pytest.raises(TypeError, match="tile_mlp"):
        apply_checkpointing(model, tile_mlp="yes")
    with pytest.raises(ValueError, match="tile_cls="):
        apply_checkpointing(model, tile_mlp=True, tile_cls="no_such_module.Expert")
    assert checkpointed_names(model) == [] and tiled_names(model) == []


def test_a_module_taking_more_than_the_hidden_states_or_mixing_tokens_is_refused():
    model = own_model()
    with pytest.raises(TypeError, match="more than one tensor argument"):
        apply_tiling(model, tile_cls=nn.MultiheadAttention)
    assert tiled_names(model) == []

    class Pool(nn.Module):  # one row for the whole sequence: not token-wise
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(-2, keepdim=True)

    holder = nn.ModuleDict({"pool": Pool()})
    apply_tiling(holder, tile_cls=Pool, tile_tokens=4)
    with pytest.raises(TypeError, match="a row per token"):
        holder["pool"](torch.randn(1, 8, 2, requires_grad=True))


def test_tiles_never_nest_and_a_checkpointed_layer_is_never_the_tiled_module():
    model = hf_model("llama")
    mlp_cls = type(model.model.layers[0].mlp)
    with pytest.raises(ValueError, match="recomputed twice"):
        apply_checkpointing(model, layer_cls=mlp_cls, tile_mlp=True)
    assert checkpointed_names(model) == [] and tiled_names(model) == []
    apply_tiling(model)
    with pytest.raises(ValueError, match="tiled inside"):
        apply_tiling(model, tile_cls=type(model.model.layers[0]))
    with pytest.raises(ValueError, match="recomputed twice"):
        apply_checkpointing(model, layer_cls=mlp_cls)


def test_applying_again_changes_the_tile_size_and_remove_restores_an_own_forward():
    model = demo_model()
    own = lambda x: nn.Sequential.forward(model.blocks[0].mlp, x)  # noqa: E731  an instance forward set before
    model.blocks[0].mlp.forward = own
    apply_tiling(model, tile_tokens=TILE)
    apply_tiling(model, tile_tokens=20)
    forward = model.blocks[0].mlp.forward
    assert isinstance(forward, TiledForward) and forward.tile_tokens == 20 and forward.original is own
    assert remove_tiling(model) == ["blocks.0.ln1", "blocks.0.ln2", "blocks.0.mlp", "blocks.1.ln1", "blocks.1.ln2",
                                    "blocks.1.mlp", "ln_f"]
    assert model.blocks[0].mlp.forward is own and not is_tiled(model.blocks[1].mlp)


def test_the_callback_tiles_with_tile_mlp_true_only_and_says_so_in_its_settings():
    from lightning.pytorch import Callback, Trainer

    from lightning_ckpt.demos import GPT, CountingDataModule

    assert GradientCheckpointing().tile_mlp is None
    with pytest.raises(TypeError, match="tile_mlp"):
        GradientCheckpointing(tile_mlp="auto")
    with pytest.raises(ValueError, match="tile_mlp=False"):
        GradientCheckpointing(tile_mlp=False, tile_tokens=8)
    with pytest.raises(ValueError, match="tile_tokens"):
        GradientCheckpointing(tile_mlp=True, tile_tokens=-1)
    callback = GradientCheckpointing(every_n_layers=2, tile_mlp=True, tile_tokens=4, tile_cls=nn.Sequential)
    assert callback.state_dict()["settings"]["tile_cls"] == "torch.nn.modules.container.Sequential"
    callback.tile_cls = None

    class Record(Callback):  # what was tiled, and the rows the second block's MLP saw in the step
        def on_train_start(self, trainer, pl_module):
            self.tiled = tiled_names(pl_module)
            pl_module.model.blocks[1].mlp[0].register_forward_hook(lambda m, a, o: self.rows.append(a[0].shape[-2]))

    for tile_mlp, rows in [(None, [16]), (True, [4] * 8)]:
        record = Record()
        record.rows: list[int] = []
        callback.tile_mlp = tile_mlp
        model = GPT(vocab_size=32, block_size=16, n_layer=2, n_embd=16, n_head=2, dropout=0.0)
        trainer = Trainer(max_steps=1, callbacks=[callback, record], accelerator="cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=2, num_samples=2))
        assert record.rows == rows
        assert record.tiled == ([] if tile_mlp is None else [*(f"model.blocks.{i}.{c}" for i in (0, 1) for c in ("ln1", "ln2", "mlp")), "model.ln_f"])
        assert tiled_names(model) == []  # undone at the end of fit


def test_fabric_checkpointing_takes_tile_mlp():
    from lightning.fabric import Fabric

    from lightning_ckpt import FabricCheckpointing
    from lightning_ckpt.demos import GPT

    ckpt = FabricCheckpointing(Fabric(accelerator="cpu", devices=1), every_n_layers=2, tile_mlp=True, tile_tokens=4)
    model = ckpt.setup(GPT(vocab_size=32, block_size=16, n_layer=2, n_embd=16, n_head=2, dropout=0.0))
    assert ckpt.callback.tile_mlp is True and ckpt.checkpointed_layers == ["model.blocks.0"]
    assert tiled_names(model.module) == [*(f"model.blocks.{i}.{c}" for i in (0, 1) for c in ("ln1", "ln2", "mlp")),
                                         "model.ln_f"]
    ckpt.teardown()
    assert tiled_names(model.module) == []


# ------------------------------------------------------------------------------------------------ DDP, FSDP2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_under_ddp_and_fsdp2_tiled_gradients_equal_untiled(token_wise_dist, strategy):
    from _tile_dist import TILE as DIST_TILE

    plain, tiled = token_wise_dist[f"{strategy}-plain"], token_wise_dist[f"{strategy}-tiled"]
    for rank in range(2):
        assert "error" not in plain[rank], plain[rank].get("traceback")
        assert "error" not in tiled[rank], tiled[rank].get("traceback")
        # block 0 checkpointed: forward, layer recompute (and the tiles' own recomputes, but for the last tile's, which
        # torch keeps from the layer's recompute); block 1: forward (and each tile's recompute)
        assert plain[rank]["rows"] == {0: [16, 16], 1: [16]}
        assert tiled[rank]["rows"] == {0: [DIST_TILE] * 11, 1: [DIST_TILE] * 8}
        want, got = plain[rank]["grads"], tiled[rank]["grads"]
        assert got.keys() == want.keys() and len(want) > 0
        for name in want:
            rel = float((got[name] - want[name]).norm() / want[name].norm())
            assert rel <= 1e-6, (name, rel)


def test_with_a_budget_every_step_runs_tiled_the_planned_ones_too():
    """``tile_mlp=True`` with a budget: the measuring step and the steps under its plan (which wraps each layer anew)
    all run the MLPs tiled. (Tiling is not priced by the plan yet: ``tile_mlp=None`` will let it choose.)"""
    from lightning.pytorch import Callback, Trainer

    from lightning_ckpt.demos import GPT, CountingDataModule

    class Record(Callback):
        tiled: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.tiled.append(len(tiled_names(pl_module)))

    callback = GradientCheckpointing(memory_budget=0.5, tile_mlp=True, tile_tokens=8, chunk_loss=False)
    record = Record()
    record.tiled = []
    model = GPT(vocab_size=32, block_size=32, n_layer=4, n_embd=32, n_head=2, dropout=0.0)
    trainer = Trainer(max_steps=3, callbacks=[callback, record], accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=32, batch_size=4, num_samples=64))
    assert callback.plan is not None and "none" in callback.plan.layers.values()
    assert record.tiled == [13, 13, 13]  # each block's ln1, ln2 and mlp, and ln_f, on the measuring step and under the plan


# ------------------------------------------------------------------------------------------------ what is token-wise


def test_only_modules_that_compute_each_token_alone_are_token_wise():
    from lightning_ckpt.core.checkpoint.tiling import _is_token_wise

    assert _is_token_wise(litgpt.model.RMSNorm(8)) and not _is_token_wise(litgpt.model.RMSNorm(8, dim=-2))
    assert _is_token_wise(nn.Sequential(nn.Linear(4, 4))) and not _is_token_wise(nn.Sequential())
    assert _is_token_wise(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 4)))
    assert not _is_token_wise(nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2)))


def test_apply_tiling_returns_names_in_registration_order_and_says_once_of_an_mlp_it_does_not_know(caplog, monkeypatch):
    monkeypatch.setattr("lightning_ckpt.core.checkpoint.say_once._said", set())  # said once per process: whatever ran before
    model = hf_model("llama")
    names = apply_tiling(model)
    assert names == [n for n, m in model.named_modules() if is_tiled(m)]
    assert names[:3] == ["model.layers.0.mlp", "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]
    demo = demo_model()
    demo.blocks[0].mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.MultiheadAttention(HIDDEN, 2))
    demo.blocks[1].ln1 = nn.BatchNorm1d(HIDDEN)  # not token-wise either, but not an MLP: nothing said
    with caplog.at_level("INFO", logger="lightning_ckpt.core.checkpoint.tiling"):
        assert apply_tiling(demo) == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln2", "blocks.1.mlp", "ln_f"]
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_ckpt.core.checkpoint.tiling"]
    assert said == ["lightning_ckpt: the `mlp` of Block is a Sequential, not a class known to be token-wise: it is not"
                    " tiled (pass tile_cls= its class to tile it)."]


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class _Tuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class _Unsigned(nn.Module):
    """A forward whose signature cannot be read: taken as called with the hidden states alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    forward.__signature__ = "unreadable"  # type: ignore[attr-defined]  (inspect.signature raises TypeError)


def test_refusals_before_anything_changes_with_their_whole_messages():
    holder = nn.ModuleDict({"pair": _Pair()})
    with pytest.raises(TypeError) as info:
        apply_tiling(holder, tile_cls=_Pair)
    assert str(info.value) == (
        f"`pair` ({_Pair.__module__}._Pair) takes more than one tensor argument: tiling splits one input, the hidden"
        " states, along the sequence. Pass tile_cls= a class called with the hidden states alone (the MLP), or"
        " tile_mlp=False.")
    with pytest.raises(ValueError) as info:
        apply_tiling(demo_model(), tile_tokens=0)
    assert "pass an int >= 1 (e.g. 4096), or None for ALST's rule" in str(info.value)
    with pytest.raises(ValueError) as info:
        apply_tiling(nn.ModuleDict({"a": nn.Linear(2, 2)}), tile_cls=nn.Conv1d)
    assert str(info.value) == ("`tile_cls=<class 'torch.nn.modules.conv.Conv1d'>` matches no submodule of ModuleDict:"
                               " pass the class of its MLP.")
    with pytest.raises(ValueError) as info:
        apply_tiling(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    assert str(info.value) == (
        "tile_mlp=True found no MLP it knows to be token-wise in ModuleDict (it knows the decoder layers of"
        " Transformers' Llama, Mistral, Qwen2/3, Phi3, Gemma/2/3, litgpt's Block and the demo GPT's Block). Pass"
        " tile_cls= the class of your layers' MLP (a class or its dotted import path), whose forward computes each"
        " token alone; or tile_mlp=False.")
    # a block tiled whole first, then its parts: refused as the other order is (test_errors), nothing changed
    model = demo_model()
    apply_tiling(model, tile_cls=type(model.blocks[0]))
    with pytest.raises(ValueError) as info:
        apply_tiling(model)
    assert str(info.value) == ("`blocks.0.ln1` would be tiled inside `blocks.0`, which is tiled too: each tile would run"
                               " the inner tiles again. Pass a tile_cls that matches one of them, or call"
                               " `remove_tiling` first.")
    assert tiled_names(model) == ["blocks.0", "blocks.1"]
    unsigned = nn.ModuleDict({"u": _Unsigned()})
    assert apply_tiling(unsigned, tile_cls=_Unsigned, tile_tokens=2) == ["u"]
    x = torch.randn(1, 5, 3, requires_grad=True)
    assert torch.equal(unsigned["u"](x), torch.relu(x))


def test_what_a_tiled_call_refuses_and_what_it_runs_whole():
    pair = nn.ModuleDict({"m": OwnMLP()})
    apply_tiling(pair, tile_cls=OwnMLP, tile_tokens=2)
    x = torch.randn(1, 4, 8, requires_grad=True)
    with pytest.raises(TypeError) as info:
        pair["m"](x, torch.ones(8))
    assert str(info.value) == (
        "lightning_ckpt: the tiled OwnMLP was called with more than one tensor (2); tiling splits only its first"
        " argument along the sequence. Tile a module that takes the hidden states alone (pass tile_cls= its class),"
        " or tile_mlp=False.")
    assert torch.equal(pair["m"](x=x), OwnMLP.forward(pair["m"], x))  # no positional argument: whole
    tupled = nn.ModuleDict({"t": _Tuple()})
    apply_tiling(tupled, tile_cls=_Tuple, tile_tokens=2)
    with pytest.raises(TypeError) as info:
        tupled["t"](x)
    assert str(info.value) == (
        "lightning_ckpt: the tiled _Tuple returned tuple for a tile of (1, 2, 8): a tiled module must return one tensor"
        " with a row per token (dim -2). Pass tile_mlp=False, or tile_cls= a token-wise class.")


def test_even_a_single_token_runs_as_a_tile_under_checkpoint():
    """Autograd saves only each tile's input (for its checkpoint), whatever the length: nothing the module computes."""
    module = nn.ModuleDict({"m": OwnMLP()})
    apply_tiling(module, tile_cls=OwnMLP, tile_tokens=2)
    for length, tiles in ((1, [1]), (2, [2]), (5, [2, 2, 1])):
        saved: list[torch.Size] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            out = module["m"](torch.randn(1, length, 8, requires_grad=True))
            out.sum().backward()
        assert saved == [torch.Size([1, t, 8]) for t in tiles], (length, saved)
        # one tile is the output itself, not a copy joined from one piece
        assert (type(out.grad_fn).__name__ == "CatBackward0") == (len(tiles) > 1)
    whole: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: whole.append(t.shape) or t, lambda t: t):
        OwnMLP.forward(module["m"], torch.randn(1, 1, 8, requires_grad=True)).sum().backward()
    assert whole  # the case has teeth: untiled, the layer's own saved tensors are seen


def test_apply_checkpointing_refuses_tile_options_it_cannot_honour_with_their_whole_messages():
    model = demo_model()
    with pytest.raises(TypeError) as info:
        apply_checkpointing(model, tile_mlp="yes")
    assert str(info.value) == ("`tile_mlp` is True or False, got 'yes'. Pass True to run each layer's MLP over tiles"
                               " of tokens, or False.")
    with pytest.raises(ValueError) as info:
        apply_checkpointing(model, tile_tokens=8)
    assert str(info.value) == ("`tile_tokens=8` and `tile_cls=None` say how `tile_mlp=True` tiles, but tile_mlp is"
                               " False. Pass tile_mlp=True with them, or leave both None.")
    with pytest.raises(ValueError) as info:  # a layer inside a tiled module: the MLP's first Linear
        apply_checkpointing(model, layer_cls=nn.Linear, tile_mlp=True)
    assert str(info.value) == ("`blocks.0.mlp.0` would be checkpointed inside the tiled `blocks.0.mlp`, whose tiles"
                               " already run under checkpoint: it would be recomputed twice. Pass a layer_cls around"
                               " the MLP (the decoder layer), or tile_mlp=False.")
    assert checkpointed_names(model) == [] and tiled_names(model) == []
