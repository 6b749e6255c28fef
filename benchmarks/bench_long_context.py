"""The longest context that fits: a Llama-3-8B-shaped run planned by ``lightning-ckpt plan --lengths`` (issue 32).

The demo GPT with 32 layers, hidden size 4096, 32 heads and vocab 128,256 (dropout 0: CPU flash attention, as the
target's), ``bf16-mixed``, ``fsdp_ckpt`` over 8 devices as ``plan`` models it (one device's share of weights,
gradients and AdamW state), batch 1, ``--device-memory 80GiB --device h100-sxm``, measured on fake tensors at 8,192,
16,384, 32,768 and 49,152 tokens (a few seconds each on a CPU; nothing is allocated). Each row runs the plan command's
own pipeline with its options and reads:

- the longest length of a setting (``every_layer``: every layer fully checkpointed) or of the plan itself
  (``plan.json``'s ``largest_length``);
- its predicted step time per token at that length: for the plan, the plan the command made there; for a setting,
  the step measured again at its longest length and priced by :func:`~lightning_ckpt.core.plan.planner.predict_seconds`.

Issue 32's targets, checked and printed: the plan's longest length at least 2x exact full checkpointing's, and its
time per token at most 1.3x exact full checkpointing's at that setting's own longest length. Predictions only: nothing
ran on a GPU.

The last row is the plan with the chunked LM head and loss (``--chunk-loss auto``), the row the targets are checked
on; a table then compares its time per token with exact full checkpointing's at equal lengths (exact's longest,
twice it, and the plan's longest), where attention's T^2 is the same for both. One more plan row is one
``--plan-option`` away::

    python benchmarks/bench_long_context.py                       # writes RESULTS.md ("long context")
    python benchmarks/bench_long_context.py --plan-option=--chunk-loss=true --plot docs/images/long_context.png
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from _results import machine, write_section
from lightning_ckpt.commands.plan import _build, _compute, _measure, _parse, _run, plan_settings
from lightning_ckpt.commands.plan.measure import check_length, device_profile, static_memory
from lightning_ckpt.commands.plan.predictions import as_planned
from lightning_ckpt.commands.plan.report import _plot_lengths, report_data
from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import predict_peak, predict_seconds

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
MODEL = ["--trainer.accelerator=cuda", "--trainer.precision=bf16-mixed", "--trainer.strategy=fsdp_ckpt",
         "--trainer.devices=8", "--model.init_args.n_layer=32", "--model.init_args.n_embd=4096",
         "--model.init_args.n_head=32", "--model.init_args.vocab_size=128256", "--model.init_args.block_size=131072",
         "--model.init_args.dropout=0.0", "--data.init_args.vocab_size=128256", "--data.init_args.block_size=8192",
         "--data.init_args.batch_size=1"]
LENGTHS = "8192,16384,32768,49152"
COMMON = ["--config", str(CONFIG), "--lengths", LENGTHS, "--device-memory", "80GiB", "--device", "h100-sxm",
          "--memory-budget", "64GiB"]


@dataclass(frozen=True)
class Row:
    """One line of the table: a setting (``every_layer`` or ``plan``) planned with the command's options."""

    name: str
    setting: str
    options: tuple[str, ...]


ROWS = (
    Row("exact full checkpointing", "every_layer",
        ("--compress", "none", "--offload", "false", "--chunk-loss", "false")),
    Row("full checkpointing, fp8", "every_layer", ("--compress", "fp8", "--offload", "false", "--chunk-loss", "false")),
    Row("plan: offload auto, fp8", "plan", ("--compress", "fp8", "--offload", "auto", "--chunk-loss", "false")),
    Row("plan: offload auto, fp8, chunk_loss auto", "plan",
        ("--compress", "fp8", "--offload", "auto", "--chunk-loss", "auto")),
)
#: The row issue 32's targets are checked on: the plan with every setting it has (the chunked LM head and loss too).
TARGET_ROW = 3


