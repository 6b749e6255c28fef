"""Planner benchmark: solve time, the cost of planning, and plans against every_n settings.

- solve time of the knapsack for 50, 200 and 500 layers (3 choices each), median of repeats;
- planning (`plan_checkpointing`: one fully checkpointed forward plus each layer re-run alone) against
  one fully checkpointed training step (forward and backward), interleaved, median;
- a heterogeneous model (wide element-wise, matmul-heavy and attention blocks interleaved) at budgets
  0.25 to 0.75: measured extra FLOPs and bytes of the plan against the cheapest every_n setting that
  meets the same budget.

Results go to RESULTS.md ("planner").

    python benchmarks/bench_planner.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from _results import machine, write_section
from lightning_ckpt.demos import Block, Transformer
from lightning_ckpt.planner import LayerCost, count_cost, make_plan, plan_checkpointing
from lightning_ckpt.profiling import SavedTensorCounter
from lightning_ckpt.wrapping import apply_checkpointing, remove_checkpointing

VOCAB, SEQ, BATCH, WIDTH = 256, 64, 8, 128


class WideElementwise(nn.Module):
    """Element-wise only, on a 4x wider tensor: many bytes held, few FLOPs to recompute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat(1, 1, 4)
        h = torch.tanh(h) * torch.sigmoid(h * 1.5)
        h = torch.exp(-h * h) * h
        return x + h.view(*x.shape[:-1], 4, x.shape[-1]).mean(-2)


