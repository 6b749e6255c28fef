"""FabricCheckpointing: the callbacks' checkpointing, memory budget and monitor in a Lightning Fabric loop.

Fabric has no Trainer to call hooks, so this class drives the memory budget itself: the very
:class:`~lightning_ckpt.core.plan.budget_driver.BudgetDriver` the :class:`GradientCheckpointing` callback drives (its
settings, plans and state held by one such callback), at the same moments of the loop, with the Fabric's strategy as
its ranks. There is no second copy of the budget cycle, the planner, the rank agreement or the probes. The
:class:`MemoryMonitor`, a Lightning callback, reads the step and the loggers through a small view of the Fabric.

Example::

    fabric = Fabric(accelerator="cpu", devices=1)
    ckpt = FabricCheckpointing(fabric, memory_budget="2MiB", monitor=True)
    model, optimizer = ckpt.setup(model, torch.optim.AdamW(model.parameters()))  # checkpoints, then fabric.setup
    for batch in loader:
        with ckpt.step(batch):                 # the budget cycle: measure a new size, or apply its plan
            loss = loss_of(model, batch)
            ckpt.backward(loss)                # fabric.backward, with the plan made before it
        optimizer.step()
        optimizer.zero_grad()
    ckpt.teardown()                            # the monitor's summary; checkpointing removed
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional, Union

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing, _send_plan_table
from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor
from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement
from lightning_ckpt.core.plan.budget_driver import BudgetDriver
from lightning_ckpt.core.plan.planner import CheckpointPlan

#: ``loss_fn(module, batch) -> loss``: the loss of a batch computed from the unwrapped module (used on fake tensors).
LossFn = Callable[[nn.Module, Any], torch.Tensor]


class FabricCheckpointing:
    r"""Activation checkpointing, a memory budget and the memory monitor for a Fabric training loop.

    Args:
        fabric: the (launched) :class:`~lightning.fabric.Fabric`.
        loss_fn: ``loss_fn(module, batch) -> loss``, the loss of a batch from the model before Fabric wrapped it.
            Only needed with ``memory_budget`` and a longest length (``max_length``, or the model's ``block_size``):
            the batch at that length is then measured on fake tensors before the first step, so that an impossible
            budget is refused before anything is trained. Without it the budget is checked on each batch as it comes.
        monitor: ``True`` or a :class:`MemoryMonitor`: its figures (``memory/*``, ``throughput/*``,
            ``time/step_sec``) are logged through ``fabric.log_dict`` every ``log_every_n_steps`` steps (default 50),
            and its summary is printed by :meth:`teardown`.
        **options: :class:`GradientCheckpointing`'s (``layer_cls``, ``every_n_layers``, ``offload``, ``mode``,
            ``memory_budget``, ``compress``, ``length_fn``, ``max_length``, ``chunk_loss``, ``tile_mlp``,
            ``tile_tokens``, ``tile_cls``, ``lean_layers``, ...), with the same meaning.

    The loop: :meth:`setup` checkpoints the model and sets it up with Fabric (or checkpoints a model Fabric already
    set up); each batch runs inside :meth:`step`, whose :meth:`backward` replaces ``fabric.backward``. One ``step``
    is one optimizer step (the monitor counts steps so; with gradient accumulation it counts micro-batches). An
    exception inside a ``step`` ends the checkpointing (the layers as they were), as an exception ends a Trainer's
    fit. With ``memory_budget`` the budget cycle of the callback runs per batch: a size not yet
    planned is measured (fully checkpointed), a plan is solved for it (combined over ranks under DDP and FSDP2, so
    every rank applies the same one), and batches it covers run under it. :meth:`state_dict` holds the plans:
    pass this object to ``fabric.save``/``fabric.load`` with the model and a resumed run does not measure those
    sizes again.

    A Fabric strategy that checkpoints on its own (``FSDPStrategy(activation_checkpointing_policy=...)``) or
    DeepSpeed is refused here; a layer that torch's ``CheckpointWrapper`` already wraps when :meth:`setup` runs is
    left to it (said in the log), and one wrapped by the strategy afterwards (a ``parallelize_fn`` that calls
    ``checkpoint_wrapper``) is refused by :meth:`setup`.

    Example::

        >>> from lightning.fabric import Fabric
        >>> from lightning_ckpt.demos import GPT
        >>> fabric = Fabric(accelerator="cpu", devices=1)
        >>> ckpt = FabricCheckpointing(fabric, every_n_layers=2)
        >>> model = ckpt.setup(GPT(vocab_size=32, block_size=8, n_layer=4, n_embd=16, n_head=2))
        >>> ckpt.checkpointed_layers
        ['model.blocks.0', 'model.blocks.2']
        >>> ckpt.teardown()
    """

    def __init__(self, fabric: Fabric, *, loss_fn: Optional[LossFn] = None,
                 monitor: Union[bool, MemoryMonitor, None] = None, **options: Any) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be a function `loss_fn(module, batch) -> loss`, got {loss_fn!r}.")
        if not isinstance(monitor, (bool, MemoryMonitor, type(None))):
            raise TypeError(f"`monitor` must be True, False or a MemoryMonitor, got {monitor!r}.")
        check_fabric_strategy(fabric.strategy)
        self.fabric = fabric
        #: The :class:`GradientCheckpointing` whose settings, plans and state this loop uses (never a Trainer's).
        self.callback = GradientCheckpointing(**options)
        #: The :class:`~lightning_ckpt.core.plan.budget_driver.BudgetDriver` that runs the budget, the callback's.
        self.driver: BudgetDriver = self.callback.driver
        self.driver.report = self._report_plan
        #: The :class:`MemoryMonitor` whose figures are logged, or ``None``.
        self.monitor: Optional[MemoryMonitor] = MemoryMonitor() if monitor is True else (monitor or None)
        self._loss_fn = loss_fn
        self._view = _MonitorView(self) if self.monitor is not None else None
        self._module: Optional[nn.Module] = None
        self._batch_idx = 0
        self._global_step = 0
        self._start_step = 0
        self._optimizers: list[torch.optim.Optimizer] = []

    # ------------------------------------------------------------------ what it decided

    @property
    def checkpointed_layers(self) -> list[str]:
        """The checkpointed layers' names, relative to the model given to :meth:`setup` (before Fabric wrapped it)."""
        return list(self.callback.checkpointed_layers)

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """With ``memory_budget``: the plan of the latest batch (``None`` while a new size is measured)."""
        return self.callback.plan

    @property
    def plans(self) -> dict[int, CheckpointPlan]:
        """With ``memory_budget``: each batch-size bucket (its tokens rounded up to a power of two: a batch of 4 x 100
        tokens is in bucket 512) and its plan (see :attr:`GradientCheckpointing.plans`)."""
        return self.callback.plans

    @property
    def measured_steps(self) -> int:
        """With ``memory_budget``: the steps that ran fully checkpointed to measure a size no plan covered
        (:attr:`GradientCheckpointing.measured_steps`)."""
        return self.callback.measured_steps

    @property
    def global_step(self) -> int:
        """The steps run through :meth:`step` (restored by :meth:`load_state_dict`)."""
        return self._global_step

    # ------------------------------------------------------------------ the loop

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer, **setup_kwargs: Any) -> Any:
        """Checkpoint ``model``'s layers, then ``fabric.setup(model, *optimizers, **setup_kwargs)``; returns what that
        returns. A model Fabric already set up is checkpointed in place and returned as it is (with ``optimizers``).

        Layers are checkpointed before the strategy wraps or shards them, so that under FSDP2 checkpointing sits
        inside each layer's unit (no extra all-gather); afterwards, a layer checkpointed twice (by this and by torch's
        ``CheckpointWrapper``) is refused.
        """
        if self._module is not None:
            raise RuntimeError("FabricCheckpointing.setup was already called; use one FabricCheckpointing per model.")
        set_up = isinstance(model, _FabricModule)
        module = model.module if set_up else model
        strategy = self.fabric.strategy
        self.driver.prepare(strategy, len(getattr(strategy, "parallel_devices", None) or [None]))
        self.callback._attach(module)
        self._module = module
        if set_up:
            result: Any = (model, *optimizers) if optimizers else model
        else:
            result = self.fabric.setup(model, *optimizers, **setup_kwargs)
        self._track(optimizers)
        # After the strategy wrapped or sharded the model: a layer checkpointed twice (a `parallelize_fn` that wraps
        # it in torch's CheckpointWrapper) is refused, as the callback does under the Trainer.
        check_checkpointing_placement(module)
        self._start_step = self._global_step
        self.driver.start()
        if self.monitor is not None:
            self.monitor.on_train_start(self._view, module)  # type: ignore[arg-type]
        return result

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """``fabric.setup_optimizers``, remembering the optimizers (whose state ``memory_budget="auto"`` and the
        monitor's summary count); for strategies that set up the model alone first (``ModelParallelStrategy``)."""
        result = self.fabric.setup_optimizers(*optimizers)
        self._track(optimizers)
        return result

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[FabricCheckpointing]:
        """Run one training step on ``batch`` inside: the budget cycle before the forward (measure a new size, or
        apply the plan that covers it; every rank alike), and after it, the plan made from a measurement.

        Example::

            with ckpt.step(batch):
                loss = model(batch).loss
                ckpt.backward(loss)
        """
        module = self._module
        if module is None:
            raise RuntimeError("Call `FabricCheckpointing.setup(model)` before the first `step`.")
        view, idx, strategy = self._view, self._batch_idx, self.fabric.strategy
        try:
            if self._loss_fn is None and self.driver.longest_due and self.callback.max_length:
                # given, and not 0 (which turns the longest batch off)
                rank_zero_warn("FabricCheckpointing: `max_length` needs `loss_fn=` to measure the longest batch before"
                               " the first step; without it the budget is checked on each batch as it comes.")
            self.driver.begin_batch(strategy, module, batch, self.callback.length_fn,
                                    None if self._loss_fn is None else functools.partial(self._loss_step, module))
            if self.monitor is not None:
                self.monitor.on_train_batch_start(view, module, batch, idx)  # type: ignore[arg-type]
            yield self
            # Before the step counts: "auto" makes its first plan a step after the first optimizer step, as under the
            # Trainer, since only then the optimizer state it must leave room for exists.
            self.driver.end_batch(strategy, module, self._global_step > self._start_step, self._optimizers)
        except BaseException as err:
            self.callback._end()
            if self.monitor is not None:
                self.monitor.on_exception(view, module, err)  # type: ignore[arg-type]
            self._module = None
            raise
        self._global_step += 1
        self._batch_idx += 1
        if self.monitor is not None:
            self.monitor.on_before_optimizer_step(view, module, None)  # type: ignore[arg-type]
            self.monitor.on_train_batch_end(view, module, None, batch, idx)  # type: ignore[arg-type]

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss, ...)``, after what the callbacks do before a backward: a measuring step's plan is
        solved here (an impossible budget raises before any gradient), and the monitor counts the bytes held."""
        if self._module is not None:
            with _as_in_fabric_backward():  # a measuring step's own backward of the head: not the loop's
                self.driver.after_forward(self.fabric.strategy, self._module, loss)
            if self.monitor is not None:
                self.monitor.on_before_backward(self._view, self._module, loss)  # type: ignore[arg-type]
        self.fabric.backward(loss, *args, **kwargs)

    def teardown(self) -> None:
        """The end of training: the monitor's summary (``monitor.summary``, printed on rank zero), and the model's
        layers as they were before :meth:`setup`."""
        module, self._module = self._module, None
        if module is None:
            return
        if self.monitor is not None:
            self.monitor.on_train_end(self._view, module)  # type: ignore[arg-type]
            self.monitor.teardown(self._view, module, "fit")  # type: ignore[arg-type]
        self.callback._end()

    # ------------------------------------------------------------------ state, for fabric.save / fabric.load

    def state_dict(self) -> dict[str, Any]:
        """The callback's state (settings, plans per size) and the step count; ``fabric.save`` stores it."""
        return {"checkpointing": self.callback.state_dict(), "global_step": self._global_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the sizes it planned are not measured again."""
        self.callback.load_state_dict(state_dict["checkpointing"])
        self._global_step = self._start_step = int(state_dict.get("global_step", 0))

    def _track(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        self._optimizers.extend(o.optimizer if isinstance(o, _FabricOptimizer) else o for o in optimizers)

    @contextlib.contextmanager
    def _loss_step(self, module: nn.Module) -> Iterator[Callable[[Any], torch.Tensor]]:
        """The loss of a (fake) batch for the longest batch's plan: ``loss_fn`` under the Fabric's autocast."""
        loss_fn = self._loss_fn
        assert loss_fn is not None

        def step(fake_batch: Any) -> torch.Tensor:
            with self.fabric.autocast():
                return loss_fn(module, fake_batch)

        yield step

    def _report_plan(self, line: str, table: str) -> None:
        """A new plan's line to the log, its table to the first Fabric logger that takes text (else the log)."""
        rank_zero_info(line)
        _send_plan_table([_LogDict(self.fabric)] if self.fabric.loggers else [], table, self._global_step)


@contextlib.contextmanager
def _as_in_fabric_backward() -> Iterator[None]:
    """Inside, Fabric's hook on the model's outputs takes a backward for one run by ``fabric.backward``: a precision or
    strategy with a backward of its own (``bf16-mixed``, ``16-mixed``, FSDP) refuses any other. The measuring step
    computes the head's backward peak with ``torch.autograd.grad`` from the loss (no ``.grad`` touched, no scaling
    needed: it counts bytes) before the loop's ``fabric.backward``; that is not the loop calling ``loss.backward()``."""
    import lightning.fabric.wrappers as wrappers

    before = wrappers._in_fabric_backward
    wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        wrappers._in_fabric_backward = before


def check_fabric_strategy(strategy: Strategy) -> None:
    """Refuse Fabric strategies that would checkpoint as well (or that the package does not support).

    Example::

        >>> from lightning.fabric.strategies import DDPStrategy
        >>> check_fabric_strategy(DDPStrategy())  # no checkpointing of its own: fine
    """
    if isinstance(strategy, FSDPStrategy) and getattr(strategy, "_activation_checkpointing_kwargs", None):
        raise ValueError(
            "`FSDPStrategy(activation_checkpointing_policy=...)` and `FabricCheckpointing` would both checkpoint the"
            " model, recomputing layers twice. Remove `activation_checkpointing_policy` from the strategy (litgpt's"
            " scripts pass `activation_checkpointing_policy={Block}`), or do not use FabricCheckpointing."
        )
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "`FabricCheckpointing` does not support DeepSpeed: DeepSpeed checkpoints activations its own way. Use"
            " `deepspeed.checkpointing`, or shard with FSDP2 (`ModelParallelStrategy`) and keep FabricCheckpointing."
        )


class _MonitorView:
    """What :class:`MemoryMonitor` (a Lightning callback) reads from a Trainer, answered by a Fabric and the
    :class:`FabricCheckpointing` that runs it (its step, optimizers and checkpointing callback)."""

    log_every_n_steps = 50  # Lightning's default; MemoryMonitor(log_every_n_steps=...) overrides it
    sanity_checking = False

    def __init__(self, checkpointing: FabricCheckpointing) -> None:
        self.checkpointing = checkpointing
        self.fabric = checkpointing.fabric
        self.callbacks = [checkpointing.callback]

    @property
    def global_step(self) -> int:
        return self.checkpointing.global_step

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.checkpointing._optimizers

    @property
    def strategy(self) -> Strategy:
        return self.fabric.strategy

    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def num_devices(self) -> int:
        return len(getattr(self.fabric.strategy, "parallel_devices", None) or [None])

    @property
    def loggers(self) -> list[_LogDict]:
        return [_LogDict(self.fabric)] if self.fabric.loggers else []


class _LogDict:
    """A logger that sends metrics through ``fabric.log_dict`` (to every Fabric logger); ``experiment`` is the first
    logger's, for the plan table (TensorBoard's ``add_text``)."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric

    @property
    def experiment(self) -> Any:
        return getattr(self.fabric.logger, "experiment", None)

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self.fabric.log_dict(metrics, step=step)
