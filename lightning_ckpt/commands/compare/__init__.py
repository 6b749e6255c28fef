"""``lightning-ckpt compare``: the same run with and without checkpointing, side by side.

Each variant runs the same model, data and seed from one LightningCLI config, in fresh processes: no
checkpointing, every layer, every layer with selective checkpointing, every 2nd, every 4th, every layer with
offload, and, when the config's ``GradientCheckpointing`` has a ``memory_budget``, that callback as configured
(``planned``). The config's own ``GradientCheckpointing`` entry is replaced per variant, keeping its other
settings (``layer_cls``, ``use_reentrant``, ...). Memory and time come from
:class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` logging every step to a CSV file; loss and gradients
after step 1 are compared with the run without checkpointing.

Timing is made to be trusted, not glanced at: every variant runs in ``--rounds`` fresh processes, the rounds
interleaved and alternately reversed (``none, every_layer, ..., offload``, then ``offload, ..., none``, ...) so
that a machine getting slower or busier during the comparison falls on every variant alike. The first
``--warmup`` steps of each process are not timed; ``--steps`` timed steps per variant are split over the rounds.
Each variant's step time is the median with its interquartile range, and time lost is the ratio of medians to
the run without checkpointing with a 95% bootstrap interval
(:func:`~lightning_ckpt.commands.compare.stats.time_difference`). A difference whose interval contains zero is
reported as within noise, never as a gain.

Next to each measured slowdown is the one the planner's time model predicts
(:func:`~lightning_ckpt.core.plan.planner.predict_seconds`) for the layers that variant checkpointed: from one measured
step of the config's model (per-layer bytes, FLOPs and ops, as ``lightning-ckpt plan`` measures it) and a
:class:`~lightning_ckpt.core.measure.device_profile.DeviceProfile`: by default the device the runs use, measured
(``DeviceProfile.measure``), or a preset with ``--device h100-sxm``. Nothing else is run for it. On the device
measured, the time each variant adds is added to the baseline's measured step
(:func:`~lightning_ckpt.commands.compare.stats.measured_baseline`).

Example::

    lightning-ckpt compare --config configs/every_4th_offload.yaml --steps 30 --rounds 3
    lightning-ckpt compare --config configs/tiny.yaml --device h100-sxm  # predicted column for an H100

It prints a Markdown table and writes it (``compare.md``), every number with the step-time samples
(``compare.json``), and a plot of memory against step time with interquartile error bars (``compare.png``) to
the output folder; each process's config, log and metrics are in ``<variant>/round<k>/``. Exit status: 0 when
every variant matches the loss and gradients of the run without checkpointing, 1 when one does not (flagged in
the table), 2 for a usage error or when a variant failed to run.

Test hook: when the environment variable ``LIGHTNING_CKPT_COMPARE_PERTURB_GRAD`` names a variant, that
variant adds a visible error to one gradient after its first backward (see
:class:`~lightning_ckpt.commands.compare.run.FirstStepRecorder`). It exists only so that the tests can check that a
wrong gradient is caught; the variant's config says so (``perturb_grad: true``).

The command is in parts: :mod:`~lightning_ckpt.commands.compare.variants` (what each variant sets, and which a config
can run), :mod:`~lightning_ckpt.commands.compare.run` (the config of each process, the worker and the time model's
measured step), :mod:`~lightning_ckpt.commands.compare.stats` (the numbers: spreads,
bootstrap intervals, gradient differences, predictions), :mod:`~lightning_ckpt.commands.compare.comparison` (one
comparison, whole: the results and the settings they ran with) and :mod:`~lightning_ckpt.commands.compare.report`
(table, JSON, plot); this module parses the arguments (:func:`_parse`), runs the processes (:func:`_run_all`), puts
their numbers together (:func:`_compare`) and writes the report (:func:`_write`): :func:`main` is those four steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from lightning_ckpt.commands.arguments import (
    add_config_argument,
    add_device_argument,
    check_config_argument,
    check_device_argument,
)
from lightning_ckpt.commands.compare.comparison import ATOL, RTOL, Comparison
from lightning_ckpt.commands.compare.report import format_gib, format_ms, plot, render_markdown, to_json
from lightning_ckpt.commands.compare.run import (
    PERTURB_ENV,
    Output,
    config_seed,
    measure_time_model,
    run_process,
    run_worker,
    schedule,
    steps_per_round,
    variant_config,
)
from lightning_ckpt.commands.compare.stats import (
    NO_STEPS,
    VariantResult,
    first_step_difference,
    measurements,
    predict_variants,
    spread,
)
from lightning_ckpt.commands.compare.variants import (
    BASELINE,
    DESCRIPTIONS,
    MIN_COSINE,
    PLANNED,
    VARIANTS,
    available_variants,
    compress_of,
    planned_settings,
)
from lightning_ckpt.core.measure.memory_stats import ACTIVATIONS, STEP_SEC

__all__ = ["main"]

#: Defaults: 30 timed steps per variant in 3 rounds of 10, each after 2 untimed warm-up steps.
DEFAULT_STEPS, DEFAULT_ROUNDS, DEFAULT_WARMUP = 30, 3, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt compare", allow_abbrev=False,
        description="Run one LightningCLI config with and without checkpointing, each variant in fresh processes"
                    " in interleaved rounds, and compare memory, step time (median, spread, and whether a difference"
                    " is beyond noise), and the loss and gradients after step 1.")
    add_config_argument(parser)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"timed steps per variant, after warm-up, over all rounds (default: {DEFAULT_STEPS})")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="fresh processes per variant, run in interleaved rounds that alternate direction"
                             f" (default: {DEFAULT_ROUNDS})")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help=f"untimed steps at the start of each process (default: {DEFAULT_WARMUP})")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)},{PLANNED} ('{BASELINE}' always runs;"
                             f" '{PLANNED}' needs a memory_budget in the config; default: all the config allows)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write compare.md, compare.json, compare.png and per-process logs"
                             " (default: lightning_ckpt_compare/<config name>)")
    parser.add_argument("--rtol", type=float, default=RTOL,
                        help=f"relative gradient/loss tolerance (default: {RTOL:g})")
    parser.add_argument("--atol", type=float, default=ATOL,
                        help=f"absolute gradient/loss tolerance (default: {ATOL:g})")
    add_device_argument(parser, "price the predicted slowdowns on this device",
                        "default: auto")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line, checked (a usage error exits 2), with what follows from it: the config read (``base``),
    the variants to run, the baseline first, the timed steps of each round (``per_round``), ``seed`` and
    ``out_dir``. A worker's command line (``--worker DIR``) is returned as it is."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.worker is not None:
        return args
    check_device_argument(parser, args.device)
    check_config_argument(parser, args.config, "compare")
    for option, least in (("steps", 1), ("rounds", 1), ("warmup", 0)):
        if getattr(args, option) < least:
            parser.error(f"--{option} must be >= {least}, got {getattr(args, option)}")
    try:
        args.base = yaml.safe_load(args.config.read_text()) or {}
    except yaml.YAMLError as err:
        parser.error(f"--config {args.config}: not valid YAML ({err}); pass a LightningCLI YAML config")
    if not isinstance(args.base, Mapping):
        parser.error(f"--config {args.config}: expected a LightningCLI config (a mapping of trainer, model, data),"
                     f" got a {type(args.base).__name__}")
    args.variants = _variants(parser, args.variants, args.base)
    args.per_round = steps_per_round(args.steps, args.rounds)
    args.seed = config_seed(args.base)
    args.out_dir = (args.output_dir or Path("lightning_ckpt_compare") / args.config.stem).resolve()
    return args


def _variants(parser: argparse.ArgumentParser, chosen: Optional[str], base: Mapping[str, Any]) -> list[str]:
    """The variants that ``--variants`` names (``None``: all that the config allows), the baseline first."""
    allowed = available_variants(base)
    names = allowed if chosen is None else [n.strip() for n in chosen.split(",") if n.strip()]
    if PLANNED in names and PLANNED not in allowed:
        parser.error(f"the '{PLANNED}' variant needs a memory_budget in the config's GradientCheckpointing init_args"
                     f" (e.g. `memory_budget: 0.5`); choose from {', '.join(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return [BASELINE] + [n for n in allowed if n in names and n != BASELINE]


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("      " + line for line in text[-lines:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-ckpt compare --config X.yaml [--steps N] [--rounds R]``; returns the exit status (0, 1 for a
    gradient mismatch, 2 for a usage error or a failed variant)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        run_worker(args.worker)
        return 0
    runs = _run_all(args)
    if runs is None:
        return 2
    comparison = _compare(args, runs)
    _write(comparison, args.out_dir)
    status = comparison.exit_status
    if status == 1:
        print("compare: loss or gradients differ from the run without checkpointing beyond tolerance"
              " (flagged in the table).", file=sys.stderr)
    return status


# ---------------------------------------------------------------------------------------------------- run


@dataclass
class Runs:
    """What the processes left, by variant: each process's ``(monitor rows, result.json)``, why a variant failed,
    and ``(loss difference, gradient difference, mismatch)`` of its first step against the baseline's."""

    outputs: dict[str, list[Output]]
    failed: dict[str, str] = field(default_factory=dict)
    checks: dict[str, tuple[float, float, Optional[str]]] = field(default_factory=dict)
    baseline_first: Any = None  # the baseline's first step: {"loss": float, "grads": {name: tensor}}