@dataclass
class Longest:
    row: Row
    length: Optional[int]
    peak_bytes: Optional[int]  # the step's peak at that length, on one device
    static_bytes: int
    seconds: Optional[float]  # predicted step time at that length
    outside_bytes: Optional[int]  # held outside the layers there (embeddings, head logits, loss)
    wall_seconds: float
    data: Optional[dict[str, Any]] = None  # the row's plan.json
    chunk_tokens: Optional[int] = None  # the plan's LM head and loss in chunks of this many tokens
    head_peak_bytes: Optional[int] = None  # what the head's backward has alive at once there

    @property
    def per_token(self) -> Optional[float]:
        return None if self.seconds is None or not self.length else self.seconds / self.length


def longest(row: Row) -> Longest:
    """Run the plan command's pipeline for ``row`` (its report silenced) and read its longest length and time."""
    start = time.perf_counter()
    args = _parse([*COMMON, *row.options, *MODEL])
    with contextlib.redirect_stdout(io.StringIO()):
        built = _build(args)
        profile = device_profile(args.device, built)
        measured = _run(args, built)
        result = _compute(args, built, measured, profile,
                          lambda length: _measure(built, measured.main.batch_size, length))
    static = result.static.total
    if row.setting == "plan":
        plan_at = result.longest
        if plan_at is None or plan_at.plan is None:
            return Longest(row, None, None, static, None, None, time.perf_counter() - start, report_data(result))
        at = _measure(built, measured.main.batch_size, plan_at.length)
        chunks = plan_at.plan.chunk_tokens
        head = at.chunked if chunks is not None and at.chunked is not None else at
        return Longest(row, plan_at.length, plan_at.plan.peak_bytes, static, plan_at.plan.predicted_step_seconds,
                       head.outside_bytes, time.perf_counter() - start, report_data(result), chunks,
                       head.head_peak_bytes)
    length = result.largest_length[row.setting]
    assert length is not None, row
    check_length(built, length)
    at = _measure(built, measured.main.batch_size, length)
    layers = {c.name: "full" for c in at.costs} if row.setting == "every_layer" else {}
    costs = as_planned(at.costs, profile)
    peak = predict_peak(costs, at.outside_bytes, layers, head_bytes=at.head_bytes, head_peak_bytes=at.head_peak_bytes)
    seconds, _ = predict_seconds(costs, at.outside_ops, layers, profile)
    return Longest(row, length, peak, static, seconds, at.outside_bytes, time.perf_counter() - start,
                   head_peak_bytes=at.head_peak_bytes)


def parts(r: Longest) -> str:
    """The peak's parts at the row's longest length, in words: static memory, the layers' share of the activation
    peak, what is held outside the layers and what the LM head's backward has alive at once."""
    if r.length is None or r.peak_bytes is None or r.outside_bytes is None:
        return "no plan"
    chunks = f"LM head and loss in chunks of {r.chunk_tokens:,} tokens" if r.chunk_tokens else "LM head and loss whole"
    return (f"{chunks}; static {format_bytes(r.static_bytes)} + peak {format_bytes(r.peak_bytes)}, of which"
            f" {format_bytes(r.outside_bytes)} outside the layers and {format_bytes(r.peak_bytes - r.outside_bytes)}"
            f" layers; the head's backward has {format_bytes(r.head_peak_bytes or 0)} alive at once")


@dataclass
class SameLength:
    """Exact full checkpointing and the target row's plan at one length: predicted step times (the plan's made for
    80 GiB less static memory there)."""

    length: int
    exact_seconds: float
    exact_fits: bool  # its peak plus static memory within 80 GiB
    plan_seconds: Optional[float]
    chunk_tokens: Optional[int]


