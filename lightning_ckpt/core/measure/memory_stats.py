"""What :class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` measures and computes, in plain PyTorch.

The callback decides *when* (which steps log, which count FLOPs); this module holds *what*: the metric keys,
host and device memory reads, the probes that count bytes held for backward and recomputed FLOPs, the
reduction over ranks of an already-gathered ``[world_size, n]`` tensor, and the end-of-fit memory breakdown.
Nothing here imports Lightning (as ``lightning.fabric.utilities.throughput`` holds the arithmetic of
``ThroughputMonitor``).

Over 500 lines: everything the callback computes is one plain-PyTorch module it imports; its parts (reads, probes,
reduction, summary) are small functions on their own.

Example::

    >>> gathered = metrics_vector({HOST_RSS: 1.0, SAMPLES_PER_SEC: 10.0}).repeat(2, 1)  # two ranks alike
    >>> reduce_metrics(gathered)  # memory: the largest rank's; rates: the sum
    {'memory/host_rss_gib': 1.0, 'throughput/samples_per_sec': 20.0}
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import psutil
import torch

from lightning_ckpt.core.measure.profiling import (
    LiveBytes,
    OpCostMode,
    SavedTensorCounter,
    format_bytes,
    optimizer_state_bytes,
    tensor_bytes,
)
from lightning_ckpt.core.checkpoint.wrapping import in_recompute

__all__ = ["ABOUT_EQUAL", "ACTIVATIONS", "ACTIVATIONS_OFFLOADED", "GIB", "HOST_RSS", "METRIC_KEYS", "PEAK_ALLOCATED",
           "PEAK_RESERVED", "RECOMPUTE_FLOPS_SHARE", "REDUCTIONS", "SAMPLES_PER_SEC", "STEP_SEC", "SUMMARY_BYTE_KEYS",
           "TOKENS_PER_SEC", "ActivationProbe", "FlopProbe", "RecomputeCostMode", "all_gather_released",
           "device_peak_bytes", "device_total_bytes", "format_summary", "host_peak_rss_bytes", "host_rss_bytes",
           "interval_metrics", "local_summary", "main_tensor", "metrics_vector", "reduce_metrics", "reduce_summary",
           "reset_device_peaks", "synchronize", "tokens_in_batch", "weights_against_activations"]

GIB = 2**30

PEAK_ALLOCATED = "memory/peak_allocated_gib"
PEAK_RESERVED = "memory/peak_reserved_gib"
HOST_RSS = "memory/host_rss_gib"
ACTIVATIONS = "memory/activations_gib"
ACTIVATIONS_OFFLOADED = "memory/activations_offloaded_gib"
ACTIVATION_PEAK = "memory/activation_peak_gib"
SAMPLES_PER_SEC = "throughput/samples_per_sec"
TOKENS_PER_SEC = "throughput/tokens_per_sec"
STEP_SEC = "time/step_sec"
RECOMPUTE_FLOPS_SHARE = "compute/recompute_flops_share"

#: Every key the monitor can log, and how it is combined over ranks: memory and step time are the
#: maximum (the rank that runs out first / the slowest rank), rates are the sum.
REDUCTIONS: dict[str, str] = {
    PEAK_ALLOCATED: "max",
    PEAK_RESERVED: "max",
    HOST_RSS: "max",
    ACTIVATIONS: "max",
    ACTIVATIONS_OFFLOADED: "max",
    ACTIVATION_PEAK: "max",
    SAMPLES_PER_SEC: "sum",
    TOKENS_PER_SEC: "sum",
    STEP_SEC: "max",
    RECOMPUTE_FLOPS_SHARE: "max",
}
#: The logged keys in the order of the columns that :func:`metrics_vector` writes and :func:`reduce_metrics` reads.
METRIC_KEYS = tuple(REDUCTIONS)
#: Byte counts of the end-of-fit summary (ints after :func:`reduce_summary`); the other figures are rates.
SUMMARY_BYTE_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_host_rss_bytes", "activation_bytes",
                     "offloaded_activation_bytes", "activation_peak_bytes", "parameter_bytes", "gradient_bytes",
                     "optimizer_state_bytes")


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------


def main_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The first tensor of a batch, depth first (a tensor, or inside tuples, lists and dicts), or ``None``.

    Example::

        >>> main_tensor({"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": torch.zeros(2)}).shape
        torch.Size([2, 5])
    """
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        for item in batch:
            found = main_tensor(item)
            if found is not None:
                return found
    return None


