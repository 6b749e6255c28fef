"""``lightning-ckpt compare``: the same run with and without checkpointing, side by side.

Each variant runs the same model, data and seed from one LightningCLI config, in fresh processes: no
checkpointing, every layer, every layer with selective checkpointing, every 2nd, every 4th, every layer with
offload, and, when the config's ``GradientCheckpointing`` has a ``memory_budget``, that callback as configured
(``planned``). The config's own ``GradientCheckpointing`` entry is replaced per variant, keeping its other
settings (``layer_cls``, ``use_reentrant``, ...). Memory and time come from
:class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` logging every step to a CSV file; loss and gradients after step 1
are compared with the run without checkpointing.

Timing is made to be trusted, not glanced at: every variant runs in ``--rounds`` fresh processes, the rounds
interleaved and alternately reversed (``none, every_layer, ..., offload``, then ``offload, ..., none``, ...) so
that a machine getting slower or busier during the comparison falls on every variant alike. The first
``--warmup`` steps of each process are not timed; ``--steps`` timed steps per variant are split over the rounds.
Each variant's step time is the median with its interquartile range, and time lost is the ratio of medians to
the run without checkpointing with a 95% bootstrap interval (:func:`time_difference`). A difference whose
interval contains zero is reported as within noise, never as a gain.

Next to each measured slowdown is the one the planner's time model predicts
(:func:`~lightning_ckpt.core.planner.predict_seconds`) for the layers that variant checkpointed: from one measured
step of the config's model (per-layer bytes, FLOPs and ops, as ``lightning-ckpt plan`` measures it) and a
:class:`~lightning_ckpt.core.device_profile.DeviceProfile`: by default the device the runs use, measured
(``DeviceProfile.measure``), or a preset with ``--device h100-sxm``. Nothing else is run for it.

Example::

    lightning-ckpt compare --config configs/every_4th_offload.yaml --steps 30 --rounds 3
    lightning-ckpt compare --config configs/tiny.yaml --device h100-sxm  # predicted column for an H100

It prints a Markdown table and writes it (``compare.md``), every number with the step-time samples
(``compare.json``), and a plot of memory against step time with interquartile error bars (``compare.png``) to
the output folder; each process's config, log and metrics are in ``<variant>/round<k>/``. Exit status: 0 when
every variant matches the loss and gradients of the run without checkpointing, 1 when one does not (flagged in
the table), 2 for a usage error or when a variant failed to run.

Test hook: when the environment variable ``LIGHTNING_CKPT_COMPARE_PERTURB_GRAD`` names a variant, that
variant adds a visible error to one gradient after its first backward (see :class:`FirstStepRecorder`). It
exists only so that the tests can check that a wrong gradient is caught; the variant's config says so
(``perturb_grad: true``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_ckpt.commands.arguments import add_device_argument, check_device_argument
from lightning_ckpt.core.device_profile import DeviceProfile
from lightning_ckpt.callbacks.memory_monitor import (
    ACTIVATIONS,
    ACTIVATIONS_OFFLOADED,
    HOST_RSS,
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    SAMPLES_PER_SEC,
    STEP_SEC,
    TOKENS_PER_SEC,
)
from lightning_ckpt.core.planner import predict_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lightning_ckpt.commands.plan.measure import Measurement

PERTURB_ENV = "LIGHTNING_CKPT_COMPARE_PERTURB_GRAD"
CALLBACK_PATH = "lightning_ckpt.GradientCheckpointing"

#: Variant name -> ``GradientCheckpointing`` settings (``None``: no checkpointing), in the order they run.
VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "every_layer": {"every_n_layers": 1, "mode": "full", "offload": False},
    "selective": {"every_n_layers": 1, "mode": "selective", "offload": False},
    "every_2nd": {"every_n_layers": 2, "mode": "full", "offload": False},
    "every_4th": {"every_n_layers": 4, "mode": "full", "offload": False},
    "offload": {"every_n_layers": 1, "mode": "full", "offload": True},
}
#: The config's own ``GradientCheckpointing``, run as written, when it has a ``memory_budget``.
PLANNED = "planned"
DESCRIPTIONS = {
    "none": "no checkpointing",
    "every_layer": "every layer",
    "selective": "every layer, selective",
    "every_2nd": "every 2nd layer",
    "every_4th": "every 4th layer",
    "offload": "every layer, inputs offloaded to host",
    PLANNED: "the config's memory_budget plan",
}
BASELINE = "none"

#: Defaults: 30 timed steps per variant in 3 rounds of 10, each after 2 untimed warm-up steps.
DEFAULT_STEPS, DEFAULT_ROUNDS, DEFAULT_WARMUP = 30, 3, 2
#: With fewer timed steps than this (either side), no verdict on time is given.
MIN_TIMED_STEPS = 10
#: Why a variant that ran without an error has nothing to show.
NO_STEPS = ("the run trained no step, so the monitor logged nothing. Check the config's `limit_train_batches` and"
            " `max_steps` (compare sets `max_steps` itself), and that the training dataloader is not empty.")
CONFIDENCE = 0.95
RESAMPLES = 2000


# ---------------------------------------------------------------------------------------------------- configs


def _is_callback(entry: Any, name: str) -> bool:
    """Whether a ``trainer.callbacks`` entry of a LightningCLI config is the class ``name`` (by its class_path)."""
    path = entry.get("class_path", "") if isinstance(entry, Mapping) else entry if isinstance(entry, str) else ""
    return path == name or path.endswith("." + name)


def _checkpointing_args(base: Mapping[str, Any]) -> dict[str, Any]:
    """The ``init_args`` of the config's ``GradientCheckpointing`` entry (``{}`` when it has none)."""
    callbacks = (base.get("trainer") or {}).get("callbacks") or []
    callbacks = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks)
    for entry in callbacks:
        if _is_callback(entry, "GradientCheckpointing"):
            return dict(entry.get("init_args") or {}) if isinstance(entry, Mapping) else {}
    return {}


