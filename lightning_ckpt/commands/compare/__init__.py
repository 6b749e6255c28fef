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
(:func:`~lightning_ckpt.core.planner.predict_seconds`) for the layers that variant checkpointed: from one measured
step of the config's model (per-layer bytes, FLOPs and ops, as ``lightning-ckpt plan`` measures it) and a
:class:`~lightning_ckpt.core.device_profile.DeviceProfile`: by default the device the runs use, measured
(``DeviceProfile.measure``), or a preset with ``--device h100-sxm``. Nothing else is run for it.

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
bootstrap intervals, gradient differences, predictions) and :mod:`~lightning_ckpt.commands.compare.report` (table,
JSON, plot); this module parses the arguments and drives the runs (:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
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
from lightning_ckpt.commands.compare.report import (
    format_ms,
    format_number,
    plot,
    prediction_text,
    render_markdown,
    to_json,
)
from lightning_ckpt.commands.compare.run import (
    PERTURB_ENV,
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
from lightning_ckpt.commands.compare.variants import BASELINE, DESCRIPTIONS, PLANNED, VARIANTS, available_variants
from lightning_ckpt.core.memory_stats import ACTIVATIONS, STEP_SEC

__all__ = ["main"]

#: Defaults: 30 timed steps per variant in 3 rounds of 10, each after 2 untimed warm-up steps.
DEFAULT_STEPS, DEFAULT_ROUNDS, DEFAULT_WARMUP = 30, 3, 2


def _parse(argv: Sequence[str]) -> argparse.Namespace:
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
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative gradient/loss tolerance (default: 1e-3)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute gradient/loss tolerance (default: 1e-6)")
    add_device_argument(parser, "price the predicted slowdowns on this device",
                        "default: auto")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
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
    allowed = available_variants(args.base)
    names = allowed if args.variants is None else [n.strip() for n in args.variants.split(",") if n.strip()]
    if PLANNED in names and PLANNED not in allowed:
        parser.error(f"the '{PLANNED}' variant needs a memory_budget in the config's GradientCheckpointing init_args"
                     f" (e.g. `memory_budget: 0.5`); choose from {', '.join(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    args.variants = [BASELINE] + [n for n in allowed if n in names and n != BASELINE]
    return args


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

    out_dir = (args.output_dir or Path("lightning_ckpt_compare") / args.config.stem).resolve()
    seed = config_seed(args.base)
    perturbed = os.environ.get(PERTURB_ENV)
    per_round = steps_per_round(args.steps, args.rounds)
    order = schedule(args.variants, len(per_round))
    timing = (f"Timing: {args.steps} timed steps per variant in {len(per_round)} round(s) of fresh processes"
              f" ({'/'.join(map(str, per_round))} steps, each after {args.warmup} untimed warm-up step(s)), the"
              f" rounds interleaved and alternately reversed.")
    print(f"compare: {args.config}, {len(args.variants)} variants x {len(per_round)} rounds = {len(order)} fresh"
          f" processes, {args.warmup} warm-up + {'/'.join(map(str, per_round))} timed steps each, seed {seed}"
          f" -> {out_dir} (each process's output in <variant>/round<k>/worker.log)", flush=True)

    runs: dict[str, list[Any]] = {name: [] for name in args.variants}
    failed: dict[str, str] = {}
    checks: dict[str, tuple[float, float, Optional[str]]] = {}
    baseline_first: Any = None
    for i, (r, name) in enumerate(order, 1):
        if name in failed:
            continue
        run_dir = out_dir / name / f"round{r + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        config = variant_config(args.base, name, args.warmup + per_round[r], run_dir, seed,
                                perturb_grad=(r == 0 and name == perturbed), record_first_step=(r == 0))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"[{i}/{len(order)}] round {r + 1}/{len(per_round)} {name} ({DESCRIPTIONS[name]}) ...", end=" ",
              flush=True)
        got, seconds = run_process(run_dir, os.environ)
        if got is None or not got[0]:
            log = run_dir / "worker.log"
            if got is None:
                print(f"FAILED after {seconds:.1f} s; last lines of {log}:\n{_tail(log)}", flush=True)
            else:
                print(f"FAILED: {NO_STEPS}", flush=True)
            failed[name] = f"see {log.relative_to(out_dir)}" if got is None else "trained no step"
            if name == BASELINE:
                print("compare: the run without checkpointing failed; nothing to compare against.", file=sys.stderr)
                return 2
            continue
        runs[name].append(got)
        mismatch = None
        if r == 0:
            first_path = run_dir / "first_step.pt"
            first = torch.load(first_path, weights_only=True)
            first_path.unlink()  # as large as the model; the differences are what is kept
            if name == BASELINE:
                baseline_first = first
            else:
                checks[name] = first_step_difference(baseline_first, first, args.rtol, args.atol)
                mismatch = checks[name][2]
        rows, result = got
        timed = [row[STEP_SEC] for row in rows[args.warmup:]]
        print(f"done in {seconds:.1f} s: {len(result['checkpointed_layers'])} layers checkpointed, activations"
              f" {format_number(max(row.get(ACTIVATIONS, 0.0) for row in rows))} GiB, median"
              f" {format_ms(spread(timed).median)} ms/step" + (f", MISMATCH: {mismatch}" if mismatch else ""),
              flush=True)

    results: list[VariantResult] = []
    for name in args.variants:
        if name in failed:
            results.append(VariantResult(name=name, error=failed[name]))
            continue
        result = measurements(name, runs[name], args.warmup)
        if name in checks:
            result.loss_diff, result.grad_diff, result.mismatch = checks[name]
        results.append(result)

    print("compare: measuring one step of the model and the device profile for the predicted slowdowns ...",
          flush=True)
    model, problems, why = None, [], ""
    try:
        model = measure_time_model(args.config, args.device)
        problems = predict_variants(results, model)
    except Exception as err:  # noqa: BLE001 - the runs are done; a prediction that fails must not lose them
        why = f"measuring the step for the time model failed ({type(err).__name__}: {err})"
        print(f"compare: no predicted slowdowns: {why}", file=sys.stderr)

    title = f"{args.config.name}, {args.steps} timed steps per variant"
    markdown = render_markdown(results, title, args.rtol, args.atol, timing, prediction_text(model, problems, why))
    (out_dir / "compare.md").write_text(markdown)
    settings = {"config": str(args.config), "steps": args.steps, "rounds": len(per_round),
                "steps_per_round": per_round, "warmup": args.warmup, "seed": seed, "order": order,
                "rtol": args.rtol, "atol": args.atol,
                "time_model": model.as_dict() if model is not None else {"error": why}}
    (out_dir / "compare.json").write_text(json.dumps(to_json(results, settings), indent=2))
    fig = plot(results, out_dir / "compare.png", title)
    print()
    print(markdown)
    print(f"compare: wrote {out_dir / 'compare.md'}, compare.json" + (" and compare.png" if fig else ""), flush=True)
    if any(r.error for r in results):
        return 2
    if any(r.mismatch for r in results):
        print("compare: loss or gradients differ from the run without checkpointing beyond tolerance"
              " (flagged in the table).", file=sys.stderr)
        return 1
    return 0
