"""The files ``lightning-ckpt plan`` writes besides the Markdown report: every figure as plain data (``plan.json``,
:func:`report_data`) and the plot of activations against recompute (``plan.png``, :func:`plot`).

Both read a :class:`~lightning_ckpt.commands.plan.result.PlanResult`; ``plot`` reads it through ``plan.json``'s data,
so a saved ``plan.json`` can be drawn again. The Markdown report is :mod:`~lightning_ckpt.commands.plan.report`.

Example::

    data = report_data(result)  # what plan.json holds
    plot(data, Path("plan.png"))
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_ckpt.commands.plan.predictions import SETTINGS
from lightning_ckpt.commands.plot_labels import LEADER, place_labels
from lightning_ckpt.core.measure.profiling import binary_unit, format_bytes
from lightning_ckpt.core.plan.planner import CheckpointPlan
from lightning_ckpt.core.measure.timing import price_source
from lightning_ckpt.commands.plan.result import PlanResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _plan_data(plan: Optional[CheckpointPlan]) -> Optional[dict[str, Any]]:
    """A plan's figures for ``plan.json``; ``None`` for no plan."""
    return None if plan is None else {
        "layers": dict(plan.layers),
        "offloaded": list(plan.offloaded),
        "compress": plan.compress, "chunk_tokens": plan.chunk_tokens, "tile_mlp": plan.tile_mlp,
        "budget_bytes": plan.budget_bytes, "activation_bytes": plan.planned_bytes, "peak_bytes": plan.peak_bytes,
        "host_bytes": plan.planned_host_bytes, "recompute_flops": plan.recompute_flops,
        "kept_ops": plan.kept_ops, "predicted_step_seconds": plan.predicted_step_seconds,
        "baseline_step_seconds": plan.baseline_step_seconds}


def report_data(result: PlanResult) -> dict[str, Any]:
    """Every figure of the report as plain data (``plan.json``; the keys are listed in the docstring of
    :mod:`lightning_ckpt.commands.plan`)."""
    built, main, static, host = result.built, result.main, result.static, result.host_memory
    s = static.sharding
    data = {
        "config": result.title,
        "model": type(built.module).__name__,
        "fake": built.fake_mode is not None,
        "planned_for": built.planned_for,
        "batch_sizes": list(result.batch_sizes),
        "batch_size": main.batch_size,
        "memory_budget": result.budget,
        "device_memory": result.device_memory,
        "device": result.profile.name if result.profile is not None else None,
        "priced_by": price_source(main.costs, result.profile),
        "offload": built.offload,
        "tile_mlp": built.tile_mlp,
        "lean_layers": built.lean_layers,
        "host_memory": None if host is None else {"bytes": host.total, "given": host.given, "static_bytes": host.static,
                                                  "for_offload_bytes": host.for_offload},
        "outside_bytes": main.outside_bytes,
        "static_bytes_per_device": static.total,
        "static": {"weights_bytes": static.weights, "gradient_bytes": static.gradients,
                   "optimizer_state_bytes": static.optimizer_state, "optimizer": static.optimizer,
                   "unsharded_bytes": static.unsharded, "strategy": s.strategy, "world": s.world,
                   "weight_shards": s.weights, "state_shards": s.states, "note": s.note,
                   "cpu_offload": s.cpu_offload, "host_weights_bytes": static.host_weights,
                   "host_gradient_bytes": static.host_gradients,
                   "host_optimizer_state_bytes": static.host_optimizer_state, "host_bytes": static.host_total},
        "layers": [{"name": c.name, "class": c.cls, "none_bytes": c.none_bytes,
                    "full_bytes": c.device_bytes("full", built.offload is True),
                    "selective_bytes": c.device_bytes("selective", built.offload is True), "full_flops": c.full_flops,
                    "selective_flops": c.selective_flops} for c in main.costs],
        "settings": [{"name": r.name, "description": SETTINGS.get(r.name, r.name), "checkpointed_layers": r.layers,
                      "activation_bytes": r.activation_bytes, "peak_bytes": r.peak_bytes, "host_bytes": r.host_bytes,
                      "recompute_flops": r.recompute_flops,
                      "predicted_step_seconds": r.predicted_step_seconds, "fixed_bytes": r.fixed_bytes,
                      "per_sample_bytes": r.per_sample_bytes, "peak_fixed_bytes": r.peak_fixed_bytes,
                      "peak_per_sample_bytes": r.peak_per_sample_bytes, "largest_batch": r.largest_batch}
                     for r in result.rows],
        "plan": _plan_data(result.plan),
        "plan_error": result.plan_error,
        "front": [dict(p) for p in result.front],
    }
    if result.lengths:
        data.update(_length_data(result))
    return data


