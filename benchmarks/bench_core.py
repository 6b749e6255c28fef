"""Core benchmark: the package against torch's checkpoint written by hand around each block (the floor).

GPT-style model, 8 layers, hidden 256, sequence 256, batch 8. Every variant is timed in this one
process, interleaved (one step of each in turn, repeated), and the median step time is taken.
Activation bytes are counted exactly with saved-tensor hooks. Results go to RESULTS.md ("core").

    python benchmarks/bench_core.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from _results import machine, write_section
from lightning_ckpt import apply_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import Block, Transformer

VOCAB, SEQ, BATCH, LAYERS, HIDDEN, HEADS = 1024, 256, 8, 8, 256, 8


class HandWritten(Transformer):
    """The floor: ``checkpoint(block, x)`` written by hand in the model's forward for blocks 0, n, 2n, ..."""

    def __init__(self, every_n: int) -> None:
        super().__init__(VOCAB, SEQ, LAYERS, HIDDEN, HEADS, dropout=0.1)
        self.every_n = every_n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % self.every_n == 0 else block(x)
        return self.head(self.ln_f(x))


def plain() -> Transformer:
    return Transformer(VOCAB, SEQ, LAYERS, HIDDEN, HEADS, dropout=0.1)


def package(every_n: int) -> Transformer:
    model = plain()
    apply_checkpointing(model, layer_cls=Block, every_n_layers=every_n)
    return model


def make_step(model: torch.nn.Module, idx: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(idx).logsumexp(-1).mean().backward()
        optimizer.step()

    return step


def activation_bytes(model: torch.nn.Module, idx: torch.Tensor) -> int:
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        loss = model(idx).logsumexp(-1).mean()
    loss.backward()
    return saved.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    variants: dict[str, torch.nn.Module] = {"none": plain()}
    for n in (1, 2, 4):
        variants[f"floor n={n}"] = HandWritten(n)
        variants[f"package n={n}"] = package(n)
    steps = {name: make_step(model, idx) for name, model in variants.items()}
    bytes_ = {name: activation_bytes(model, idx) for name, model in variants.items()}
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.repeats}", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}

    rows = ["| every_n | step time vs none | activations vs none | step time vs floor | activations vs floor |",
            "| --- | --- | --- | --- | --- |"]
    verdicts = []
    for n in (1, 2, 4):
        pkg, floor = f"package n={n}", f"floor n={n}"
        t_floor, b_floor = median[pkg] / median[floor], bytes_[pkg] / bytes_[floor]
        rows.append(f"| {n} | {median[pkg] / median['none']:.3f} | {bytes_[pkg] / bytes_['none']:.3f}"
                    f" ({bytes_[pkg] / 2**20:.1f} of {bytes_['none'] / 2**20:.1f} MiB) | {t_floor:.3f} | {b_floor:.4f} |")
        verdicts.append(f"every_n={n}: step time vs floor {t_floor:.3f} (target <= 1.05:"
                        f" {'met' if t_floor <= 1.05 else 'NOT met'}), activations vs floor {b_floor:.4f}"
                        f" (target within 2%: {'met' if abs(b_floor - 1) <= 0.02 else 'NOT met'})")
    table = "\n".join(rows)
    print(table)
    print("\n".join(verdicts))
    write_section("core", f"""## Core: package vs hand-written `torch.utils.checkpoint` (bench_core.py)

GPT-style model: {LAYERS} layers, hidden {HIDDEN}, sequence {SEQ}, batch {BATCH}, dropout 0.1; one step =
forward, backward, SGD step. Median of {args.repeats} interleaved rounds in one process; activation bytes
counted with saved-tensor hooks (parameters excluded). Machine: {machine()}.

{table}

{chr(10).join('- ' + v for v in verdicts)}
""")


if __name__ == "__main__":
    main()
