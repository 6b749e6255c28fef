"""DDP and FSDP, with and without checkpointing, on 2 CPU processes (gloo): step time and memory per rank.

Demo GPT (4 layers, hidden 128, sequence 128, batch 8 per rank), trained through a real ``Trainer``:

- DDP: Lightning's ``DDPStrategy`` / ``"ddp_ckpt"`` with ``GradientCheckpointing()``;
- FSDP: ``"fsdp_ckpt"`` without / with ``GradientCheckpointing()`` (one FSDP2 unit per block, then the rest).

Step times: the four arms alternate as short fits (rotated order) in one pair of processes, so machine
load drifts over all arms alike; each fit's median step after a warm-up, and the ratio between adjacent fits,
median over the repetitions. Memory: each arm in a fresh pair of processes, so each run's peak is its own:
activation bytes held for backward at the end of one training forward, per rank, counted with saved-tensor
hooks (``SavedTensorCounter``; parameters, FSDP's gathered ones included, excluded), and the host memory the
fit added (peak RSS from ``getrusage`` minus ``psutil`` RSS before ``fit``). Times are reported only as
ratios. Results go to RESULTS.md ("distributed").

    python benchmarks/bench_distributed.py [--reps 7] [--rounds 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import psutil
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from _results import machine, write_section
from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import GPT, CountingDataModule
from lightning_ckpt.strategies import CheckpointingDDPStrategy, CheckpointingFSDPStrategy

WORLD_SIZE = 2
WARMUP = 3
MODEL = dict(vocab_size=64, block_size=128, n_layer=4, n_embd=128, n_head=4, dropout=0.0)
BATCH = 8
ARMS = [("DDP", False), ("DDP", True), ("FSDP", False), ("FSDP", True)]
MIB = 2**20


class ParameterAwareCounter(SavedTensorCounter):
    """Saved bytes without parameters, re-reading them at each save: FSDP gathers parameters per unit."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._module = module

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # FSDP registers the gathered (plain) parameters of the running unit and sharded DTensors elsewhere
        self._excluded = {(p.device, p.untyped_storage().data_ptr())
                          for p in self._module.parameters() if not isinstance(p, DTensor)}
        return super()._pack(tensor)


