"""Tiles of tokens on the CPU (issue 38): measured peak against the plan's, and the tiled step's time side by side.

A Transformers ``LlamaForCausalLM`` from a small config whose SwiGLU MLP dominates a layer (hidden 64, intermediate
512, 4 heads, 2 layers, vocab 256), fp32, one sequence of 2,048 tokens. Two plans, each with every layer fully
checkpointed (``modes=("full",)`` at the least budget it reaches): without tiles, and with each layer's MLP and its
norms, and the final norm, over tiles of tokens (``tile_mlp=True``: ALST's rule, ``ceil(2048 / 64)`` = 32 tiles of
64). For each:

- the plan's predicted activation peak (``plan.peak_bytes``), and the peak of one real step under the applied plan,
  counted by ``benchmarks/_peak.py`` (storages alive after each op, forward and backward, the parameters' gradients
  left out): it must be within 5%;
- the step time (forward and backward), both plans interleaved, median of 7, as a ratio to the untiled plan.

The bytes tiles remove, by hand: each MLP's [2048, 512] float32 intermediates (gate, up, SiLU(gate), their product:
4 MiB each) less one tile's.

    python benchmarks/bench_tiling.py          # writes RESULTS.md ("tiles of tokens on the CPU")
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from typing import Optional

import torch
import transformers

from _peak import counted_peak
from _results import machine, write_section
from lightning_ckpt import remove_checkpointing
from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import plan_checkpointing

T, HIDDEN, INTERMEDIATE = 2048, 64, 512


def model_and_step():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=T, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.train()
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def least_plan(model, step, tile_mlp: bool):
    """Every layer fully checkpointed: the plan at the least budget ``modes=("full",)`` reaches."""
    try:
        plan_checkpointing(model, step, "1KiB", modes=("full",), tile_mlp=tile_mlp)
    except ValueError as err:
        least = int(re.search(r"pass a budget of at least (\d+) bytes", str(err)).group(1))
    return plan_checkpointing(model, step, least, modes=("full",), tile_mlp=tile_mlp)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args(argv)
    model, step = model_and_step()
    plans = {tiles: least_plan(model, step, tiles) for tiles in (False, True)}
    peaks = {}
    for tiles, plan in plans.items():
        plan.apply(model)
        peaks[tiles] = counted_peak(model, step)
        remove_checkpointing(model)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved: both plans see the same machine
        for tiles, plan in plans.items():
            plan.apply(model)
            started = time.perf_counter()
            step().backward()
            times[tiles].append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
            remove_checkpointing(model)
    base = statistics.median(times[False])
    lines = ["| plan (every layer full) | predicted peak | measured peak | measured / predicted | step time vs untiled |",
             "|---|---:|---:|---:|---:|"]
    for tiles, plan in plans.items():
        ratio = peaks[tiles] / plan.peak_bytes
        lines.append(f"| {'tiled (32 tiles of 64)' if tiles else 'untiled'} | {plan.peak_bytes:,} B"
                     f" ({format_bytes(plan.peak_bytes)}) | {peaks[tiles]:,} B | {ratio:.3f}"
                     f" | {statistics.median(times[tiles]) / base:.2f}x |")
    removed = peaks[False] - peaks[True]
    per_tensor = T * INTERMEDIATE * 4
    checks = [f"- tiles removed {removed:,} B from the measured peak: {removed / per_tensor:.2f} of the MLP's [2048, 512]"
              f" float32 intermediates ({per_tensor:,} B each);",
              f"- measured within 5% of predicted: untiled {abs(peaks[False] / plans[False].peak_bytes - 1) <= 0.05},"
              f" tiled {abs(peaks[True] / plans[True].peak_bytes - 1) <= 0.05};",
              f"- the tiles' second forward, priced: {plans[True].recompute_flops - plans[False].recompute_flops:,} FLOP"
              " more recompute per step than untiled."]
    text = "\n".join([
        "## Tiles of tokens on the CPU (`bench_tiling.py`)",
        f"{machine()}; transformers {transformers.__version__}. " + " ".join(__doc__.split("\n\n")[1].split()),
        "", *lines, "", *checks])
    print(text)
    if not args.no_write:
        write_section("tiles of tokens on the CPU", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
