"""What `MemoryMonitor`'s activation count does to a measured slowdown: forward and backward of a config's model
with no checkpointing and with every layer checkpointed, each with and without the count running
(:class:`~lightning_ckpt.core.measure.memory_stats.ActivationProbe`, the saved-tensor hooks the monitor enters on
the steps it logs; ``compare`` logs every step), interleaved, medians.

    python benchmarks/bench_monitor_hook.py [--config configs/tiny.yaml] [--reps 40]

Checkpointed layers save through checkpoint's own hooks, which are innermost, so the count's Python hook sees only
what the un-checkpointed parts save: a step without checkpointing pays it for every saved tensor. Prints only;
RESULTS.md quotes it by hand ("Prices from the device").
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_time_model import measured_batch
from lightning_ckpt.commands.plan.measure import _loss
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.memory_stats import ActivationProbe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    built, _, batch = measured_batch(args.config)
    module = built.module
    probe = ActivationProbe()

    def step(counted: bool) -> None:
        if counted:
            probe.start(module.parameters())
        loss = _loss(module.training_step(batch, 0))
        if counted:
            probe.stop()
        loss.backward()
        module.zero_grad(set_to_none=True)

    times: dict[tuple[bool, bool], list[int]] = {}
    for _ in range(args.reps):
        for checkpointed in (False, True):
            if checkpointed:
                apply_checkpointing(module, layer_cls=built.layer_cls)
            for counted in (False, True):
                start = time.perf_counter_ns()
                step(counted)
                times.setdefault((checkpointed, counted), []).append(time.perf_counter_ns() - start)
            if checkpointed:
                remove_checkpointing(module)
    ms = {key: statistics.median(ns) / 1e6 for key, ns in times.items()}
    print(f"{args.config}: forward and backward, median of {args.reps} interleaved")
    print("| activation count | none (ms) | every layer (ms) | slowdown |")
    print("| --- | ---: | ---: | ---: |")
    for counted in (False, True):
        none, full = ms[(False, counted)], ms[(True, counted)]
        print(f"| {'on' if counted else 'off'} | {none:.2f} | {full:.2f} | {100 * (full / none - 1):+.0f}% |")


if __name__ == "__main__":
    main()