def tokens_in_batch(batch: Any) -> Optional[int]:
    """``batch * seq`` when the batch's main tensor holds token ids ``[batch, seq]`` (2-D, integer), else ``None``.

    Example::

        >>> tokens_in_batch((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)))
        64
    """
    tensor = main_tensor(batch)
    if tensor is None or tensor.dim() != 2 or tensor.is_floating_point() or tensor.is_complex():
        return None
    return tensor.numel()


# ------------------------------------------------------------------------------------------------
# Host and device memory
# ------------------------------------------------------------------------------------------------


def host_rss_bytes() -> int:
    """Resident set size of this process, in bytes.

    Example::

        >>> host_rss_bytes() > 2**20
        True
    """
    return psutil.Process().memory_info().rss


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (0 where the platform does not say).

    Example::

        >>> host_peak_rss_bytes() > 2**20  # Linux and macOS say (getrusage); Windows without peak_wset: 0
        True
    """
    try:
        import resource
    except ImportError:  # Windows
        return getattr(psutil.Process().memory_info(), "peak_wset", 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if psutil.MACOS else peak * 1024  # macOS reports bytes, Linux KiB


def _device_module(device: torch.device) -> Optional[Any]:
    """The ``torch.cuda``-like module of an accelerator that keeps allocator statistics, or ``None`` (CPU, MPS, ...)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "max_memory_allocated"):
        return None
    return module


def device_peak_bytes(device: torch.device) -> Optional[tuple[int, int]]:
    """``(peak allocated, peak reserved)`` bytes on ``device`` since its peak counters were last reset, or ``None``.

    Example::

        >>> device_peak_bytes(torch.device("cpu")) is None  # no allocator statistics on CPU
        True
    """
    module = _device_module(device)
    if module is None:
        return None
    return module.max_memory_allocated(device), module.max_memory_reserved(device)


def device_total_bytes(device: torch.device) -> Optional[int]:
    """The total memory of ``device``, or ``None`` without allocator statistics (CPU, MPS, ...).

    Example::

        >>> device_total_bytes(torch.device("cpu")) is None
        True
    """
    module = _device_module(device)
    if module is None or not hasattr(module, "mem_get_info"):
        return None
    return module.mem_get_info(device)[1]


