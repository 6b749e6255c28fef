"""MemoryMonitor overhead: training with the monitor logging every 50 steps against the same run without it.

Demo GPT (4 layers, hidden 64, sequence 64, batch 16) through a real ``Trainer`` with a CSVLogger in both arms.
Runs alternate (with, without, without, with, ...) so drifting machine load hits both alike; each run's mean
step time is taken after a warm-up, and the medians over the runs are compared. The time spent inside the
monitor's hooks is also summed, and the extra time of a forward under the activation counter (what logging steps
add inside the forward) is measured on its own: figures that machine noise does not blur. Results go to
RESULTS.md ("monitor").

    python benchmarks/bench_monitor.py [--runs 7] [--steps 250]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from _results import machine, write_section
from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import GPT, CountingDataModule
from lightning_ckpt.demos import counting_sequences

WARMUP, LOG_EVERY = 20, 50
HOOKS = ("on_train_start", "on_train_batch_start", "on_before_backward", "on_before_optimizer_step",
         "on_train_batch_end", "on_train_end")


class StepClock(Callback):
    """Wall time of the training steps after ``WARMUP`` (the last batch end is after the final optimizer step)."""

    def __init__(self) -> None:
        self.start: Optional[float] = None
        self.end = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP and self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.end = time.perf_counter()
        self.steps = trainer.global_step - WARMUP

    @property
    def step_sec(self) -> float:
        assert self.start is not None
        return (self.end - self.start) / self.steps


def timed_monitor() -> tuple[MemoryMonitor, dict[str, float]]:
    """A MemoryMonitor whose hooks add their own wall time to ``spent["hooks"]``."""
    monitor = MemoryMonitor(log_every_n_steps=LOG_EVERY)
    spent = {"hooks": 0.0}
    for name in HOOKS:
        hook = getattr(monitor, name)

        @functools.wraps(hook)
        def wrapped(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent["hooks"] += time.perf_counter() - t

        setattr(monitor, name, wrapped)
    return monitor, spent


def run(with_monitor: bool, steps: int, log_dir: str) -> tuple[float, float]:
    """One training run; ``(mean step time after warm-up, fraction of it spent in the monitor's hooks)``."""
    seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    spent = {"hooks": 0.0}
    if with_monitor:
        monitor, spent = timed_monitor()
        callbacks.insert(0, monitor)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=WARMUP + steps, log_every_n_steps=LOG_EVERY,
                      logger=CSVLogger(log_dir), callbacks=callbacks, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(GPT(n_layer=4, n_embd=64, block_size=64), CountingDataModule(block_size=64, batch_size=16))
    total = clock.step_sec * clock.steps
    return clock.step_sec, spent["hooks"] / total  # hook time includes warm-up steps: a slight overestimate


def counting_cost(pairs: int = 40) -> tuple[float, float]:
    """``(median training step, median extra time of the same step under the activation counter)`` in seconds,
    the two timed back to back, alternating which goes first."""
    seed_everything(0, verbose=False)
    model = GPT(n_layer=4, n_embd=64, block_size=64)
    optimizer = model.configure_optimizers()
    seqs = counting_sequences(16, 65, 64)
    idx, targets = seqs[:, :-1], seqs[:, 1:]

    def step(count: bool) -> float:
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if count:
            with SavedTensorCounter(exclude=model.parameters()):
                loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        else:
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        return time.perf_counter() - t

    for _ in range(5):
        step(False), step(True)
    plain, extra = [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        timed = {count: step(count) for count in order}
        plain.append(timed[False])
        extra.append(timed[True] - timed[False])
    return statistics.median(plain), statistics.median(extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per arm (default: 7)")
    parser.add_argument("--steps", type=int, default=250, help="timed steps per run, after warm-up (default: 250)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machines this runs on are often small and shared; one thread is steadier

    times: dict[bool, list[float]] = {True: [], False: []}
    fractions: list[float] = []
    with tempfile.TemporaryDirectory() as log_dir:
        for i in range(args.runs):
            for with_monitor in ((True, False) if i % 2 == 0 else (False, True)):
                step_sec, fraction = run(with_monitor, args.steps, log_dir)
                times[with_monitor].append(step_sec)
                if with_monitor:
                    fractions.append(fraction)
                print(f"run {i + 1}/{args.runs} {'monitor' if with_monitor else 'none':>7}: {1000 * step_sec:.2f} ms/step"
                      + (f", {100 * fraction:.3f}% in monitor hooks" if with_monitor else ""), flush=True)

    bare_step, counter_extra = counting_cost()
    counter_share = 100 * counter_extra / bare_step / LOG_EVERY
    with_ms, without_ms = (1000 * statistics.median(times[k]) for k in (True, False))
    ratio = with_ms / without_ms
    paired = statistics.median(a / b for a, b in zip(times[True], times[False]))
    spread = (1000 * min(times[False]), 1000 * max(times[False]))
    hook_share = 100 * statistics.median(fractions)
    own_cost = hook_share + counter_share
    noise = 100 * (max(times[False]) - min(times[False])) / statistics.median(times[False])
    verdict = (f"Target: under 1% of step time with logging every {LOG_EVERY} steps -"
               f" {'met' if own_cost < 1 else 'NOT met'} ({own_cost:.2f}%, measured directly). The end-to-end"
               f" difference ({100 * (paired - 1):+.1f}%, paired) is "
               + ("within" if abs(100 * (paired - 1)) <= noise else "beyond")
               + f" the run-to-run spread of the runs without the monitor ({noise:.1f}%).")
    markdown = f"""## MemoryMonitor overhead

`python benchmarks/bench_monitor.py --runs {args.runs} --steps {args.steps}` — {machine()}.

Demo GPT (4 layers, hidden 64, sequence 64, batch 16), `Trainer` with a CSVLogger, {args.steps} timed steps per run
after {WARMUP} warm-up steps; {args.runs} runs per arm, alternating. `MemoryMonitor(log_every_n_steps={LOG_EVERY})`.

| | median step time (ms) |
| --- | --- |
| without monitor | {without_ms:.3f} (runs ranged {spread[0]:.3f}–{spread[1]:.3f}) |
| with monitor | {with_ms:.3f} |
| ratio with / without (medians) | {ratio:.4f} |
| ratio with / without (median of paired runs) | {paired:.4f} |
| time inside the monitor's hooks, share of step time | {hook_share:.3f}% |
| activation counting on logging steps, share of step time | {counter_share:.3f}% ({1000 * counter_extra:.3f} ms extra on a {1000 * bare_step:.2f} ms step, once every {LOG_EVERY} steps) |
| **monitor's own cost (hooks + counting)** | **{own_cost:.3f}%** |

{verdict}

The end-to-end ratio is only as precise as the spread between runs of the same arm on this machine (the
without-monitor runs alone ranged as shown); the last three rows measure the monitor's own work directly.
"""
    print(markdown)
    write_section("monitor", markdown)


if __name__ == "__main__":
    main()