def planned_settings(base: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The settings of the ``planned`` variant: the config's ``GradientCheckpointing`` as written, when it has a
    ``memory_budget``; ``None`` otherwise (then there is no ``planned`` variant).

    Example::

        >>> cb = {"class_path": "lightning_ckpt.GradientCheckpointing", "init_args": {"memory_budget": 0.3}}
        >>> planned_settings({"trainer": {"callbacks": [cb]}})
        {'memory_budget': 0.3}
        >>> planned_settings({"trainer": {"callbacks": []}}) is None
        True
    """
    args = _checkpointing_args(base)
    return args if args.get("memory_budget") is not None else None


def available_variants(base: Mapping[str, Any]) -> list[str]:
    """Every variant this config can run, in order: :data:`VARIANTS`, then ``planned`` if it has a budget.

    Example::

        >>> available_variants({})
        ['none', 'every_layer', 'selective', 'every_2nd', 'every_4th', 'offload']
    """
    return list(VARIANTS) + ([PLANNED] if planned_settings(base) is not None else [])


def variant_config(base: Mapping[str, Any], variant: str, steps: int, run_dir: Path, seed: int,
                   perturb_grad: bool = False, record_first_step: bool = True) -> dict[str, Any]:
    """The LightningCLI config of one process of one variant: ``base`` with its checkpointing replaced and
    measurement added, training ``steps`` steps and writing its logs and metrics to ``run_dir``.

    Example::

        >>> cfg = variant_config({"trainer": {"callbacks": []}}, "every_2nd", 5, Path("out"), seed=0)
        >>> cfg["trainer"]["callbacks"][1]["init_args"]
        {'every_n_layers': 2, 'mode': 'full', 'offload': False}
    """
    if variant == PLANNED:
        settings = planned_settings(base)
        if settings is None:
            raise ValueError(f"The {PLANNED!r} variant needs a `memory_budget` in the config's GradientCheckpointing"
                             f" init_args (e.g. `memory_budget: 0.5`); choose from {', '.join(VARIANTS)}.")
    elif variant in VARIANTS:
        settings = VARIANTS[variant]
    else:
        raise ValueError(f"Unknown variant {variant!r}; choose from {', '.join(available_variants(base))}.")
    config = copy.deepcopy(dict(base))
    for key in ("ckpt_path", "fit", "validate", "test", "predict", "subcommand"):
        config.pop(key, None)
    trainer = dict(config.get("trainer") or {})
    callbacks = trainer.get("callbacks") or []
    callbacks = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks)
    kept = [c for c in callbacks
            if not _is_callback(c, "GradientCheckpointing") and not _is_callback(c, "MemoryMonitor")]
    ckpt_args = _checkpointing_args(base)
    ckpt_args.pop("memory_budget", None)  # the fixed variants choose the layers themselves
    # The monitor before the checkpointing: saved-tensor hooks entered later are inner, and a budget's measuring
    # step must see every saved tensor itself.
    kept.append({"class_path": "lightning_ckpt.callbacks.memory_monitor.MemoryMonitor", "init_args": {"log_every_n_steps": 1}})
    if variant == PLANNED:
        kept.append({"class_path": CALLBACK_PATH, "init_args": dict(settings)})
    elif settings is not None:
        kept.append({"class_path": CALLBACK_PATH, "init_args": {**ckpt_args, **settings}})
    if record_first_step:
        recorder_args: dict[str, Any] = {"path": str(run_dir / "first_step.pt")}
        if perturb_grad:
            recorder_args["perturb_grad"] = True
        kept.append({"class_path": "lightning_ckpt.commands.compare.run.FirstStepRecorder", "init_args": recorder_args})
    trainer.update(
        callbacks=kept,
        max_steps=steps,
        max_epochs=-1,
        max_time=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(run_dir),
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir.parent), "name": run_dir.name, "version": ""}},
    )
    config["trainer"] = trainer
    config["seed_everything"] = seed
    return config


def config_seed(base: Mapping[str, Any], default: int = 1234) -> int:
    """The config's ``seed_everything`` if it is a number, else ``default`` (every variant must use the same)."""
    seed = base.get("seed_everything")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else default


def steps_per_round(steps: int, rounds: int) -> list[int]:
    """``steps`` timed steps split as evenly as possible over at most ``rounds`` rounds (none empty).

    Example::

        >>> steps_per_round(30, 3), steps_per_round(7, 3), steps_per_round(2, 3)
        ([10, 10, 10], [3, 2, 2], [1, 1])
    """
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The order of the processes, ``(round, variant)``: rounds one after another, alternately forwards and
    backwards, so that slow drift of the machine falls evenly on every variant (the baseline runs first).

    Example::

        >>> schedule(["none", "a", "b"], 3)
        [(0, 'none'), (0, 'a'), (0, 'b'), (1, 'b'), (1, 'a'), (1, 'none'), (2, 'none'), (2, 'a'), (2, 'b')]
    """
    order = []
    for r in range(rounds):
        order += [(r, name) for name in (variants if r % 2 == 0 else list(variants)[::-1])]
    return order


# ---------------------------------------------------------------------------------------------------- worker


class FirstStepRecorder(Callback):
    """Saves the loss and every gradient of the first optimizer step (global rank zero), for ``compare``.

    Args:
        path: where to ``torch.save`` ``{"loss": float, "grads": {name: tensor}}``.
        perturb_grad: test hook only: add an error of 5% of the largest entry to one element of the first
            gradient before recording (and before the optimizer uses it), as a checkpointing bug would.
    """

    def __init__(self, path: str, perturb_grad: bool = False) -> None:
        self.path = path
        self.perturb_grad = perturb_grad
        self._loss = 0.0
        self._done = False

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == 0 and not self._done:
            self._loss += float(loss.detach())  # already divided by the accumulation steps

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._done:
            return
        self._done = True
        named = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
        if self.perturb_grad and named:
            grad = named[0][1]
            grad.view(-1)[0] += 0.05 * grad.abs().max() + 1e-3
        if trainer.is_global_zero:
            grads = {n: g.detach().float().cpu().clone() for n, g in named}
            torch.save({"loss": self._loss, "grads": grads}, self.path)


def run_worker(variant_dir: Path) -> None:
    """Train one variant from ``variant_dir/config.yaml`` and write ``variant_dir/result.json`` (rank zero)."""
    from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
    from lightning_ckpt.commands.cli_builder import run_cli
    from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor

    with warnings.catch_warnings():
        # The worker's own command line (`--worker DIR`) is not for LightningCLI; the config comes as `args` on
        # purpose, so LightningCLI's caution against passing both would only be noise in every worker log.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        cli = run_cli(["--config", str(variant_dir / "config.yaml")], run=False, save_config_callback=None)
    trainer = cli.trainer
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if not trainer.is_global_zero:
        return
    layers = [c.checkpointed_layers for c in trainer.callbacks if isinstance(c, GradientCheckpointing)]
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    plans = [c.plan for c in trainer.callbacks if isinstance(c, GradientCheckpointing) and c.plan is not None]
    result = {"checkpointed_layers": layers[0] if layers else [], "device": trainer.strategy.root_device.type,
              "world_size": trainer.world_size, "steps": trainer.global_step, "summary": monitor.summary}
    if plans:  # the memory_budget plan, for the predicted slowdown of `planned`
        result["plan"] = {"layers": dict(plans[0].layers), "kept_ops": dict(plans[0].kept_ops),
                          "offloaded": list(plans[0].offloaded)}
    (variant_dir / "result.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range (``q1``, ``q3``) of ``n`` samples."""

    median: float
    q1: float
    q3: float
    n: int


def spread(samples: Sequence[float]) -> Spread:
    """Median and quartiles of ``samples`` (linear interpolation, as ``numpy.percentile``).

    Example::

        >>> spread([1.0, 2.0, 3.0, 4.0, 100.0])
        Spread(median=3.0, q1=2.0, q3=4.0, n=5)
    """
    if len(samples) == 0:
        return Spread(math.nan, math.nan, math.nan, 0)
    q1, median, q3 = (float(v) for v in np.percentile(np.asarray(samples, dtype=float), [25, 50, 75]))
    return Spread(median, q1, q3, len(samples))


@dataclass(frozen=True)
class TimeDifference:
    """Step time of a variant against the baseline: ``ratio`` of medians and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    timed_steps: int  # the fewer of the two sides
    confidence: float = CONFIDENCE

    @property
    def enough_steps(self) -> bool:
        return self.timed_steps >= MIN_TIMED_STEPS

    @property
    def within_noise(self) -> bool:
        """Whether no difference is one of the ratios the interval allows (then it is not a result)."""
        return self.low <= 1.0 <= self.high

    @property
    def noise(self) -> float:
        """Within noise, the largest difference (as a fraction) that the interval allows; otherwise ``nan``."""
        return max(self.high - 1.0, 1.0 - self.low) if self.within_noise else math.nan

    def describe(self) -> str:
        """The table's words for it: ``≈0%, within noise ±6%``, a loss or gain with its interval, or why there is no
        verdict.

        Example::

            >>> TimeDifference(1.02, 0.97, 1.06, 30).describe()
            '≈0%, within noise ±6.0%'
            >>> TimeDifference(1.31, 1.27, 1.35, 30).describe()
            '+31% (+27% to +35%)'
            >>> TimeDifference(0.80, 0.75, 0.90, 30).describe()
            '-20% (-25% to -10%), faster'
            >>> TimeDifference(0.78, 0.70, 0.90, 3).describe()
            'n/a: 3 timed steps, too few to tell'
        """
        if not self.enough_steps:
            return f"n/a: {self.timed_steps} timed steps, too few to tell"
        if self.within_noise:
            return f"≈0%, within noise ±{_percent(self.noise)}%"
        text = f"{_signed(self.ratio - 1)} ({_signed(self.low - 1)} to {_signed(self.high - 1)})"
        return text if self.ratio > 1 else text + ", faster"


def _signed(fraction: float) -> str:
    return ("+" if fraction >= 0 else "-") + _percent(abs(fraction)) + "%"


def _percent(fraction: float) -> str:
    value = 100 * fraction
    return f"{value:.1f}" if value < 9.95 else f"{value:.0f}"


def _pad(rounds: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rounds])
    table = np.zeros((len(rounds), int(lengths.max())))
    for i, r in enumerate(rounds):
        table[i, : len(r)] = r
    return table, lengths


def _resampled_medians(rounds: Sequence[Sequence[float]], picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Medians of two-level bootstrap resamples: the rounds in ``picks`` (``[B, R]``), steps drawn within each."""
    table, lengths = _pad(rounds)
    n = lengths[picks]                                                     # [B, R] steps in each picked round
    width = table.shape[1]
    steps = np.floor(rng.random(picks.shape + (width,)) * n[..., None]).astype(int)
    values = table[picks[..., None], steps]                                # [B, R, width]
    values[np.arange(width) >= n[..., None]] = np.nan                      # a round contributes only its own size
    return np.nanmedian(values.reshape(len(picks), -1), axis=1)


def time_difference(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
                    confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> TimeDifference:
    """Median step time of ``other`` over that of ``base``, with a percentile bootstrap interval.

    Both are step-time samples in rounds (one list per process). A resample draws rounds with replacement (the
    same round numbers for both sides when they have as many, since round ``k`` of each ran at about the same
    time), then steps with replacement within each drawn round; so the interval counts the differences between
    processes as well as between steps. Deterministic for a given ``seed``.

    Example::

        >>> d = time_difference([[1.0, 1.1, 0.9] * 5], [[1.3, 1.43, 1.17] * 5])
        >>> round(d.ratio, 2), d.within_noise
        (1.3, False)
    """
    base = [list(r) for r in base if len(r)]
    other = [list(r) for r in other if len(r)]
    timed = min(sum(map(len, base)), sum(map(len, other)))
    if not base or not other:
        return TimeDifference(math.nan, math.nan, math.nan, timed, confidence)
    ratio = float(np.median(np.concatenate(other)) / np.median(np.concatenate(base)))
    rng = np.random.default_rng(seed)
    base_picks = rng.integers(0, len(base), (resamples, len(base)))
    other_picks = base_picks if len(other) == len(base) else rng.integers(0, len(other), (resamples, len(other)))
    ratios = _resampled_medians(other, other_picks, rng) / _resampled_medians(base, base_picks, rng)
    tail = 100 * (1 - confidence) / 2
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100 - tail]))
    return TimeDifference(ratio, min(low, ratio), max(high, ratio), timed, confidence)


