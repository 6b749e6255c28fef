"""What ``compare``'s runs measured, in numbers: each variant's memory and step times (:class:`VariantResult`), its
step time against the baseline's with a bootstrap interval (:func:`time_difference`), its first step's loss and
gradients against the baseline's (:func:`first_step_difference`), and the step time the planner's time model predicts
for it (:func:`predict_variants`). Plain functions of numbers and tensors: nothing here runs a process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch

from lightning_ckpt.commands.compare.variants import PLANNED, VARIANTS, compress_of
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.memory_stats import (
    ACTIVATION_PEAK,
    ACTIVATIONS,
    ACTIVATIONS_OFFLOADED,
    HOST_RSS,
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    SAMPLES_PER_SEC,
    STEP_SEC,
    TOKENS_PER_SEC,
)
from lightning_ckpt.core.plan.planner import predict_seconds
from lightning_ckpt.core.measure.timing import price_source

if TYPE_CHECKING:
    from lightning_ckpt.commands.plan.measure import Measurement

#: With fewer timed steps than this (either side), no verdict on time is given.
MIN_TIMED_STEPS = 10
#: Why a variant that ran without an error has nothing to show.
NO_STEPS = ("the run trained no step, so the monitor logged nothing. Check the config's `limit_train_batches` and"
            " `max_steps` (compare sets `max_steps` itself), and that the training dataloader is not empty.")
CONFIDENCE = 0.95
RESAMPLES = 2000


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
        text = f"{signed_percent(self.ratio - 1)} ({signed_percent(self.low - 1)} to {signed_percent(self.high - 1)})"
        return text if self.ratio > 1 else text + ", faster"


def signed_percent(fraction: float) -> str:
    """A fraction as a signed percentage.

    Example::

        >>> signed_percent(0.234), signed_percent(-0.05)
        ('+23%', '-5.0%')
    """
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
    activation_peak_gib: Optional[float] = None  # the step's activation peak, forward and backward (None: not counted)
    step_times: list[list[float]] = field(default_factory=list)
    samples_per_step: float = math.nan  # of one optimizer step, all ranks together
    tokens_per_step: Optional[float] = None
    loss_diff: Optional[float] = None
    grad_diff: Optional[float] = None
    mismatch: Optional[str] = None
    error: Optional[str] = None
    timed_memory_gib: Optional[float] = None  # the memory of memory_gib over the timed steps only
    #: What the variant checkpointed, as :func:`~lightning_ckpt.core.plan.planner.predict_seconds` takes it.
    layer_modes: dict[str, str] = field(default_factory=dict)
    kept_ops: dict[str, list[int]] = field(default_factory=dict)
    offload: Union[bool, list[str]] = False  # True: every checkpointed layer's inputs; a plan: the layers it offloads
    compress: Optional[str] = None  # how the checkpointed layers held their inputs ("bf16", "fp8"; None: exact)
    #: The time model's step time and its ratio to the baseline's (:func:`predict_variants`); None: no prediction.
    predicted_step_seconds: Optional[float] = None
    predicted_ratio: Optional[float] = None

    @property
    def memory_gib(self) -> float:
        """The memory that checkpointing is meant to cut: device peak on an accelerator, else the step's activation
        peak, else (not counted) the activations held at the end of the forward."""
        if self.peak_allocated_gib is not None:
            return self.peak_allocated_gib
        return self.activation_peak_gib if self.activation_peak_gib is not None else self.activations_gib

    @property
    def step(self) -> Spread:
        """Median and interquartile range of the timed step times, all rounds pooled."""
        return spread([t for r in self.step_times for t in r])

    @property
    def step_sec(self) -> float:
        return self.step.median

    @property
    def samples_per_sec(self) -> float:
        """The samples of one step over the median step time: the throughput that the step column implies.

        Example::

            >>> r = VariantResult("none", step_times=[[0.10, 0.13], [0.40, 0.42]], samples_per_step=8)
            >>> r.step.median, round(r.samples_per_sec, 2)  # 8 / 0.265
            (0.265, 30.19)
        """
        return self.samples_per_step / self.step.median if self.step.n else math.nan

    @property
    def tokens_per_sec(self) -> Optional[float]:
        """The tokens of one step over the median step time (``None`` when the batches are not token ids)."""
        if self.tokens_per_step is None or not self.step.n:
            return None
        return self.tokens_per_step / self.step.median


def measurements(name: str, runs: Sequence[tuple[Sequence[Mapping[str, float]], Mapping[str, Any]]],
                 warmup: int) -> VariantResult:
    """One variant from its processes' ``(monitor rows, result.json)``: peaks over every step of every process;
    step times per process after its first ``warmup`` steps; the samples (and tokens) of one step over those steps.

    The monitor logs rates; a step's samples are its rate times its time. Throughput is then the samples of a step
    over the median step time (:attr:`VariantResult.samples_per_sec`), not the median of the logged rates: with an
    even number of steps the median averages the two middle ones, and the mean of two rates is not the rate of
    their mean time (8 samples at 0.13 s and 0.40 s: 40.8 samples/s against 8 / 0.265 s = 30.2)."""
    if not runs or not all(rows for rows, _ in runs):
        raise ValueError(f"{name}: {NO_STEPS}")
    rows = [row for run_rows, _ in runs for row in run_rows]
    timed = [row for run_rows, _ in runs for row in run_rows[warmup:]]
    result = runs[0][1]

    def peak(key: str) -> Optional[float]:
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    def per_step(rate: str) -> Optional[float]:
        values = [r[rate] * r[STEP_SEC] for r in timed if rate in r and STEP_SEC in r]
        return float(np.median(values)) if values else None

    memory_key = next(k for k in (PEAK_ALLOCATED, ACTIVATION_PEAK, ACTIVATIONS) if peak(k) is not None or k == ACTIVATIONS)
    timed_memory = [r[memory_key] for r in timed if memory_key in r]
    layers = list(result.get("checkpointed_layers", []))
    settings = VARIANTS.get(name)
    plan = result.get("plan") or {}
    if name == PLANNED and plan:
        modes = {n: m for n, m in plan["layers"].items() if m != "none"}
        kept, offload = {n: list(k) for n, k in plan.get("kept_ops", {}).items()}, list(plan.get("offloaded", []))
        compress = plan.get("compress")
    else:
        modes = dict.fromkeys(layers, settings["mode"] if settings else "full")
        kept, offload, compress = {}, bool(settings and settings["offload"]), compress_of(settings)

    return VariantResult(
        name=name,
        checkpointed_layers=list(result.get("checkpointed_layers", [])),
        device=result.get("device", "cpu"),
        peak_allocated_gib=peak(PEAK_ALLOCATED),
        peak_reserved_gib=peak(PEAK_RESERVED),
        host_rss_gib=peak(HOST_RSS) or math.nan,
        activations_gib=peak(ACTIVATIONS) or 0.0,
        offloaded_gib=peak(ACTIVATIONS_OFFLOADED) or 0.0,
        activation_peak_gib=peak(ACTIVATION_PEAK),
        step_times=[[r[STEP_SEC] for r in run_rows[warmup:]] for run_rows, _ in runs],
        samples_per_step=per_step(SAMPLES_PER_SEC) or math.nan,
        tokens_per_step=per_step(TOKENS_PER_SEC),
        timed_memory_gib=max(timed_memory) if timed_memory else None,
        layer_modes=modes,
        kept_ops=kept,
        offload=offload,
        compress=compress,
    )


def first_step_difference(baseline: Mapping[str, Any], other: Mapping[str, Any], rtol: float,
                          atol: float, min_cosine: Optional[float] = None) -> tuple[float, float, Optional[str]]:
    """``(|loss difference|, largest |gradient difference|, what is beyond tolerance or None)``.

    A gradient is beyond tolerance when ``max|g - g_ref| > atol + rtol * max|g_ref|`` for that parameter, so a
    wrong small gradient is not hidden by a large one elsewhere. With ``min_cosine`` (a compressed variant, whose
    backward starts from rounded inputs) a gradient is beyond it when its cosine similarity to ``g_ref`` is lower;
    the loss is held to the tolerance either way (the forward is exact).

    Example::

        >>> import torch
        >>> ref = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -2.0])}}
        >>> first_step_difference(ref, {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -1.0])}}, 1e-3, 1e-6)
        (0.0, 1.0, 'gradient of w')
        >>> [first_step_difference(ref, {"loss": 1.0, "grads": {"w": torch.tensor([1.0, g])}}, 1e-3, 1e-6, 0.999)[2]
        ...  for g in (-2.01, -1.0)]  # cosine 0.999999 and 0.949 to [1, -2]
        [None, 'gradient of w (cosine below 0.999)']
        >>> first_step_difference({"loss": 1.0, "grads": {"w": torch.zeros(2)}},  # a gradient that should be zero
        ...                       {"loss": 1.0, "grads": {"w": torch.tensor([1.0, 0.0])}}, 1e-3, 1e-6, 0.999)[2]
        'gradient of w (cosine below 0.999)'
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
        if min_cosine is not None:
            cosine = float(torch.nn.functional.cosine_similarity(got[name].flatten().double(),
                                                                 g_ref.flatten().double(), dim=0))
            close = diff <= atol or cosine >= min_cosine
        else:
            close = diff <= atol + rtol * scale
        if problem is None and not close:
            problem = f"gradient of {name}" + (f" (cosine below {min_cosine:g})" if min_cosine is not None else "")
    if problem is None and not loss_diff <= atol + rtol * abs(baseline["loss"]):
        problem = "loss"
    return loss_diff, grad_diff, problem


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
            "cpu (matmul 200 GFLOP/s, memory 10 GB/s, host 10 GB/s, 4 µs per op recomputed, 4 µs per op under a policy; priced by cpu's rates)"
        """
        p = self.profile
        return (f"{p.name} (matmul {p.matmul_flops / 1e9:.3g} GFLOP/s, memory {p.memory_bandwidth / 1e9:.3g} GB/s,"
                f" host {p.host_bandwidth / 1e9:.3g} GB/s, {1e6 * p.op_overhead:.3g} µs per op recomputed,"
                f" {1e6 * p.per_op_under_policy:.3g} µs per op under a policy;"
                f" priced by {price_source(self.measurement.costs, p)})")

    def as_dict(self) -> dict[str, Any]:
        p = self.profile
        return {"device": p.name, "matmul_flops": p.matmul_flops, "memory_bandwidth": p.memory_bandwidth,
                "host_bandwidth": p.host_bandwidth, "op_overhead": p.op_overhead,
                "policy_overhead": p.per_op_under_policy, "offload_moves": self.offload_moves,
                "batch_size": self.measurement.batch_size, "layers": [c.name for c in self.measurement.costs]}


def measured_baseline(results: Sequence[VariantResult], model: TimeModel) -> Optional[float]:
    """The baseline's (``results[0]``'s) median step time, where the time model prices the device it ran on (a
    profile measured here) and it was timed: what :func:`predict_variants` adds each variant's predicted extra to,
    since the optimizer step, the training loop and the logging are in a step but not in the model. Else None.

    Example::

        >>> profile = DeviceProfile(2e11, 1e10, 1e10, layer_times=True)
        >>> from lightning_ckpt.commands.plan.measure import Measurement
        >>> measured_baseline([VariantResult("none", step_times=[[0.01, 0.03]])], TimeModel(Measurement(8, [], 0), profile))
        0.02
    """
    base = results[0] if results else None
    if base is None or base.error or not base.step.n or not model.profile.layer_times:
        return None
    return base.step_sec


def predict_variants(results: Sequence[VariantResult], model: TimeModel) -> list[str]:
    """Set each variant's predicted step time and its ratio to no checkpointing's, from the layers it checkpointed
    (:func:`~lightning_ckpt.core.plan.planner.predict_seconds`): the predicted extra over the baseline's measured step
    where there is one (:func:`measured_baseline`), else over the model's own step. Returns what could not be
    predicted, and why: a variant whose layers the measured step does not have is left without a prediction."""
    costs, outside = model.measurement.costs, model.measurement.outside_ops
    measured = measured_baseline(results, model)
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
                                            offload=r.offload if model.offload_moves else False, kept_ops=r.kept_ops,
                                            compress=r.compress)
        if measured is not None:
            seconds, baseline = measured + seconds - baseline, measured
        r.predicted_step_seconds, r.predicted_ratio = seconds, seconds / baseline
    return problems