class MatmulHeavy(nn.Module):
    """Four square matmuls: few bytes held, many FLOPs to recompute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for fc in self.fcs:
            h = F.relu(fc(h))
        return x + h


class Hetero(nn.Module):
    def __init__(self, n_layers: int = 9) -> None:
        super().__init__()
        kinds = [WideElementwise, lambda: MatmulHeavy(WIDTH), lambda: Block(WIDTH, 4)]
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(kinds[i % 3]() for i in range(n_layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


CLASSES = (WideElementwise, MatmulHeavy, Block)


def random_costs(n: int, seed: int = 0) -> list[LayerCost]:
    rng = random.Random(seed)
    costs = []
    for i in range(n):
        none = rng.randint(10**6, 10**8)
        full = rng.randint(10**4, none // 10)
        flops = rng.randint(10**8, 10**11)
        costs.append(LayerCost(f"l{i}", "Block", none, full, rng.randint(full, none), 0, flops, rng.randint(0, flops)))
    return costs


def solve_times(repeats: int) -> list[str]:
    rows = ["| layers | choices | solve time (median) |", "| ---: | ---: | ---: |"]
    for n in (50, 200, 500):
        costs = random_costs(n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            make_plan(costs, outside_bytes=10**7, memory_budget=0.3)
            times.append(time.perf_counter() - start)
        rows.append(f"| {n} | 3 | {1000 * statistics.median(times):.0f} ms |")
    return rows


def planning_overhead(repeats: int) -> list[str]:
    torch.manual_seed(0)
    model = Transformer(VOCAB, 128, 8, 256, 8, dropout=0.1)
    idx = torch.randint(0, VOCAB, (BATCH, 128))
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731

    def full_step() -> None:
        apply_checkpointing(model, layer_cls=Block)
        model.zero_grad(set_to_none=True)
        step().backward()
        remove_checkpointing(model)

    def planning() -> None:
        plan_checkpointing(model, step, 0.5, layer_cls=Block)

    times: dict[str, list[float]] = {"full": [], "plan": []}
    full_step(), planning()  # warm-up
    for _ in range(repeats):
        for name, fn in (("full", full_step), ("plan", planning)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    full, plan = statistics.median(times["full"]), statistics.median(times["plan"])
    return [
        "| run (GPT, 8 layers, hidden 256, seq 128, batch 8) | median |", "| --- | ---: |",
        f"| one fully checkpointed training step (forward + backward) | {1000 * full:.0f} ms |",
        f"| `plan_checkpointing` (modes full + selective) | {1000 * plan:.0f} ms |",
        f"| ratio (target <= 1.5) | {plan / full:.2f}x |",
        "",
        "A training step that measures while it trains (the callback) adds the per-layer runs to its own fully",
        "checkpointed step: two forwards of each layer (plain and selective) on top of about four forwards' worth.",
    ]


def measure(model: nn.Module, idx: torch.Tensor, base_cost: int) -> tuple[int, int]:
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(idx).logsumexp(-1).mean()
    model.zero_grad(set_to_none=True)
    cost = count_cost(lambda: model(idx).logsumexp(-1).mean().backward())
    model.zero_grad(set_to_none=True)
    return saved.bytes, cost - base_cost


def against_every_n() -> list[str]:
    torch.manual_seed(0)
    model = Hetero()
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    step = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    model.zero_grad(set_to_none=True)
    base_cost = count_cost(lambda: step().backward())
    model.zero_grad(set_to_none=True)
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        step()
    base_bytes = saved.bytes
    every_n = {}
    for n in range(1, len(model.blocks) + 1):
        apply_checkpointing(model, layer_cls=CLASSES, every_n_layers=n)
        every_n[n] = measure(model, idx, base_cost)
        remove_checkpointing(model)
    rows = [
        f"Model: 9 blocks (element-wise, matmul, attention, repeated), hidden {WIDTH}, seq {SEQ}, batch {BATCH};"
        f" {base_bytes / 2**20:.1f} MiB of activations without checkpointing. Bytes and extra FLOPs measured after"
        " applying each setting.",
        "",
        "| budget | cheapest every_n meeting it: n, bytes, extra FLOPs | plan (full only): bytes, extra FLOPs |"
        " plan (full + selective): bytes, extra FLOPs, layers | ratio plan / every_n |",
        "| ---: | --- | --- | --- | ---: |",
    ]
    for budget in (0.25, 0.35, 0.5, 0.6, 0.75):
        fits = [(cost, n, held) for n, (held, cost) in every_n.items() if held <= budget * base_bytes]
        cost_n, n, held_n = min(fits) if fits else (None, None, None)
        cells = []
        for modes in (("full",), ("full", "selective")):
            plan = plan_checkpointing(model, step, budget, layer_cls=CLASSES, modes=modes)
            plan.apply(model)
            held, cost = measure(model, idx, base_cost)
            remove_checkpointing(model)
            assert held <= budget * base_bytes * 1.02, (budget, modes, held)
            layers = "".join({"none": "-", "full": "F", "selective": "S"}[m] for m in plan.layers.values())
            cells.append((held, cost, layers))
        every = f"n={n}, {held_n / base_bytes:.2f}, {cost_n / 1e6:.1f} MFLOP" if n else "none fits"
        ratio = f"{cells[1][1] / cost_n:.2f}" if n else "-"
        rows.append(f"| {budget} | {every} | {cells[0][0] / base_bytes:.2f}, {cells[0][1] / 1e6:.1f} MFLOP |"
                    f" {cells[1][0] / base_bytes:.2f}, {cells[1][1] / 1e6:.1f} MFLOP, `{cells[1][2]}` | {ratio} |")
    rows += ["", "Bytes as a fraction of the un-checkpointed step. Layers: `F` full, `S` selective, `-` none."]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sections = [
        "## Planner (`plan_checkpointing`)", "", f"Measured on {machine()}.", "",
        "### Solve time", "", *solve_times(args.repeats), "",
        "### Planning against a fully checkpointed step", "", f"Interleaved, median of {args.repeats}.", "",
        *planning_overhead(args.repeats), "",
        "### Heterogeneous model: plan against every_n", "", *against_every_n(), "",
        "FLOPs as `lightning_ckpt.planner.OpCostMode` counts them: torch's formulas for matmul, convolution and",
        "attention, one per output element for every other op.",
        "",
        "torch's AutoSAC (`SACEstimator` + `sac_milp`) is not compared yet: its estimators need a CUDA device for",
        "runtime and memory statistics and the `pulp` and `pwlf` packages, and its solution (a fraction of each",
        "module's activations to discard, op by op) needs per-module selective policies to apply.",
    ]
    text = "\n".join(sections)
    print(text)
    write_section("planner", text)


if __name__ == "__main__":
    main()
