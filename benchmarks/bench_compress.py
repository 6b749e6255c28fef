"""Compressed checkpoints (``compress="bf16"`` / ``"fp8"``) against exact ones: bytes, gradients, training, step time.

All measured in this one process, every layer checkpointed (``apply_checkpointing``):

1. Bytes: what a checkpointed demo ``Block`` holds for its recompute (its fp32 input), counted as live storages
   by ``_peak.py`` (no package counter), exact vs bf16 vs fp8; and the activation peak of a whole demo GPT step
   (``LiveStorages.peak``, the parameters' gradients left out).
2. Gradients: one step on the demo GPT (dropout 0.1) and on Transformers' Llama built from a config (every
   ``LlamaDecoderLayer`` checkpointed), same seed and batch: the loss (bit-equal to exact?), the cosine of the
   gradients against exact overall and per parameter group, and per group the largest relative error
   ``||g - g_exact|| / ||g_exact||`` of its parameters.
3. Training: the demo GPT on an order-2 Markov chain over 16 tokens (:func:`markov_sequences`: a task it is still
   learning at the last step, unlike the counting task, whose loss reaches its floor by step 150 and leaves only
   rounding to compare), a plain PyTorch loop with AdamW, exact, bf16 and fp8 from seed 0 (same initial weights,
   dropout masks and batches), and exact from seeds 1..3. The seed-to-seed spread is that of the four exact runs.
   Final loss and mean of the last 50 steps; curves to ``loss.png``.
4. Step time: exact, bf16 and fp8 steps interleaved, the median of the rounds, as ratios to exact.

Results go to RESULTS.md ("compress") and ``benchmarks/loss.png``.

    python benchmarks/bench_compress.py [--steps 300] [--rounds 15] [--hidden 128] [--layers 4] [--peak-layers 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from _peak import LiveStorages, grad_storages
from _results import machine, write_section
from lightning_ckpt import apply_checkpointing
from lightning_ckpt.core.checkpoint.compress import compressed_bytes
from lightning_ckpt.demos import Block, Transformer, counting_sequences

VOCAB, SEQ, BATCH, HEADS, DROPOUT, LR = 64, 64, 16, 4, 0.1, 3e-3
ARMS: tuple[Optional[str], ...] = (None, "bf16", "fp8")
PLOT = Path(__file__).with_name("loss.png")


def name(compress: Optional[str]) -> str:
    return compress or "exact"


def gpt(args: argparse.Namespace, compress: Optional[str], seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(VOCAB, SEQ, args.layers, args.hidden, HEADS, DROPOUT)
    apply_checkpointing(model, layer_cls=Block, compress=compress)
    return model


def data(samples: int = 4096) -> torch.Tensor:
    return counting_sequences(samples, SEQ + 1, VOCAB, seed=0)


def markov_sequences(num: int, length: int, vocab: int = 16, successors: int = 4, seed: int = 0) -> tuple[torch.Tensor, float]:
    """``num`` sequences of an order-2 Markov chain: after tokens ``a, b`` comes one of ``successors`` tokens drawn
    for that pair, with probabilities drawn for it (a softmax of normal numbers). Returns them and the chain's
    entropy per token in nats (the least loss there is, averaged over pairs)."""
    gen = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, vocab, successors), generator=gen)
    probs = torch.softmax(torch.randn(vocab, vocab, successors, generator=gen), -1)
    seqs = torch.empty(num, length, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, vocab, (num, 2), generator=gen)
    for t in range(2, length):
        a, b = seqs[:, t - 2], seqs[:, t - 1]
        pick = torch.multinomial(probs[a, b], 1, generator=gen).squeeze(1)
        seqs[:, t] = nxt[a, b, pick]
    return seqs, float(-(probs * probs.log()).sum(-1).mean())


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


# ------------------------------------------------------------------------------------------------ 1. bytes


def held_input_bytes(hidden: int, compress: Optional[str]) -> tuple[int, int]:
    """Storages made in a checkpointed block's forward and alive after it, less its output: what it holds for its
    recompute (its input, which nothing else holds); and the input's bytes (as tests/core/checkpoint/test_compress.py counts)."""
    torch.manual_seed(0)
    block = Block(hidden, HEADS)
    base = torch.randn(BATCH, SEQ, hidden, requires_grad=True)
    apply_checkpointing(nn.Sequential(block), layer_cls=Block, compress=compress)
    with LiveStorages() as live:
        x = base * 1.0  # a fresh storage: freed unless something holds it
        x_bytes = x.untyped_storage().nbytes()
        y = block(x)
        del x
        torch.zeros(1)  # one more op: the mode notes the storages that died
        held = live.alive() - y.untyped_storage().nbytes()
    return held, x_bytes


