"""One accelerator check, one command: every accelerator test, then the offload benchmark, into RESULTS.md ("gpu").

    python benchmarks/accelerator_check.py [--budget-s 280]

Runs ``pytest -m accelerator`` (offload under delayed copies, MemoryMonitor's device peaks, pinned memory, bf16
autocast under checkpointing) and ``bench_offload.py`` at 2k/8k/32k within the budget (under 5 minutes on one GPU),
and writes both into the "gpu" section of benchmarks/RESULTS.md. Exits 1 if a test failed or an offload variant's
loss or gradients differ from checkpointing without offload. On a machine without CUDA it prints
"no accelerator", touches nothing and exits 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent


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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=280.0, help="tests and benchmark together")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no accelerator: torch.cuda.is_available() is False, so nothing was run and nothing was written.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_offload
    from _results import machine, write_section

    start = time.perf_counter()
    results, test_s = run_tests(timeout_s=args.budget_s * 0.5)
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
    ]
    write_section("gpu", "\n".join(lines))
    print("\n".join(lines))
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