def _length_data(result: PlanResult) -> dict[str, Any]:
    """``plan.json``'s ``lengths``, ``length_fit`` and ``largest_length`` (with ``--lengths`` only)."""
    longest = result.longest
    return {
        "lengths": [{"length": at.length, "batch_size": at.batch_size, "tokens": at.batch_size * at.length,
                     "plan": _plan_data(at.plan), "plan_error": at.plan_error, "least_peak_bytes": at.least_peak_bytes,
                     "settings": [{"name": r.name, "peak_bytes": r.peak_bytes, "activation_bytes": r.activation_bytes,
                                   "recompute_flops": r.recompute_flops,
                                   "predicted_step_seconds": r.predicted_step_seconds} for r in at.rows]}
                    for at in result.lengths],
        "length_fit": result.length_fit,
        "largest_length": dict(result.largest_length) if result.device_memory is not None else None,
        "longest_plan": None if longest is None else {
            "fitted_length": longest.fitted, "length": longest.length, "batch_size": longest.batch_size,
            "least_peak_bytes": longest.least_peak_bytes, "plan": _plan_data(longest.plan),
            "plan_error": longest.plan_error, "predicted_seconds_per_token": longest.seconds_per_token(),
            "shortened": list(longest.shortened)},
    }


def plot(data: Mapping[str, Any], path: Path) -> Optional[Figure]:
    """Activations against recompute cost (predicted step time when every setting has one, else recompute FLOPs)
    of every setting in ``data`` (:func:`report_data`), the planner's front over budgets as a line (planned with the
    plan's offload; with offload, its plans that offload circled) and the chosen plan as a star; saved as a PNG. With
    ``--lengths`` (``data["lengths"]``) a second panel draws each setting's peak against the sequence length, one line
    per setting. Returns the figure (``None`` without matplotlib). Points are in bytes and FLOPs (or seconds); byte
    axes are labelled in binary units as :func:`~lightning_ckpt.core.measure.profiling.format_bytes` writes them, and each
    point's label is placed where it overlaps no other label
    (:func:`~lightning_ckpt.commands.plot_labels.place_labels`).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, MaxNLocator
    except ImportError:
        print("plan: the plot needs matplotlib (`pip install matplotlib`); wrote the report only.", file=sys.stderr)
        return None
    settings = data["settings"]
    timed = all(s["predicted_step_seconds"] is not None for s in settings)
    cost = "predicted_step_seconds" if timed else "recompute_flops"
    offload = data.get("offload", False)
    lengths = data.get("lengths")
    fig = Figure(figsize=(13, 4.5) if lengths else (6.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if lengths else fig.add_subplot()
    front = [p for p in data["front"] if p.get(cost) is not None]
    if front:
        front = sorted(front, key=lambda p: p["budget_bytes"])  # one plan per budget, in the budgets' order
        ax.plot([p[cost] for p in front], [p["activation_bytes"] for p in front], ".-", color="tab:gray", alpha=0.6,
                label="planner's front over budgets" + _offload_label(offload))
        moved = [p for p in front if p.get("host_bytes")]
        if moved:
            ax.plot([p[cost] for p in moved], [p["activation_bytes"] for p in moved], "o", color="tab:gray",
                    markerfacecolor="none", markersize=8, label="front: plans that offload")
    labels = []
    for s in settings:
        chosen = s["name"] == "plan"
        ax.scatter([s[cost]], [s["activation_bytes"]], marker="*" if chosen else "o", s=160 if chosen else 40,
                   color="tab:red" if chosen else "black" if s["name"] == "none" else "tab:blue", zorder=3,
                   label=s["name"])
        labels.append(ax.annotate(_point_label(s, offload), (s[cost], s["activation_bytes"]),
                                  textcoords="offset points", xytext=(5, 5), fontsize=9, zorder=4,
                                  arrowprops=dict(LEADER)))
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(EngFormatter(unit="s" if timed else "FLOP"))
    _byte_axis(ax.yaxis)
    ax.set_xlabel("predicted step time" if timed else "recompute per step")
    ax.set_ylabel("activations held for backward on the device" + ("\n(not counting host memory)" if offload else ""))
    ax.legend(handles=ax.lines, loc="upper right", fontsize=8)
    ax.set_title(f"Checkpointing plan: activations vs recompute\n{data['config']}", fontsize=10)
    ax.grid(alpha=0.3)
    if lengths:
        _plot_lengths(fig.add_subplot(1, 2, 2), data)
    fig.tight_layout()
    markers = [(s[cost], s["activation_bytes"], 160**0.5 if s["name"] == "plan" else 40**0.5) for s in settings]
    place_labels(ax, [labels[-1], *labels[:-1]] if settings and settings[-1]["name"] == "plan" else labels, markers)
    fig.savefig(path)
    return fig


def _offload_label(offload: object) -> str:
    """What the front's legend adds about offload: the front is planned with the plan's offload."""
    if offload is True:
        return " (offload on, as the plan)"
    return " (offload 'auto', as the plan)" if offload == "auto" else ""


def _point_label(setting: Mapping[str, Any], offload: object) -> str:
    """A setting's label on the plot: its name, ``plan (chosen)`` for the plan, and with offload the bytes it keeps
    in host memory."""
    name = "plan (chosen)" if setting["name"] == "plan" else setting["name"]
    host = setting.get("host_bytes") or 0
    return f"{name}, +{format_bytes(host)} on host" if offload and host else name


def _byte_axis(axis: Any) -> None:
    """Ticks at round multiples of the binary unit of the axis's largest figure, labelled by
    :func:`~lightning_ckpt.core.measure.profiling.format_bytes` (``512.0 MiB``, ``1.0 GiB``)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    class BinaryLocator(MaxNLocator):
        def tick_values(self, vmin: float, vmax: float) -> Any:
            _, size = binary_unit(max(abs(vmin), abs(vmax)))
            return super().tick_values(vmin / size, vmax / size) * size

    axis.set_major_locator(BinaryLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    axis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))


