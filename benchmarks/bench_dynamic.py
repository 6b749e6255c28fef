"""A byte budget on batches whose lengths vary: the per-size plans against one plan solved for the longest length.

Demo GPT (6 layers, hidden 64, 4 heads), batches of 4 sequences whose lengths come from a long-tailed
distribution (32 to 512 tokens, most short; the first batch short), a byte budget between the activation peaks of
full checkpointing and of none at the longest length. Two arms train on the same batches, alternating in one process:

- ``per-size``: ``GradientCheckpointing(memory_budget=budget)``, which measures each new size and keeps a plan per
  size bucket;
- ``longest``: one plan solved by ``plan_checkpointing`` at the longest length, applied for every step (what a
  user would do by hand to be safe).

Reported: the bytes held for backward against the budget on every step (saved-tensor hooks, parameters excluded,
the measuring steps included: they run fully checkpointed), the activation peak of each step (``_peak.py``), which
the budget bounds, and each plan's predicted peak against that count; the measuring steps and plan switches and their cost
as a share of step time; the recompute FLOPs over all steps (``FlopCounterMode``: a step's FLOPs with the plan
minus without, at each step's length) and the step time, medians over rounds. Results go to RESULTS.md
("dynamic").

    python benchmarks/bench_dynamic.py [--rounds 3] [--steps 40]

``--long-tailed`` runs issue 29's workload instead: lengths from a lognormal (median 48) clipped to 8..768, batch 4,
each batch padded to its own length, 60 steps, in three orders (random, ascending, descending), on a demo GPT of 768
positions; the budget run (a byte budget 30% of the way from full checkpointing's peak to none's at length 768)
against ``every_n_layers=1``, paired and interleaved rounds, medians. Reported per order: the measuring steps, the
wall time ratio (measuring steps included; target <= 0.90), and the largest held bytes (saved-tensor hooks, a
measuring step counted as full checkpointing at its length) and activation peak (``_peak.py``, every step) over the
budget. ``--quick``: one round. Results go to RESULTS.md ("long-tailed"). ``--arm litgpt``: the same on issue 29's
litgpt model (Llama-style: 6 layers, hidden 192, RMSNorm, LLaMAMLP, 768 positions) at the issue's budget, 160 MiB;
results in "long-tailed litgpt". Its fits take minutes each on a CPU: ``--rounds 2`` is about 15 fits.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from _peak import LiveStorages, grad_storages
from _results import machine, write_section
from lightning_ckpt import GradientCheckpointing, apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, format_bytes
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.planner import CheckpointPlan, plan_checkpointing
from lightning_ckpt.demos import GPT, counting_sequences

BATCH, SHORTEST, LONGEST = 4, 32, 512
MODEL = dict(vocab_size=64, block_size=LONGEST, n_layer=6, n_embd=64, n_head=4, dropout=0.0)


def long_tailed_lengths(steps: int, seed: int = 0) -> list[int]:
    """Most batches short, a few long: 32 * 2^(1.2 * Exp(1)), clipped to [32, 512]; the first batch the shortest and
    one in eight the longest, so that every run meets both ends."""
    rng = random.Random(seed)
    lengths = [min(LONGEST, int(SHORTEST * 2 ** (1.2 * rng.expovariate(1.0)))) for _ in range(steps)]
    lengths[0] = SHORTEST
    for i in range(4, steps, 8):
        lengths[i] = LONGEST
    return lengths


def batches(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i, length in enumerate(lengths):
        seqs = counting_sequences(BATCH, length + 1, MODEL["vocab_size"], seed=i)
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out


def loss_of(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class RecordSteps:
    """Per step: the bytes held for backward and whether the callback measured it."""

    callback: GradientCheckpointing | None
    held: list[int]
    measured: list[bool]

    def _record(self, callback: GradientCheckpointing | None) -> None:
        self.callback = callback
        self.held: list[int] = []
        self.measured: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        measuring = self.callback is not None and self.callback.driver.cycle.measuring is not None
        self.measured.append(measuring)
        if measuring:  # the measuring step's own counters are active: a nested counter would hide them
            loss = loss_of(self, batch)
            self.held.append(-1)
            return loss
        with SavedTensorCounter(exclude=self.parameters()) as saved:
            loss = loss_of(self, batch)
        self.held.append(saved.bytes)
        return loss


class Recorder(RecordSteps, GPT):
    def __init__(self, callback: GradientCheckpointing | None) -> None:
        GPT.__init__(self, **MODEL)
        self._record(callback)


class LitgptRecorder(RecordSteps, LightningModule):
    """Issue 29's litgpt model (``LITGPT``) as a LightningModule, recording each step like ``Recorder``."""

    def __init__(self, callback: GradientCheckpointing | None) -> None:
        LightningModule.__init__(self)
        self.model = litgpt_model()
        self._record(callback)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TimedCheckpointing(GradientCheckpointing):
    """The callback, timing its driver's re-plans (measure + solve) and plan switches (re-wrapping the layers)."""

    plan_seconds: list[float]
    switch_seconds: list[float]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.driver._make_plan = self._timed(self.driver._make_plan, "plan_seconds")  # type: ignore[method-assign]
        self.driver._reapply = self._timed(self.driver._reapply, "switch_seconds")  # type: ignore[method-assign]

    def _timed(self, method: Any, seconds: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            method(*args, **kwargs)
            getattr(self, seconds).append(time.perf_counter() - start)

        return timed


class StepClock(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def trainer(callbacks: list[Callback], steps: int) -> Trainer:
    return Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def run_per_size(data: list, budget: int) -> dict[str, Any]:
    seed_everything(0)
    callback = TimedCheckpointing(memory_budget=budget)
    callback.plan_seconds, callback.switch_seconds = [], []
    model, clock = Recorder(callback), StepClock()
    trainer([callback, clock], len(data)).fit(model, DataLoader(data, batch_size=None))
    plans = {b: callback.plans[b] for b in callback.plans}
    sizes = dict(callback.driver.cycle.sizes)
    return {"held": model.held, "measured": model.measured, "seconds": clock.seconds, "plans": plans, "sizes": sizes,
            "plan_seconds": callback.plan_seconds, "switch_seconds": callback.switch_seconds}


def longest_plan(budget: int) -> CheckpointPlan:
    seed_everything(0)
    model = GPT(**MODEL)
    batch = batches([LONGEST])[0]
    return plan_checkpointing(model, lambda: loss_of(model, batch), budget)


def run_longest(data: list, plan: CheckpointPlan) -> dict[str, Any]:
    seed_everything(0)
    model, clock = Recorder(None), StepClock()
    plan.apply(model)
    trainer([clock], len(data)).fit(model, DataLoader(data, batch_size=None))
    remove_checkpointing(model)
    return {"held": model.held, "seconds": clock.seconds}


def step_peak(plan: CheckpointPlan | str | None, length: int) -> int:
    """Activation bytes alive at the busiest op of one forward and backward at ``length`` (storages made during the
    step, the parameters' gradients left out), with ``plan`` applied (``"full"``: every layer fully checkpointed);
    see ``_peak.py``."""
    seed_everything(0)
    model = bare_model()
    if plan == "full":
        apply_checkpointing(model)
    elif plan is not None:
        plan.apply(model)
    batch = batches([length])[0]
    with LiveStorages() as live:
        loss_of(model, batch).backward()
    return live.peak(exclude=grad_storages(model))


def step_flops(plan: CheckpointPlan | None, length: int) -> int:
    """FLOPs of one forward and backward at ``length``, with ``plan`` applied (``None``: nothing checkpointed)."""
    seed_everything(0)
    model = GPT(**MODEL)
    if plan is not None:
        plan.apply(model)
    batch = batches([length])[0]
    with FlopCounterMode(display=False) as counter:
        loss_of(model, batch).backward()
    return counter.get_total_flops()


def held_at(length: int, full: bool) -> int:
    seed_everything(0)
    model = bare_model()
    if full:
        apply_checkpointing(model)
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        loss_of(model, batches([length])[0])
    return saved.bytes


LT_MODEL = dict(MODEL, block_size=768)
# Issue 29's litgpt model: Llama-style (RMSNorm, LLaMAMLP, rotary, sequential residual), 6 layers, hidden 192.
LITGPT = dict(n_layer=6, n_embd=192, n_head=6, block_size=768, vocab_size=64, padded_vocab_size=64, bias=False,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=512, parallel_residual=False)
ARM = "gpt"  # which model the long-tailed helpers build: "gpt" (the demo GPT) or "litgpt"


def litgpt_model() -> nn.Module:
    import litgpt  # only the litgpt arm needs it

    return litgpt.GPT(litgpt.Config(**LITGPT)).train()


def bare_model() -> nn.Module:
    """A fresh model of the arm being run, without Lightning."""
    return litgpt_model() if ARM == "litgpt" else GPT(**MODEL)


def recorder(callback: GradientCheckpointing | None) -> RecordSteps:
    return LitgptRecorder(callback) if ARM == "litgpt" else Recorder(callback)


def lognormal_lengths(steps: int = 60, seed: int = 0) -> list[int]:
    """Issue 29's lengths: a lognormal with median 48, clipped to 8..768, one batch at 768."""
    rng = random.Random(seed)
    lengths = [min(768, max(8, int(rng.lognormvariate(math.log(48), 1.0)))) for _ in range(steps)]
    lengths[steps // 2] = 768
    return lengths


class PeakPerStep(Callback):
    """Each step's activation peak (``_peak.py``), forward through backward, the parameters' gradients left out."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._live = LiveStorages()
        self._live.__enter__()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._live.__exit__(None, None, None)
        self.peaks.append(self._live.peak(exclude=grad_storages(pl_module)))


def run_long_tailed(data: list, budget: Optional[int], peaks: bool, time_layers: bool = True) -> dict[str, Any]:
    """One run on ``data``: with ``budget``, the callback (its plans priced by measured times, or with
    ``time_layers=False`` by FLOPs); ``None``: ``every_n_layers=1``."""
    seed_everything(0)
    callback = (GradientCheckpointing(memory_budget=budget, time_layers=time_layers) if budget is not None
                else GradientCheckpointing())
    model = recorder(callback if budget is not None else None)
    extra: list[Callback] = [PeakPerStep()] if peaks else []
    start = time.perf_counter()
    trainer([callback, *extra], len(data)).fit(model, DataLoader(data, batch_size=None))
    selective = sum(m == "selective" for plan in callback.plans.values() for m in plan.layers.values())
    return {"seconds": time.perf_counter() - start, "held": model.held, "measured": model.measured,
            "peaks": extra[0].peaks if peaks else [], "measured_steps": callback.driver.cycle.measured_steps,
            "selective": selective}


def long_tailed_main(rounds: int, arm: str = "gpt") -> None:
    global MODEL, ARM
    MODEL, ARM = LT_MODEL, arm  # the helpers build this model
    lengths = lognormal_lengths()
    none_peak, full_peak = step_peak(None, 768), step_peak("full", 768)
    # litgpt: the budget, 160 MiB (32% of the way from full to none at 768)
    budget = 160 * 2**20 if arm == "litgpt" else full_peak + (none_peak - full_peak) * 3 // 10
    full_at = {L: held_at(L, True) for L in set(lengths)}
    rows = []
    for order, ordered in [("random", lengths), ("ascending", sorted(lengths)),
                           ("descending", sorted(lengths, reverse=True))]:
        data = batches(ordered)
        first = run_long_tailed(data, budget, peaks=True)  # counted, not timed: the peak counter is slow
        pairs, by_flops = [], []
        for _ in range(rounds):  # interleaved: the budget run, its FLOPs-priced twin, then every layer, each round
            timed = run_long_tailed(data, budget, peaks=False)
            by_flops.append(run_long_tailed(data, budget, peaks=False, time_layers=False))
            pairs.append((timed, run_long_tailed(data, None, peaks=False)))
        assert all(a["measured"] == first["measured"] for a, _ in pairs)
        held = max((h if h >= 0 else full_at[L]) / budget for h, L in zip(first["held"], ordered))
        peak = max(first["peaks"]) / budget
        ratio = statistics.median(a["seconds"] / b["seconds"] for a, b in pairs)
        t_a = statistics.median(a["seconds"] for a, _ in pairs)
        t_b = statistics.median(b["seconds"] for _, b in pairs)
        flops_ratio = statistics.median(f["seconds"] / b["seconds"] for f, (_, b) in zip(by_flops, pairs))
        rows.append(f"| {order} | {first['measured_steps']} | {t_a:.2f} s | {t_b:.2f} s | {ratio:.3f} | {held:.3f} |"
                    f" {peak:.3f} | {flops_ratio:.3f} | {pairs[0][0]['selective']} / {by_flops[0]['selective']} |")
    model = ("litgpt GPT (Llama-style: 6 layers, hidden 192, 6 heads, RMSNorm, LLaMAMLP 512, rotary, 768 positions)"
             if arm == "litgpt" else "Demo GPT (6 layers, hidden 64, 4 heads, 768 positions)")
    share = (budget - full_peak) / (none_peak - full_peak)
    text = "\n".join([
        f"{model}, batch 4, 60 steps, lengths lognormal (median 48)"
        f" clipped to 8..768 ({sum(lengths)} positions in all, {lengths.count(768)} at 768), each batch padded to its"
        f" own length. Byte budget {format_bytes(budget)}: {share:.0%} of the way from full checkpointing's activation peak"
        f" ({format_bytes(full_peak)}) to none's ({format_bytes(none_peak)}) at 768. {rounds} round(s), paired and"
        " interleaved (budget run, the same priced by FLOPs (`time_layers=False`), then every_n_layers=1); the time"
        " ratios are the medians of the paired ratios of whole fits to every_n_layers=1's, measuring steps included."
        " Held and peak / budget: the largest over the 60 steps of one more budget"
        " run, not timed (the peak counter is slow); the timed runs measure the same steps. Selective layers: over"
        " all the plans of the first timed round, priced by times / by FLOPs.",
        "",
        "| order | measuring steps | budget run | every_n_layers=1 | time ratio | held / budget | peak / budget"
        " | time ratio, priced by FLOPs | selective layers (times / FLOPs) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ])
    print(text, flush=True)
    write_section("long-tailed" if arm == "gpt" else f"long-tailed {arm}", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--long-tailed", action="store_true", help="issue 29's workload (see the docstring)")
    parser.add_argument("--quick", action="store_true", help="with --long-tailed: one round")
    parser.add_argument("--arm", choices=["gpt", "litgpt"], default="gpt", help="with --long-tailed: the model")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.long_tailed:
        long_tailed_main(1 if args.quick else args.rounds, args.arm)
        return

    lengths = long_tailed_lengths(args.steps)
    data = batches(lengths)
    none_long, full_long = held_at(LONGEST, False), held_at(LONGEST, True)
    none_peak, full_peak = step_peak(None, LONGEST), step_peak("full", LONGEST)
    budget = full_peak + (none_peak - full_peak) * 3 // 10
    fixed = longest_plan(budget)

    per_size, longest = [], []
    for _ in range(args.rounds):  # alternating arms, so drifting load hits both alike
        per_size.append(run_per_size(data, budget))
        longest.append(run_longest(data, fixed))
    first = per_size[0]

    # bytes: every step of every round (the steps are deterministic: the same in each round); a measuring step runs
    # every layer fully checkpointed, and its own counters hide it from ours: it holds what full checkpointing does
    full_at = {L: held_at(L, True) for L in set(lengths)}
    held_ratio = max((h if h >= 0 else full_at[L]) / budget for r in per_size for h, L in zip(r["held"], lengths))
    longest_ratio = max(h / budget for r in longest for h in r["held"])
    measured = sum(first["measured"])
    assert all(r["measured"] == first["measured"] for r in per_size)

    # FLOPs: each step's recompute with the plan it ran (a measuring step: every layer fully checkpointed)
    full_plan = CheckpointPlan.from_state_dict({**fixed.state_dict(), "layers": dict.fromkeys(fixed.layers, "full")})
    cache: dict[tuple[str, int], int] = {}

    def recompute(plan: CheckpointPlan, length: int) -> int:
        key = (repr(sorted(plan.layers.items())), length)
        if key not in cache:
            cache[key] = step_flops(plan, length) - step_flops(None, length)
        return cache[key]

    peaks: dict[tuple[str, int], int] = {}

    def peak(plan: CheckpointPlan, length: int) -> int:
        key = (repr(sorted(plan.layers.items())), length)
        if key not in peaks:
            peaks[key] = step_peak(plan, length)
        return peaks[key]

    # each per-size plan's predicted peak against the count, at the size it was made for
    predicted = {b: plan.peak_bytes / peak(plan, first["sizes"][b].length) for b, plan in first["plans"].items()}
    worst = max(predicted.values(), key=lambda r: abs(r - 1))

    cycle_flops = longest_flops = planned_cycle = planned_longest = 0  # planned_*: the steps that ran a plan
    peak_ratio = longest_peak_ratio = 0.0
    for length, was_measured in zip(lengths, first["measured"]):
        size = BatchSize(BATCH * length, length)
        ran = full_plan if was_measured else first["plans"][size.bucket]
        peak_ratio = max(peak_ratio, peak(ran, length) / budget)
        longest_peak_ratio = max(longest_peak_ratio, peak(fixed, length) / budget)
        mine = recompute(ran, length)
        theirs = recompute(fixed, length)
        cycle_flops, longest_flops = cycle_flops + mine, longest_flops + theirs
        if not was_measured:
            planned_cycle, planned_longest = planned_cycle + mine, planned_longest + theirs

    total = lambda r: sum(r["seconds"])  # noqa: E731
    t_cycle = statistics.median(total(r) for r in per_size)
    t_longest = statistics.median(total(r) for r in longest)
    paired = statistics.median(total(a) / total(b) for a, b in zip(per_size, longest))
    plan_share = statistics.median(sum(r["plan_seconds"]) / total(r) for r in per_size)
    switch_share = statistics.median(sum(r["switch_seconds"]) / total(r) for r in per_size)
    switches = len(first["switch_seconds"])
    median_step = statistics.median(s for r in per_size for s in r["seconds"])
    median_switch = statistics.median(s for r in per_size for s in r["switch_seconds"]) if switches else 0.0
    median_plan = statistics.median(s for r in per_size for s in r["plan_seconds"])

    hist = ", ".join(f"{L}: {lengths.count(L)}" for L in sorted(set(lengths)))
    buckets = ", ".join(f"{b} tokens (measured at {first['sizes'][b]}): "
                        f"{sum(m != 'none' for m in first['plans'][b].layers.values())} of {MODEL['n_layer']} layers"
                        for b in sorted(first["plans"]))
    lines = [
        "## Variable-length batches under a byte budget (bench_dynamic.py)",
        "",
        f"`python benchmarks/bench_dynamic.py --rounds {args.rounds} --steps {args.steps}` — {machine()}.",
        "",
        f"Demo GPT (6 layers, hidden 64), batches of {BATCH}; {args.steps} steps with lengths (length: steps) {hist}."
        f" Budget {format_bytes(budget)} of activation peak: at length {LONGEST} full checkpointing peaks at"
        f" {format_bytes(full_peak)} (holding {format_bytes(full_long)} at the end of the forward) and none at"
        f" {format_bytes(none_peak)} (holding {format_bytes(none_long)}). Arms alternate in one process,"
        f" {args.rounds} rounds each.",
        "",
        "| | per-size plans (the callback) | one plan solved at the longest length |",
        "| --- | --- | --- |",
        f"| largest held / budget over all steps | {held_ratio:.3f} | {longest_ratio:.3f} |",
        f"| largest activation peak / budget over all steps | {peak_ratio:.3f} | {longest_peak_ratio:.3f} |",
        f"| predicted / counted peak of each plan, farthest from 1 | {worst:.3f} | {fixed.peak_bytes / peak(fixed, LONGEST):.3f} |",
        f"| recompute FLOPs over the {args.steps} steps | {cycle_flops / 1e9:.3f} GFLOP | {longest_flops / 1e9:.3f} GFLOP |",
        f"| step time, sum of the {args.steps} steps (median over rounds) | {t_cycle:.3f} s | {t_longest:.3f} s |",
        "",
        f"- held / budget: target <= 1.00 ({'met' if held_ratio <= 1.0 else 'NOT met'}); a measuring step (fully"
        " checkpointed, its own counters active) counts as what full checkpointing holds at its length.",
        f"- recompute over all steps: {cycle_flops / longest_flops:.3f} of the longest plan's"
        f" ({'less' if cycle_flops < longest_flops else 'NOT less'}; the measuring steps recompute every layer)."
        f" Over the {args.steps - measured} steps that ran a plan: {planned_cycle / 1e9:.3f} against"
        f" {planned_longest / 1e9:.3f} GFLOP, {planned_cycle / max(planned_longest, 1):.3f}"
        f" ({'less' if planned_cycle < planned_longest else 'NOT less'}: short batches run their own plans).",
        f"- step time per-size / longest: {t_cycle / t_longest:.3f} of the medians, {paired:.3f} median of paired"
        f" rounds (target <= 1.00: {'met' if paired <= 1.0 else 'NOT met'}; the measuring steps included).",
        f"- measuring steps (a new size: fully checkpointed, then solved): {measured} of {args.steps}; re-plans take"
        f" {100 * plan_share:.2f}% of the run's step time (median {1e3 * median_plan:.2f} ms each).",
        f"- plan switches (re-wrapping the layers between two steps): {switches}, {100 * switch_share:.2f}% of step"
        f" time (median {1e3 * median_switch:.2f} ms each, against a median step of {1e3 * median_step:.1f} ms).",
        f"- plans: {buckets}.",
        "- activation peak: storages made during the step and alive at its busiest op, forward, backward and"
        " recompute (the parameters' gradients left out), counted by a dispatch mode that uses none of the package's"
        f" counters (`benchmarks/_peak.py`). The budget bounds it: target <= 1.00"
        f" ({'met' if peak_ratio <= 1.0 else 'NOT met'}; a measuring step counts as full checkpointing at its length,"
        " without what measuring itself adds). Predicted / counted per plan: "
        + ", ".join(f"{b} tokens {r:.3f}" for b, r in sorted(predicted.items())) + ".",
    ]
    text = "\n".join(lines)
    print(text)
    write_section("dynamic", text)


if __name__ == "__main__":
    main()