class Probe(Callback):
    """Step times after the warm-up, and the activation bytes of one training forward (the first timed step)."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.activation_bytes = 0
        self._start = 0.0
        self._counter: Optional[ParameterAwareCounter] = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == WARMUP:
            self._counter = ParameterAwareCounter(pl_module)
            self._counter.__enter__()
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.activation_bytes = self._counter.bytes
            self._counter = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._start
        if batch_idx >= WARMUP:
            self.step_times.append(elapsed)


def _fit(kind: str, checkpointing: bool, steps: int) -> tuple[Probe, int]:
    """One fit of ``WARMUP + steps`` steps in this process; the probe and the RSS before ``fit``."""
    seed_everything(0, verbose=False)
    if kind == "DDP":
        strategy = CheckpointingDDPStrategy() if checkpointing else DDPStrategy()
    else:
        strategy = CheckpointingFSDPStrategy()
    probe = Probe()
    callbacks = [probe] + ([GradientCheckpointing()] if checkpointing else [])
    trainer = Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=WARMUP + steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)
    model = GPT(**MODEL)
    data = CountingDataModule(vocab_size=MODEL["vocab_size"], block_size=MODEL["block_size"], batch_size=BATCH,
                              num_samples=BATCH * WORLD_SIZE * (WARMUP + steps))
    rss_before = psutil.Process().memory_info().rss
    trainer.fit(model, data)
    return probe, rss_before


def _join_as_rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def memory_worker(rank: int, port: int, arm: tuple[str, bool], steps: int, out: str) -> None:
    """One arm in a fresh process: activation bytes and the host memory its fit added."""
    _join_as_rank(rank, port)
    probe, rss_before = _fit(*arm, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    torch.save({"activations": probe.activation_bytes, "rss_added": peak - rss_before}, Path(out) / f"rank{rank}.pt")


def time_worker(rank: int, port: int, reps: int, steps: int, out: str) -> None:
    """All arms in one pair of processes, alternating: ``reps`` times each arm, in rotated order."""
    _join_as_rank(rank, port)
    times: dict[tuple[str, bool], list[float]] = {arm: [] for arm in ARMS}
    for rep in range(reps):
        for arm in ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]:
            probe, _ = _fit(*arm, steps)
            times[arm].append(statistics.median(probe.step_times))
    torch.save(times, Path(out) / f"rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Any, *args: Any) -> list[Any]:
    """Run ``worker(rank, port, *args, out)`` in a fresh pair of processes; return each rank's saved result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(free_port(), *args, out), nprocs=WORLD_SIZE, start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="fits per arm for the step times")
    parser.add_argument("--rounds", type=int, default=3, help="fresh process pairs per arm for the memory")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    # step times: slower rank's median step of each fit; ratios within a rep (adjacent fits), median over reps
    times = spawn(time_worker, args.reps, args.steps)
    step = {arm: [max(rank[arm][i] for rank in times) for i in range(args.reps)] for arm in ARMS}

    def ratio(num: tuple[str, bool], den: tuple[str, bool]) -> float:
        return statistics.median(a / b for a, b in zip(step[num], step[den]))

    # memory: every arm in fresh processes, rounds interleaved
    memory: dict[tuple[str, bool], list[list[dict[str, int]]]] = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        for arm in ARMS[round_ % len(ARMS):] + ARMS[:round_ % len(ARMS)]:
            memory[arm].append(spawn(memory_worker, arm, args.steps))
            print(f"memory round {round_ + 1}: {arm}: {memory[arm][-1]}", flush=True)

    def mem(arm: tuple[str, bool], key: str, rank: int) -> float:
        return statistics.median(run[rank][key] for run in memory[arm])

    rows = []
    for kind in ("DDP", "FSDP"):
        plain, ckpt = (kind, False), (kind, True)
        for rank in range(WORLD_SIZE):
            act0, act1 = mem(plain, "activations", rank), mem(ckpt, "activations", rank)
            rss0, rss1 = mem(plain, "rss_added", rank), mem(ckpt, "rss_added", rank)
            rows.append(
                f"| {kind} | {rank} | {ratio(ckpt, plain):.3f} |"
                f" {act1 / act0:.3f} ({act1 / MIB:.1f} of {act0 / MIB:.1f} MiB) |"
                f" {rss1 / rss0:.3f} ({rss1 / MIB:.0f} of {rss0 / MIB:.0f} MiB) |"
            )
    spread = {f"{k}{' + ckpt' if c else ''}": f"{min(v) / statistics.median(v):.2f}-{max(v) / statistics.median(v):.2f}"
              for (k, c), v in step.items()}
    m = MODEL
    markdown = f"""
## Distributed: DDP and FSDP with and without checkpointing (bench_distributed.py)

GPT-style model: {m['n_layer']} layers, hidden {m['n_embd']}, sequence {m['block_size']}, batch {BATCH} per rank;
{WORLD_SIZE} CPU processes with gloo, 1 thread each, through a real `Trainer`. Checkpointing:
`GradientCheckpointing()` (every block) with `"ddp_ckpt"` / `"fsdp_ckpt"`; without: Lightning's `DDPStrategy` /
`"fsdp_ckpt"` without the callback.

- Step time: all four arms alternate as short fits in one pair of processes ({args.reps} fits each, rotated order);
  per fit the median of {args.steps} steps after {WARMUP} warm-up steps (slower rank); the ratio is taken between
  adjacent fits, and the median over the {args.reps} ratios is shown. Per-fit spread around each arm's median
  (min-max): {', '.join(f'{k} {v}' for k, v in spread.items())}.
- Activations: bytes held for backward at the end of one training forward, per rank (saved-tensor hooks; parameters,
  FSDP's gathered ones included, are excluded).
- Host memory: peak RSS during `fit` (getrusage) minus RSS before `fit` (psutil), per rank, each arm in a fresh
  pair of processes; median of {args.rounds} interleaved rounds.

Machine: {machine()} (shared; the workers use 1 thread each).

| strategy | rank | step time ckpt / none | activations ckpt / none | host memory added ckpt / none |
| --- | --- | --- | --- | --- |
{chr(10).join(rows)}

- FSDP / DDP step time: {ratio(("FSDP", False), ("DDP", False)):.3f} without checkpointing,
  {ratio(("FSDP", True), ("DDP", True)):.3f} with.
- On CPU the activations live in host memory, so the host-memory column shows checkpointing's saving diluted by
  everything else the fit allocates (weights, gradients, optimizer state, allocator caching).
"""
    print(markdown)
    write_section("distributed", markdown)


if __name__ == "__main__":
    main()
