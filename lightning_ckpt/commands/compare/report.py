"""How ``compare`` shows a :class:`~lightning_ckpt.commands.compare.comparison.Comparison`: the Markdown table
(:func:`render_markdown`), every number for ``compare.json`` (:func:`to_json`), and the plot of memory against step
time (:func:`plot`). Each takes the one comparison; the parts of the Markdown (:func:`timing_text`,
:func:`prediction_text`, one row per variant) are functions of it too.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_ckpt.commands.compare.comparison import Comparison
from lightning_ckpt.commands.compare.stats import (
    CONFIDENCE,
    MIN_TIMED_STEPS,
    VariantResult,
    measured_baseline,
    signed_percent,
    time_difference,
)
from lightning_ckpt.commands.compare.variants import BASELINE, DESCRIPTIONS, MIN_COSINE, PLANNED
from lightning_ckpt.commands.plot_labels import LEADER, place_labels
from lightning_ckpt.core.measure.memory_stats import GIB
from lightning_ckpt.core.measure.profiling import binary_unit, format_bytes

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


def format_gib(value: Optional[float]) -> str:
    """A memory figure in GiB (as the monitor logs them) in the binary unit that fits it
    (:func:`~lightning_ckpt.core.measure.profiling.format_bytes`); ``"n/a"`` for ``None`` or NaN.

    Example::

        >>> format_gib(0.0002501), format_gib(1.5), format_gib(0.0), format_gib(None)
        ('262.2 KiB', '1.5 GiB', '0 B', 'n/a')
    """
    return "n/a" if value is None or math.isnan(value) else format_bytes(value * GIB)


def title(c: Comparison) -> str:
    """The comparison's title: the config and how many steps each variant timed."""
    return f"{c.config.name}, {c.steps} timed steps per variant"


def timing_text(c: Comparison) -> str:
    """How the steps were timed, in words.

    Example::

        >>> print(timing_text(Comparison([], Path("tiny.yaml"), [2, 1], warmup=1)))  # doctest: +NORMALIZE_WHITESPACE
        Timing: 3 timed steps per variant in 2 round(s) of fresh processes (2/1 steps, each after 1 untimed warm-up
        step(s)), the rounds interleaved and alternately reversed.
    """
    return (f"Timing: {c.steps} timed steps per variant in {len(c.steps_per_round)} round(s) of fresh processes"
            f" ({'/'.join(map(str, c.steps_per_round))} steps, each after {c.warmup} untimed warm-up step(s)), the"
            f" rounds interleaved and alternately reversed.")


def prediction_text(c: Comparison) -> str:
    """The report's sentence on the predicted column: the profile it is priced on, or why there is none (``""``
    when nothing says: a comparison built without trying).

    Example::

        >>> prediction_text(Comparison([], Path("tiny.yaml"), [1], no_time_model="the model could not be built"))
        'Predicted: n/a, the model could not be built.'
    """
    model = c.time_model
    if model is None:
        return f"Predicted: n/a, {c.no_time_model}." if c.no_time_model else ""
    text = ("Predicted: the slowdown the planner's time model (`predict_seconds`) gives for the layers each variant"
            f" checkpointed, from one measured step of the model (batch {model.measurement.batch_size}) priced on"
            f" {model.describe()}")
    if measured_baseline(c.results, model) is not None:
        text += (f"; the time each adds, over `{c.baseline.name}`'s measured step (the optimizer, the loop and the"
                 " logging are not in the model).")
    else:
        text += "; no run is timed for it."
    return text + "".join(f" No prediction: {p}." for p in c.unpredicted)


#: The table's columns, one row per variant (:func:`_row`).
COLUMNS = ("variant", "checkpointed layers", "peak device", "host RSS", "activations", "offloaded", "timed steps",
           "step (ms)", "step IQR (ms)", "samples/s", "memory saved", "time lost", "predicted", "loss diff",
           "grad diff", "check")