def reset_device_peaks(device: torch.device) -> None:
    """Reset the peak memory counters of ``device`` (no-op without allocator statistics).

    Example::

        >>> reset_device_peaks(torch.device("cpu"))  # nothing to reset
    """
    module = _device_module(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``, so that wall time covers it. No-op on CPU.

    Example::

        >>> synchronize(torch.device("cpu"))
    """
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


# ------------------------------------------------------------------------------------------------
# Probes: bytes held for backward, recomputed FLOPs
# ------------------------------------------------------------------------------------------------


class ActivationProbe:
    """Counts bytes saved for backward between ``start`` (before a training forward) and ``stop`` (before backward).

    Example::

        >>> layer = torch.nn.Linear(8, 8)
        >>> probe = ActivationProbe()
        >>> probe.start(layer.parameters())
        >>> loss = layer(torch.randn(4, 8)).sum()
        >>> probe.stop()  # the input, 4 * 8 float32; the weight is a parameter and not counted
        (128, 0)
    """

    def __init__(self) -> None:
        self._counter: Optional[SavedTensorCounter] = None

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self, parameters: Iterable[torch.Tensor]) -> None:
        """Enter the saved-tensor hooks (stopping a count still running); storages of ``parameters`` are excluded."""
        self.stop()
        self._counter = SavedTensorCounter(exclude=parameters)
        self._counter.__enter__()

    def stop(self) -> Optional[tuple[int, int]]:
        """Leave the hooks; return ``(bytes, offloaded bytes)`` if a count was running."""
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        return counter.bytes, counter.offloaded_bytes


class PeakProbe:
    """The step's activation peak: the most bytes alive at once, forward and backward (recomputes and activation
    gradients included), of the storages made between ``start`` (a training batch starts) and ``stop`` (its backward
    is done), the gradients of ``parameters`` left out. This is the figure a memory budget bounds
    (:attr:`~lightning_ckpt.core.plan.checkpoint_plan.CheckpointPlan.peak_bytes`). Counting puts every op through a Python dispatch
    mode (:class:`~lightning_ckpt.core.measure.profiling.LiveBytes`), which slows the step counted.

    Example::

        >>> x, weight = torch.randn(1024), torch.nn.Parameter(torch.ones(1024))  # made before: not counted
        >>> probe = PeakProbe()
        >>> probe.start()
        >>> (x * weight).sum().backward()
        >>> probe.stop([weight])  # x * weight (4096 B) and its sum (4 B); the weight's gradient left out
        4100
    """

    def __init__(self) -> None:
        self._mode: Optional[LiveBytes] = None

    def start(self) -> None:
        """Enter a fresh count (dropping one still running)."""
        self.stop()
        self._mode = LiveBytes()
        self._mode.__enter__()

    def stop(self, parameters: Iterable[torch.Tensor] = ()) -> Optional[int]:
        """Leave the count; return its peak without the storages of ``parameters``' gradients, if one was running."""
        mode, self._mode = self._mode, None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        return mode.peak(exclude=[p.grad for p in parameters if p.grad is not None])


class RecomputeCostMode(OpCostMode):
    """Count a step's FLOPs as the planner does (:class:`~lightning_ckpt.core.measure.profiling.OpCostMode`: torch's formulas for
    matmul, convolution and attention, one per output element for every other op) and, apart, those of checkpoint's
    recomputation (ops run while :func:`~lightning_ckpt.core.checkpoint.wrapping.in_recompute` is true).

    ``OpCostMode`` rather than torch's ``FlopCounterMode``: ``FlopCounterMode`` counts only matmul-like ops, so the
    cheap ops that selective checkpointing recomputes would count as free and its share would read 0. Outputs that
    selective checkpointing kept are not run again in the recompute, and not counted. Only the totals are kept.

    Example::

        >>> from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> apply_checkpointing(layer, layer_cls=torch.nn.Sequential)
        ['']
        >>> with RecomputeCostMode() as cost:
        ...     layer(torch.randn(4, 8)).sum().backward()
        >>> cost.recompute  # the matmul (2 * 4 * 8 * 8) again, to get GELU's input back; GELU itself is not needed
        512
    """

    def __init__(self) -> None:
        super().__init__()
        self.recompute = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        flops, _ = self.log.pop()  # totals only: a step runs too many ops to keep each one
        if in_recompute():
            self.recompute += flops
        return out


class FlopProbe:
    """Counts FLOPs (all, and recomputed) between ``start`` (a training batch starts) and ``stop`` (its backward is
    done), summed over the micro-batches of one optimizer step until ``take``.

    Example::

        >>> layer = torch.nn.Linear(8, 8)
        >>> probe = FlopProbe()
        >>> probe.start()
        >>> layer(torch.randn(4, 8)).sum().backward()
        >>> probe.take()  # nothing checkpointed: nothing recomputed
        0.0
        >>> probe.take() is None  # nothing counted since the last take
        True
    """

    def __init__(self) -> None:
        self._mode: Optional[RecomputeCostMode] = None
        self.total = 0
        self.recompute = 0

    def start(self) -> None:
        """Enter a fresh :class:`RecomputeCostMode` (adding up a count still running first)."""
        self.stop()
        self._mode = RecomputeCostMode()
        self._mode.__enter__()

    def stop(self) -> None:
        """Leave the mode, if one is running, and add its counts to ``total`` and ``recompute``."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self.total += mode.total
            self.recompute += mode.recompute

    def take(self) -> Optional[float]:
        """The recompute's share of the FLOPs counted since the last ``take`` (``None`` if none were); resets."""
        self.stop()
        share = self.recompute / self.total if self.total else None
        self.total = self.recompute = 0
        return share


