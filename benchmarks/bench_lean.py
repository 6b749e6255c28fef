"""What lean layers cost (``lean_layers=True``): FLOPs and time of one checkpointed decoder layer's step, lean or not.

A Transformers ``LlamaDecoderLayer`` in Llama-3-8B's ratios at a width this machine runs (hidden 512, intermediate
1,792, 8 heads, 2 KV heads), one sequence of 4,096 tokens, ``bf16-mixed`` (fp32 weights under CPU autocast), under
full non-reentrant checkpoint (its input kept, everything recomputed in backward), forward and backward:

- matmul and attention FLOPs by ``torch.utils.flop_counter.FlopCounterMode`` (lean layers add none);
- every other op's output elements by the package's ``count_cost`` (one per element): what the norms' second
  recompute and ``act(gate)`` again add;
- step time, lean over plain, measured side by side in one process, interleaved, the median of 9 pairs (after one
  warm-up each), on this shared 2-core CPU: a ratio, not a time to quote.

    python benchmarks/bench_lean.py    # writes RESULTS.md ("lean layers' cost")
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from _results import machine, write_section
from lightning_ckpt.core.checkpoint.lean import apply_lean
from lightning_ckpt.core.measure.profiling import count_cost

T, HIDDEN, INTERMEDIATE, PAIRS = 4096, 512, 1792, 9


def layer_step(lean: bool):
    """A function running one step of one checkpointed layer (lean or not), from the same weights and input."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=T, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    if lean:
        apply_lean(model)
    layer = model.model.layers[0]
    x = torch.randn(1, T, HIDDEN, requires_grad=True)
    positions = torch.arange(T)[None]
    grad = torch.randn(1, T, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rotary = tuple(t.detach() for t in model.model.rotary_emb(x, positions))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(lambda h: layer(h, position_embeddings=rotary, attention_mask=None,
                                             position_ids=positions), x, use_reentrant=False)
            out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    return step


def flops(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def main() -> int:
    plain, lean = layer_step(False), layer_step(True)
    counted = {name: (flops(step), count_cost(step)) for name, step in (("plain", plain), ("lean", lean))}
    for step in (plain, lean):
        step()  # warm-up
    ratios = []
    for _ in range(PAIRS):
        seconds = []
        for step in (plain, lean):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        ratios.append(seconds[1] / seconds[0])
    ratio = statistics.median(ratios)
    extra = counted["lean"][1] - counted["plain"][1]
    lines = ["| layer step | matmul and attention FLOPs (FlopCounterMode) | all ops, one per output element"
             " elsewhere (`count_cost`) |", "|---|---:|---:|",
             *(f"| {name} | {f:,} | {c:,} |" for name, (f, c) in counted.items()), "",
             f"- FLOPs lean over plain: {counted['lean'][0] / counted['plain'][0]:.4f}x; the other ops' elements:"
             f" {extra:,} more ({extra / counted['plain'][1]:.2%} of the step's count), about"
             f" {extra / T / HIDDEN:.1f} per token per hidden unit;",
             f"- step time lean over plain, median of {PAIRS} interleaved pairs: {ratio:.3f}x"
             f" (pairs from {min(ratios):.3f}x to {max(ratios):.3f}x)."]
    text = "\n".join(["## Lean layers' cost (`bench_lean.py`)",
                      f"{machine()}; transformers {transformers.__version__}. "
                      + " ".join(" ".join(__doc__.split("\n\n")[1:3]).split()), "", *lines])
    print(text)
    write_section("lean layers' cost", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