def step_peak(model: nn.Module, batch: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with LiveStorages() as live:
        gpt_loss(model, batch).backward()
    peak = live.peak(exclude=grad_storages(model))
    model.zero_grad(set_to_none=True)
    return peak


def bytes_section(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    held = {c: held_input_bytes(args.hidden, c) for c in ARMS}
    exact, x_bytes = held[None]
    batch = data()[:BATCH]
    depths = sorted({args.layers, args.peak_layers})
    peaks = {(d, c): step_peak(gpt(argparse.Namespace(**{**vars(args), "layers": d}), c), batch)
             for d in depths for c in ARMS}
    ratios = {name(c): held[c][0] / exact for c in ARMS}
    n = BATCH * SEQ * args.hidden
    lines = [f"One checkpointed `Block`'s held input, {BATCH} x {SEQ} x {args.hidden} fp32 ({x_bytes:,} B), counted as"
             " live storages (`_peak.py`):", "",
             "| compress | held input (B) | ratio | expected (`compressed_bytes`) |", "| --- | ---: | ---: | ---: |"]
    for c in ARMS:
        expected = x_bytes if c is None else compressed_bytes(n, c)
        lines.append(f"| {name(c)} | {held[c][0]:,} | {held[c][0] / exact:.3f}x | {expected:,} |")
    lines += ["", f"Targets: bf16 0.50x ({'met' if ratios['bf16'] == 0.5 else 'NOT met'}), fp8 <= 0.27x"
              f" ({'met' if ratios['fp8'] <= 0.27 else 'NOT met'}).", "",
              f"Activation peak of a whole demo GPT step (hidden {args.hidden}, batch {BATCH} x {SEQ}), every layer"
              " checkpointed, counted by `_peak.py` (the parameters' gradients left out):", "",
              "| layers | exact (B) | bf16 (B) | fp8 (B) | bf16 / exact | fp8 / exact |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d in depths:
        e = peaks[(d, None)]
        lines.append(f"| {d} | {e:,} | {peaks[(d, 'bf16')]:,} | {peaks[(d, 'fp8')]:,} | {peaks[(d, 'bf16')] / e:.3f}x |"
                     f" {peaks[(d, 'fp8')] / e:.3f}x |")
    lines += ["", "The step peak falls by less than the held inputs: it is reached in the last layer's recompute and"
              " backward, where the inputs of the layers below are held (compressed) but that layer's own activations,"
              " its decompressed input, the logits and the gradients in flight are not compressed; the deeper the"
              " model, the larger the inputs' share."]
    return "\n".join(lines), ratios


# ------------------------------------------------------------------------------------------------ 2. gradients


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


GPT_GROUPS = {"embeddings": ("tok_emb", "pos_emb"), "attention qkv": ("attn.qkv",), "attention out": ("attn.proj",),
              "mlp": ("mlp.",), "norms": ("ln1", "ln2", "ln_f"), "head": ("head",)}
LLAMA_GROUPS = {"embeddings": ("embed_tokens",), "attention q/k/v": ("q_proj", "k_proj", "v_proj"),
                "attention o": ("o_proj",), "mlp": ("gate_proj", "up_proj", "down_proj"),
                "norms": ("layernorm", "model.norm"), "head": ("lm_head",)}


def group_of(param: str, groups: dict[str, tuple[str, ...]]) -> str:
    for group, keys in groups.items():
        if any(key in param for key in keys):
            return group
    raise KeyError(f"{param} is in no group")


def loss_and_grads(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # the same dropout masks in every arm
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def llama(args: argparse.Namespace, compress: Optional[str]) -> nn.Module:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB * 2, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                      num_hidden_layers=args.layers, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                      max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config).train()
    apply_checkpointing(model, layer_cls=LlamaDecoderLayer, compress=compress)
    return model


def compare_grads(build: Callable[[Optional[str]], nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor],
                  groups: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    runs = {c: loss_and_grads(build(c), loss_fn) for c in ARMS}
    exact_loss, exact = runs[None]
    out = {}
    for c in ARMS[1:]:
        loss, grads = runs[c]
        names = list(exact)
        per_group = {}
        for group in groups:
            members = [n for n in names if group_of(n, groups) == group]
            if not members:
                continue
            g = torch.cat([grads[n].flatten() for n in members])
            e = torch.cat([exact[n].flatten() for n in members])
            per_group[group] = (cosine(g, e), max(rel_error(grads[n], exact[n]) for n in members))
        overall = cosine(torch.cat([grads[n].flatten() for n in names]), torch.cat([exact[n].flatten() for n in names]))
        out[name(c)] = {"loss_equal": torch.equal(loss, exact_loss), "overall": overall, "groups": per_group,
                        "min_param": min((cosine(grads[n], exact[n]), n) for n in names),
                        "identical": all(torch.equal(grads[n], exact[n]) for n in names)}
    return out


def grads_section(args: argparse.Namespace) -> tuple[str, dict[str, dict]]:
    batch = data()[:BATCH]
    models = {"demo GPT": compare_grads(lambda c: gpt(args, c), lambda m: gpt_loss(m, batch), GPT_GROUPS)}
    try:
        ids = torch.randint(0, VOCAB * 2, (BATCH // 4, SEQ), generator=torch.Generator().manual_seed(1))
        models["Llama"] = compare_grads(lambda c: llama(args, c), lambda m: m(input_ids=ids, labels=ids).loss,
                                        LLAMA_GROUPS)
    except ImportError as err:
        print(f"Llama skipped: {err}")
    targets = {"bf16": 0.99999, "fp8": 0.999}
    lines = [f"One step, same weights, batch and dropout masks: demo GPT ({args.layers} layers, hidden {args.hidden},"
             f" dropout {DROPOUT}, batch {BATCH} x {SEQ}) and Transformers' `LlamaForCausalLM` from a config"
             f" ({args.layers} layers, hidden {args.hidden}, batch {BATCH // 4} x {SEQ}), every layer checkpointed."
             " Cosine against exact checkpointing's gradients (each group's parameters concatenated), and the largest"
             " relative error `||g - g_exact|| / ||g_exact||` of a parameter in the group:", ""]
    verdicts = []
    for model, results in models.items():
        groups = list(next(iter(results.values()))["groups"])
        lines += [f"**{model}**", "", "| compress | loss bit-equal | overall cosine | least parameter cosine | "
                  + " | ".join(groups) + " |", "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in groups) + " |"]
        for c, r in results.items():
            cells = " | ".join(f"{r['groups'][g][0]:.7f} / {r['groups'][g][1]:.1e}" for g in groups)
            least, least_name = r["min_param"]
            lines.append(f"| {c} | {'yes' if r['loss_equal'] else 'NO'} | {r['overall']:.7f} | {least:.7f}"
                         f" (`{least_name}`) | {cells} |")
            worst = min(r["overall"], *(v[0] for v in r["groups"].values()))
            verdicts.append(f"{model} {c}: least of the overall and group cosines {worst:.7f} against {targets[c]}"
                            f" ({'met' if worst >= targets[c] else 'NOT met'}); least single-parameter cosine"
                            f" {least:.7f} ({'at or above' if least >= targets[c] else 'below'} the target); loss"
                            f" {'bit-equal' if r['loss_equal'] else 'NOT bit-equal'}"
                            + ("; gradients identical to exact, compression did nothing" if r["identical"] else ""))
        lines += ["", "Group cells: cosine / largest relative error.", ""]
    lines += ["Targets: bf16 cosine >= 0.99999, fp8 >= 0.999; the first loss bit-equal (`torch.equal`).", ""]
    lines += [f"- {v}" for v in verdicts]
    return "\n".join(lines), models


# ------------------------------------------------------------------------------------------------ 3. training


def train(args: argparse.Namespace, compress: Optional[str], seed: int, sequences: torch.Tensor) -> list[float]:
    model = gpt(args, compress, seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    losses = []
    for _ in range(args.steps):
        batch = sequences[torch.randint(0, len(sequences), (BATCH,), generator=order)]
        optimizer.zero_grad(set_to_none=True)
        loss = gpt_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(runs: dict[str, list[float]], floor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in runs.items():
        if label.startswith("exact seed"):
            ax.plot(smooth(losses), color="0.75", lw=1, label=label)
    style = {"exact": ("black", "-"), "bf16": ("tab:blue", "--"), "fp8": ("tab:red", ":")}
    for label, (color, dash) in style.items():
        ax.plot(smooth(runs[label]), color=color, ls=dash, lw=1.6, label=f"{label} (seed 0)")
    ax.axhline(floor, color="0.5", ls="--", lw=1, label=f"the chain's entropy ({floor:.3f}): the least loss")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (20-step moving average)")
    ax.set_title("Demo GPT, every layer checkpointed: exact vs compressed inputs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def training_section(args: argparse.Namespace) -> tuple[str, dict]:
    sequences, entropy = markov_sequences(4096, SEQ + 1)
    runs: dict[str, list[float]] = {}
    for c in ARMS:
        start = time.perf_counter()
        runs[name(c)] = train(args, c, 0, sequences)
        print(f"trained {name(c)}: {time.perf_counter() - start:.0f} s, last-50 mean {statistics.mean(runs[name(c)][-50:]):.4f}")
    for seed in range(1, args.seeds + 1):
        runs[f"exact seed {seed}"] = train(args, None, seed, sequences)
        print(f"trained exact seed {seed}: last-50 mean {statistics.mean(runs[f'exact seed {seed}'][-50:]):.4f}")
    plot(runs, entropy)
    seeds = ["exact"] + [k for k in runs if k.startswith("exact seed")]  # exact is seed 0
    early = slice(min(50, args.steps // 6), min(100, args.steps // 3))
    windows = {"last 50": slice(-50, None), f"steps {early.start + 1}..{early.stop}": early}

    def position(value: float, low: float, high: float) -> str:
        if low <= value <= high:
            return "inside"
        off = value - high if value > high else value - low
        return f"outside by {off:+.4f}" + (f" ({off / (high - low):+.2f} spreads)" if high > low else "")

    means = {w: {k: statistics.mean(v[s]) for k, v in runs.items()} for w, s in windows.items()}
    spreads = {w: (min(means[w][k] for k in seeds), max(means[w][k] for k in seeds)) for w in windows}
    lines = [f"Demo GPT ({args.layers} layers, hidden {args.hidden}, dropout {DROPOUT}) on an order-2 Markov chain"
             f" over 16 tokens (4 successors per pair of tokens; its entropy, the least loss there is: {entropy:.4f}"
             f" nats per token), batch {BATCH} x {SEQ}, AdamW lr {LR}, {args.steps} steps, plain PyTorch loop, every"
             " layer checkpointed. exact, bf16 and fp8 start from seed 0 (same weights, dropout masks and batches);"
             f" exact from seeds 1..{args.seeds} has other weights, masks and batch order. The seed-to-seed spread is"
             f" that of the {args.seeds + 1} exact runs (seeds 0..{args.seeds}).", "",
             "| run | first loss | final loss | " + " | ".join(f"mean of {w} | against the seeds" for w in windows) + " |",
             "| --- | ---: | ---: | " + " | ".join("---: | ---" for _ in windows) + " |"]
    verdicts = {}
    for k, v in runs.items():
        cells = []
        for w in windows:
            where = position(means[w][k], *spreads[w]) if k in ("bf16", "fp8") else ""
            verdicts[(k, w)] = where
            cells.append(f"{means[w][k]:.4f} | {where}")
        lines.append(f"| {k} | {v[0]:.6f} | {v[-1]:.4f} | " + " | ".join(cells) + " |")
    first_equal = runs["bf16"][0] == runs["exact"][0] == runs["fp8"][0]
    last = next(iter(windows))
    low, high = spreads[last]
    gap = max(abs(means[last][c] - means[last]["exact"]) for c in ("bf16", "fp8"))
    lines += ["", f"Seed-to-seed spread (min .. max of exact seeds 0..{args.seeds}): "
              + "; ".join(f"{w}: {spreads[w][0]:.4f} .. {spreads[w][1]:.4f} (width {spreads[w][1] - spreads[w][0]:.4f})"
                          for w in windows) + ".",
              f"Target, the compressed runs' last-50 mean inside the spread: bf16 {verdicts[('bf16', last)]}, fp8"
              f" {verdicts[('fp8', last)]}. Largest gap of a compressed run's last-50 mean to exact seed 0's (the"
              f" run it starts from): {gap:.4f}, {gap / (high - low) if high > low else float('inf'):.2f} of the"
              " spread's width."
              f" First step's loss equal in the three seed-0 runs: {'yes' if first_equal else 'NO'}.",
              "", f"![training loss, exact vs bf16 vs fp8, and exact seeds 1..{args.seeds}]({PLOT.name})"]
    tail = means[last]
    return "\n".join(lines), {"tail": tail, "spread": (low, high), "verdicts": verdicts}


# ------------------------------------------------------------------------------------------------ 4. step time


def timing_section(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    batch = data()[:BATCH]
    steps = {}
    for c in ARMS:
        model = gpt(args, c).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            gpt_loss(model, batch).backward()
            optimizer.step()

        for _ in range(3):  # warm-up
            step()
        steps[name(c)] = step
    seconds: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[k].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    paired = {k: statistics.median(s / e for s, e in zip(seconds[k], seconds["exact"])) for k in ("bf16", "fp8")}
    lines = [f"Demo GPT training step (the model above, batch {BATCH} x {SEQ}, AdamW), every layer checkpointed; the"
             f" three arms interleaved in one process, {args.rounds} rounds:", "",
             "| compress | median step (ms) | ratio to exact | paired ratio (median over rounds) |",
             "| --- | ---: | ---: | ---: |"]
    for k in steps:
        ratio = median[k] / median["exact"]
        lines.append(f"| {k} | {median[k] * 1e3:.1f} | {ratio:.3f}x | {paired.get(k, 1.0):.3f}x |")
    lines += ["", "No target: compression adds a cast (bf16) or a scale, cast and pad (fp8) per layer in forward and"
              " the reverse in backward, element-wise work that a CPU pays in full; on an accelerator it is small next"
              " to the layer's matmuls. This machine is shared: ratios, not absolute times."]
    return "\n".join(lines), {k: median[k] / median["exact"] for k in ("bf16", "fp8")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="exact runs with other seeds (the spread)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--peak-layers", type=int, default=16, help="also count the step peak at this depth")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadier on a shared machine, where 2 threads contend)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    sections = []
    for title, make in (("Bytes", bytes_section), ("Gradients", grads_section), ("Training", training_section),
                        ("Step time", timing_section)):
        text, _ = make(args)
        sections.append(f"### {title}\n\n{text}")
        print(f"[{title}: done at {time.perf_counter() - start:.0f} s]")
    text = (f"## Compressed checkpoints (bench_compress.py)\n\n{machine()}. Run: `python benchmarks/bench_compress.py"
            f" --steps {args.steps} --seeds {args.seeds} --rounds {args.rounds} --hidden {args.hidden} --layers"
            f" {args.layers} --peak-layers {args.peak_layers} --threads {args.threads}` ({time.perf_counter() - start:.0f} s).\n\n" + "\n\n".join(sections))
    print(text)
    write_section("compress", text)


if __name__ == "__main__":
    main()
