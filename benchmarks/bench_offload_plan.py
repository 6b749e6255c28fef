"""Offload as a priced choice: ``offload="auto"`` against ``False`` and ``True`` on each device preset.

One training step of a demo GPT (12 layers, width 1024, sequence 1024, batch 4) is measured once, on the CPU,
with every layer fully checkpointed (:func:`~lightning_ckpt.core.plan.planner.measure_step`); then, for each preset and
budget, plans are solved with ``offload=False``, ``True`` and ``"auto"`` (host memory 64 GiB), and their
predicted step-time increase over no checkpointing printed with what ``"auto"`` offloads and recomputes. The
tensors count as living on the preset's device. The script exits 1 if an ``"auto"`` plan is predicted slower
than either other plan, or over its budget. Predictions only: nothing here ran on a GPU.

Results go to RESULTS.md ("offload as a priced choice").

    python benchmarks/bench_offload_plan.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import make_plan, measure_step
from lightning_ckpt.demos import Block, Transformer

PRESETS = ("l4", "h100-pcie", "h100-sxm", "gh200")
# Fractions of the step's activation peak without checkpointing; every layer checkpointed reaches 11.9% (10.6% offloaded)
BUDGETS = (0.5, 0.25, 0.125)
HOST = 64 << 30
LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 12, 1024, 16, 1024, 4, 8192


def main() -> int:
    torch.manual_seed(0)
    model = Transformer(VOCAB, SEQ, LAYERS, WIDTH, HEADS, dropout=0.1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1))

    def step() -> torch.Tensor:
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    start = time.perf_counter()
    measured = measure_step(model, step, Block)
    print(f"measured in {time.perf_counter() - start:.1f} s: {LAYERS} layers, width {WIDTH}, seq {SEQ}, batch {BATCH}")
    print("| device | budget | False | True | auto | auto offloads | auto host | auto recomputes |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    bad = []
    for preset in PRESETS:
        for budget in BUDGETS:
            cells, plans = [], {}
            for offload in (False, True, "auto"):
                try:
                    plan = make_plan(measured.costs, measured.outside_bytes, budget, offload=offload, device=preset,
                                     outside_ops=measured.outside_ops, host_memory=HOST)
                except ValueError:
                    cells.append("does not fit")
                    continue
                plans[offload] = plan
                cells.append(f"+{100 * plan.step_time_increase:.1f}%")
            auto = plans.get("auto")
            if auto is None:
                bad.append(f"{preset} {budget}: auto found no plan")
                print(f"| {preset} | {budget} | {' | '.join(cells)} | | | |")
                continue
            if auto.planned_bytes > auto.budget_bytes or any(
                    auto.predicted_step_seconds > p.predicted_step_seconds * (1 + 1e-12) for p in plans.values()):
                bad.append(f"{preset} {budget}: auto over budget or slower")
            modes = [m for m in auto.layers.values() if m != "none"]
            recomputes = ", ".join(f"{modes.count(m)} {m}" for m in sorted(set(modes))) or "nothing"
            offloaded = f"{len(auto.offloaded)} of {LAYERS}"
            print(f"| {preset} | {budget} | {' | '.join(cells)} | {offloaded} | {format_bytes(auto.host_bytes)}"
                  f" | {recomputes} |")
    for line in bad:
        print("FAIL:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