def same_lengths(lengths: list[int]) -> list[SameLength]:
    """Exact full checkpointing's predicted step time and the target row's plan's at each of ``lengths``: the cost of
    the plan's choices (offload, fp8, the chunked head) at equal lengths, where attention's T^2 is the same."""
    with contextlib.redirect_stdout(io.StringIO()):
        exact_built = _build(_parse([*COMMON, *ROWS[0].options, *MODEL]))
        args = _parse([*COMMON, *ROWS[TARGET_ROW].options, *MODEL])
        built = _build(args)
        profile = device_profile(args.device, built)
        room = args.device_memory - static_memory(built).total
        settings = plan_settings(built, profile)
        out = []
        for length in lengths:
            at = _measure(exact_built, 1, length)
            costs, layers = as_planned(at.costs, profile), {c.name: "full" for c in at.costs}
            seconds, _ = predict_seconds(costs, at.outside_ops, layers, profile)
            peak = predict_peak(costs, at.outside_bytes, layers, head_bytes=at.head_bytes,
                                head_peak_bytes=at.head_peak_bytes)
            plan, _ = settings.plan(_measure(built, 1, length), room)
            out.append(SameLength(length, seconds, peak <= room, plan and plan.predicted_step_seconds,
                                  plan and plan.chunk_tokens))
    return out


def same_table(rows: list[SameLength]) -> str:
    lines = ["| length (tokens) | exact full: step time | per token | fits 80 GiB | plan (offload auto, fp8, chunk_loss"
             " auto): step time | per token | LM head and loss | plan / exact per token |",
             "|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        plan = ("no plan | | |" if r.plan_seconds is None else
                f"{r.plan_seconds:.2f} s | {1e6 * r.plan_seconds / r.length:.1f} us |"
                f" {f'chunks of {r.chunk_tokens:,}' if r.chunk_tokens else 'whole'} |"
                f" {r.plan_seconds / r.exact_seconds:.2f}")
        lines.append(f"| {r.length:,} | {r.exact_seconds:.2f} s | {1e6 * r.exact_seconds / r.length:.1f} us |"
                     f" {'yes' if r.exact_fits else 'no'} | {plan} |")
    return "\n".join(lines)