def _run_all(args: argparse.Namespace) -> Optional[Runs]:
    """Run every process in :func:`~lightning_ckpt.commands.compare.run.schedule` order, printing progress; a variant
    that fails is not run again. ``None`` when the baseline fails: then there is nothing to compare against."""
    order = schedule(args.variants, len(args.per_round))
    print(f"compare: {args.config}, {len(args.variants)} variants x {len(args.per_round)} rounds = {len(order)} fresh"
          f" processes, {args.warmup} warm-up + {'/'.join(map(str, args.per_round))} timed steps each, seed"
          f" {args.seed} -> {args.out_dir} (each process's output in <variant>/round<k>/worker.log)", flush=True)
    runs = Runs(outputs={name: [] for name in args.variants})
    for i, (r, name) in enumerate(order, 1):
        if name in runs.failed:
            continue
        print(f"[{i}/{len(order)}] round {r + 1}/{len(args.per_round)} {name} ({DESCRIPTIONS[name]}) ...", end=" ",
              flush=True)
        run_dir = args.out_dir / name / f"round{r + 1}"
        got, seconds = _run_one(args, r, name, run_dir)
        if got is None or not got[0]:
            runs.failed[name] = _failure(got, seconds, run_dir, args.out_dir)
            if name == BASELINE:
                print("compare: the run without checkpointing failed; nothing to compare against.", file=sys.stderr)
                return None
            continue
        runs.outputs[name].append(got)
        mismatch = (_check_first_step(runs, name, run_dir / "first_step.pt", args.rtol, args.atol,
                                      _min_cosine(args.base, name)) if r == 0 else None)
        _print_done(got, seconds, args.warmup, mismatch)
    return runs


