"""MemoryMonitor: what checkpointing bought (memory) and what it cost (time), through any Lightning logger.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing, MemoryMonitor

    trainer = Trainer(log_every_n_steps=50, callbacks=[GradientCheckpointing(every_n_layers=2), MemoryMonitor()])
    trainer.fit(model)  # logs memory/*, throughput/*, time/step_sec, compute/*; prints a summary at the end

The callback decides when to measure, gather and log; what it measures and computes (the probes, the reduction over
ranks, the memory breakdown) is in :mod:`lightning_ckpt.core.measure.memory_stats`, plain PyTorch.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_ckpt.callbacks.gradient_checkpointing import find_checkpointing_callback
from lightning_ckpt.core.measure.memory_stats import (
    ActivationProbe,
    FlopProbe,
    PeakProbe,
    all_gather_released,
    device_peak_bytes,
    format_summary,
    host_peak_rss_bytes,
    host_rss_bytes,
    interval_metrics,
    local_summary,
    main_tensor,
    metrics_vector,
    reduce_metrics,
    reduce_summary,
    reset_device_peaks,
    synchronize,
    tokens_in_batch,
)
from lightning_ckpt.core.measure.profiling import tensor_bytes

#: FLOPs are counted on a logging step at least this many optimizer steps after the last counted one.
FLOP_COUNT_EVERY = 100

Count = Union[int, torch.Tensor]


def _positive_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


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
    - ``memory/activation_peak_gib``: the step's activation peak, forward and backward (recomputes and activation
      gradients included, parameters' gradients not), the figure a ``memory_budget`` bounds. Counted by
      :class:`~lightning_ckpt.core.measure.memory_stats.PeakProbe`, a Python dispatch mode that slows the step it counts: on
      each batch larger (its main tensor's shape, padding included) than every earlier one, on the second optimizer step (the first
      runs a budget's measuring) and on the steps that count FLOPs (below); logging steps in between repeat the last
      count.
    - ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` (when ``length_fn`` is given or the batch's main
      tensor holds token ids ``[batch, seq]``), ``time/step_sec``: averages over the steps since the last log,
      validation excluded.
    - ``compute/recompute_flops_share``: the FLOPs that checkpointing recomputes over all FLOPs of the step's forward
      and backward (0 without checkpointing; optimizer step excluded), counted by
      :class:`~lightning_ckpt.core.measure.memory_stats.RecomputeCostMode` as the planner counts them. Counting puts every op through a Python dispatch mode, which slows that step (and runs a
      compiled model eagerly for it), so it runs on logging steps only, never the first step, and at most once every
      :data:`FLOP_COUNT_EVERY` optimizer steps; logging steps in between repeat the last count. No other step is
      touched.

    Under DDP/FSDP memory and step time are the maximum over ranks and rates the sum, gathered only on logging steps.
    The device is synchronised only on logging steps (and once at the end of fit). One step is one optimizer step, so
    with gradient accumulation the activations are the largest of the step's micro-batches.

    At the end of fit it prints (rank zero) peak memory, peak activations (the step's activation peak, which a
    ``memory_budget`` bounds and is compared with, and what the forward leaves held), samples/s and a breakdown into
    parameters, gradients, optimizer state and activations at their peak, saying so when checkpointing cannot help. Without a logger it only
    prints that summary. The last logged values are in ``metrics`` (this rank's, before reduction, in
    ``local_metrics``) and the summary in ``summary``.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` uses the trainer's ``log_every_n_steps``.
        batch_size_fn: samples in a batch; default: the length of the first tensor in the batch.
        length_fn: tokens (items) in a batch; default: ``batch * seq`` when the first tensor is a 2-D integer tensor.
            Both may return a Python int or a 0-dim tensor (tensors are only read on logging steps, so counting
            e.g. ``attention_mask.sum()`` does not synchronise the device every step).
        activation_steps: count ``memory/activations_gib`` only on the first this many optimizer steps; ``None``: on
            every logging step. The count's saved-tensor hook costs a Python call per tensor saved outside
            checkpointed layers, so a step without checkpointing pays more for it than one with: ``compare`` times
            its steps with the count off (``benchmarks/bench_monitor_hook.py``: every layer checkpointed on
            tiny.yaml measured +83% with it, +109% without).

    Example::

        trainer = Trainer(callbacks=[MemoryMonitor(length_fn=lambda batch: int(batch["attention_mask"].sum()))])
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        batch_size_fn: Optional[Callable[[Any], Count]] = None,
        length_fn: Optional[Callable[[Any], Count]] = None,
        activation_steps: Optional[int] = None,
    ) -> None:
        if not _positive_or_none(log_every_n_steps):
            raise ValueError(
                f"`log_every_n_steps` must be an int >= 1 or None (use the trainer's), got {log_every_n_steps!r}."
            )
        if not _positive_or_none(activation_steps):
            raise ValueError(
                f"`activation_steps` must be an int >= 1 or None (count on every logging step), got {activation_steps!r}."
            )
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a function of the batch returning an int, got {fn!r}.")
        self.log_every_n_steps = log_every_n_steps
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.activation_steps = activation_steps
        self.metrics: dict[str, float] = {}
        self.local_metrics: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self._probe = ActivationProbe()
        self._flops = FlopProbe()
        self._peak = PeakProbe()
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
        self._step_peak: Optional[int] = None  # this optimizer step's activation peak, when counted
        self._last_peak: Optional[int] = None  # the latest counted, repeated on logging steps in between
        self._most_peak: Optional[int] = None  # the largest counted, for the summary
        self._largest_batch = 0  # tokens (or samples) of the largest batch so far

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
        if (self._steps == 0 or self._is_log_step(trainer.global_step + 1)) and (
                self.activation_steps is None or self._steps < self.activation_steps):
            self._probe.start(pl_module.parameters())
        if self._counts_flops(trainer):
            self._flops.start()
        main = main_tensor(batch)  # its shape, padding included, is what memory grows with (and reading it never syncs)
        if (trainer.global_step + 1 == 2 or self._counts_flops(trainer)
                or self._largest_yet(main.numel() if main is not None else 0)):
            self._peak.start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._record_activations()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._flops.stop()  # forward and backward only
        self._record_peak(pl_module)
        if self._gradient_bytes is None:
            self._gradient_bytes = tensor_bytes(p.grad for p in pl_module.parameters())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._record_activations()  # when the step returned no loss, there was no backward
        self._flops.stop()
        self._record_peak(pl_module)
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: not an optimizer step yet
        self._steps += trainer.global_step - self._last_step
        self._last_step = trainer.global_step
        if self._step_activations is not None:
            self._peak_activations = max(self._peak_activations, self._step_activations)
        if self._step_peak is not None:
            self._last_peak = self._step_peak
            self._most_peak = max(self._most_peak or 0, self._step_peak)
        if self._is_log_step(trainer.global_step) and trainer.loggers:
            self._log(trainer)
        self._step_activations = self._step_peak = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t0 is not None and not trainer.sanity_checking:
            self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_probes()
        if self._t0 is None:
            return
        self.summary = self._summarize(trainer, pl_module)
        rank_zero_info(format_summary(self.summary))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_probes()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_probes()

    def _stop_probes(self) -> None:
        self._probe.stop()
        self._flops.stop()
        self._peak.stop()

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

    def _largest_yet(self, size: int) -> bool:
        """Whether a batch of ``size`` values in its main tensor is larger than every earlier one: its peak is
        counted."""
        larger, self._largest_batch = size > self._largest_batch, max(self._largest_batch, size)
        return larger

    def _record_peak(self, pl_module: pl.LightningModule) -> None:
        counted = self._peak.stop(pl_module.parameters())
        if counted is not None:  # with gradient accumulation, the largest micro-batch's
            self._step_peak = max(self._step_peak or 0, counted)

    def _record_activations(self) -> None:
        counted = self._probe.stop()
        if counted is not None:
            self._step_activations = max(self._step_activations or (0, 0), counted)

    def _local_values(self, trainer: pl.Trainer) -> dict[str, float]:
        """This rank's figures since the last log. Synchronises the device (only called on logging steps)."""
        device = trainer.strategy.root_device
        synchronize(device)
        samples, tokens = int(self._samples), int(self._tokens)
        self._throughput.update(
            time=self._elapsed(), batches=self._steps, samples=samples, lengths=tokens if self._has_tokens else None
        )
        rates = self._throughput.compute()
        peaks = device_peak_bytes(device)
        if peaks is not None:
            self._peak_device = max(self._peak_device, peaks)
            reset_device_peaks(device)
        rss = host_rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        share = self._flops.take()
        if share is not None:
            self._recompute_share, self._flops_counted_at = share, trainer.global_step
        return interval_metrics(
            host_rss=rss,
            samples_per_sec=rates["device/samples_per_sec"],
            batches_per_sec=rates["device/batches_per_sec"],
            tokens_per_sec=rates.get("device/items_per_sec"),
            device_peaks=peaks,
            activations=self._step_activations,
            recompute_share=self._recompute_share,
            activation_peak=self._last_peak,
        )

    def _log(self, trainer: pl.Trainer) -> None:
        self.local_metrics = self._local_values(trainer)
        self.metrics = reduce_metrics(_gather(trainer, metrics_vector(self.local_metrics)))
        step = trainer.global_step - 1  # the index Lightning logs `self.log` values of this step under
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics, step=step)

    def _summarize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        device = trainer.strategy.root_device
        synchronize(device)
        elapsed = self._elapsed()
        peaks = device_peak_bytes(device)
        if peaks is not None:
            self._peak_device = max(self._peak_device, peaks)
        local = local_summary(
            parameters=pl_module.parameters(),
            optimizers=trainer.optimizers,
            gradient_bytes=self._gradient_bytes,
            activations=self._peak_activations,
            activation_peak=self._most_peak,
            peak_host_rss=max(self._peak_rss, host_peak_rss_bytes()),
            peak_device=self._peak_device if peaks is not None else None,
            samples=int(self._samples),
            tokens=int(self._tokens) if self._has_tokens else None,
            elapsed=elapsed,
        )
        gathered = _gather(trainer, torch.tensor(list(local.values()), dtype=torch.float64))
        return {"steps": self._steps, "world_size": gathered.shape[0], "device": device.type,
                **reduce_summary(list(local), gathered), **_how_chosen(trainer)}


def _how_chosen(trainer: pl.Trainer) -> dict[str, Any]:
    """How the run chose its checkpointed layers, and the largest budget of its plans (``None``: no budget)."""
    callback = find_checkpointing_callback(trainer)
    if callback is None:
        return {"chooser": None, "budget_bytes": None}
    if callback.memory_budget is None:
        return {"chooser": "every_n_layers", "budget_bytes": None}
    budgets = [plan.budget_bytes for plan in callback.plans.values()]
    return {"chooser": "memory_budget", "budget_bytes": max(budgets) if budgets else None}


def _gather(trainer: pl.Trainer, local: torch.Tensor) -> torch.Tensor:
    """``[world_size, n]``: every rank's ``local`` vector (one collective)."""
    on_device = local.to(trainer.strategy.root_device)
    if on_device.device.type == "cpu" and torch.distributed.is_available() and torch.distributed.is_initialized():
        return all_gather_released(on_device).reshape(-1, local.numel())
    return trainer.strategy.all_gather(on_device).reshape(-1, local.numel()).cpu()