def table(results: list[Longest]) -> str:
    exact = results[0]
    lines = ["| setting | longest length (tokens) | x exact | peak there + static | of which outside the layers"
             " | predicted step time there | per token | x exact's per token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.length is None:
            lines.append(f"| {r.row.name} | no plan | | | | | | |")
            continue
        ratio = r.length / exact.length if exact.length else float("nan")
        per = r.per_token / exact.per_token if r.per_token and exact.per_token else float("nan")
        lines.append(f"| {r.row.name} | {r.length:,} | {ratio:.2f} | {format_bytes(r.peak_bytes + r.static_bytes)}"
                     f" | {format_bytes(r.outside_bytes)} | {r.seconds:.2f} s | {1e6 * r.per_token:.1f} us"
                     f" | {per:.2f} |")
    return "\n".join(lines)


def plot_lengths(data: dict[str, Any], path: Path) -> None:
    """The plan command's panel of peak against length, alone and small: each setting's peak (under the row's
    compression), the plan's least peak, the room the device leaves and the plan at its longest length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _plot_lengths(ax, data)
    ax.set_title("Llama-3-8B-shaped, batch 1, fsdp over 8, 80 GiB: peak across lengths\n(settings with fp8 inputs;"
                 " plan: offload auto, fp8, chunk_loss auto)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan-option", action="append", default=[],
                        help="one more plan row, planned with these plan options on top of offload auto and fp8"
                             " (such as --plan-option=--chunk-loss=auto); repeat for more options in that row")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the plan row's peak against the length (plan.png's second panel) to this PNG"
                             " (the docs' docs/images/long_context.png)")
    args = parser.parse_args(argv)
    rows = list(ROWS)
    if args.plan_option:
        options = tuple(part for option in args.plan_option for part in option.split("=", 1))
        rows.append(Row(f"plan: offload auto, fp8, {' '.join(args.plan_option)}", "plan",
                        ("--compress", "fp8", "--offload", "auto", *options)))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for row in rows:
        results.append(longest(row))
        r = results[-1]
        print(f"{row.name}: longest {r.length} tokens, {r.per_token and 1e6 * r.per_token:.1f} us per token"
              f" (planned in {r.wall_seconds:.0f} s); {parts(r)}", flush=True)
    text = table(results)
    exact, plan = results[0], results[TARGET_ROW]
    longer = plan.length / exact.length if plan.length and exact.length else 0.0
    slower = plan.per_token / exact.per_token if plan.per_token and exact.per_token else float("inf")
    verdict = (f"Targets (issue 32): the plan's longest length {longer:.2f}x exact full checkpointing's (target >= 2x):"
               f" {'met' if longer >= 2 else 'missed'}; its predicted time per token {slower:.2f}x exact's at exact's"
               f" own longest length (target <= 1.3x): {'met' if slower <= 1.3 else 'missed'}.")
    lengths = sorted({exact.length, 2 * exact.length, plan.length} - {None})
    equal = same_lengths(lengths)  # type: ignore[arg-type]
    same = same_table(equal)
    twice = next((r for r in equal if exact.length and r.length == 2 * exact.length), None)
    if twice is not None and twice.plan_seconds is not None and exact.per_token:
        at_twice = twice.plan_seconds / twice.length / exact.per_token
        verdict += (f" At 2x exact's longest length ({twice.length:,} tokens) the same plan takes"
                    f" {at_twice:.2f}x exact's time per token: {'both met' if at_twice <= 1.3 else 'missed'} there;"
                    " exact full checkpointing's own time per token grows"
                    f" {twice.exact_seconds / twice.length / exact.per_token:.2f}x from its longest length to that"
                    " one (attention's T^2).")
    longest_data = plan.data and plan.data.get("longest_plan")
    if longest_data and longest_data["fitted_length"] != plan.length:
        verdict += (f" The plan's fit gave {longest_data['fitted_length']:,} tokens; the model's block_size caps it at"
                    f" {plan.length:,}.")
    print(text)
    print(verdict)
    print(same)
    if args.plot is not None and plan.data is not None:
        plot_lengths(plan.data, args.plot)
    if not args.no_write:
        write_section("long context", "\n\n".join([
            "## The longest context that fits: a Llama-3-8B-shaped run (`bench_long_context.py`)",
            "The demo GPT shaped as Llama-3-8B (32 layers, hidden 4096, 32 heads, vocab 128,256, dropout 0),"
            " `bf16-mixed`, `fsdp_ckpt` over 8 devices as `plan` models it (one device's share of weights, gradients"
            " and AdamW state), batch 1, `--device-memory 80GiB --device h100-sxm`, measured by `lightning-ckpt plan"
            f" --lengths {LENGTHS}` on fake tensors. Longest length: a setting's fitted peak (quadratic through the 4"
            " lengths) plus static memory within 80 GiB; the plan's: the least peak its settings reach, fitted alike,"
            " and the plan made for 80 GiB less static memory at that length, the step measured again there. Step"
            " times are the h100-sxm profile's predictions at each row's own longest length; nothing ran on a GPU."
            f" Machine: {machine()}.",
            text, verdict,
            "The head's logits and the cross-entropy (length x 128,256 values, in bf16 and again in fp32) are what"
            " grows outside the layers; without the chunked head and loss (`--chunk-loss false`) they stay in every"
            " row. With `--chunk-loss auto` the plan runs them in chunks of 1,024 tokens at these lengths, and what"
            " stays outside the layers is a few GiB. Time per token at equal lengths, exact full checkpointing against"
            " the last row's plan made there for 80 GiB (exact full checkpointing's own step time priced whether or"
            " not it fits):",
            same]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