# ------------------------------------------------------------------------------------------------
# Logged metrics: one rank's, then over ranks
# ------------------------------------------------------------------------------------------------


def interval_metrics(
    *,
    host_rss: int,
    samples_per_sec: float,
    batches_per_sec: float,
    tokens_per_sec: Optional[float] = None,
    device_peaks: Optional[tuple[int, int]] = None,
    activations: Optional[tuple[int, int]] = None,
    recompute_share: Optional[float] = None,
    activation_peak: Optional[int] = None,
) -> dict[str, float]:
    """One rank's logged figures over an interval (GiB, per second), keyed as :data:`REDUCTIONS`; figures not
    measured (``None``) or not a number are left out. Bytes: ``device_peaks`` is ``(allocated, reserved)``,
    ``activations`` ``(held, offloaded)`` at the end of the forward, ``activation_peak`` the step's activation peak
    (:class:`PeakProbe`); one batch is one optimizer step.

    Example::

        >>> metrics = interval_metrics(host_rss=2**30, samples_per_sec=64.0, batches_per_sec=4.0,
        ...                            activations=(2**29, 0))
        >>> metrics[HOST_RSS], metrics[ACTIVATIONS], metrics[STEP_SEC]
        (1.0, 0.5, 0.25)
        >>> PEAK_ALLOCATED in metrics, TOKENS_PER_SEC in metrics  # not measured: left out
        (False, False)
    """
    values = {key: math.nan for key in METRIC_KEYS}
    if device_peaks is not None:
        values[PEAK_ALLOCATED], values[PEAK_RESERVED] = device_peaks[0] / GIB, device_peaks[1] / GIB
    values[HOST_RSS] = host_rss / GIB
    if activations is not None:
        values[ACTIVATIONS], values[ACTIVATIONS_OFFLOADED] = activations[0] / GIB, activations[1] / GIB
    values[SAMPLES_PER_SEC] = samples_per_sec
    if tokens_per_sec is not None:
        values[TOKENS_PER_SEC] = tokens_per_sec
    values[STEP_SEC] = 1.0 / batches_per_sec
    if recompute_share is not None:
        values[RECOMPUTE_FLOPS_SHARE] = recompute_share
    if activation_peak is not None:
        values[ACTIVATION_PEAK] = activation_peak / GIB
    return {key: value for key, value in values.items() if not math.isnan(value)}


def metrics_vector(metrics: Mapping[str, float]) -> torch.Tensor:
    """``metrics`` as one float64 row in :data:`METRIC_KEYS` order, NaN for a key it lacks: what each rank gathers.

    Example::

        >>> metrics_vector({STEP_SEC: 0.5}).tolist()[-3:]
        [nan, 0.5, nan]
    """
    return torch.tensor([metrics.get(key, math.nan) for key in METRIC_KEYS], dtype=torch.float64)


def reduce_metrics(gathered: torch.Tensor) -> dict[str, float]:
    """Combine the ranks' rows of ``gathered`` (``[world_size, len(METRIC_KEYS)]``, rows from :func:`metrics_vector`)
    per :data:`REDUCTIONS`; a key missing (NaN) on any rank is left out.

    Example::

        >>> rows = torch.stack([metrics_vector({STEP_SEC: 0.5, SAMPLES_PER_SEC: 8.0}),
        ...                     metrics_vector({STEP_SEC: 0.7, SAMPLES_PER_SEC: 6.0, HOST_RSS: 1.0})])
        >>> reduce_metrics(rows)  # the slowest rank's step time, the ranks' rates summed; HOST_RSS only on one rank
        {'throughput/samples_per_sec': 14.0, 'time/step_sec': 0.7}
    """
    metrics = {}
    for i, key in enumerate(METRIC_KEYS):
        column = gathered[:, i]
        if torch.isnan(column).any():
            continue
        metrics[key] = float(column.sum() if REDUCTIONS[key] == "sum" else column.max())
    return metrics