def render_markdown(c: Comparison) -> str:
    """The comparison as Markdown: how it was measured, then one table row per variant, the baseline first.

    Time lost is :func:`~lightning_ckpt.commands.compare.stats.time_difference` against the baseline, in the words of
    :meth:`~lightning_ckpt.commands.compare.stats.TimeDifference.describe`: never a gain when the difference is within
    noise. The predicted slowdowns (:func:`~lightning_ckpt.commands.compare.stats.predict_variants`) are explained by
    :func:`prediction_text`.

    Example::

        >>> print(render_markdown(Comparison([VariantResult("none", error="it crashed")], Path("tiny.yaml"), [3]))
        ...       .splitlines()[-1])
        | none | | | | | | | | | | | | | | | FAILED: it crashed |
    """
    lines = [f"# Checkpointing comparison: {title(c)}", "", _method(c), ""]
    for note in (prediction_text(c), _offload_note(c)):
        if note:
            lines += [note, ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [_row(r, c.baseline) for r in c.results]
    for note in map(_warmup_note, c.results):
        if note:
            lines += ["", note]
    return "\n".join(lines) + "\n"


def _method(c: Comparison) -> str:
    """The paragraph on what is measured and how: memory, timing, throughput, time lost, the step-1 check."""
    on_device = c.baseline.peak_allocated_gib is not None
    memory_what = ("peak allocated device memory" if on_device else
                   f"the step's activation peak, forward and backward, counted on step 2 ({c.baseline.device} run:"
                   " no device memory; host RSS shown)" if c.baseline.activation_peak_gib is not None else
                   f"activations held for backward at the end of the forward ({c.baseline.device} run: no device"
                   " memory, and no step's peak counted; host RSS shown)")
    return (
        f"Memory saved is measured on {memory_what}. {timing_text(c)} Step time is the median over the timed steps,"
        f" with its interquartile range (IQR); samples/s is the samples of one step over that median. Time lost is"
        f" the ratio of medians to `{BASELINE}` with a {100 * CONFIDENCE:.0f}% bootstrap interval (rounds, then"
        f" steps, resampled); a difference whose interval contains 0% is within noise, and with fewer than"
        f" {MIN_TIMED_STEPS} timed steps there is no verdict. Loss and gradients after step 1 are compared with"
        f" `{BASELINE}` (tolerance: |diff| <= {c.atol:g} + {c.rtol:g} x the largest |value| of each gradient)"
        + (f"; a variant that holds its layers' inputs compressed runs the exact forward but backpropagates from the"
           f" rounded inputs, so its loss has that tolerance and each gradient must keep a cosine similarity of at"
           f" least {MIN_COSINE['fp8']:g} (fp8) or {MIN_COSINE['bf16']:g} (bf16) to the baseline's."
           if any(r.compress for r in c.results) else "."))


def _offload_note(c: Comparison) -> str:
    if c.baseline.peak_allocated_gib is None and any(r.name == "offload" for r in c.results):
        return "On a CPU run `offload` has no effect: the saved layer inputs are already in host memory."
    return ""


def _row(r: VariantResult, base: VariantResult) -> str:
    """One variant's table row; ``base`` is the baseline it is measured against (``r`` itself for the baseline)."""
    if r.error:
        return f"| {r.name} |" + " |" * (len(COLUMNS) - 2) + f" FAILED: {r.error} |"
    if r is base:
        saved = lost = loss = grad = predicted = "-"
        check = "baseline"
    else:
        delta = base.memory_gib - r.memory_gib
        saved = f"{format_gib(delta)} ({100 * delta / base.memory_gib:.0f}%)" if base.memory_gib else "n/a"
        lost = time_difference(base.step_times, r.step_times).describe()
        predicted = "n/a" if r.predicted_ratio is None else signed_percent(r.predicted_ratio - 1)
        loss, grad = format_number(r.loss_diff, 2), format_number(r.grad_diff, 2)
        check = f"**MISMATCH: {r.mismatch}**" if r.mismatch else "ok"
        if r.compress and not r.mismatch:
            check = f"ok (cosine ≥ {MIN_COSINE[r.compress]:g})"
    step, gib = r.step, format_gib
    return (f"| {r.name} | {len(r.checkpointed_layers)} | {gib(r.peak_allocated_gib)} | {gib(r.host_rss_gib)}"
            f" | {gib(r.activations_gib)} | {gib(r.offloaded_gib)} | {step.n} | {format_ms(step.median)}"
            f" | {format_ms(step.q1)}–{format_ms(step.q3)} | {format_number(r.samples_per_sec)} | {saved} | {lost}"
            f" | {predicted} | {loss} | {grad} | {check} |")


def _warmup_note(r: VariantResult) -> str:
    """Says so when a variant's warm-up steps held clearly more than its timed ones (``""`` otherwise)."""
    if r.error or r.timed_memory_gib is None or r.memory_gib <= 1.01 * r.timed_memory_gib:
        return ""
    why = " (the first step measures for the memory_budget plan)." if r.name == PLANNED else "."
    return (f"`{r.name}`: the warm-up steps held the most ({format_gib(r.memory_gib)}, in the table); the"
            f" timed steps at most {format_gib(r.timed_memory_gib)}{why}")


def to_json(c: Comparison) -> dict[str, Any]:
    """Every number of the comparison, the raw step times included, for ``compare.json``."""
    model = c.time_model.as_dict() if c.time_model is not None else {"error": c.no_time_model}
    return {"config": str(c.config), "steps": c.steps, "rounds": len(c.steps_per_round),
            "steps_per_round": c.steps_per_round, "warmup": c.warmup, "seed": c.seed, "order": c.order,
            "rtol": c.rtol, "atol": c.atol, "time_model": model,
            "variants": [_variant_json(r, c.baseline) for r in c.results]}


def _variant_json(r: VariantResult, base: VariantResult) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": r.name, "description": DESCRIPTIONS.get(r.name, r.name), "error": r.error}
    if r.error:
        return entry
    step = r.step
    entry.update(
        checkpointed_layers=r.checkpointed_layers, device=r.device, peak_allocated_gib=r.peak_allocated_gib,
        peak_reserved_gib=r.peak_reserved_gib, host_rss_gib=r.host_rss_gib,
        activations_gib=r.activations_gib, offloaded_gib=r.offloaded_gib, activation_peak_gib=r.activation_peak_gib,
        timed_memory_gib=r.timed_memory_gib,
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
                              "within_noise": d.within_noise, "enough_steps": d.enough_steps, "text": d.describe()}
    return entry


def plot(c: Comparison, path: Path) -> Optional[Figure]:
    """Memory against median step time, one labelled point per variant with its step-time interquartile range as
    horizontal error bars, saved as a PNG; memory in the binary unit of the largest figure
    (:func:`~lightning_ckpt.core.measure.profiling.binary_unit`), each variant's label placed clear of the others
    (:func:`~lightning_ckpt.commands.plot_labels.place_labels`). Returns the figure (``None`` without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("compare: the plot needs matplotlib (`pip install matplotlib`); wrote the table only.", file=sys.stderr)
        return None
    done = [r for r in c.results if not r.error and r.step.n]
    fig = Figure(figsize=(6.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    unit, size = binary_unit(max((r.memory_gib * GIB for r in done), default=0.0))
    labels: list[Any] = []
    markers: list[tuple[float, float, float]] = []
    for r in done:
        colour = "tab:red" if r.mismatch else "tab:blue" if r.name != BASELINE else "black"
        step = r.step
        x, y = 1000 * step.median, r.memory_gib * GIB / size
        ax.errorbar([x], [y], xerr=[[1000 * (step.median - step.q1)], [1000 * (step.q3 - step.median)]],
                    fmt="o", color=colour, capsize=4)
        labels.append(ax.annotate(r.name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=9,
                                  arrowprops=dict(LEADER)))
        markers.append((x, y, 6.0))  # errorbar's marker: rcParams' lines.markersize points across
    on_device = bool(done) and done[0].peak_allocated_gib is not None
    ax.set_xlabel("median step time (ms); bars: interquartile range")
    ax.set_ylabel(f"peak allocated device memory ({unit})" if on_device else f"activations held for backward ({unit})")
    ax.set_title(f"Checkpointing: memory vs step time\n{title(c)}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    place_labels(ax, labels, markers)
    fig.savefig(path)
    return fig
