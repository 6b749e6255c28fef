"""How ``compare`` shows its results: the Markdown table (:func:`render_markdown`), every number for ``compare.json``
(:func:`to_json`), the plot of memory against step time (:func:`plot`), and the sentence on where the predicted
column comes from (:func:`prediction_text`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_ckpt.commands.compare.stats import TimeModel
from lightning_ckpt.commands.compare.stats import (
    CONFIDENCE,
    MIN_TIMED_STEPS,
    VariantResult,
    signed_percent,
    time_difference,
)
from lightning_ckpt.commands.compare.variants import BASELINE, DESCRIPTIONS, PLANNED

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def format_number(value: Optional[float], digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits; ``"n/a"`` for ``None`` or NaN.

    Example::

        >>> format_number(0.123456), format_number(None), format_ms(0.0123456)
        ('0.1235', 'n/a', '12.3')
    """
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}g}"


def format_ms(value: float) -> str:
    """Seconds as milliseconds, 3 significant digits."""
    return format_number(1000 * value, 3)


def prediction_text(model: Optional[TimeModel], problems: Sequence[str] = (), why: str = "") -> str:
    """The report's sentence on the predicted column: the profile it is priced on, or why there is none.

    Example::

        >>> prediction_text(None, why="the model could not be built")
        'Predicted: n/a, the model could not be built.'
    """
    if model is None:
        return f"Predicted: n/a, {why}."
    text = ("Predicted: the slowdown the planner's time model (`predict_seconds`) gives for the layers each variant"
            f" checkpointed, from one measured step of the model (batch {model.measurement.batch_size}) priced on"
            f" {model.describe()}; no run is timed for it.")
    return text + "".join(f" No prediction: {p}." for p in problems)


def render_markdown(results: Sequence[VariantResult], title: str, rtol: float, atol: float,
                    timing: str = "", prediction: str = "") -> str:
    """The comparison as Markdown: a short header and one table row per variant, the baseline first.

    ``timing`` says how the steps were timed (rounds, warm-up). Time lost is
    :func:`~lightning_ckpt.commands.compare.stats.time_difference` against the baseline, in the words of
    :meth:`~lightning_ckpt.commands.compare.stats.TimeDifference.describe`: never a gain when the difference is within
    noise. ``prediction`` says where the predicted slowdowns
    (:func:`~lightning_ckpt.commands.compare.stats.predict_variants`) come from (:func:`prediction_text`).
    """
    base = results[0]
    on_device = base.peak_allocated_gib is not None
    memory_what = ("peak allocated device memory" if on_device else
                   f"activations held for backward ({base.device} run: no device memory; host RSS shown)")
    lines = [
        f"# Checkpointing comparison: {title}",
        "",
        f"Memory saved is measured on {memory_what}. {timing} Step time is the median over the timed steps, with"
        f" its interquartile range (IQR); samples/s is the samples of one step over that median. Time lost is the ratio of medians to `{BASELINE}` with a"
        f" {100 * CONFIDENCE:.0f}% bootstrap interval (rounds, then steps, resampled); a difference whose interval"
        f" contains 0% is within noise, and with fewer than {MIN_TIMED_STEPS} timed steps there is no verdict."
        f" Loss and gradients after step 1 are compared with `{BASELINE}` (tolerance: |diff| <= {atol:g} +"
        f" {rtol:g} x the largest |value| of each gradient).",
        "",
    ]
    if prediction:
        lines += [prediction, ""]
    if not on_device and any(r.name == "offload" for r in results):
        lines += ["On a CPU run `offload` has no effect: the saved layer inputs are already in host memory.", ""]
    lines += [
        "| variant | checkpointed layers | peak device (GiB) | host RSS (GiB) | activations (GiB) | offloaded (GiB)"
        " | timed steps | step (ms) | step IQR (ms) | samples/s | memory saved | time lost | predicted | loss diff"
        " | grad diff | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | | | | | | | | | | | | | | | FAILED: {r.error} |")
            continue
        predicted = "n/a" if r.predicted_ratio is None else signed_percent(r.predicted_ratio - 1)
        if r is base:
            saved = lost = loss = grad = predicted = "-"
            check = "baseline"
        else:
            delta = base.memory_gib - r.memory_gib
            saved = (f"{format_number(delta, 3)} GiB ({100 * delta / base.memory_gib:.0f}%)" if base.memory_gib
                     else "n/a")
            lost = time_difference(base.step_times, r.step_times).describe()
            loss, grad = format_number(r.loss_diff, 2), format_number(r.grad_diff, 2)
            check = f"**MISMATCH: {r.mismatch}**" if r.mismatch else "ok"
        step, n = r.step, format_number
        lines.append(
            f"| {r.name} | {len(r.checkpointed_layers)} | {n(r.peak_allocated_gib)} | {n(r.host_rss_gib)}"
            f" | {n(r.activations_gib)} | {n(r.offloaded_gib)} | {step.n} | {format_ms(step.median)}"
            f" | {format_ms(step.q1)}–{format_ms(step.q3)} | {n(r.samples_per_sec)} | {saved} | {lost} | {predicted}"
            f" | {loss} | {grad}"
            f" | {check} |"
        )
    for r in results:
        if not r.error and r.timed_memory_gib is not None and r.memory_gib > 1.01 * r.timed_memory_gib:
            lines += ["", f"`{r.name}`: the warm-up steps held the most ({format_number(r.memory_gib)} GiB, in the"
                          f" table); the timed steps at most {format_number(r.timed_memory_gib)} GiB"
                          + (" (the first step measures for the memory_budget plan)." if r.name == PLANNED else ".")]
    return "\n".join(lines) + "\n"


