"""MemoryMonitor: what checkpointing bought (memory) and what it cost (time), through any Lightning logger.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing, MemoryMonitor

    trainer = Trainer(log_every_n_steps=50, callbacks=[GradientCheckpointing(every_n_layers=2), MemoryMonitor()])
    trainer.fit(model)  # logs memory/*, throughput/*, time/step_sec, compute/*; prints a summary at the end
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import psutil
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_ckpt.core.profiling import OpCostMode, SavedTensorCounter, optimizer_state_bytes, tensor_bytes
from lightning_ckpt.core.wrapping import in_recompute

GIB = 2**30

PEAK_ALLOCATED = "memory/peak_allocated_gib"
PEAK_RESERVED = "memory/peak_reserved_gib"
HOST_RSS = "memory/host_rss_gib"
ACTIVATIONS = "memory/activations_gib"
ACTIVATIONS_OFFLOADED = "memory/activations_offloaded_gib"
SAMPLES_PER_SEC = "throughput/samples_per_sec"
TOKENS_PER_SEC = "throughput/tokens_per_sec"
STEP_SEC = "time/step_sec"
RECOMPUTE_FLOPS_SHARE = "compute/recompute_flops_share"
#: FLOPs are counted on a logging step at least this many optimizer steps after the last counted one.
FLOP_COUNT_EVERY = 100

#: Every key the monitor can log, and how it is combined over ranks: memory and step time are the
#: maximum (the rank that runs out first / the slowest rank), rates are the sum.
REDUCTIONS: dict[str, str] = {
    PEAK_ALLOCATED: "max",
    PEAK_RESERVED: "max",
    HOST_RSS: "max",
    ACTIVATIONS: "max",
    ACTIVATIONS_OFFLOADED: "max",
    SAMPLES_PER_SEC: "sum",
    TOKENS_PER_SEC: "sum",
    STEP_SEC: "max",
    RECOMPUTE_FLOPS_SHARE: "max",
}
_KEYS = tuple(REDUCTIONS)

Count = Union[int, torch.Tensor]


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


def host_rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    return psutil.Process().memory_info().rss


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (0 where the platform does not say)."""
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
    """``(peak allocated, peak reserved)`` bytes on ``device`` since its peak counters were last reset, or ``None``."""
    module = _device_module(device)
    if module is None:
        return None
    return module.max_memory_allocated(device), module.max_memory_reserved(device)


def reset_device_peaks(device: torch.device) -> None:
    """Reset the peak memory counters of ``device`` (no-op without allocator statistics)."""
    module = _device_module(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``, so that wall time covers it. No-op on CPU."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


class _ActivationProbe:
    """Counts bytes saved for backward between ``start`` (before a training forward) and ``stop`` (before backward)."""

    def __init__(self) -> None:
        self._counter: Optional[SavedTensorCounter] = None

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self, parameters: Iterable[torch.Tensor]) -> None:
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


