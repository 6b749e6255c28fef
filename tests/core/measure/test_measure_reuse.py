"""A measuring step re-runs each distinct layer once: identical layers called alike reuse its figures.

Each measured layer is re-run plainly and backpropagated to its inputs (``rerun._rerun``). Layers of one class
with the same configuration, weights' shapes, training flags and arguments' shapes measure the same, so only the
first is re-run; every case here checks that the figures are exactly those of re-running every layer (the reuse
switched off), and that a layer differing in any one of these gets its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt.core.measure import layer_costs as measure
from lightning_ckpt.core.measure import rerun, rerun_key
from lightning_ckpt.core.measure.costs import LayerCost
from lightning_ckpt.core.measure.layer_costs import measure_step

WIDTH, HIDDEN, BATCH, LENGTH = 16, 32, 4, 16

Call = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Layer(nn.Module):
    """Two linears around an activation (``act``), dropout, an optional mask on the hidden activations."""

    def __init__(self, hidden: int = HIDDEN, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, hidden)
        self.fc2 = nn.Linear(hidden, WIDTH)
        self.drop = nn.Dropout(0.5)
        self.act = act

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.fc1(x.to(self.fc1.weight.dtype))
        h = F.gelu(h) if self.act == "gelu" else torch.tanh(h).exp()
        if mask is not None:
            h = h * mask
        return x + self.fc2(self.drop(h)).to(x.dtype)


class Routed(nn.Module):
    """Only the tokens whose first feature is positive go through the linear: how many depends on the data (as a
    mixture of experts' routing does), so do the bytes it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[..., 0] > 0
        return x.index_put((mask,), torch.tanh(self.fc(x[mask])))


class Stack(nn.Module):
    """A stem, then the layers, each called as ``calls`` says (default: ``layer(x)``)."""

    def __init__(self, layers: list[nn.Module], calls: Optional[dict[int, Call]] = None) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(layers)
        self.calls = calls or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, layer in enumerate(self.layers):
            x = self.calls[i](layer, x) if i in self.calls else layer(x)
        return x


def _frozen(layer: Layer) -> Layer:
    return layer.requires_grad_(False)


def _hooked(layer: Layer) -> Layer:
    layer.fc1.register_forward_hook(lambda module, args, out: out.exp())
    return layer


def _dropout_off(layer: Layer) -> Layer:
    layer.drop.eval()
    return layer


#: How the third of four layers differs from the others: its own figures, not the others'.
VARIANTS: dict[str, tuple[Callable[[], nn.Module], Optional[Call]]] = {
    "wider": (lambda: Layer(hidden=2 * HIDDEN), None),
    "other configuration": (lambda: Layer(act="tanh-exp"), None),
    "float64 weights": (lambda: Layer().double(), None),
    "frozen weights": (lambda: _frozen(Layer()), None),
    "hook on a submodule": (lambda: _hooked(Layer()), None),
    "a submodule in eval mode": (lambda: _dropout_off(Layer()), None),
    "shorter input": (Layer, lambda layer, x: torch.cat([layer(x[:, :LENGTH // 2]), x[:, LENGTH // 2:]], 1)),
    "a tensor keyword argument": (Layer, lambda layer, x: layer(x, mask=torch.ones(HIDDEN))),
}


def stack(variant: Optional[str]) -> Stack:
    torch.manual_seed(0)
    layers: list[nn.Module] = [Layer() for _ in range(4)]
    calls = {}
    if variant is not None:
        make, call = VARIANTS[variant]
        layers[2] = make()
        if call is not None:
            calls[2] = call
    return Stack(layers, calls)


def measured(model: nn.Module, layer_cls: type[nn.Module], reuse: bool, monkeypatch: pytest.MonkeyPatch,
             step: Optional[Callable[[], torch.Tensor]] = None) -> tuple[list[LayerCost], int]:
    """The layers' costs from one measuring step (default: a :class:`Stack`'s), and how many backward measurements
    (re-runs) it took; ``reuse=False``: every layer re-run."""
    backward_bytes = rerun._backward_bytes
    runs = 0

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal runs
        runs += 1
        return backward_bytes(*args, **kwargs)

    rerun_key._names_read.cache_clear()  # what a class's code reads, cached per process: read anew for each case
    with monkeypatch.context() as patch:
        patch.setattr(rerun, "_backward_bytes", counting)
        if not reuse:
            patch.setattr(measure, "_rerun_key", lambda *args: None)
        if step is None:
            x = torch.randn(BATCH, LENGTH, WIDTH, generator=torch.Generator().manual_seed(1))
            step = lambda: model(x).square().mean()  # noqa: E731
        costs = measure_step(model, step, layer_cls).costs
    return costs, runs


def figures(cost: LayerCost) -> tuple[object, ...]:
    return (cost.none_bytes, cost.selective_bytes, cost.full_flops, cost.selective_flops, cost.transient_bytes,
            cost.saved_sizes, cost.ops)


def test_identical_layers_are_rerun_once_and_measure_as_each_on_its_own(monkeypatch):
    model = stack(None)
    costs, runs = measured(model, Layer, reuse=True, monkeypatch=monkeypatch)
    alone, runs_alone = measured(model, Layer, reuse=False, monkeypatch=monkeypatch)
    assert (runs, runs_alone) == (1, 4)
    assert costs == alone


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_layer_that_differs_gets_its_own_figures(variant, monkeypatch):
    model = stack(variant)
    costs, runs = measured(model, Layer, reuse=True, monkeypatch=monkeypatch)
    alone, _ = measured(model, Layer, reuse=False, monkeypatch=monkeypatch)
    assert costs == alone
    assert runs == 2  # the three identical layers once, the other one once
    assert figures(costs[2]) != figures(costs[0]) == figures(costs[1]) == figures(costs[3])


def test_layers_whose_ops_depend_on_the_data_are_each_rerun(monkeypatch):
    """Identical routed layers, each routing a different number of tokens: no figures are reused."""
    torch.manual_seed(0)
    model = Stack([Routed() for _ in range(4)])
    costs, runs = measured(model, Routed, reuse=True, monkeypatch=monkeypatch)
    alone, _ = measured(model, Routed, reuse=False, monkeypatch=monkeypatch)
    assert costs == alone
    assert runs == 4
    assert len({c.none_bytes for c in costs}) > 1  # the case has teeth: the layers do measure differently


def test_a_demo_gpt_measures_its_blocks_with_one_rerun(monkeypatch):
    """The transformer the dynamic benchmark trains: six identical blocks, one re-run."""
    from lightning_ckpt.demos import Block, Transformer

    torch.manual_seed(0)
    model = Transformer(32, 16, n_layer=6, n_embd=WIDTH, n_head=4, dropout=0.1)
    idx = torch.randint(0, 32, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    costs, runs = measured(model, Block, reuse=True, monkeypatch=monkeypatch, step=step)
    alone, runs_alone = measured(model, Block, reuse=False, monkeypatch=monkeypatch, step=step)
    assert (runs, runs_alone) == (1, 6)
    assert costs == alone


def _under_bf16_autocast(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return layer(x)


def test_a_layer_called_under_autocast_gets_its_own_figures(monkeypatch):
    """The third layer runs under bf16 autocast: its weights, arguments and call are the others', but it saves
    bf16. Per layer, 64 tokens: fp32 saves x (64 x 16 x 4 = 4,096 B), the fc1 output, dropout's mask and the fc2
    input (64 x 32 x 4 = 8,192 B each): 28,672 B; under autocast the same at 2 bytes (2,048 + 3 x 4,096) and the
    two weights' bf16 copies (2 x 1,024): 16,384 B."""
    torch.manual_seed(0)
    model = Stack([Layer() for _ in range(4)], calls={2: _under_bf16_autocast})
    costs, runs = measured(model, Layer, reuse=True, monkeypatch=monkeypatch)
    alone, _ = measured(model, Layer, reuse=False, monkeypatch=monkeypatch)
    assert [c.none_bytes for c in costs] == [28_672, 28_672, 16_384, 28_672]
    assert costs == alone and runs == 2


class Indexed(Layer):
    """A ``Layer`` that keeps its index, which its code never reads (litgpt's attention keeps `block_idx` so)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


class OddExp(Indexed):
    """An ``Indexed`` whose forward reads its index: the odd ones end in ``exp``, which saves its output."""

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = super().forward(x, mask)
        return out.exp() if self.index % 2 else out


def test_layers_differing_only_in_an_index_their_code_never_reads_are_rerun_once(monkeypatch):
    """litgpt keeps each block's `block_idx` on its attention and never reads it after __init__: its 6 blocks were
    re-run 6 times in each measuring step (most of issue 29's 1.87x measuring step). An int no code of the layer's
    modules reads is left out of the key."""
    torch.manual_seed(0)
    model = Stack([Indexed(i) for i in range(4)])
    costs, runs = measured(model, Indexed, reuse=True, monkeypatch=monkeypatch)
    alone, runs_alone = measured(model, Indexed, reuse=False, monkeypatch=monkeypatch)
    assert (runs, runs_alone) == (1, 4)
    assert costs == alone


def test_litgpt_blocks_are_rerun_once(monkeypatch):
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=4, n_embd=WIDTH, n_head=4, block_size=LENGTH, vocab_size=32, padded_vocab_size=32,
                           bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    model = litgpt.GPT(config).train()
    idx = torch.randint(0, 32, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    costs, runs = measured(model, litgpt.model.Block, reuse=True, monkeypatch=monkeypatch, step=step)
    alone, runs_alone = measured(model, litgpt.model.Block, reuse=False, monkeypatch=monkeypatch, step=step)
    assert (runs, runs_alone) == (1, 4)
    assert costs == alone


def _logged(forward):  # a decorator as Transformers puts on forward: the body read is the wrapped function's
    import functools

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class DecoratedOddExp(Indexed):
    @_logged
    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = super().forward(x, mask)
        return out.exp() if self.index % 2 else out


class NamedOddExp(Indexed):
    """Its index as a name in a dict, read by ``getattr`` with a literal: ``self.names`` never appears as an
    attribute read in its code."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.names = {"parity": "odd" if index % 2 else "even"}

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = super().forward(x, mask)
        return out.exp() if getattr(self, "names")["parity"] == "odd" else out


# the decorated forward: the wrapped body is read; a dict read through getattr: the literal counts as a read
@pytest.mark.parametrize("layer", [OddExp, DecoratedOddExp, NamedOddExp])
def test_layers_whose_forward_reads_their_index_are_each_rerun(layer, monkeypatch):
    torch.manual_seed(0)
    model = Stack([layer(i) for i in range(4)])
    costs, runs = measured(model, layer, reuse=True, monkeypatch=monkeypatch)
    alone, _ = measured(model, layer, reuse=False, monkeypatch=monkeypatch)
    assert runs == (2 if layer is NamedOddExp else 4)  # NamedOddExp: its index unread, its parity read: two kinds
    assert costs == alone
    assert figures(costs[0]) != figures(costs[1])  # the case has teeth: reused, layer 1 would get layer 0's


@pytest.mark.parametrize("tile_tokens", [(4, 4), (4, 8)], ids=["alike", "differently"])
def test_tiled_blocks_are_rerun_once_when_tiled_alike(tile_tokens, monkeypatch):
    """Six demo GPT blocks whose MLPs run over tiles of tokens: tiled alike, one re-run measures all, as each on its
    own; one block tiled differently (8 tokens a tile, not 4) gets a re-run of its own."""
    from lightning_ckpt.core.checkpoint.tiling import apply_tiling
    from lightning_ckpt.demos import Block, Transformer

    torch.manual_seed(0)
    model = Transformer(32, 16, n_layer=6, n_embd=WIDTH, n_head=4, dropout=0.0)
    apply_tiling(model, tile_tokens=tile_tokens[0])
    apply_tiling(model.blocks[5], tile_tokens=tile_tokens[1])
    idx = torch.randint(0, 32, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    costs, runs = measured(model, Block, reuse=True, monkeypatch=monkeypatch, step=step)
    alone, runs_alone = measured(model, Block, reuse=False, monkeypatch=monkeypatch, step=step)
    assert (runs, runs_alone) == (1 if tile_tokens[0] == tile_tokens[1] else 2, 6)
    assert costs == alone


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Gemma2", "Llama-LoRA"])
def test_transformers_decoder_layers_are_rerun_once_per_kind(family, monkeypatch):
    """Transformers' attention reads its `layer_idx` in forward only to index the KV cache: without a cache, decoder
    layers differing only in it share one re-run (an 8B's 32 layers were re-run 32 times in each measuring step, most
    of `plan`'s time on a LoRA 8B). Gemma2 alternates sliding and global attention: two kinds, two re-runs. PEFT's
    adapters keep their qualified name (in `kwargs`, never read in forward); under LoRA the first layer's input needs
    no gradient (the embedding is frozen), the others' does: two re-runs."""
    transformers = pytest.importorskip("transformers")
    lora = family.endswith("-LoRA")
    family = family.removesuffix("-LoRA")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=32, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=LENGTH, sliding_window=4, use_cache=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).train()
    layer_cls = type(model.model.layers[0])
    if lora:
        peft = pytest.importorskip("peft")
        lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      init_lora_weights=False)
        model = peft.get_peft_model(model, lora_config).train()
    idx = torch.randint(0, 32, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    step = lambda: model(input_ids=idx, labels=idx).loss  # noqa: E731
    costs, runs = measured(model, layer_cls, reuse=True, monkeypatch=monkeypatch, step=step)
    alone, runs_alone = measured(model, layer_cls, reuse=False, monkeypatch=monkeypatch, step=step)
    assert (runs, runs_alone) == (2 if family == "Gemma2" or lora else 1, 4)
    assert costs == alone



# ------------------------------------------------------------------------------------------------ the key's parts


def key(layer: nn.Module, *args: object, **kwargs: object) -> object:
    rerun_key._names_read.cache_clear()
    return rerun_key._rerun_key(layer, args, kwargs, set())


X = torch.ones(2, WIDTH)


class Activation(nn.Module):
    """Two activations of a class given at construction (``nn.Tanh`` or ``nn.Sigmoid``: no attributes of their own)."""

    def __init__(self, kind: type[nn.Module], shared: bool = False) -> None:
        super().__init__()
        self.a = kind()
        self.b = self.a if shared else kind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class LayerIndexed(Layer):
    """Not a Transformers attention: its `layer_idx` is read in forward and changes what it computes."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, mask) * (self.layer_idx + 1)


def test_the_key_tells_apart_what_changes_the_forward_and_nothing_else():
    assert key(Activation(nn.Tanh), X) == key(Activation(nn.Tanh), X)
    assert key(Activation(nn.Tanh), X) != key(Activation(nn.Sigmoid), X)  # submodules' classes
    assert key(Activation(nn.Tanh, shared=True), X) == key(Activation(nn.Tanh), X)  # one module twice computes alike
    assert key(LayerIndexed(0), X) != key(LayerIndexed(1), X)  # a layer_idx read outside Transformers' attentions
    # an own forward: by its function; a plain function set on the instance, by identity
    bound, other = Activation(nn.Tanh), Activation(nn.Tanh)
    bound.forward = Activation.forward.__get__(bound)
    assert key(bound, X) == key(Activation(nn.Tanh), X)
    plain, plain2 = Activation(nn.Tanh), Activation(nn.Tanh)
    plain.forward = lambda x: torch.tanh(torch.tanh(x))
    plain2.forward = lambda x: torch.tanh(torch.tanh(x))
    assert key(plain, X) is not None and key(plain, X) != key(plain2, X) != key(other, X)
    # what cannot be compared gets no key: another object among the arguments, global hooks
    assert key(Activation(nn.Tanh), X, note=object()) is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert key(Activation(nn.Tanh), X) is None
    finally:
        handle.remove()


def test_values_in_a_key():
    def values(*leaves: object, by_identity: bool = True) -> object:
        return rerun_key._values_key(leaves, {}, set(), by_identity)

    class Plain(nn.Module):
        pass

    class Other(nn.Module):
        pass

    assert values(1) != values(True) != values(1.0)  # equal in Python, not to a forward
    assert values(Plain()) == values(Plain()) != values(Other())  # stateless: by class
    one, two = object(), object()
    assert values(one) == values(one) != values(two)  # other objects: by identity in a module's configuration
    assert values(one, by_identity=False) is None  # and not comparable at all among the arguments
    import functools

    t = torch.ones(3)
    assert values(functools.partial(torch.add, t, alpha=2)) == values(functools.partial(torch.add, t, alpha=2))
    assert values(functools.partial(torch.add, t, alpha=2)) != values(functools.partial(torch.add, t, alpha=3))


def test_plain_data_and_stateless_modules():
    assert rerun_key._plain_data({1: "a", "b": (2.0, None, [True])})
    assert not rerun_key._plain_data({object(): 1}) and not rerun_key._plain_data({1: object()})
    assert not rerun_key._plain_data([1, object()]) and not rerun_key._plain_data((nn.ReLU(),))
    assert rerun_key._stateless_module(nn.Tanh())
    with_buffer, with_child, with_param, with_attr = nn.Module(), nn.Module(), nn.Module(), nn.Module()
    with_buffer.register_buffer("b", torch.ones(1))
    with_child.c = nn.Tanh()
    with_param.p = nn.Parameter(torch.ones(1))
    with_attr.scale = 2
    assert not any(map(rerun_key._stateless_module, (with_buffer, with_child, with_param, with_attr, object())))


def test_the_names_code_reads():
    def outer(self: object) -> object:
        def inner() -> object:
            return self.hidden  # type: ignore[attr-defined]
        return getattr(self, "by_literal"), inner(), "not an identifier!"

    names = rerun_key._code_names(outer.__code__)
    assert {"hidden", "by_literal"} <= names and "not an identifier!" not in names and "getattr" in names


class _Sharded(nn.Parameter):
    """A parameter that looks like a DTensor shard (``to_local``): its gradient is FSDP's to reduce, not ours."""

    def to_local(self) -> torch.Tensor:
        return self


def test_what_a_re_runs_backward_starts_from_and_goes_to():
    from lightning_ckpt.core.checkpoint.tiling import apply_tiling
    from lightning_ckpt.demos import Block

    torch.manual_seed(0)
    block = Block(WIDTH, 4, 0.0)
    x = torch.randn(2, 16, WIDTH, requires_grad=True)
    out = block(x)
    seed, wrt = rerun._backward_seed(block, [x], out)
    assert seed is not None and wrt == [x]  # an input that needs a gradient: to it alone
    apply_tiling(nn.ModuleDict({"b": block}), tile_tokens=4)  # its norms and MLP over tiles: their weights too,
    block.ln2.bias = _Sharded(block.ln2.bias.detach())  # less a sharded one
    tiled = [p for name in ("ln1", "ln2", "mlp") for p in block.get_submodule(name).parameters()
             if not isinstance(p, _Sharded)]
    assert [id(t) for t in rerun._backward_seed(block, [x], block(x))[1]] == [id(t) for t in [x, *tiled]]
    frozen = x.detach()  # a frozen input (PEFT): to the layer's trainable weights, less a sharded or frozen one
    block.attn.qkv.weight = _Sharded(block.attn.qkv.weight.detach())
    block.ln1.weight.requires_grad_(False)
    seed, wrt = rerun._backward_seed(block, [frozen], block(frozen))
    expected = [p for p in block.parameters() if p.requires_grad and not isinstance(p, _Sharded)]
    assert seed is not None and [id(p) for p in wrt] == [id(p) for p in expected]
    assert rerun._backward_seed(block, [x], block(x).detach()) == (None, [x, *[p for p in tiled if p.requires_grad]])
    with torch.no_grad():  # nothing needs a gradient at all
        assert rerun._backward_seed(nn.Linear(2, 2).requires_grad_(False), [frozen], torch.ones(2))[0] is None