@dataclass
class VariantResult:
    """What one variant measured: memory in GiB, step times in seconds (per round), its step-1 differences."""

    name: str
    checkpointed_layers: list[str] = field(default_factory=list)
    device: str = "cpu"
    peak_allocated_gib: Optional[float] = None
    peak_reserved_gib: Optional[float] = None
    host_rss_gib: float = math.nan
    activations_gib: float = math.nan
    offloaded_gib: float = 0.0
    step_times: list[list[float]] = field(default_factory=list)
    samples_per_sec: float = math.nan
    tokens_per_sec: Optional[float] = None
    loss_diff: Optional[float] = None
    grad_diff: Optional[float] = None
    mismatch: Optional[str] = None
    error: Optional[str] = None
    timed_memory_gib: Optional[float] = None  # the memory of memory_gib over the timed steps only
    #: What the variant checkpointed, as :func:`~lightning_ckpt.core.planner.predict_seconds` takes it.
    layer_modes: dict[str, str] = field(default_factory=dict)
    kept_ops: dict[str, list[int]] = field(default_factory=dict)
    offload: Union[bool, list[str]] = False  # True: every checkpointed layer's inputs; a plan: the layers it offloads
    #: The time model's step time and its ratio to the baseline's (:func:`predict_variants`); None: no prediction.
    predicted_step_seconds: Optional[float] = None
    predicted_ratio: Optional[float] = None

    @property
    def memory_gib(self) -> float:
        """The memory that checkpointing is meant to cut: device peak on an accelerator, else activations."""
        return self.peak_allocated_gib if self.peak_allocated_gib is not None else self.activations_gib

    @property
    def step(self) -> Spread:
        """Median and interquartile range of the timed step times, all rounds pooled."""
        return spread([t for r in self.step_times for t in r])

    @property
    def step_sec(self) -> float:
        return self.step.median