def _plot_lengths(ax: Any, data: Mapping[str, Any]) -> None:
    """Each setting's peak (the plan's too, where there is one) against the sequence length: one line per setting;
    with ``--device-memory`` also the least peak the plan's own settings reach, the room the device leaves for
    activations (device memory less static memory) and the plan's longest length."""
    lengths = data["lengths"]
    names = list(dict.fromkeys(s["name"] for at in lengths for s in at["settings"]))
    for name in names:
        points = [(at["length"], s["peak_bytes"]) for at in lengths for s in at["settings"] if s["name"] == name]
        ax.plot([x for x, _ in points], [y for _, y in points], "*--" if name == "plan" else "o-", label=name,
                color="black" if name == "plan" else None)  # tab:red is every_layer's colour here
    if data.get("largest_length") is not None:
        ax.plot([at["length"] for at in lengths], [at["least_peak_bytes"] for at in lengths], "s:", color="black",
                label="plan's settings: least peak")
        ax.axhline(data["device_memory"] - data["static_bytes_per_device"], color="tab:gray", linewidth=1,
                   label="device memory less static")
        longest = data.get("longest_plan")
        if longest and longest["plan"]:
            ax.plot([longest["length"]], [longest["plan"]["peak_bytes"]], "P", color="black", markersize=10,
                    label=f"plan at its longest, {longest['length']:,}")
        ax.set_ylim(0, 2.5 * (data["device_memory"] - data["static_bytes_per_device"]))
    ax.set_xscale("log", base=2)
    ax.set_xticks([at["length"] for at in lengths], [f"{at['batch_size']} x {at['length']}" for at in lengths])
    _byte_axis(ax.yaxis)
    ax.set_xlabel("batch x sequence length measured")
    ax.set_ylabel("activation peak of the step, per device")
    ax.set_title("Peak across lengths", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