class RecomputeCostMode(OpCostMode):
    """Count a step's FLOPs as the planner does (:class:`~lightning_ckpt.core.profiling.OpCostMode`: torch's formulas for
    matmul, convolution and attention, one per output element for every other op) and, apart, those of checkpoint's
    recomputation (ops run while :func:`~lightning_ckpt.core.wrapping.in_recompute` is true).

    ``OpCostMode`` rather than torch's ``FlopCounterMode``: ``FlopCounterMode`` counts only matmul-like ops, so the
    cheap ops that selective checkpointing recomputes would count as free and its share would read 0. Outputs that
    selective checkpointing kept are not run again in the recompute, and not counted. Only the totals are kept.

    Example::

        >>> from lightning_ckpt.core.wrapping import apply_checkpointing
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


class _FlopProbe:
    """Counts FLOPs (all, and recomputed) between ``start`` (a training batch starts) and ``stop`` (its backward is
    done), summed over the micro-batches of one optimizer step until ``take``."""

    def __init__(self) -> None:
        self._mode: Optional[RecomputeCostMode] = None
        self.total = 0
        self.recompute = 0

    def start(self) -> None:
        self.stop()
        self._mode = RecomputeCostMode()
        self._mode.__enter__()

    def stop(self) -> None:
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


class MemoryMonitor(Callback):
    r"""Log device, host and activation memory, throughput and step time, and summarise them at the end of fit.

    Logs through the trainer's loggers (CSV, TensorBoard, any Lightning logger), every ``log_every_n_steps``
    optimizer steps, these keys (GiB as float, rates per second, all ranks together):

    - ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``: device peak since the last log (accelerators only;
      the peak counters are reset after each log).
    - ``memory/host_rss_gib``: resident memory of the process.
    - ``memory/activations_gib``: bytes held for backward at the end of the training forward, parameters not
      counted, counted with saved-tensor hooks on the logging step; ``memory/activations_offloaded_gib``: the part
      that ``GradientCheckpointing(offload=True)`` keeps in host memory instead.
    - ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` (when ``length_fn`` is given or the batch's main
      tensor holds token ids ``[batch, seq]``), ``time/step_sec``: averages over the steps since the last log,
      validation excluded.
    - ``compute/recompute_flops_share``: the FLOPs that checkpointing recomputes over all FLOPs of the step's forward
      and backward (0 without checkpointing; optimizer step excluded), counted by :class:`RecomputeCostMode` as the
      planner counts them. Counting puts every op through a Python dispatch mode, which slows that step (and runs a
      compiled model eagerly for it), so it runs on logging steps only, never the first step, and at most once every
      :data:`FLOP_COUNT_EVERY` optimizer steps; logging steps in between repeat the last count. No other step is
      touched.

    Under DDP/FSDP memory and step time are the maximum over ranks and rates the sum, gathered only on logging steps.
    The device is synchronised only on logging steps (and once at the end of fit). One step is one optimizer step, so
    with gradient accumulation the activations are the largest of the step's micro-batches.

    At the end of fit it prints (rank zero) peak memory, peak activations, samples/s and a breakdown into parameters,
    gradients, optimizer state and activations, saying so when checkpointing cannot help. Without a logger it only
    prints that summary. The last logged values are in ``metrics`` (this rank's, before reduction, in
    ``local_metrics``) and the summary in ``summary``.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` uses the trainer's ``log_every_n_steps``.
        batch_size_fn: samples in a batch; default: the length of the first tensor in the batch.
        length_fn: tokens (items) in a batch; default: ``batch * seq`` when the first tensor is a 2-D integer tensor.
            Both may return a Python int or a 0-dim tensor (tensors are only read on logging steps, so counting
            e.g. ``attention_mask.sum()`` does not synchronise the device every step).

    Example::

        trainer = Trainer(callbacks=[MemoryMonitor(length_fn=lambda batch: int(batch["attention_mask"].sum()))])
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        batch_size_fn: Optional[Callable[[Any], Count]] = None,
        length_fn: Optional[Callable[[Any], Count]] = None,
    ) -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"`log_every_n_steps` must be an int >= 1 or None (use the trainer's), got {log_every_n_steps!r}."
            )
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a function of the batch returning an int, got {fn!r}.")
        self.log_every_n_steps = log_every_n_steps
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.metrics: dict[str, float] = {}
        self.local_metrics: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self._probe = _ActivationProbe()
        self._flops = _FlopProbe()
        self._reset()

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._every = 0
        self._t0: Optional[float] = None
        self._paused = 0.0
        self._pause_start: Optional[float] = None
        self._last_step = 0
        self._steps = 0
        self._samples: Count = 0
        self._tokens: Count = 0
        self._has_tokens: Optional[bool] = None
        self._throughput = Throughput(window_size=2)
        self._step_activations: Optional[tuple[int, int]] = None
        self._peak_activations = (0, 0)
        self._peak_device = (0, 0)
        self._peak_rss = 0
        self._gradient_bytes: Optional[int] = None
        self._flops.take()
        self._recompute_share: Optional[float] = None
        self._flops_counted_at: Optional[int] = None

    def _elapsed(self) -> float:
        assert self._t0 is not None
        return time.perf_counter() - self._t0 - self._paused

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        # the trainer's `log_every_n_steps=0` turns logging off; then only the summary is printed
        self._every = self.log_every_n_steps or trainer.log_every_n_steps
        self._last_step = trainer.global_step
        self.metrics, self.local_metrics, self.summary = {}, {}, {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
            self._throughput.update(time=0.0, batches=0, samples=0, lengths=0 if self._counts_tokens(batch) else None)
        self._samples = self._samples + self._batch_size(batch)
        if self._has_tokens:
            self._tokens = self._tokens + self._batch_tokens(batch)
        # count activations on the steps that log, and on the first step so that the summary has them anyway
        if self._steps == 0 or self._is_log_step(trainer.global_step + 1):
            self._probe.start(pl_module.parameters())
        if self._counts_flops(trainer):
            self._flops.start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._record_activations()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._flops.stop()  # forward and backward only
        if self._gradient_bytes is None:
            self._gradient_bytes = tensor_bytes(p.grad for p in pl_module.parameters())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._record_activations()  # when the step returned no loss, there was no backward
        self._flops.stop()
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: not an optimizer step yet
        self._steps += trainer.global_step - self._last_step
        self._last_step = trainer.global_step
        if self._step_activations is not None:
            self._peak_activations = max(self._peak_activations, self._step_activations)
        if self._is_log_step(trainer.global_step) and trainer.loggers:
            self._log(trainer)
        self._step_activations = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t0 is not None and not trainer.sanity_checking:
            self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe.stop()
        self._flops.stop()
        if self._t0 is None:
            return
        self.summary = self._summarize(trainer, pl_module)
        rank_zero_info(format_summary(self.summary))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._probe.stop()
        self._flops.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._probe.stop()
        self._flops.stop()

    # ------------------------------------------------------------------ measuring

    def _is_log_step(self, step: int) -> bool:
        return self._every > 0 and step % self._every == 0

    def _counts_flops(self, trainer: pl.Trainer) -> bool:
        """Whether this batch's step counts FLOPs: a logging step (with a logger), not the first (one-time work such
        as the planner's measuring), at least :data:`FLOP_COUNT_EVERY` steps after the last count."""
        step = trainer.global_step + 1
        return (bool(trainer.loggers) and step > 1 and self._is_log_step(step)
                and (self._flops_counted_at is None or step - self._flops_counted_at >= FLOP_COUNT_EVERY))

    def _batch_size(self, batch: Any) -> Count:
        if self.batch_size_fn is not None:
            return self.batch_size_fn(batch)
        try:
            return extract_batch_size(batch)
        except Exception as err:
            raise ValueError(
                "MemoryMonitor could not find the batch size: the batch holds no tensor. Pass"
                " `MemoryMonitor(batch_size_fn=lambda batch: ...)`."
            ) from err

    def _counts_tokens(self, batch: Any) -> bool:
        if self._has_tokens is None:
            self._has_tokens = self.length_fn is not None or tokens_in_batch(batch) is not None
        return self._has_tokens

    def _batch_tokens(self, batch: Any) -> Count:
        if self.length_fn is not None:
            return self.length_fn(batch)
        return tokens_in_batch(batch) or 0

    def _record_activations(self) -> None:
        counted = self._probe.stop()
        if counted is not None:
            self._step_activations = max(self._step_activations or (0, 0), counted)

    def _local_values(self, trainer: pl.Trainer) -> dict[str, float]:
        """This rank's figures since the last log. Synchronises the device (only called on logging steps)."""
        device = trainer.strategy.root_device
        _synchronize(device)
        samples, tokens = int(self._samples), int(self._tokens)
        self._throughput.update(
            time=self._elapsed(), batches=self._steps, samples=samples, lengths=tokens if self._has_tokens else None
        )
        rates = self._throughput.compute()
        values = {key: math.nan for key in _KEYS}
        peaks = device_peak_bytes(device)
        if peaks is not None:
            values[PEAK_ALLOCATED], values[PEAK_RESERVED] = peaks[0] / GIB, peaks[1] / GIB
            self._peak_device = max(self._peak_device, peaks)
            reset_device_peaks(device)
        rss = host_rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        values[HOST_RSS] = rss / GIB
        if self._step_activations is not None:
            values[ACTIVATIONS] = self._step_activations[0] / GIB
            values[ACTIVATIONS_OFFLOADED] = self._step_activations[1] / GIB
        values[SAMPLES_PER_SEC] = rates["device/samples_per_sec"]
        if "device/items_per_sec" in rates:
            values[TOKENS_PER_SEC] = rates["device/items_per_sec"]
        values[STEP_SEC] = 1.0 / rates["device/batches_per_sec"]
        share = self._flops.take()
        if share is not None:
            self._recompute_share, self._flops_counted_at = share, trainer.global_step
        if self._recompute_share is not None:
            values[RECOMPUTE_FLOPS_SHARE] = self._recompute_share
        return values

    def _log(self, trainer: pl.Trainer) -> None:
        self.local_metrics = {k: v for k, v in self._local_values(trainer).items() if not math.isnan(v)}
        local = torch.tensor([self.local_metrics.get(k, math.nan) for k in _KEYS], dtype=torch.float64)
        self.metrics = _reduce_over_ranks(trainer, local)
        step = trainer.global_step - 1  # the index Lightning logs `self.log` values of this step under
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics, step=step)

    def _summarize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        device = trainer.strategy.root_device
        _synchronize(device)
        elapsed = self._elapsed()
        peaks = device_peak_bytes(device)
        if peaks is not None:
            self._peak_device = max(self._peak_device, peaks)
        local = {
            "peak_allocated_bytes": float(self._peak_device[0]) if peaks is not None else math.nan,
            "peak_reserved_bytes": float(self._peak_device[1]) if peaks is not None else math.nan,
            "peak_host_rss_bytes": float(max(self._peak_rss, host_peak_rss_bytes())),
            "activation_bytes": float(self._peak_activations[0]),
            "offloaded_activation_bytes": float(self._peak_activations[1]),
            "parameter_bytes": float(tensor_bytes(pl_module.parameters())),
            "gradient_bytes": float(self._gradient_bytes or 0),
            "optimizer_state_bytes": float(optimizer_state_bytes(trainer.optimizers)),
            "samples_per_sec": int(self._samples) / elapsed if elapsed > 0 else math.nan,
            "tokens_per_sec": int(self._tokens) / elapsed if elapsed > 0 and self._has_tokens else math.nan,
        }
        gathered = _gather(trainer, torch.tensor(list(local.values()), dtype=torch.float64))
        summary: dict[str, Any] = {"steps": self._steps, "world_size": gathered.shape[0], "device": device.type}
        for i, key in enumerate(local):
            column = gathered[:, i]
            if torch.isnan(column).any():
                summary[key] = None
            elif key.endswith("_per_sec"):
                summary[key] = float(column.sum())
            else:
                summary[key] = float(column.max())
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_host_rss_bytes", "activation_bytes",
                    "offloaded_activation_bytes", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            if summary[key] is not None:
                summary[key] = int(summary[key])
        return summary