def read_monitor_csv(path: Path) -> list[dict[str, float]]:
    """The rows :class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` wrote to a CSVLogger ``metrics.csv``, as floats
    (none when the run logged nothing, and so wrote no file)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in rows if row.get(STEP_SEC)]



def measurements(name: str, runs: Sequence[tuple[Sequence[Mapping[str, float]], Mapping[str, Any]]],
                 warmup: int) -> VariantResult:
    """One variant from its processes' ``(monitor rows, result.json)``: peaks over every step of every process;
    step times per process after its first ``warmup`` steps; throughput as the median over those steps."""
    if not runs or not all(rows for rows, _ in runs):
        raise ValueError(f"{name}: {NO_STEPS}")
    rows = [row for run_rows, _ in runs for row in run_rows]
    timed = [row for run_rows, _ in runs for row in run_rows[warmup:]]
    result = runs[0][1]

    def peak(key: str) -> Optional[float]:
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    def median(key: str) -> Optional[float]:
        values = [r[key] for r in timed if key in r]
        return float(np.median(values)) if values else None

    memory_key = PEAK_ALLOCATED if peak(PEAK_ALLOCATED) is not None else ACTIVATIONS
    timed_memory = [r[memory_key] for r in timed if memory_key in r]
    layers = list(result.get("checkpointed_layers", []))
    settings = VARIANTS.get(name)
    plan = result.get("plan") or {}
    if name == PLANNED and plan:
        modes = {n: m for n, m in plan["layers"].items() if m != "none"}
        kept, offload = {n: list(k) for n, k in plan.get("kept_ops", {}).items()}, list(plan.get("offloaded", []))
    else:
        modes = dict.fromkeys(layers, settings["mode"] if settings else "full")
        kept, offload = {}, bool(settings and settings["offload"])

    return VariantResult(
        name=name,
        checkpointed_layers=list(result.get("checkpointed_layers", [])),
        device=result.get("device", "cpu"),
        peak_allocated_gib=peak(PEAK_ALLOCATED),
        peak_reserved_gib=peak(PEAK_RESERVED),
        host_rss_gib=peak(HOST_RSS) or math.nan,
        activations_gib=peak(ACTIVATIONS) or 0.0,
        offloaded_gib=peak(ACTIVATIONS_OFFLOADED) or 0.0,
        step_times=[[r[STEP_SEC] for r in run_rows[warmup:]] for run_rows, _ in runs],
        samples_per_sec=median(SAMPLES_PER_SEC) or math.nan,
        tokens_per_sec=median(TOKENS_PER_SEC),
        timed_memory_gib=max(timed_memory) if timed_memory else None,
        layer_modes=modes,
        kept_ops=kept,
        offload=offload,
    )


def first_step_difference(baseline: Mapping[str, Any], other: Mapping[str, Any], rtol: float,
                          atol: float) -> tuple[float, float, Optional[str]]:
    """``(|loss difference|, largest |gradient difference|, what is beyond tolerance or None)``.

    A gradient is beyond tolerance when ``max|g - g_ref| > atol + rtol * max|g_ref|`` for that parameter, so a
    wrong small gradient is not hidden by a large one elsewhere.

    Example::

        >>> ref = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -2.0])}}
        >>> first_step_difference(ref, {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -1.0])}}, 1e-3, 1e-6)
        (0.0, 1.0, 'gradient of w')
    """
    loss_diff = abs(other["loss"] - baseline["loss"])
    ref, got = baseline["grads"], other["grads"]
    if set(ref) != set(got):
        missing = sorted(set(ref) ^ set(got))
        return loss_diff, math.inf, f"gradients of different parameters ({', '.join(missing[:3])})"
    grad_diff, problem = 0.0, None
    for name, g_ref in ref.items():
        diff = float((got[name] - g_ref).abs().max()) if g_ref.numel() else 0.0
        grad_diff = max(grad_diff, diff)
        scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
        if problem is None and not diff <= atol + rtol * scale:
            problem = f"gradient of {name}"
    if problem is None and not loss_diff <= atol + rtol * abs(baseline["loss"]):
        problem = "loss"
    return loss_diff, grad_diff, problem


# ---------------------------------------------------------------------------------------------------- predicted


@dataclass(frozen=True)
class TimeModel:
    """What the predicted column comes from: one measured step of the config's model (``measurement``: per-layer
    costs and ops, and the ops outside the layers) and the device ``profile`` it is priced on.

    ``offload_moves``: whether offload moves anything in the runs compared (not on a CPU run priced on the CPU's
    own profile: the inputs are already in host memory there).
    """

    measurement: Measurement
    profile: DeviceProfile
    offload_moves: bool = True

    def describe(self) -> str:
        """The profile's figures, in words.

        Example::

            >>> from lightning_ckpt.commands.plan.measure import Measurement
            >>> TimeModel(Measurement(8, [], 0), DeviceProfile(2e11, 1e10, 1e10, 4e-6, name="cpu")).describe()
            'cpu (matmul 200 GFLOP/s, memory 10 GB/s, host 10 GB/s, 4 µs per op recomputed, 4 µs per op under a policy)'
        """
        p = self.profile
        return (f"{p.name} (matmul {p.matmul_flops / 1e9:.3g} GFLOP/s, memory {p.memory_bandwidth / 1e9:.3g} GB/s,"
                f" host {p.host_bandwidth / 1e9:.3g} GB/s, {1e6 * p.op_overhead:.3g} µs per op recomputed,"
                f" {1e6 * p.per_op_under_policy:.3g} µs per op under a policy)")

    def as_dict(self) -> dict[str, Any]:
        p = self.profile
        return {"device": p.name, "matmul_flops": p.matmul_flops, "memory_bandwidth": p.memory_bandwidth,
                "host_bandwidth": p.host_bandwidth, "op_overhead": p.op_overhead,
                "policy_overhead": p.per_op_under_policy, "offload_moves": self.offload_moves,
                "batch_size": self.measurement.batch_size, "layers": [c.name for c in self.measurement.costs]}


def measure_time_model(config: Path, device: Optional[str] = None) -> TimeModel:
    """Measure one step of ``config``'s model as ``lightning-ckpt plan`` does (:func:`~lightning_ckpt.commands.plan.measure.
    measure`) and get the profile ``device`` names (a preset, or ``None``/``"auto"``: the device the step runs on,
    measured with :meth:`DeviceProfile.measure`)."""
    from lightning_ckpt.commands.plan.measure import build, device_profile, measure

    built = build(config, fake=False)
    measured = measure(built)
    profile = device_profile(device or "auto", built)
    assert profile is not None
    return TimeModel(measured, profile, offload_moves=not (device in (None, "auto") and built.device.type == "cpu"))


def prediction_text(model: Optional[TimeModel], problems: Sequence[str] = (), why: str = "") -> str:
    """The report's sentence on the predicted column: the profile it is priced on, or why there is none.

    Example::

        >>> prediction_text(None, why="the model could not be built")
        'Predicted: n/a, the model could not be built.'
    """
    if model is None:
        return f"Predicted: n/a, {why}."
    text = ("Predicted: the slowdown the planner's time model (`predict_seconds`) gives for the layers each variant"
            f" checkpointed, from one measured step of the model (batch {model.measurement.batch_size}) priced on"
            f" {model.describe()}; no run is timed for it.")
    return text + "".join(f" No prediction: {p}." for p in problems)


def predict_variants(results: Sequence[VariantResult], model: TimeModel) -> list[str]:
    """Set each variant's predicted step time and its ratio to no checkpointing's, from the layers it checkpointed
    (:func:`~lightning_ckpt.core.planner.predict_seconds`). Returns what could not be predicted, and why: a variant whose
    layers the measured step does not have is left without a prediction."""
    costs, outside = model.measurement.costs, model.measurement.outside_ops
    known = {c.name for c in costs}
    problems = []
    for r in results:
        if r.error:
            continue
        missing = sorted(set(r.layer_modes) - known)
        if missing:
            problems.append(f"`{r.name}` checkpointed {', '.join(missing[:3])}, which the measured step does not have")
            continue
        seconds, baseline = predict_seconds(costs, outside, r.layer_modes, model.profile,
                                            offload=r.offload if model.offload_moves else False, kept_ops=r.kept_ops)
        r.predicted_step_seconds, r.predicted_ratio = seconds, seconds / baseline
    return problems


# ---------------------------------------------------------------------------------------------------- output


def _num(value: Optional[float], digits: int = 4) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}g}"


def _ms(value: float) -> str:
    return _num(1000 * value, 3)


def render_markdown(results: Sequence[VariantResult], title: str, rtol: float, atol: float,
                    timing: str = "", prediction: str = "") -> str:
    """The comparison as Markdown: a short header and one table row per variant, the baseline first.

    ``timing`` says how the steps were timed (rounds, warm-up). Time lost is :func:`time_difference` against the
    baseline, in the words of :meth:`TimeDifference.describe`: never a gain when the difference is within noise.
    ``prediction`` says where the predicted slowdowns (:func:`predict_variants`) come from (:func:`prediction_text`).
    """
    base = results[0]
    on_device = base.peak_allocated_gib is not None
    memory_what = ("peak allocated device memory" if on_device else
                   f"activations held for backward ({base.device} run: no device memory; host RSS shown)")
    lines = [
        f"# Checkpointing comparison: {title}",
        "",
        f"Memory saved is measured on {memory_what}. {timing} Step time is the median over the timed steps, with"
        f" its interquartile range (IQR). Time lost is the ratio of medians to `{BASELINE}` with a"
        f" {100 * CONFIDENCE:.0f}% bootstrap interval (rounds, then steps, resampled); a difference whose interval"
        f" contains 0% is within noise, and with fewer than {MIN_TIMED_STEPS} timed steps there is no verdict."
        f" Loss and gradients after step 1 are compared with `{BASELINE}` (tolerance: |diff| <= {atol:g} +"
        f" {rtol:g} x the largest |value| of each gradient).",
        "",
    ]
    if prediction:
        lines += [prediction, ""]
    if not on_device and any(r.name == "offload" for r in results):
        lines += ["On a CPU run `offload` has no effect: the saved layer inputs are already in host memory.", ""]
    lines += [
        "| variant | checkpointed layers | peak device (GiB) | host RSS (GiB) | activations (GiB) | offloaded (GiB)"
        " | timed steps | step (ms) | step IQR (ms) | samples/s | memory saved | time lost | predicted | loss diff"
        " | grad diff | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | | | | | | | | | | | | | | | FAILED: {r.error} |")
            continue
        predicted = "n/a" if r.predicted_ratio is None else _signed(r.predicted_ratio - 1)
        if r is base:
            saved = lost = loss = grad = predicted = "-"
            check = "baseline"
        else:
            delta = base.memory_gib - r.memory_gib
            saved = f"{_num(delta, 3)} GiB ({100 * delta / base.memory_gib:.0f}%)" if base.memory_gib else "n/a"
            lost = time_difference(base.step_times, r.step_times).describe()
            loss, grad = _num(r.loss_diff, 2), _num(r.grad_diff, 2)
            check = f"**MISMATCH: {r.mismatch}**" if r.mismatch else "ok"
        step = r.step
        lines.append(
            f"| {r.name} | {len(r.checkpointed_layers)} | {_num(r.peak_allocated_gib)} | {_num(r.host_rss_gib)}"
            f" | {_num(r.activations_gib)} | {_num(r.offloaded_gib)} | {step.n} | {_ms(step.median)}"
            f" | {_ms(step.q1)}–{_ms(step.q3)} | {_num(r.samples_per_sec)} | {saved} | {lost} | {predicted}"
            f" | {loss} | {grad}"
            f" | {check} |"
        )
    for r in results:
        if not r.error and r.timed_memory_gib is not None and r.memory_gib > 1.01 * r.timed_memory_gib:
            lines += ["", f"`{r.name}`: the warm-up steps held the most ({_num(r.memory_gib)} GiB, in the table);"
                          f" the timed steps at most {_num(r.timed_memory_gib)} GiB"
                          + (" (the first step measures for the memory_budget plan)." if r.name == PLANNED else ".")]
    return "\n".join(lines) + "\n"


def to_json(results: Sequence[VariantResult], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every number of the comparison, the raw step times included, for ``compare.json``."""
    base = results[0]
    variants = []
    for r in results:
        entry: dict[str, Any] = {"name": r.name, "description": DESCRIPTIONS.get(r.name, r.name), "error": r.error}
        if not r.error:
            step = r.step
            entry.update(
                checkpointed_layers=r.checkpointed_layers, device=r.device, peak_allocated_gib=r.peak_allocated_gib,
                peak_reserved_gib=r.peak_reserved_gib, host_rss_gib=r.host_rss_gib,
                activations_gib=r.activations_gib, offloaded_gib=r.offloaded_gib, timed_memory_gib=r.timed_memory_gib,
                timed_steps=step.n,
                step_sec_median=step.median, step_sec_q1=step.q1, step_sec_q3=step.q3,
                samples_per_sec=r.samples_per_sec, tokens_per_sec=r.tokens_per_sec, step_times=r.step_times,
                loss_diff=r.loss_diff, grad_diff=r.grad_diff, mismatch=r.mismatch, layer_modes=r.layer_modes,
                kept_ops=r.kept_ops, offload=r.offload, predicted_step_seconds=r.predicted_step_seconds,
                predicted_time_lost=r.predicted_ratio)
            if r is not base and not base.error:
                d = time_difference(base.step_times, r.step_times)
                entry["time_lost"] = {"ratio": d.ratio, "low": d.low, "high": d.high, "confidence": d.confidence,
                                      "within_noise": d.within_noise, "enough_steps": d.enough_steps,
                                      "text": d.describe()}
        variants.append(entry)
    return {**settings, "variants": variants}


def plot(results: Sequence[VariantResult], path: Path, title: str) -> Optional[Figure]:
    """Memory against median step time, one labelled point per variant with its step-time interquartile range as
    horizontal error bars, saved as a PNG. Returns the figure (``None`` without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("compare: the plot needs matplotlib (`pip install matplotlib`); wrote the table only.", file=sys.stderr)
        return None
    done = [r for r in results if not r.error and r.step.n]
    fig = Figure(figsize=(6.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in done:
        colour = "tab:red" if r.mismatch else "tab:blue" if r.name != BASELINE else "black"
        step = r.step
        x = 1000 * step.median
        ax.errorbar([x], [r.memory_gib], xerr=[[1000 * (step.median - step.q1)], [1000 * (step.q3 - step.median)]],
                    fmt="o", color=colour, capsize=4)
        ax.annotate(r.name, (x, r.memory_gib), textcoords="offset points", xytext=(5, 5), fontsize=9)
    on_device = bool(done) and done[0].peak_allocated_gib is not None
    ax.set_xlabel("median step time (ms); bars: interquartile range")
    ax.set_ylabel("peak allocated device memory (GiB)" if on_device else "activations held for backward (GiB)")
    ax.set_title(f"Checkpointing: memory vs step time\n{title}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return fig


# ---------------------------------------------------------------------------------------------------- driver


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt compare", allow_abbrev=False,
        description="Run one LightningCLI config with and without checkpointing, each variant in fresh processes"
                    " in interleaved rounds, and compare memory, step time (median, spread, and whether a difference"
                    " is beyond noise), and the loss and gradients after step 1.")
    parser.add_argument("--config", type=Path, help="LightningCLI YAML config (model, data, trainer)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"timed steps per variant, after warm-up, over all rounds (default: {DEFAULT_STEPS})")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="fresh processes per variant, run in interleaved rounds that alternate direction"
                             f" (default: {DEFAULT_ROUNDS})")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help=f"untimed steps at the start of each process (default: {DEFAULT_WARMUP})")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)},{PLANNED} ('{BASELINE}' always runs;"
                             f" '{PLANNED}' needs a memory_budget in the config; default: all the config allows)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write compare.md, compare.json, compare.png and per-process logs"
                             " (default: lightning_ckpt_compare/<config name>)")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative gradient/loss tolerance (default: 1e-3)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute gradient/loss tolerance (default: 1e-6)")
    add_device_argument(parser, "price the predicted slowdowns on this device",
                        "default: auto")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    if args.worker is not None:
        return args
    check_device_argument(parser, args.device)
    if args.config is None:
        parser.error("--config is required: pass the LightningCLI YAML of the run to compare, e.g. --config"
                     " configs/tiny.yaml")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file; pass the path of a LightningCLI YAML config")
    for option, least in (("steps", 1), ("rounds", 1), ("warmup", 0)):
        if getattr(args, option) < least:
            parser.error(f"--{option} must be >= {least}, got {getattr(args, option)}")
    try:
        args.base = yaml.safe_load(args.config.read_text()) or {}
    except yaml.YAMLError as err:
        parser.error(f"--config {args.config}: not valid YAML ({err}); pass a LightningCLI YAML config")
    if not isinstance(args.base, Mapping):
        parser.error(f"--config {args.config}: expected a LightningCLI config (a mapping of trainer, model, data),"
                     f" got a {type(args.base).__name__}")
    allowed = available_variants(args.base)
    names = allowed if args.variants is None else [n.strip() for n in args.variants.split(",") if n.strip()]
    if PLANNED in names and PLANNED not in allowed:
        parser.error(f"the '{PLANNED}' variant needs a memory_budget in the config's GradientCheckpointing init_args"
                     f" (e.g. `memory_budget: 0.5`); choose from {', '.join(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    args.variants = [BASELINE] + [n for n in allowed if n in names and n != BASELINE]
    return args


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("      " + line for line in text[-lines:])


def _run_process(run_dir: Path, env: Mapping[str, str]) -> tuple[Optional[tuple[list[dict[str, float]], Any]], float]:
    start = time.perf_counter()
    with open(run_dir / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "lightning_ckpt.commands.compare.run", "--worker", str(run_dir)],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    seconds = time.perf_counter() - start
    result_path = run_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        return None, seconds
    return (read_monitor_csv(run_dir / "metrics.csv"), json.loads(result_path.read_text())), seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-ckpt compare --config X.yaml [--steps N] [--rounds R]``; returns the exit status (0, 1 for a
    gradient mismatch, 2 for a usage error or a failed variant)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        run_worker(args.worker)
        return 0

    out_dir = (args.output_dir or Path("lightning_ckpt_compare") / args.config.stem).resolve()
    seed = config_seed(args.base)
    perturbed = os.environ.get(PERTURB_ENV)
    per_round = steps_per_round(args.steps, args.rounds)
    order = schedule(args.variants, len(per_round))
    timing = (f"Timing: {args.steps} timed steps per variant in {len(per_round)} round(s) of fresh processes"
              f" ({'/'.join(map(str, per_round))} steps, each after {args.warmup} untimed warm-up step(s)), the"
              f" rounds interleaved and alternately reversed.")
    print(f"compare: {args.config}, {len(args.variants)} variants x {len(per_round)} rounds = {len(order)} fresh"
          f" processes, {args.warmup} warm-up + {'/'.join(map(str, per_round))} timed steps each, seed {seed}"
          f" -> {out_dir} (each process's output in <variant>/round<k>/worker.log)", flush=True)

    runs: dict[str, list[Any]] = {name: [] for name in args.variants}
    failed: dict[str, str] = {}
    checks: dict[str, tuple[float, float, Optional[str]]] = {}
    baseline_first: Any = None
    for i, (r, name) in enumerate(order, 1):
        if name in failed:
            continue
        run_dir = out_dir / name / f"round{r + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        config = variant_config(args.base, name, args.warmup + per_round[r], run_dir, seed,
                                perturb_grad=(r == 0 and name == perturbed), record_first_step=(r == 0))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"[{i}/{len(order)}] round {r + 1}/{len(per_round)} {name} ({DESCRIPTIONS[name]}) ...", end=" ",
              flush=True)
        got, seconds = _run_process(run_dir, os.environ)
        if got is None or not got[0]:
            log = run_dir / "worker.log"
            if got is None:
                print(f"FAILED after {seconds:.1f} s; last lines of {log}:\n{_tail(log)}", flush=True)
            else:
                print(f"FAILED: {NO_STEPS}", flush=True)
            failed[name] = f"see {log.relative_to(out_dir)}" if got is None else "trained no step"
            if name == BASELINE:
                print("compare: the run without checkpointing failed; nothing to compare against.", file=sys.stderr)
                return 2
            continue
        runs[name].append(got)
        mismatch = None
        if r == 0:
            first_path = run_dir / "first_step.pt"
            first = torch.load(first_path, weights_only=True)
            first_path.unlink()  # as large as the model; the differences are what is kept
            if name == BASELINE:
                baseline_first = first
            else:
                checks[name] = first_step_difference(baseline_first, first, args.rtol, args.atol)
                mismatch = checks[name][2]
        rows, result = got
        timed = [row[STEP_SEC] for row in rows[args.warmup:]]
        print(f"done in {seconds:.1f} s: {len(result['checkpointed_layers'])} layers checkpointed, activations"
              f" {_num(max(row.get(ACTIVATIONS, 0.0) for row in rows))} GiB, median"
              f" {_ms(spread(timed).median)} ms/step" + (f", MISMATCH: {mismatch}" if mismatch else ""), flush=True)

    results: list[VariantResult] = []
    for name in args.variants:
        if name in failed:
            results.append(VariantResult(name=name, error=failed[name]))
            continue
        result = measurements(name, runs[name], args.warmup)
        if name in checks:
            result.loss_diff, result.grad_diff, result.mismatch = checks[name]
        results.append(result)

    print("compare: measuring one step of the model and the device profile for the predicted slowdowns ...",
          flush=True)
    model, problems, why = None, [], ""
    try:
        model = measure_time_model(args.config, args.device)
        problems = predict_variants(results, model)
    except Exception as err:  # noqa: BLE001 - the runs are done; a prediction that fails must not lose them
        why = f"measuring the step for the time model failed ({type(err).__name__}: {err})"
        print(f"compare: no predicted slowdowns: {why}", file=sys.stderr)

    title = f"{args.config.name}, {args.steps} timed steps per variant"
    markdown = render_markdown(results, title, args.rtol, args.atol, timing, prediction_text(model, problems, why))
    (out_dir / "compare.md").write_text(markdown)
    settings = {"config": str(args.config), "steps": args.steps, "rounds": len(per_round),
                "steps_per_round": per_round, "warmup": args.warmup, "seed": seed, "order": order,
                "rtol": args.rtol, "atol": args.atol,
                "time_model": model.as_dict() if model is not None else {"error": why}}
    (out_dir / "compare.json").write_text(json.dumps(to_json(results, settings), indent=2))
    fig = plot(results, out_dir / "compare.png", title)
    print()
    print(markdown)
    print(f"compare: wrote {out_dir / 'compare.md'}, compare.json" + (" and compare.png" if fig else ""), flush=True)
    if any(r.error for r in results):
        return 2
    if any(r.mismatch for r in results):
        print("compare: loss or gradients differ from the run without checkpointing beyond tolerance"
              " (flagged in the table).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
