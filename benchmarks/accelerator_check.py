"""One accelerator check, one command: every accelerator test, the offload benchmark and the time model, into
RESULTS.md ("gpu").

    python benchmarks/accelerator_check.py [--budget-s 280]
    python benchmarks/accelerator_check.py --cpu-smoke   # the time-model part on a tiny model on the CPU

Runs ``pytest -m accelerator`` (offload under delayed copies, MemoryMonitor's device peaks, pinned memory, bf16
autocast under checkpointing), ``bench_offload.py`` at 2k/8k/32k, and the time-model check (:func:`time_model_check`:
the planner's predicted step time on ``DeviceProfile.measure`` of the GPU against the measured step time, for no
checkpointing, every layer, every 2nd layer, selective, every layer with offload, and a plan for the profile; target
within 15%), the activation peak check (:func:`peak_check`: the plan's predicted peak against
``torch.cuda.max_memory_allocated``) and the compressed-checkpoints check (:func:`compress_check`: bf16 and fp8
inputs against exact, with and without offload), within the budget (under 5 minutes on one GPU), and writes them into the "gpu" section of
benchmarks/RESULTS.md. Exits 1 if a test failed or an offload variant's loss or gradients differ from checkpointing
without offload (a prediction off target is reported, not a failure). On a machine without CUDA it prints
"no accelerator", touches nothing and exits 0; ``--cpu-smoke`` then runs the time-model check on a tiny model on the
CPU (prints its table, writes nothing) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from lightning_ckpt import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint import offload as offload_module
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import (
    CheckpointPlan,
    make_plan,
    measure_step,
    plan_checkpointing,
    predict_peak,
    predict_seconds,
)
from lightning_ckpt.demos import Block, Transformer

ROOT = Path(__file__).resolve().parent.parent
#: The time model's target on an accelerator: predicted step time within 15% of the measured one.
TIME_TARGET = 0.15
#: The memory budget of the plan row (a fraction of the activations without checkpointing).
PLAN_BUDGET = 0.5


def run_tests(timeout_s: float) -> tuple[list[tuple[str, str]], float]:
    """``(test id, outcome)`` for every accelerator-marked test, and the seconds it took."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        command = [sys.executable, "-m", "pytest", "-m", "accelerator", "-p", "no:cacheprovider", "-q",
                   f"--junitxml={report}", "tests"]
        try:
            subprocess.run(command, cwd=ROOT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return [("(pytest)", f"timed out after {timeout_s:.0f} s")], time.perf_counter() - start
        elapsed = time.perf_counter() - start
        if not report.exists():
            return [("(pytest)", "no report: collection failed")], elapsed
        results = []
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            results.append((f"{case.get('classname')}::{case.get('name')}", outcome))
        return results, elapsed


# ------------------------------------------------------------------------------------------------ time model


@dataclass
class Setting:
    """One way to run the model: ``apply`` configures it (from no checkpointing) and returns the layer modes it
    set, as :func:`~lightning_ckpt.core.plan.planner.predict_seconds` takes them; ``offload``/``kept_ops`` likewise."""

    name: str
    apply: Callable[[torch.nn.Module], dict[str, str]]
    offload: Union[bool, list[str]] = False  # or the names of the layers offloaded
    kept_ops: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class TimeRow:
    name: str
    predicted_s: Optional[float] = None
    measured_s: Optional[float] = None
    predicted_baseline_s: Optional[float] = None
    note: str = ""

    @property
    def ratio(self) -> Optional[float]:
        """Predicted over measured step time."""
        return None if self.predicted_s is None or not self.measured_s else self.predicted_s / self.measured_s


def _every(n: int, mode: str = "full", offload: bool = False) -> Callable[[torch.nn.Module], dict[str, str]]:
    def apply(model: torch.nn.Module) -> dict[str, str]:
        return dict.fromkeys(apply_checkpointing(model, layer_cls=Block, every_n_layers=n, mode=mode,  # type: ignore[arg-type]
                                                 offload=offload), mode)
    return apply


def plan_setting(name: str, plan: CheckpointPlan, cpu: bool = False) -> Setting:
    """The row of a :class:`~lightning_ckpt.core.plan.planner.CheckpointPlan`: applied with ``plan.apply``, predicted for its
    layers, kept ops and the layers it offloads (none on the CPU, where offload moves nothing)."""
    def apply(model: torch.nn.Module) -> dict[str, str]:
        plan.apply(model)
        return {n: m for n, m in plan.layers.items() if m != "none"}
    return Setting(name, apply, offload=[] if cpu else list(plan.offloaded),
                   kept_ops={n: list(k) for n, k in plan.kept_ops.items()})


def _configured(model: torch.nn.Module, setting: Setting) -> contextlib.AbstractContextManager[dict[str, str]]:
    @contextlib.contextmanager
    def configured() -> Any:
        remove_checkpointing(model)
        try:
            yield setting.apply(model)
        finally:
            remove_checkpointing(model)
    return configured()


def time_model_check(device: torch.device, seq: int = 4096, layers: int = 16, hidden: int = 2048, heads: int = 16,
                     vocab: int = 32000, steps: int = 5, rounds: int = 3, budget_s: float = 90.0) -> tuple[list[TimeRow], str]:
    """Predicted against measured step time (forward and backward, bf16 autocast, batch 1) for every setting.

    The profile is ``DeviceProfile.measure(device)``; the step is measured once fully checkpointed
    (:func:`~lightning_ckpt.core.plan.planner.measure_step`), and each setting predicted from that with
    :func:`~lightning_ckpt.core.plan.planner.predict_seconds`. Measured: each setting in ``rounds`` interleaved rounds
    (alternately reversed) of one warm-up and ``steps`` timed steps; the median of all timed steps. The optimizer step
    is left out of both: the model does not price it, and it is the same for every setting.
    """
    started = time.perf_counter()
    cpu = device.type == "cpu"
    profile = DeviceProfile.measure(device)
    torch.manual_seed(0)
    with device:
        model = Transformer(vocab, seq, layers, hidden, heads, dropout=0.0)
    idx = torch.randint(0, vocab, (1, seq + 1), device=device)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    dtype = torch.bfloat16

    def loss() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    measured = measure_step(model, loss, layer_cls=Block)
    settings = [
        Setting("none", lambda m: {}),
        Setting("every_layer", _every(1)),
        Setting("every_2nd", _every(2)),
        Setting("selective", _every(1, "selective")),
        Setting("offload", _every(1, offload=True), offload=not cpu),  # on the CPU offload moves nothing
        plan_setting(f"plan ({PLAN_BUDGET:g}, for the profile)",
                     plan_checkpointing(model, loss, PLAN_BUDGET, layer_cls=Block, device=profile)),
        plan_setting(f"plan ({PLAN_BUDGET:g}, offload auto)",
                     plan_checkpointing(model, loss, PLAN_BUDGET, layer_cls=Block, offload="auto", device=profile), cpu),
    ]
    rows = {s.name: TimeRow(s.name) for s in settings}
    times: dict[str, list[float]] = {s.name: [] for s in settings}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in range(rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            row = rows[setting.name]
            if row.note:
                continue
            if time.perf_counter() - started > budget_s:
                row.note = row.note or f"not run: over the {budget_s:.0f} s budget"
                continue
            try:
                with _configured(model, setting) as modes:
                    if r == 0:
                        row.predicted_s, row.predicted_baseline_s = predict_seconds(
                            measured.costs, measured.outside_ops, modes, profile, setting.offload, setting.kept_ops)
                    for i in range(steps + 1):
                        model.zero_grad(set_to_none=True)
                        sync()
                        start = time.perf_counter()
                        loss().backward()
                        sync()
                        if i:  # the first is a warm-up
                            times[setting.name].append(time.perf_counter() - start)
            except torch.OutOfMemoryError:
                row.note = "out of memory"
            finally:
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    offload_module.release_all()
                    torch.cuda.empty_cache()
    for name, ts in times.items():
        if ts:
            rows[name].measured_s = statistics.median(ts)
    n_params = sum(p.numel() for p in model.parameters())
    return list(rows.values()), time_model_markdown(list(rows.values()), profile, n_params, layers, hidden, seq, steps,
                                                     rounds, cpu)


def time_model_markdown(rows: list[TimeRow], profile: DeviceProfile, n_params: int, layers: int, hidden: int, seq: int,
                        steps: int, rounds: int, cpu: bool) -> str:
    """The time-model table: one row per setting, predicted and measured step time, their ratio, the slowdowns."""
    base = rows[0]
    lines = [
        "### Time model: predicted against measured step time",
        "",
        f"GPT-style model: {layers} blocks, hidden {hidden}, {n_params / 1e9:.2f}B parameters, batch 1, seq {seq}, bf16"
        f" autocast; forward and backward (no optimizer step). Profile: {profile.name} (matmul"
        f" {profile.matmul_flops / 1e12:.3g} TFLOP/s, memory {profile.memory_bandwidth / 1e9:.4g} GB/s, host"
        f" {profile.host_bandwidth / 1e9:.3g} GB/s, {1e6 * profile.op_overhead:.3g} µs per op recomputed,"
        f" {1e6 * profile.per_op_under_policy:.3g} µs per op under a policy). Measured: median of {steps} steps in each"
        f" of {rounds} interleaved rounds. Target: predicted within ±{100 * TIME_TARGET:.0f}% of measured.",
        *(["", "**CPU smoke run of the script: the figures say nothing about an accelerator.**"] if cpu else []),
        "",
        "| setting | predicted (ms) | measured (ms) | predicted / measured | predicted slowdown | measured slowdown |"
        " within target |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.ratio is None:
            lines.append(f"| {r.name} | {_ms(r.predicted_s)} | {_ms(r.measured_s)} | | | | {r.note or 'n/a'} |")
            continue
        predicted_slow = (f"{100 * (r.predicted_s / r.predicted_baseline_s - 1):+.0f}%"  # type: ignore[operator]
                          if r.predicted_baseline_s else "n/a")
        measured_slow = f"{100 * (r.measured_s / base.measured_s - 1):+.0f}%" if base.measured_s else "n/a"  # type: ignore[operator]
        lines.append(f"| {r.name} | {_ms(r.predicted_s)} | {_ms(r.measured_s)} | {r.ratio:.2f} | {predicted_slow}"
                     f" | {measured_slow} | {'yes' if abs(r.ratio - 1) <= TIME_TARGET else 'no'} |")
    return "\n".join(lines)


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def peak_check(device: torch.device, seq: int = 2048, layers: int = 8, hidden: int = 1024, heads: int = 8,
               vocab: int = 32000, batch: int = 2) -> str:
    """The planner's predicted activation peak against the step's measured one (Markdown), for no checkpointing,
    every layer and a plan at ``PLAN_BUDGET``: measured by ``_peak.py``'s count of live storages after every op
    (parameter gradients left out), on any device. On CUDA also ``torch.cuda.max_memory_allocated`` over the step less
    what was allocated before it: the allocator's view, with the gradients alive at the peak and its rounding in.
    (Taking all the gradients off the allocator's figure read 643 MiB low on an H200: at the peak none exist yet.)"""
    torch.manual_seed(0)
    model = Transformer(vocab, seq, layers, hidden, heads, dropout=0.0).to(device)
    idx = torch.randint(0, vocab, (batch, seq + 1), device=device)

    def step() -> torch.Tensor:
        return F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())

    measured = measure_step(model, step)
    plan = make_plan(measured.costs, measured.outside_bytes, PLAN_BUDGET, head_bytes=measured.head_bytes,
                     head_peak_bytes=measured.head_peak_bytes)
    cuda = device.type == "cuda"
    rows = ["| setting | predicted peak | measured peak (live storages) | predicted / measured |"
            + (" CUDA allocator peak (gradients in) |" if cuda else ""),
            "| --- | ---: | ---: | ---: |" + (" ---: |" if cuda else "")]
    from _peak import LiveStorages, grad_storages
    for name, choices in (("none", {}), ("every layer", dict.fromkeys(plan.layers, "full")),
                          (f"plan {PLAN_BUDGET}", plan.layers)):
        kept = plan.kept_ops if choices is plan.layers else {}
        predicted = predict_peak(measured.costs, measured.outside_bytes, choices, kept_ops=kept,
                                 head_bytes=measured.head_bytes, head_peak_bytes=measured.head_peak_bytes)
        applied = CheckpointPlan.from_state_dict({**plan.state_dict(), "layers": {n: choices.get(n, "none")
                                                                                  for n in plan.layers},
                                                  "kept_ops": kept, "offloaded": []})
        applied.apply(model)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        with LiveStorages() as live:
            step().backward()
        peak = live.peak(exclude=grad_storages(model))
        allocator = ""
        if cuda:
            torch.cuda.synchronize(device)
            allocator = f" {(torch.cuda.max_memory_allocated(device) - before) / 2**20:.1f} MiB |"
        remove_checkpointing(model)
        rows.append(f"| {name} | {predicted / 2**20:.1f} MiB | {peak / 2**20:.1f} MiB"
                    f" | {predicted / peak:.3f} |{allocator}")
    return "\n".join([f"### Activation peak: predicted against measured (demo GPT, {layers} layers, hidden {hidden},"
                      f" length {seq}, batch {batch}, vocabulary {vocab})", "", *rows])


def compress_check(device: torch.device, seq: int = 2048, layers: int = 8, hidden: int = 1024, heads: int = 8,
                   vocab: int = 32000, batch: int = 4, rounds: int = 5) -> str:
    """Every layer checkpointed, its inputs exact, bf16 or fp8, each without and with offload (Markdown): the step's
    activation peak (CUDA: the allocator's peak over the step, the gradients alive at it included; CPU: live storages
    without gradients), the bytes offload moved to host in one step, the median step
    time over ``rounds`` interleaved rounds as a ratio to exact without offload (and, with offload, to exact with
    offload), and the gradients' least cosine similarity to exact. Offload moves nothing on the CPU."""
    torch.manual_seed(0)
    model = Transformer(vocab, seq, layers, hidden, heads, dropout=0.0).to(device)
    idx = torch.randint(0, vocab, (batch, seq + 1), device=device)
    arms = [(compress, offload) for offload in (False, True) for compress in (None, "bf16", "fp8")]
    if device.type != "cuda":
        arms = [arm for arm in arms if not arm[1]]
    times: dict[tuple[Optional[str], bool], list[float]] = {arm: [] for arm in arms}
    peaks, moved, grads = {}, {}, {}

    def step() -> torch.Tensor:
        return F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())

    for r in range(rounds):
        for compress, offload in arms if r % 2 == 0 else arms[::-1]:
            apply_checkpointing(model, layer_cls=Block, offload=offload, compress=compress)
            model.zero_grad(set_to_none=True)
            engine = offload_module.default_engine(device) if offload else None
            before_moved = engine.stats.offloaded_bytes if engine is not None else 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                start = time.perf_counter()
                step().backward()
                torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
                peak = torch.cuda.max_memory_allocated(device) - before  # gradients alive at the peak in
            else:
                from _peak import LiveStorages, grad_storages
                start = time.perf_counter()
                with LiveStorages() as live:
                    step().backward()
                seconds = time.perf_counter() - start
                peak = live.peak(exclude=grad_storages(model))
            remove_checkpointing(model)
            times[(compress, offload)].append(seconds)
            if r == 0:
                peaks[(compress, offload)] = peak
                moved[(compress, offload)] = (engine.stats.offloaded_bytes - before_moved) if engine is not None else 0
                grads[(compress, offload)] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    median = {arm: statistics.median(t[1:] or t) for arm, t in times.items()}  # the first round warms up

    def cosine(arm: tuple[Optional[str], bool]) -> float:
        exact = grads[(None, False)]
        return min(float(F.cosine_similarity(g.flatten().double(), exact[n].flatten().double(), dim=0))
                   for n, g in grads[arm].items())

    rows = ["| inputs | offload | step peak | to host per step | step time / exact | step time / exact with"
            " offload | least gradient cosine |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for compress, offload in arms:
        arm = (compress, offload)
        with_offload = f"{median[arm] / median[(None, True)]:.3f}" if offload else "-"
        rows.append(f"| {compress or 'exact'} | {'yes' if offload else 'no'} | {peaks[arm] / 2**20:.1f} MiB"
                    f" | {moved[arm] / 2**20:.1f} MiB | {median[arm] / median[(None, False)]:.3f} | {with_offload}"
                    f" | {cosine(arm):.6f} |")
    return "\n".join([f"### Compressed checkpoints (demo GPT, {layers} layers, hidden {hidden}, length {seq}, batch"
                      f" {batch}, every layer checkpointed; medians of {rounds - 1} interleaved rounds)", "", *rows])


def chunk_check(device: torch.device, seq: int = 16384, layers: int = 4, hidden: int = 1024, heads: int = 8,
                vocab: int = 32000, rounds: int = 3) -> str:
    """The LM head and loss whole against in chunks (``chunk_loss=True``), every layer checkpointed (Markdown): the
    step's peak (CUDA: the allocator's over the step, gradients in; CPU: live storages without gradients), the
    median step time over ``rounds`` interleaved rounds (the first warms up), and the loss and gradients in fp32 against
    the whole head's (largest difference relative to the largest gradient of the same parameter)."""
    torch.manual_seed(0)
    model = Transformer(vocab, seq, layers, hidden, heads, dropout=0.0).to(device)
    idx = torch.randint(0, vocab, (1, seq + 1), device=device)
    arms = (False, True)
    times: dict[bool, list[float]] = {arm: [] for arm in arms}
    peaks, losses, grads = {}, {}, {}
    for r in range(rounds):
        for chunked in arms if r % 2 == 0 else arms[::-1]:
            apply_checkpointing(model, layer_cls=Block, chunk_loss=chunked)
            model.zero_grad(set_to_none=True)
            _sync_reset(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            if device.type == "cuda":
                loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - before
            else:
                from _peak import LiveStorages, grad_storages
                with LiveStorages() as live:
                    loss = model(idx[:, :-1], idx[:, 1:])
                    loss.backward()
                peak = live.peak(exclude=grad_storages(model))
            times[chunked].append(time.perf_counter() - start)
            remove_checkpointing(model)
            if r == 0:
                peaks[chunked], losses[chunked] = peak, loss.item()
                grads[chunked] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    median = {arm: statistics.median(t[1:] or t) for arm, t in times.items()}
    worst = max(float((g - grads[False][n]).abs().max() / grads[False][n].abs().max().clamp_min(1e-30))
                for n, g in grads[True].items())
    rows = ["| head and loss | step peak | step time / whole | loss | largest relative gradient difference |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for chunked in arms:
        rows.append(f"| {'chunks' if chunked else 'whole'} | {peaks[chunked] / 2**20:.1f} MiB"
                    f" | {median[chunked] / median[False]:.3f} | {losses[chunked]:.6f}"
                    f" | {f'{worst:.2e}' if chunked else 'reference'} |")
    return "\n".join([f"### Chunked LM head and loss (demo GPT, {layers} layers, hidden {hidden}, length {seq}, batch 1,"
                      f" vocabulary {vocab}, fp32, every layer checkpointed; medians of {rounds - 1} interleaved rounds)",
                      "", *rows])


def _sync_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=280.0, help="tests and benchmark together")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="without CUDA: run the time-model check on a tiny model on the CPU (writes nothing)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if args.cpu_smoke:
            rows, table = time_model_check(torch.device("cpu"), seq=64, layers=4, hidden=64, heads=2, vocab=64,
                                           steps=3, rounds=2, budget_s=60.0)
            print(table)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            print(peak_check(torch.device("cpu"), seq=64, layers=4, hidden=64, heads=2, vocab=64))
            print(compress_check(torch.device("cpu"), seq=64, layers=4, hidden=128, heads=2, vocab=64, batch=2,
                                 rounds=3))
            print(chunk_check(torch.device("cpu"), seq=256, layers=2, hidden=64, heads=2, vocab=512))
            return 0 if all(r.measured_s is not None and r.predicted_s is not None for r in rows) else 1
        print("no accelerator: torch.cuda.is_available() is False, so nothing was run and nothing was written.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_offload
    from _results import machine, write_section

    start = time.perf_counter()
    results, test_s = run_tests(timeout_s=args.budget_s * 0.4)
    _, time_table = time_model_check(torch.device("cuda", torch.cuda.current_device()), budget_s=args.budget_s * 0.2)
    print(time_table, flush=True)
    peak_table = peak_check(torch.device("cuda", torch.cuda.current_device()))
    print(peak_table, flush=True)
    compress_table = compress_check(torch.device("cuda", torch.cuda.current_device()))
    print(compress_table, flush=True)
    chunk_table = chunk_check(torch.device("cuda", torch.cuda.current_device()))
    print(chunk_table, flush=True)
    bench_budget = max(30.0, args.budget_s - (time.perf_counter() - start) - 20.0)
    rows, bench = bench_offload.run([2048, 8192, 32768], steps=3, warmup=1, budget_s=bench_budget)
    failed = [name for name, outcome in results if outcome not in ("passed", "skipped")]
    mismatched = [f"seq {r.seq} {r.variant}: {r.vs_full}" for r in bench_offload.mismatched(rows)]
    lines = [
        "## GPU check (accelerator_check.py)",
        "",
        f"`python benchmarks/accelerator_check.py` - {machine()}. Tests took {test_s:.0f} s,"
        f" everything {time.perf_counter() - start:.0f} s.",
        "",
        f"Accelerator tests: {sum(o == 'passed' for _, o in results)} passed, {len(failed)} failed,"
        f" {sum(o == 'skipped' for _, o in results)} skipped.",
        "",
        "| test | outcome |",
        "| --- | --- |",
        *(f"| {name} | {outcome} |" for name, outcome in results),
        "",
        bench.replace("## Offload:", "### Offload:"),
        "",
        time_table,
        "",
        peak_table,
        "",
        compress_table,
        "",
        chunk_table,
    ]
    write_section("gpu", "\n".join(lines))
    print("\n".join(lines))
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