def _gather(trainer: pl.Trainer, local: torch.Tensor) -> torch.Tensor:
    """``[world_size, n]``: every rank's ``local`` vector (one collective)."""
    on_device = local.to(trainer.strategy.root_device)
    if on_device.device.type == "cpu" and torch.distributed.is_available() and torch.distributed.is_initialized():
        return all_gather_released(on_device).reshape(-1, local.numel())
    return trainer.strategy.all_gather(on_device).reshape(-1, local.numel()).cpu()


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


def _reduce_over_ranks(trainer: pl.Trainer, local: torch.Tensor) -> dict[str, float]:
    """Combine each rank's values per :data:`REDUCTIONS`; keys missing on any rank are left out."""
    gathered = _gather(trainer, local)
    metrics = {}
    for i, key in enumerate(_KEYS):
        column = gathered[:, i]
        if torch.isnan(column).any():
            continue
        metrics[key] = float(column.sum() if REDUCTIONS[key] == "sum" else column.max())
    return metrics


def _gib(num_bytes: Optional[float]) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / GIB:.3g} GiB"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-fit report of :class:`MemoryMonitor` as text.

    Example::

        >>> print(format_summary({"steps": 10, "world_size": 1, "device": "cpu", "peak_allocated_bytes": None,
        ...     "peak_reserved_bytes": None, "peak_host_rss_bytes": 2**30, "activation_bytes": 2**29,
        ...     "offloaded_activation_bytes": 0, "parameter_bytes": 2**20, "gradient_bytes": 2**20,
        ...     "optimizer_state_bytes": 2**21, "samples_per_sec": 100.0, "tokens_per_sec": None}).splitlines()[-1])
          Activations (0.5 GiB) are the largest part: checkpointing more layers (smaller `every_n_layers`) or `offload=True` shrinks them.
    """
    ranks = f", {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    lines = [f"MemoryMonitor summary ({summary['steps']} steps{ranks}):"]
    if summary["peak_allocated_bytes"] is not None:
        lines.append(f"  peak device memory: {_gib(summary['peak_allocated_bytes'])} allocated,"
                     f" {_gib(summary['peak_reserved_bytes'])} reserved; peak host RSS {_gib(summary['peak_host_rss_bytes'])}")
    else:
        lines.append(f"  peak device memory: n/a ({summary['device']} run); peak host RSS {_gib(summary['peak_host_rss_bytes'])}")
    offloaded = summary["offloaded_activation_bytes"]
    lines.append(f"  peak activations:   {_gib(summary['activation_bytes'])} held for backward"
                 + (f" (+ {_gib(offloaded)} offloaded to host memory)" if offloaded else ""))
    rate = summary["samples_per_sec"]
    tokens = summary.get("tokens_per_sec")
    lines.append(f"  throughput:         {rate:,.1f} samples/s" + (f", {tokens:,.0f} tokens/s" if tokens else "")
                 if rate is not None else "  throughput:         n/a")
    weights = summary["parameter_bytes"] + summary["gradient_bytes"] + summary["optimizer_state_bytes"]
    activations = summary["activation_bytes"]
    per = " per process" if summary["world_size"] > 1 else ""
    lines.append(f"  memory breakdown{per}: parameters {_gib(summary['parameter_bytes'])}, gradients"
                 f" {_gib(summary['gradient_bytes'])}, optimizer state {_gib(summary['optimizer_state_bytes'])},"
                 f" activations {_gib(activations)}")
    if weights >= activations:
        lines.append(
            f"  Parameters, gradients and optimizer state ({_gib(weights)}) outweigh activations ({_gib(activations)}):"
            " checkpointing cannot shrink them. Shard them across devices (FSDP, DeepSpeed ZeRO) or train fewer"
            " parameters (parameter-efficient tuning such as LoRA) instead."
        )
    else:
        lines.append(
            f"  Activations ({_gib(activations)}) are the largest part: checkpointing more layers (smaller"
            " `every_n_layers`) or `offload=True` shrinks them."
        )
    return "\n".join(lines)
