"""``lightning-ckpt compare``: the same run with and without checkpointing, side by side.

Each variant runs the same model, data and seed from one LightningCLI config, in a fresh process, for a few
steps: no checkpointing, every layer, every 2nd, every 4th, and every layer with offload. The config's own
``GradientCheckpointing`` entry (if any) is replaced per variant, keeping its other settings (``layer_cls``,
``mode``, ...). Memory and time come from :class:`~lightning_ckpt.monitor.MemoryMonitor` logging every step
to a CSV file; loss and gradients after step 1 are compared with the run without checkpointing.

Example::

    lightning-ckpt compare --config configs/every_4th_offload.yaml --steps 20

It prints a Markdown table and writes it, with a plot of memory against step time, to the output folder
(``compare.md``, ``compare.png``; each variant's config, log and metrics in a subfolder). Exit status: 0 when
every variant matches the loss and gradients of the run without checkpointing, 1 when one does not (flagged
in the table), 2 when a variant failed to run.

Test hook: when the environment variable ``LIGHTNING_CKPT_COMPARE_PERTURB_GRAD`` names a variant, that
variant adds a visible error to one gradient after its first backward (see :class:`FirstStepRecorder`). It
exists only so that the tests can check that a wrong gradient is caught; the variant's config says so
(``perturb_grad: true``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_ckpt.monitor import (
    ACTIVATIONS,
    ACTIVATIONS_OFFLOADED,
    HOST_RSS,
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    SAMPLES_PER_SEC,
    STEP_SEC,
    TOKENS_PER_SEC,
)

PERTURB_ENV = "LIGHTNING_CKPT_COMPARE_PERTURB_GRAD"
CALLBACK_PATH = "lightning_ckpt.GradientCheckpointing"

#: Variant name -> ``GradientCheckpointing`` settings (``None``: no checkpointing), in the order they run.
VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "every_layer": {"every_n_layers": 1, "offload": False},
    "every_2nd": {"every_n_layers": 2, "offload": False},
    "every_4th": {"every_n_layers": 4, "offload": False},
    "offload": {"every_n_layers": 1, "offload": True},
}
DESCRIPTIONS = {
    "none": "no checkpointing",
    "every_layer": "every layer",
    "every_2nd": "every 2nd layer",
    "every_4th": "every 4th layer",
    "offload": "every layer, inputs offloaded to host",
}
BASELINE = "none"


# ---------------------------------------------------------------------------------------------------- configs


def _is_callback(entry: Any, name: str) -> bool:
    """Whether a ``trainer.callbacks`` entry of a LightningCLI config is the class ``name`` (by its class_path)."""
    path = entry.get("class_path", "") if isinstance(entry, Mapping) else entry if isinstance(entry, str) else ""
    return path == name or path.endswith("." + name)


def variant_config(base: Mapping[str, Any], variant: str, steps: int, out_dir: Path, seed: int,
                   perturb_grad: bool = False) -> dict[str, Any]:
    """The LightningCLI config of one variant: ``base`` with its checkpointing replaced and measurement added.

    Example::

        >>> cfg = variant_config({"trainer": {"callbacks": []}}, "every_2nd", 5, Path("out"), seed=0)
        >>> cfg["trainer"]["callbacks"][0]
        {'class_path': 'lightning_ckpt.GradientCheckpointing', 'init_args': {'every_n_layers': 2, 'offload': False}}
    """
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}; choose from {', '.join(VARIANTS)}.")
    config = copy.deepcopy(dict(base))
    for key in ("ckpt_path", "fit", "validate", "test", "predict", "subcommand"):
        config.pop(key, None)
    trainer = dict(config.get("trainer") or {})
    callbacks = trainer.get("callbacks") or []
    callbacks = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks)
    ckpt_args: dict[str, Any] = {}
    kept = []
    for entry in callbacks:
        if _is_callback(entry, "GradientCheckpointing"):
            ckpt_args = dict(entry.get("init_args") or {}) if isinstance(entry, Mapping) else {}
        elif not _is_callback(entry, "MemoryMonitor"):
            kept.append(entry)
    ckpt_args.pop("memory_budget", None)  # the variant chooses the layers
    settings = VARIANTS[variant]
    if settings is not None:
        kept.append({"class_path": CALLBACK_PATH, "init_args": {**ckpt_args, **settings}})
    kept.append({"class_path": "lightning_ckpt.monitor.MemoryMonitor", "init_args": {"log_every_n_steps": 1}})
    recorder_args: dict[str, Any] = {"path": str(out_dir / variant / "first_step.pt")}
    if perturb_grad:
        recorder_args["perturb_grad"] = True
    kept.append({"class_path": "lightning_ckpt.compare.FirstStepRecorder", "init_args": recorder_args})
    trainer.update(
        callbacks=kept,
        max_steps=steps,
        max_epochs=-1,
        max_time=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(out_dir / variant),
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(out_dir), "name": variant, "version": ""}},
    )
    config["trainer"] = trainer
    config["seed_everything"] = seed
    return config


def config_seed(base: Mapping[str, Any], default: int = 1234) -> int:
    """The config's ``seed_everything`` if it is a number, else ``default`` (every variant must use the same)."""
    seed = base.get("seed_everything")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else default