def _min_cosine(base: Any, name: str) -> Optional[float]:
    """The gradient check of a variant that holds compressed inputs (:data:`MIN_COSINE`); ``None`` for exact ones."""
    compress = compress_of(VARIANTS[name] if name in VARIANTS else planned_settings(base))
    return MIN_COSINE.get(compress) if compress else None


def _run_one(args: argparse.Namespace, r: int, name: str, run_dir: Path) -> tuple[Optional[Output], float]:
    """Write the config of variant ``name``'s process in round ``r`` to ``run_dir`` and run it (:func:`run_process`);
    round 1 records the first step, and perturbs it when the test hook names the variant."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = variant_config(args.base, name, args.warmup + args.per_round[r], run_dir, args.seed,
                            perturb_grad=(r == 0 and name == os.environ.get(PERTURB_ENV)), record_first_step=(r == 0),
                            warmup=args.warmup)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run_process(run_dir, os.environ)


def _failure(got: Optional[Output], seconds: float, run_dir: Path, out_dir: Path) -> str:
    """Print why a process gave nothing to compare; return the table's words for it."""
    log = run_dir / "worker.log"
    if got is None:
        print(f"FAILED after {seconds:.1f} s; last lines of {log}:\n{_tail(log)}", flush=True)
        return f"see {log.relative_to(out_dir)}"
    print(f"FAILED: {NO_STEPS}", flush=True)
    return "trained no step"


