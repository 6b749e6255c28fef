"""The time model against one process's forward and backward (no optimizer, no Lightning), for a config.

    python benchmarks/bench_time_model.py [--config configs/tiny.yaml] [--reps 60]

Builds the config's model and batch as ``lightning-ckpt plan`` does, measures one step (``measure_step``) and the
device (``DeviceProfile.measure``), then times forward and backward of no checkpointing, every layer, every 2nd
layer, selective, a plan at ``--budget`` (0.5) priced on that profile and the same budget's plan priced by FLOPs
(what ``time_layers=False`` plans), interleaved and alternately reversed,
``--reps`` times each; prints measured and predicted (``predict_seconds``) step time, extra time and slowdown per setting. What ``compare`` measures adds the optimizer
step and the training loop (Lightning's hooks, logging) to every step; this leaves them out, to show how the model
does on what it prices. Prints only; RESULTS.md quotes it by hand.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_ckpt.commands.plan.build import Built
from lightning_ckpt.commands.plan.measure import Measurement, _loss, _on_device, batch_of_size, build, measure
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.timing import price_source
from lightning_ckpt.core.plan.planner import CheckpointPlan, make_plan, predict_seconds

SETTINGS = {"none": None, "every_layer": {"mode": "full"}, "every_2nd": {"mode": "full", "every_n_layers": 2},
            "selective": {"mode": "selective"}}


def measured_batch(config: Path) -> tuple[Built, Measurement, Any]:
    """``config``'s model built and one step of it measured as ``lightning-ckpt plan`` does, and the batch of the
    measured size on its device."""
    warnings.filterwarnings("ignore", message="You are trying to `self.log")
    built = build(config, fake=False)
    measured = measure(built)
    return built, measured, _on_device(built, batch_of_size(built.loader, measured.batch_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--budget", type=float, default=0.5, help="the plan's memory_budget (a fraction)")
    args = parser.parse_args()
    built, measured, batch = measured_batch(args.config)
    module = built.module
    profile = DeviceProfile.measure(built.device)
    plan = make_plan(measured.costs, measured.outside_bytes, args.budget, device=profile,
                     outside_ops=measured.outside_ops, head_bytes=measured.head_bytes,
                     head_peak_bytes=measured.head_peak_bytes)
    # the same budget priced by FLOPs (the costs without their times, no profile): what time_layers=False plans
    untimed = [replace(c, plain_ns=0, full_ns=0, selective_ns=0) for c in measured.costs]
    flops_plan = make_plan(untimed, measured.outside_bytes, args.budget, head_bytes=measured.head_bytes,
                           head_peak_bytes=measured.head_peak_bytes)

    def step() -> None:
        _loss(module.training_step(batch, 0)).backward()
        module.zero_grad(set_to_none=True)

    settings = {**SETTINGS, f"plan {args.budget}": plan, f"plan {args.budget} by FLOPs": flops_plan}
    times: dict[str, list[float]] = {name: [] for name in settings}
    modes: dict[str, dict[str, str]] = {}
    for rep in range(args.reps):
        for name, options in settings.items() if rep % 2 == 0 else reversed(list(settings.items())):
            remove_checkpointing(module)
            if isinstance(options, CheckpointPlan):
                options.apply(module)
                modes[name] = options.layers
            else:
                names = apply_checkpointing(module, built.layer_cls, **options) if options else []
                modes[name] = dict.fromkeys(names, options["mode"]) if options else {}
            step()  # warm-up after re-wrapping
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    remove_checkpointing(module)
    base = statistics.median(times["none"])
    print(f"{args.config}: forward and backward, median of {args.reps} interleaved; profile {profile};"
          f" priced by {price_source(measured.costs, profile)}; plan {plan.layers}; by FLOPs {flops_plan.layers}")
    print("| setting | measured (ms) | predicted (ms) | measured extra (ms) | predicted extra (ms) | measured slowdown"
          " | predicted slowdown |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in settings:
        got = statistics.median(times[name])
        kept = settings[name].kept_ops if isinstance(settings[name], CheckpointPlan) else {}
        predicted, baseline = predict_seconds(measured.costs, measured.outside_ops, modes[name], profile,
                                              kept_ops=kept)
        print(f"| {name} | {1e3 * got:.2f} | {1e3 * predicted:.2f} | {1e3 * (got - base):.2f}"
              f" | {1e3 * (predicted - baseline):.2f} | {100 * (got / base - 1):+.0f}% | {100 * (predicted / baseline - 1):+.0f}% |")


if __name__ == "__main__":
    main()