# ---------------------------------------------------------------------------------------------------- worker


class FirstStepRecorder(Callback):
    """Saves the loss and every gradient of the first optimizer step (global rank zero), for ``compare``.

    Args:
        path: where to ``torch.save`` ``{"loss": float, "grads": {name: tensor}}``.
        perturb_grad: test hook only: add an error of 5% of the largest entry to one element of the first
            gradient before recording (and before the optimizer uses it), as a checkpointing bug would.
    """

    def __init__(self, path: str, perturb_grad: bool = False) -> None:
        self.path = path
        self.perturb_grad = perturb_grad
        self._loss = 0.0
        self._done = False

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == 0 and not self._done:
            self._loss += float(loss.detach())  # already divided by the accumulation steps

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._done:
            return
        self._done = True
        named = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
        if self.perturb_grad and named:
            grad = named[0][1]
            grad.view(-1)[0] += 0.05 * grad.abs().max() + 1e-3
        if trainer.is_global_zero:
            grads = {n: g.detach().float().cpu().clone() for n, g in named}
            torch.save({"loss": self._loss, "grads": grads}, self.path)


def run_worker(variant_dir: Path) -> None:
    """Train one variant from ``variant_dir/config.yaml`` and write ``variant_dir/result.json`` (rank zero)."""
    from lightning_ckpt.callback import GradientCheckpointing
    from lightning_ckpt.cli_builder import run_cli
    from lightning_ckpt.monitor import MemoryMonitor

    with warnings.catch_warnings():
        # The worker's own command line (`--worker DIR`) is not for LightningCLI; the config comes as `args` on
        # purpose, so LightningCLI's caution against passing both would only be noise in every worker log.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        cli = run_cli(["--config", str(variant_dir / "config.yaml")], run=False, save_config_callback=None)
    trainer = cli.trainer
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if not trainer.is_global_zero:
        return
    layers = [c.checkpointed_layers for c in trainer.callbacks if isinstance(c, GradientCheckpointing)]
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    result = {"checkpointed_layers": layers[0] if layers else [], "device": trainer.strategy.root_device.type,
              "world_size": trainer.world_size, "steps": trainer.global_step, "summary": monitor.summary}
    (variant_dir / "result.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------- results


@dataclass
class VariantResult:
    """What one variant measured: memory in GiB, time in seconds, and its step-1 differences to the baseline."""

    name: str
    checkpointed_layers: list[str] = field(default_factory=list)
    device: str = "cpu"
    peak_allocated_gib: Optional[float] = None
    peak_reserved_gib: Optional[float] = None
    host_rss_gib: float = math.nan
    activations_gib: float = math.nan
    offloaded_gib: float = 0.0
    step_sec: float = math.nan
    samples_per_sec: float = math.nan
    tokens_per_sec: Optional[float] = None
    loss_diff: Optional[float] = None
    grad_diff: Optional[float] = None
    mismatch: Optional[str] = None
    error: Optional[str] = None

    @property
    def memory_gib(self) -> float:
        """The memory that checkpointing is meant to cut: device peak on an accelerator, else activations."""
        return self.peak_allocated_gib if self.peak_allocated_gib is not None else self.activations_gib


def read_monitor_csv(path: Path) -> list[dict[str, float]]:
    """The rows :class:`~lightning_ckpt.monitor.MemoryMonitor` wrote to a CSVLogger ``metrics.csv``, as floats."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in rows if row.get(STEP_SEC)]


def measurements(name: str, rows: Sequence[Mapping[str, float]], result: Mapping[str, Any]) -> VariantResult:
    """Peaks over all steps; time and throughput as medians over the steps after the first (warm-up)."""
    if not rows:
        raise ValueError(f"{name}: the monitor logged nothing")
    timed = rows[1:] or rows

    def peak(key: str) -> Optional[float]:
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    def median(key: str) -> Optional[float]:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else None

    return VariantResult(
        name=name,
        checkpointed_layers=list(result.get("checkpointed_layers", [])),
        device=result.get("device", "cpu"),
        peak_allocated_gib=peak(PEAK_ALLOCATED),
        peak_reserved_gib=peak(PEAK_RESERVED),
        host_rss_gib=peak(HOST_RSS) or math.nan,
        activations_gib=peak(ACTIVATIONS) or 0.0,
        offloaded_gib=peak(ACTIVATIONS_OFFLOADED) or 0.0,
        step_sec=median(STEP_SEC) or math.nan,
        samples_per_sec=median(SAMPLES_PER_SEC) or math.nan,
        tokens_per_sec=median(TOKENS_PER_SEC),
    )


def first_step_difference(baseline: Mapping[str, Any], other: Mapping[str, Any], rtol: float,
                          atol: float) -> tuple[float, float, Optional[str]]:
    """``(|loss difference|, largest |gradient difference|, what is beyond tolerance or None)``.

    A gradient is beyond tolerance when ``max|g - g_ref| > atol + rtol * max|g_ref|`` for that parameter, so a
    wrong small gradient is not hidden by a large one elsewhere.

    Example::

        >>> ref = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -2.0])}}
        >>> first_step_difference(ref, {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -1.0])}}, 1e-3, 1e-6)
        (0.0, 1.0, 'gradient of w')
    """
    loss_diff = abs(other["loss"] - baseline["loss"])
    ref, got = baseline["grads"], other["grads"]
    if set(ref) != set(got):
        missing = sorted(set(ref) ^ set(got))
        return loss_diff, math.inf, f"gradients of different parameters ({', '.join(missing[:3])})"
    grad_diff, problem = 0.0, None
    for name, g_ref in ref.items():
        diff = float((got[name] - g_ref).abs().max()) if g_ref.numel() else 0.0
        grad_diff = max(grad_diff, diff)
        scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
        if problem is None and not diff <= atol + rtol * scale:
            problem = f"gradient of {name}"
    if problem is None and not loss_diff <= atol + rtol * abs(baseline["loss"]):
        problem = "loss"
    return loss_diff, grad_diff, problem


# ---------------------------------------------------------------------------------------------------- output


def _num(value: Optional[float], digits: int = 4) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}g}"


def render_markdown(results: Sequence[VariantResult], title: str, rtol: float, atol: float) -> str:
    """The comparison as Markdown: a short header and one table row per variant, the baseline first."""
    base = results[0]
    on_device = base.peak_allocated_gib is not None
    memory_what = ("peak allocated device memory" if on_device else
                   f"activations held for backward ({base.device} run: no device memory; host RSS shown)")
    lines = [
        f"# Checkpointing comparison: {title}",
        "",
        f"Memory saved is measured on {memory_what}; time lost on the median step time after the first step."
        f" Loss and gradients after step 1 are compared with `{BASELINE}` (tolerance: |diff| <= {atol:g} +"
        f" {rtol:g} x the largest |value| of each gradient).",
        "",
    ]
    if not on_device and any(r.name == "offload" for r in results):
        lines += ["On a CPU run `offload` has no effect: the saved layer inputs are already in host memory.", ""]
    lines += [
        "| variant | checkpointed layers | peak device (GiB) | host RSS (GiB) | activations (GiB) | offloaded (GiB)"
        " | step (s) | samples/s | memory saved | time lost | loss diff | grad diff | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | | | | | | | | | | | | FAILED: {r.error} |")
            continue
        if r is base:
            saved = lost = loss = grad = "-"
            check = "baseline"
        else:
            delta = base.memory_gib - r.memory_gib
            saved = f"{_num(delta, 3)} GiB ({100 * delta / base.memory_gib:.0f}%)" if base.memory_gib else "n/a"
            lost = f"{100 * (r.step_sec / base.step_sec - 1):+.0f}%" if base.step_sec > 0 else "n/a"
            loss, grad = _num(r.loss_diff, 2), _num(r.grad_diff, 2)
            check = f"**MISMATCH: {r.mismatch}**" if r.mismatch else "ok"
        lines.append(
            f"| {r.name} | {len(r.checkpointed_layers)} | {_num(r.peak_allocated_gib)} | {_num(r.host_rss_gib)}"
            f" | {_num(r.activations_gib)} | {_num(r.offloaded_gib)} | {_num(r.step_sec)} | {_num(r.samples_per_sec)}"
            f" | {saved} | {lost} | {loss} | {grad} | {check} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[VariantResult], path: Path, title: str) -> Optional[Path]:
    """Memory against step time, one labelled point per variant, as a PNG (``None`` without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("compare: the plot needs matplotlib (`pip install matplotlib`); wrote the table only.", file=sys.stderr)
        return None
    done = [r for r in results if not r.error]
    fig = Figure(figsize=(6, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in done:
        colour = "tab:red" if r.mismatch else "tab:blue" if r.name != BASELINE else "black"
        ax.scatter([r.step_sec], [r.memory_gib], color=colour)
        ax.annotate(r.name, (r.step_sec, r.memory_gib), textcoords="offset points", xytext=(5, 5), fontsize=9)
    on_device = bool(done) and done[0].peak_allocated_gib is not None
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("peak allocated device memory (GiB)" if on_device else "activations held for backward (GiB)")
    ax.set_title(f"Checkpointing: memory vs step time\n{title}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


# ---------------------------------------------------------------------------------------------------- driver


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt compare",
        description="Run one LightningCLI config with and without checkpointing, each variant in a fresh process,"
                    " and compare memory, step time, and the loss and gradients after step 1.")
    parser.add_argument("--config", type=Path, help="LightningCLI YAML config (model, data, trainer)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per variant (default: 20)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} ('{BASELINE}' always runs)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write compare.md, compare.png and per-variant logs"
                             " (default: lightning_ckpt_compare/<config name>)")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative gradient/loss tolerance (default: 1e-3)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute gradient/loss tolerance (default: 1e-6)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    if args.worker is None:
        if args.config is None:
            parser.error("--config is required")
        if not args.config.is_file():
            parser.error(f"--config {args.config}: no such file")
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
        args.variants = [BASELINE] + [n for n in VARIANTS if n in names and n != BASELINE]
    return args


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("      " + line for line in text[-lines:])


def _run_variant(name: str, out_dir: Path, env: Mapping[str, str]) -> tuple[Optional[VariantResult], float]:
    variant_dir = out_dir / name
    start = time.perf_counter()
    with open(variant_dir / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "lightning_ckpt.compare", "--worker", str(variant_dir)],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    seconds = time.perf_counter() - start
    result_path = variant_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        return None, seconds
    result = json.loads(result_path.read_text())
    return measurements(name, read_monitor_csv(variant_dir / "metrics.csv"), result), seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-ckpt compare --config X.yaml [--steps N]``; returns the exit status (0, 1 mismatch, 2 failure)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        run_worker(args.worker)
        return 0

    base = yaml.safe_load(args.config.read_text()) or {}
    out_dir = (args.output_dir or Path("lightning_ckpt_compare") / args.config.stem).resolve()
    seed = config_seed(base)
    perturbed = os.environ.get(PERTURB_ENV)
    print(f"compare: {args.config}, {args.steps} steps per variant, seed {seed}, {len(args.variants)} variants"
          f" in fresh processes -> {out_dir} (each variant's output in <variant>/worker.log)", flush=True)

    results: list[VariantResult] = []
    firsts: dict[str, Any] = {}
    for i, name in enumerate(args.variants, 1):
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        config = variant_config(base, name, args.steps, out_dir, seed, perturb_grad=(name == perturbed))
        (out_dir / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"[{i}/{len(args.variants)}] {name} ({DESCRIPTIONS[name]}) ...", end=" ", flush=True)
        result, seconds = _run_variant(name, out_dir, os.environ)
        if result is None:
            print(f"FAILED after {seconds:.1f} s; last lines of {out_dir / name / 'worker.log'}:\n"
                  f"{_tail(out_dir / name / 'worker.log')}", flush=True)
            results.append(VariantResult(name=name, error=f"see {name}/worker.log"))
            if name == BASELINE:
                print("compare: the run without checkpointing failed; nothing to compare against.", file=sys.stderr)
                return 2
            continue
        first_path = out_dir / name / "first_step.pt"
        firsts[name] = torch.load(first_path, weights_only=True)
        first_path.unlink()  # as large as the model; the differences are what is kept
        if name != BASELINE:
            result.loss_diff, result.grad_diff, result.mismatch = first_step_difference(
                firsts[BASELINE], firsts.pop(name), args.rtol, args.atol)
        print(f"done in {seconds:.1f} s: {len(result.checkpointed_layers)} layers checkpointed, activations"
              f" {_num(result.activations_gib)} GiB, {_num(result.step_sec)} s/step"
              + (f", MISMATCH: {result.mismatch}" if result.mismatch else ""), flush=True)
        results.append(result)

    title = f"{args.config.name}, {args.steps} steps"
    markdown = render_markdown(results, title, args.rtol, args.atol)
    (out_dir / "compare.md").write_text(markdown)
    png = plot(results, out_dir / "compare.png", title)
    print()
    print(markdown)
    print(f"compare: wrote {out_dir / 'compare.md'}" + (f" and {png}" if png else ""), flush=True)
    if any(r.error for r in results):
        return 2
    if any(r.mismatch for r in results):
        print("compare: loss or gradients differ from the run without checkpointing beyond tolerance"
              " (flagged in the table).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