def _check_first_step(runs: Runs, name: str, path: Path, rtol: float, atol: float,
                      min_cosine: Optional[float] = None) -> Optional[str]:
    """Load round 1's first step of ``name`` from ``path`` and compare it with the baseline's (the baseline runs
    first); returns what is beyond tolerance, if anything (``min_cosine``: a compressed variant's gradient check,
    see :func:`~lightning_ckpt.commands.compare.stats.first_step_difference`)."""
    first = torch.load(path, weights_only=True)
    path.unlink()  # as large as the model; the differences are what is kept
    if name == BASELINE:
        runs.baseline_first = first
        return None
    runs.checks[name] = first_step_difference(runs.baseline_first, first, rtol, atol, min_cosine)
    return runs.checks[name][2]


def _print_done(got: Output, seconds: float, warmup: int, mismatch: Optional[str]) -> None:
    rows, result = got
    timed = [row[STEP_SEC] for row in rows[warmup:]]
    print(f"done in {seconds:.1f} s: {len(result['checkpointed_layers'])} layers checkpointed, activations"
          f" {format_gib(max(row.get(ACTIVATIONS, 0.0) for row in rows))}, median"
          f" {format_ms(spread(timed).median)} ms/step" + (f", MISMATCH: {mismatch}" if mismatch else ""),
          flush=True)


# ---------------------------------------------------------------------------------------------------- compute


def _compare(args: argparse.Namespace, runs: Runs) -> Comparison:
    """Each variant's numbers (:func:`~lightning_ckpt.commands.compare.stats.measurements`) and its predicted
    slowdown, as one :class:`~lightning_ckpt.commands.compare.comparison.Comparison`."""
    results = [_result(name, runs, args.warmup) for name in args.variants]
    comparison = Comparison(results, args.config, args.per_round, args.warmup, args.seed, args.rtol, args.atol)
    print("compare: measuring one step of the model and the device profile for the predicted slowdowns ...",
          flush=True)
    try:
        comparison.time_model = measure_time_model(args.config, args.device)
        comparison.unpredicted = predict_variants(results, comparison.time_model)
    except Exception as err:  # noqa: BLE001 - the runs are done; a prediction that fails must not lose them
        comparison.no_time_model = f"measuring the step for the time model failed ({type(err).__name__}: {err})"
        print(f"compare: no predicted slowdowns: {comparison.no_time_model}", file=sys.stderr)
    return comparison


def _result(name: str, runs: Runs, warmup: int) -> VariantResult:
    if name in runs.failed:
        return VariantResult(name=name, error=runs.failed[name])
    result = measurements(name, runs.outputs[name], warmup)
    if name in runs.checks:
        result.loss_diff, result.grad_diff, result.mismatch = runs.checks[name]
    return result


# ---------------------------------------------------------------------------------------------------- render


def _write(comparison: Comparison, out_dir: Path) -> None:
    """Write ``compare.md``, ``compare.json`` and ``compare.png`` to ``out_dir``, and print the table."""
    markdown = render_markdown(comparison)
    (out_dir / "compare.md").write_text(markdown)
    (out_dir / "compare.json").write_text(json.dumps(to_json(comparison), indent=2))
    fig = plot(comparison, out_dir / "compare.png")
    print()
    print(markdown)
    print(f"compare: wrote {out_dir / 'compare.md'}, compare.json" + (" and compare.png" if fig else ""), flush=True)