def to_json(results: Sequence[VariantResult], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every number of the comparison, the raw step times included, for ``compare.json``."""
    base = results[0]
    variants = []
    for r in results:
        entry: dict[str, Any] = {"name": r.name, "description": DESCRIPTIONS.get(r.name, r.name), "error": r.error}
        if not r.error:
            step = r.step
            entry.update(
                checkpointed_layers=r.checkpointed_layers, device=r.device, peak_allocated_gib=r.peak_allocated_gib,
                peak_reserved_gib=r.peak_reserved_gib, host_rss_gib=r.host_rss_gib,
                activations_gib=r.activations_gib, offloaded_gib=r.offloaded_gib, timed_memory_gib=r.timed_memory_gib,
                timed_steps=step.n,
                step_sec_median=step.median, step_sec_q1=step.q1, step_sec_q3=step.q3,
                samples_per_step=r.samples_per_step, tokens_per_step=r.tokens_per_step,
                samples_per_sec=r.samples_per_sec, tokens_per_sec=r.tokens_per_sec, step_times=r.step_times,
                loss_diff=r.loss_diff, grad_diff=r.grad_diff, mismatch=r.mismatch, layer_modes=r.layer_modes,
                kept_ops=r.kept_ops, offload=r.offload, predicted_step_seconds=r.predicted_step_seconds,
                predicted_time_lost=r.predicted_ratio)
            if r is not base and not base.error:
                d = time_difference(base.step_times, r.step_times)
                entry["time_lost"] = {"ratio": d.ratio, "low": d.low, "high": d.high, "confidence": d.confidence,
                                      "within_noise": d.within_noise, "enough_steps": d.enough_steps,
                                      "text": d.describe()}
        variants.append(entry)
    return {**settings, "variants": variants}


def plot(results: Sequence[VariantResult], path: Path, title: str) -> Optional[Figure]:
    """Memory against median step time, one labelled point per variant with its step-time interquartile range as
    horizontal error bars, saved as a PNG. Returns the figure (``None`` without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("compare: the plot needs matplotlib (`pip install matplotlib`); wrote the table only.", file=sys.stderr)
        return None
    done = [r for r in results if not r.error and r.step.n]
    fig = Figure(figsize=(6.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in done:
        colour = "tab:red" if r.mismatch else "tab:blue" if r.name != BASELINE else "black"
        step = r.step
        x = 1000 * step.median
        ax.errorbar([x], [r.memory_gib], xerr=[[1000 * (step.median - step.q1)], [1000 * (step.q3 - step.median)]],
                    fmt="o", color=colour, capsize=4)
        ax.annotate(r.name, (x, r.memory_gib), textcoords="offset points", xytext=(5, 5), fontsize=9)
    on_device = bool(done) and done[0].peak_allocated_gib is not None
    ax.set_xlabel("median step time (ms); bars: interquartile range")
    ax.set_ylabel("peak allocated device memory (GiB)" if on_device else "activations held for backward (GiB)")
    ax.set_title(f"Checkpointing: memory vs step time\n{title}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return fig