def all_gather_released(tensor: torch.Tensor, timeout: float = 10.0) -> torch.Tensor:
    """``[world_size, *tensor.shape]``: ``tensor`` from every rank of the default process group, returned only once
    the process group has let go of the tensors it was given (at most ``timeout`` seconds after the collective).

    Gloo runs a collective on a worker thread, which drops its references to the input and output tensors only
    *after* the caller has returned. Dropping the last C++ reference to a tensor that Python created takes the GIL.
    When the summary gathered at the end of ``fit`` is the last thing a process does, the interpreter can start
    shutting down first: the worker thread, waiting for the GIL, is then ended mid-destructor and the process aborts
    ("terminate called without an active exception"), although training finished. Waiting here (the GIL released,
    usually well under a millisecond) takes that race away.

    Example::

        >>> all_gather_released(torch.tensor([1.0, 2.0]))  # one process, no process group: just this rank
        tensor([[1., 2.]])
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    outputs = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(outputs, tensor)
    held = [tensor, *outputs]
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in held) and time.monotonic() < deadline:
        time.sleep(1e-4)
    return torch.stack(outputs)


# ------------------------------------------------------------------------------------------------
# The end-of-fit summary
# ------------------------------------------------------------------------------------------------


def local_summary(
    *,
    parameters: Iterable[torch.Tensor],
    optimizers: Iterable[torch.optim.Optimizer],
    gradient_bytes: Optional[int],
    activations: tuple[int, int],
    activation_peak: Optional[int] = None,
    peak_host_rss: int,
    peak_device: Optional[tuple[int, int]] = None,
    samples: int,
    tokens: Optional[int] = None,
    elapsed: float,
) -> dict[str, float]:
    """One rank's end-of-fit figures, as floats (NaN: not measured), in the order that :func:`reduce_summary` reads.

    ``activations`` is the peak ``(held, offloaded)`` bytes at the end of a forward, ``activation_peak`` the largest
    activation peak of a step counted (``None``: none counted), ``peak_device`` the peak ``(allocated, reserved)``
    (``None`` without allocator statistics), ``gradient_bytes`` those of the gradients seen at an optimizer step
    (``None``: none seen); ``samples`` and ``tokens`` (``None``: not counted) over ``elapsed`` seconds of training.

    Example::

        >>> model = torch.nn.Linear(4, 4)  # 20 float32 parameters
        >>> adam = torch.optim.Adam(model.parameters())
        >>> figures = local_summary(parameters=model.parameters(), optimizers=[adam], gradient_bytes=80,
        ...     activations=(2**20, 0), peak_host_rss=2**30, samples=100, elapsed=2.0)
        >>> figures["parameter_bytes"], figures["optimizer_state_bytes"], figures["samples_per_sec"]
        (80.0, 0.0, 50.0)
    """
    has_device = peak_device is not None
    return {
        "peak_allocated_bytes": float(peak_device[0]) if has_device else math.nan,
        "peak_reserved_bytes": float(peak_device[1]) if has_device else math.nan,
        "peak_host_rss_bytes": float(peak_host_rss),
        "activation_bytes": float(activations[0]),
        "offloaded_activation_bytes": float(activations[1]),
        "activation_peak_bytes": float(activation_peak) if activation_peak is not None else math.nan,
        "parameter_bytes": float(tensor_bytes(parameters)),
        "gradient_bytes": float(gradient_bytes or 0),
        "optimizer_state_bytes": float(optimizer_state_bytes(optimizers)),
        "samples_per_sec": samples / elapsed if elapsed > 0 else math.nan,
        "tokens_per_sec": tokens / elapsed if elapsed > 0 and tokens is not None else math.nan,
    }


def reduce_summary(keys: Sequence[str], gathered: torch.Tensor) -> dict[str, Any]:
    """Combine the ranks' rows of ``gathered`` (``[world_size, len(keys)]``, columns named by ``keys``): rates
    (``*_per_sec``) are summed, everything else is the maximum, byte counts become ints, and a figure that any
    rank lacks (NaN) is ``None``.

    Example::

        >>> reduce_summary(["activation_bytes", "samples_per_sec", "peak_allocated_bytes"],
        ...                torch.tensor([[2048.0, 10.0, math.nan], [1024.0, 12.0, 5.0]], dtype=torch.float64))
        {'activation_bytes': 2048, 'samples_per_sec': 22.0, 'peak_allocated_bytes': None}
    """
    summary: dict[str, Any] = {}
    for i, key in enumerate(keys):
        column = gathered[:, i]
        if torch.isnan(column).any():
            summary[key] = None
        elif key.endswith("_per_sec"):
            summary[key] = float(column.sum())
        else:
            summary[key] = float(column.max())
        if key in SUMMARY_BYTE_KEYS and summary[key] is not None:
            summary[key] = int(summary[key])
    return summary


def _bytes(num_bytes: Optional[float]) -> str:
    return "n/a" if num_bytes is None else format_bytes(num_bytes)


#: Weights and activations this close (the smaller at least this share of the larger) are about equal: then neither
#: "outweighs" the other, and each has its own remedy.
ABOUT_EQUAL = 0.9


def format_summary(summary: Mapping[str, Any]) -> str:
    r"""The end-of-fit report of :class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` as text.

    Example::

        >>> print(format_summary({"steps": 10, "world_size": 1, "device": "cpu", "peak_allocated_bytes": None,
        ...     "peak_reserved_bytes": None, "peak_host_rss_bytes": 2**30, "activation_bytes": 2**29,
        ...     "offloaded_activation_bytes": 0, "activation_peak_bytes": 3 * 2**28, "parameter_bytes": 2**20,
        ...     "gradient_bytes": 2**20, "optimizer_state_bytes": 2**21, "samples_per_sec": 100.0,
        ...     "tokens_per_sec": None, "chooser": "memory_budget", "budget_bytes": 2**30}).split("\n", 2)[2])
          peak activations:   768.0 MiB at the step's peak (forward and backward), 0.75x the memory_budget of 1.0 GiB, which bounds that peak; 512.0 MiB held for backward at the end of the forward
          throughput:         100.0 samples/s
          memory breakdown: parameters 1.0 MiB, gradients 1.0 MiB, optimizer state 2.0 MiB, activations 768.0 MiB at the step's peak
          Activations at the step's peak (768.0 MiB) are the largest part: a smaller `memory_budget` (or `offload=True`) shrinks them.

    ``chooser`` is how the run chose its checkpointed layers (``"memory_budget"``, ``"every_n_layers"`` or ``None``
    without the callback), and ``budget_bytes`` (optional) the largest budget of its plans, which the step's
    activation peak (``activation_peak_bytes``) is compared with: that is what a budget bounds. Where no step's peak
    was counted, the bytes held at the end of the forward stand in, and the report says which figure it gives.
    """
    ranks = f", {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    lines = [f"MemoryMonitor summary ({summary['steps']} steps{ranks}):"]
    rss = _bytes(summary["peak_host_rss_bytes"])
    if summary["peak_allocated_bytes"] is not None:
        lines.append(f"  peak device memory: {_bytes(summary['peak_allocated_bytes'])} allocated,"
                     f" {_bytes(summary['peak_reserved_bytes'])} reserved; peak host RSS {rss}")
    else:
        lines.append(f"  peak device memory: n/a ({summary['device']} run); peak host RSS {rss}")
    offloaded = summary["offloaded_activation_bytes"]
    budget = summary.get("budget_bytes")
    peak = summary.get("activation_peak_bytes")
    held = (f"{_bytes(summary['activation_bytes'])} held for backward at the end of the forward"
            + (f" (+ {_bytes(offloaded)} offloaded to host memory)" if offloaded else ""))
    if peak is not None:
        lines.append(f"  peak activations:   {_bytes(peak)} at the step's peak (forward and backward)"
                     + (f", {peak / budget:.2f}x the memory_budget of {_bytes(budget)}, which bounds that peak"
                        if budget else "") + f"; {held}")
    else:
        lines.append(f"  peak activations:   {held}" + (f" (the step's peak, which the memory_budget of"
                                                          f" {_bytes(budget)} bounds, was not counted)" if budget else ""))
    activations, which = (peak, "at the step's peak") if peak is not None else (summary["activation_bytes"],
                                                                               "held at the end of the forward")
    rate = summary["samples_per_sec"]
    tokens = summary.get("tokens_per_sec")
    lines.append(f"  throughput:         {rate:,.1f} samples/s" + (f", {tokens:,.0f} tokens/s" if tokens else "")
                 if rate is not None else "  throughput:         n/a")
    per = " per process" if summary["world_size"] > 1 else ""
    lines.append(f"  memory breakdown{per}: parameters {_bytes(summary['parameter_bytes'])}, gradients"
                 f" {_bytes(summary['gradient_bytes'])}, optimizer state {_bytes(summary['optimizer_state_bytes'])},"
                 f" activations {_bytes(activations)} {which}")
    weights = summary["parameter_bytes"] + summary["gradient_bytes"] + summary["optimizer_state_bytes"]
    lines.append("  " + weights_against_activations(weights, activations, summary.get("chooser"), which))
    return "\n".join(lines)


def weights_against_activations(weights: float, activations: float, chooser: Optional[str] = None,
                                which: str = "at the step's peak") -> str:
    """Which is larger, ``weights`` (parameters, gradients and optimizer state) or ``activations`` (bytes, compared
    as they are, not as printed), and what shrinks it; "about equal" when the smaller is at least
    :data:`ABOUT_EQUAL` of the larger. ``chooser`` is how the run chose its checkpointed layers; ``which`` says which
    activation figure it is (the step's peak, or what the forward leaves held).

    Example::

        >>> weights_against_activations(2**24, 2**24).split(":")[0]  # the same 16 MiB: neither outweighs the other
        "Parameters, gradients and optimizer state (16.0 MiB) are about equal to activations at the step's peak (16.0 MiB)"
        >>> weights_against_activations(2**24, 2**20, which="held at the end of the forward").split(":")[0]
        'Parameters, gradients and optimizer state (16.0 MiB) outweigh activations held at the end of the forward (1.0 MiB)'
    """
    w, a = format_bytes(weights), format_bytes(activations)
    if min(weights, activations) >= ABOUT_EQUAL * max(weights, activations):
        return (f"Parameters, gradients and optimizer state ({w}) are about equal to activations {which} ({a}): both"
                f" count. For activations, {_ADVICE[chooser]} For the rest, {_SHARD}.")
    if weights > activations:
        return (f"Parameters, gradients and optimizer state ({w}) outweigh activations {which} ({a}): checkpointing"
                f" cannot shrink them. Instead, {_SHARD}.")
    return f"Activations {which} ({a}) are the largest part: {_ADVICE[chooser]}"


_SHARD = ("shard them across devices (FSDP, DeepSpeed ZeRO) or train fewer parameters (parameter-efficient tuning"
          " such as LoRA)")
"""What shrinks parameters, gradients and optimizer state, which checkpointing does not."""


_ADVICE = {
    "memory_budget": "a smaller `memory_budget` (or `offload=True`) shrinks them.",
    "every_n_layers": "checkpointing more layers (smaller `every_n_layers`) or `offload=True` shrinks them.",
    None: "checkpointing layers (the `GradientCheckpointing` callback) shrinks them.",
}
"""What shrinks activations, by how the run chose its checkpointed layers (``summary["chooser"]``)."""
