"""What one checkpointed decoder layer holds at its backward peak, and how much tiles remove (issue 38).

A Transformers ``LlamaDecoderLayer`` in Llama-3-8B's ratios at a width this machine runs (hidden 512, intermediate
1,792, 8 heads, 2 KV heads), one sequence of 8,192 tokens, under full non-reentrant checkpoint as a plan's layer is
(its input kept, everything recomputed in backward), in two precisions (``bf16-mixed``: fp32 weights under autocast;
``bf16-true``: bf16 weights) and four tilings: none; the MLP alone (``tile_cls=LlamaMLP``); the MLP and the norm
before it (what ``tile_mlp=True`` tiled before this session); the MLP and every norm (``tile_mlp=True`` now); and untiled with lean layers (``lean_layers=True``: norms recomputed in backward, the gated MLP keeping gate and up). A dispatch mode counts the storages alive after every op, forward and
backward (the layer input and the output gradient included, as in a step); at the most alive at once it lists them by
the op and shape that made them. Figures are bytes per token per hidden unit: at hidden 4,096 multiply by 4,096.

    python benchmarks/bench_layer_bytes.py    # writes RESULTS.md ("one layer's bytes"); prints each peak's storages
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from _results import machine, write_section
from lightning_ckpt.core.checkpoint.lean import apply_lean
from lightning_ckpt.core.checkpoint.tiling import apply_tiling

T, HIDDEN, INTERMEDIATE, TILE = 8192, 512, 1792, 256
_LLAMA = "transformers.models.llama.modeling_llama"


class AliveAtPeak(TorchDispatchMode):
    """Storages made inside, alive after each op; at the most bytes alive, what each was made by."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[Any, int, str]] = {}
        self.peak, self.at_peak, self.phase = 0, [], "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not torch.UntypedStorage._expired(v[0])}
        read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self.live and key not in read:
                    what = f"{self.phase} {func.__name__} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                    self.live[key] = (t.untyped_storage()._weak_ref(), t.untyped_storage().nbytes(), what)
        alive = sum(n for _, n, _ in self.live.values())
        if alive > self.peak:
            self.peak, self.at_peak = alive, [(what, n) for _, n, what in self.live.values()]
        return out


def layer_peak(bf16_weights: bool, tiles: str) -> tuple[float, list[tuple[str, float]]]:
    """Bytes per token per hidden unit at the layer's peak, and the storages then (by maker, largest first)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=T, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    dtype = torch.bfloat16 if bf16_weights else torch.float32
    model.to(dtype)
    layer = model.model.layers[0]
    if tiles in ("mlp", "mlp+norm"):
        apply_tiling(model, tile_cls=f"{_LLAMA}.LlamaMLP", tile_tokens=TILE)
    if tiles == "mlp+norm":
        apply_tiling(torch.nn.ModuleDict({"norm": layer.post_attention_layernorm}), tile_cls=f"{_LLAMA}.LlamaRMSNorm",
                     tile_tokens=TILE)
    elif tiles == "default":
        apply_tiling(model, tile_tokens=TILE)
    elif tiles == "lean":
        apply_lean(model)
    x = torch.randn(1, T, HIDDEN, dtype=dtype, requires_grad=True)
    positions = torch.arange(T)[None]
    counter = AliveAtPeak()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_weights):
        rotary = tuple(t.detach() for t in model.model.rotary_emb(x, positions))
        with counter:
            out = checkpoint(lambda h: layer(h, position_embeddings=rotary, attention_mask=None,
                                             position_ids=positions), x, use_reentrant=False)
            out = out[0] if isinstance(out, tuple) else out
            counter.phase = "backward"
            out.backward(torch.randn_like(out))
    by_maker: collections.Counter = collections.Counter()
    for what, n in counter.at_peak:
        by_maker[what] += n
    return counter.peak / T / HIDDEN, [(what, n / T / HIDDEN) for what, n in by_maker.most_common()]


def main() -> int:
    lines = ["| precision | untiled | the MLP tiled | the MLP and the norm before it | the MLP and every norm"
             " (`tile_mlp=True`) | untiled, lean layers (`lean_layers=True`) |", "|---|---:|---:|---:|---:|---:|"]
    details = {}
    for bf16_weights in (False, True):
        row = []
        for tiles in ("none", "mlp", "mlp+norm", "default", "lean"):
            peak, parts = layer_peak(bf16_weights, tiles)
            row.append(f"{peak:.1f}")
            details[(bf16_weights, tiles)] = parts
        lines.append(f"| {'bf16-true' if bf16_weights else 'bf16-mixed'} | " + " | ".join(row) + " |")
    for (bf16_weights, tiles), parts in details.items():
        print(f"\n{'bf16-true' if bf16_weights else 'bf16-mixed'}, tiles: {tiles}")
        for what, per in parts[:10]:
            print(f"  {per:6.2f}  {what}")
    top = [f"- at the peak with every norm tiled, bf16-mixed: " + "; ".join(
        f"{per:.2f} {what}" for what, per in details[(False, "default")][:8]),
           "- at the peak untiled with lean layers, bf16-mixed: " + "; ".join(
        f"{per:.2f} {what}" for what, per in details[(False, "lean")][:8])]
    text = "\n".join(["## One layer's bytes at its backward peak (`bench_layer_bytes.py`)",
                      f"{machine()}; transformers {transformers.__version__}. "
                      + " ".join(__doc__.split("\n\n")[1].split()), "", *lines, "", *top])
    print(text)
    write_section("one layer's bytes", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
