"""The memory budget, batch by batch: what :class:`~lightning_ckpt.callbacks.GradientCheckpointing` and
:class:`~lightning_ckpt.callbacks.fabric.FabricCheckpointing` do with a ``memory_budget``, in plain PyTorch.

A :class:`BudgetDriver` holds the plans per batch size (:class:`~lightning_ckpt.core.plan.budget_cycle.BudgetCycle`)
and runs their cycle around each training step, at the moments its caller's loop gives it:

- :meth:`BudgetDriver.begin_batch`, before the forward: the first time, the longest batch is planned on fake tensors
  (:mod:`~lightning_ckpt.core.measure.longest`); then the batch's size (the largest over ranks) is predicted from the
  costs fitted over the sizes measured, run under a plan that covers it, or measured (every matched layer fully
  checkpointed while a :class:`~lightning_ckpt.core.plan.planner.LayerCostRecorder` records its costs);
- :meth:`BudgetDriver.after_forward`, before the backward: the measurement ends, the ranks' costs are combined
  (their maximum: every rank solves the same plan), the plan is solved (``make_plan``; the LM head in chunks where it
  chooses them), and a predicted plan's held bytes are checked;
- :meth:`BudgetDriver.end_batch`, after the step: what a step with no backward left, ``"auto"``'s first plan (after the
  first optimizer step), and the plan applied for the next batch.

It learns about the other ranks through :class:`Ranks` (a Lightning or Fabric strategy is one), and says what it
planned through the callables it is given (``info``, ``warn``, ``report``), so that it imports no Lightning.

About 800 lines: one budget's cycle, whose steps (measure, combine, solve, check, the longest batch, the chunked head)
share the state of the batch in flight; cut apart, each would take that state as arguments and the callers would
have to call them in order. The arithmetic and the plans per size already live apart (``budget``, ``budget_cycle``).

Example::

    >>> from torch import nn
    >>> class Block(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return self.down(torch.relu(self.up(x)))
    >>> model = nn.Sequential(*[Block() for _ in range(3)])
    >>> driver = BudgetDriver(dict(BUDGET_DEFAULTS, memory_budget=0.8, max_length=0))
    >>> driver.apply(model)  # no plan yet: every layer fully checkpointed, for the measuring step
    ['0', '1', '2']
    >>> ranks = OneRank()  # one device; under DDP, the strategy (its all_gather combines the ranks' costs)
    >>> batch = torch.randn(32, 16, requires_grad=True)
    >>> driver.begin_batch(ranks, model, batch)  # a new size: measured
    >>> loss = model(batch).square().mean()
    >>> driver.after_forward(ranks, model, loss)  # the plan, solved before the backward
    >>> loss.backward()
    >>> driver.end_batch(ranks, model)
    >>> driver.plan is not None, driver.measured_steps
    (True, 1)
    >>> driver.end(model)
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Optional, Protocol, TypeVar

import psutil
import torch

from lightning_ckpt.core.checkpoint.chunked_loss import (
    DEFAULT_CHUNK_TOKENS,
    LossNotChunkable,
    chunk_causal_lm_loss,
    chunked_models,
    losses_kept_whole,
    unchunk_causal_lm_loss,
)
from lightning_ckpt.core.checkpoint.placement import fsdp2
from lightning_ckpt.core.checkpoint.tiling import apply_tiling, token_wise_modules
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.longest import batch_of_length, longest_length, measure_fake_step, sequence_length_of
from lightning_ckpt.core.measure.memory_stats import device_peak_bytes, device_total_bytes, reset_device_peaks
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, format_bytes
from lightning_ckpt.core.plan.budget import (
    AutoBudget,
    RankMeasurement,
    combine_costs,
    host_memory_share,
    offload_min_bytes,
    pack_costs,
    plan_summary,
    plan_table,
    static_bytes,
)
from lightning_ckpt.core.plan.budget_cycle import BatchSize, BudgetCycle, batch_size_of
from lightning_ckpt.core.plan.planner import (
    CheckpointPlan,
    ChunkedHead,
    HeadCount,
    LayerCostRecorder,
    chunk_sizes,
    head_and_loss_bytes,
    make_plan,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The settings a :class:`BudgetDriver` reads, at their defaults (those of
#: :class:`~lightning_ckpt.callbacks.GradientCheckpointing`).
BUDGET_DEFAULTS: Mapping[str, Any] = {
    "layer_cls": None, "every_n_layers": 1, "offload": False, "mode": "full", "memory_budget": None,
    "use_reentrant": False, "preserve_rng_state": True, "checkpoint_kwargs": None, "compress": None,
    "max_length": None, "chunk_loss": None, "tile_mlp": None, "tile_tokens": None, "tile_cls": None,
    "time_layers": True,
}

#: The chunk a measuring step runs the LM head in when the plan chooses it; smaller chunks (down to
#: :data:`~lightning_ckpt.core.plan.planner.MIN_CHUNK_TOKENS`) are priced from it on fake tensors of the head alone. A
#: budget that only smaller chunks reach is exceeded on measuring steps, by at most what they free (as offload's is).
MEASURED_CHUNK = DEFAULT_CHUNK_TOKENS
#: Chunks of more tokens than any batch has: the head and loss whole, through lm_loss.
ONE_CHUNK = 2**62

#: ``step() -> a context manager whose value computes the loss of a (fake) batch``, as the run computes it.
LongestStep = Callable[[], ContextManager[Callable[[Any], torch.Tensor]]]


class Ranks(Protocol):
    """What the driver needs from the ranks of a run (a Lightning or a Fabric strategy answers it as it is).

    ``all_gather`` stacks every rank's tensor (a new first dimension, one row per rank; the tensor itself on one
    device); ``broadcast`` returns rank ``src``'s object on every rank.
    """

    @property
    def root_device(self) -> torch.device: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...


class OneRank:
    """:class:`Ranks` of a run on one device (the CPU by default): nothing to gather or broadcast.

    Example::

        >>> OneRank().all_gather(torch.tensor([1, 2])).tolist()
        [[1, 2]]
    """

    world_size = 1
    is_global_zero = True

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.root_device = device

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the only row."""
        return tensor.unsqueeze(0)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` itself."""
        return obj


# --------------------------------------------------------------------------------------------- over ranks


def _combine_over_ranks(ranks: Ranks, measured: RankMeasurement, figures: list[int]) -> tuple[RankMeasurement, list[int]]:
    """Every rank's costs and ``figures`` gathered and combined (:func:`~lightning_ckpt.core.plan.budget.combine_costs`)."""
    row = pack_costs(measured, figures, offload_min_bytes(ranks.root_device))
    local = torch.tensor(row, dtype=torch.int64, device=ranks.root_device)
    return combine_costs(ranks.all_gather(local).reshape(-1, local.numel()), measured)


def _all_ranks(ranks: Ranks, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one small all-gather; none on a single device)."""
    if ranks.world_size <= 1:
        return flag
    local = torch.tensor([int(flag)], dtype=torch.int64, device=ranks.root_device)
    return bool(ranks.all_gather(local).min())


def _largest_over_ranks(ranks: Ranks, size: BatchSize) -> BatchSize:
    """The largest tokens and length over all ranks (one small all-gather; none on a single device)."""
    if ranks.world_size <= 1:
        return size
    local = torch.tensor([size.tokens, size.length], dtype=torch.int64, device=ranks.root_device)
    largest = ranks.all_gather(local).reshape(-1, 2).amax(dim=0).tolist()
    return BatchSize(int(largest[0]), int(largest[1]))


def _measure_device(ranks: Ranks, num_devices: int) -> tuple[DeviceProfile, int]:
    """The accelerator's :class:`DeviceProfile` and the host memory offload may use on this rank, rank 0's on every
    rank (all ranks must solve the same plan): half of the host memory free now, shared by the node's devices."""
    if ranks.root_device.type == "cpu":
        raise ValueError(
            "`offload='auto'` weighs offload against recompute by the time each takes on the accelerator it"
            " measures, but this run is on the CPU, where nothing is offloaded. Pass offload=False on the CPU, or"
            " run on a GPU; to plan for a GPU from here, use `plan_checkpointing(..., offload='auto',"
            " device='h100-sxm')` or `lightning-ckpt plan --device NAME --offload auto`."
        )
    profile = DeviceProfile.measure(ranks.root_device)
    host_memory = host_memory_share(psutil.virtual_memory().available, num_devices)
    return ranks.broadcast((profile, host_memory), src=0)


# --------------------------------------------------------------------------------------------- the LM head's chunks


@dataclass
class _HeadRun:
    """A step measured (``measured``) with its LM heads (counted by ``count``) through lm_loss in chunks of ``chunk``
    tokens."""

    measured: RankMeasurement
    count: HeadCount
    chunk: int

    @property
    def tokens(self) -> int:
        """Each head's share of the tokens."""
        return self.count.tokens // len(self.count.heads)

    @functools.cached_property
    def alone(self) -> list[tuple[int, int]]:
        """Each head and loss alone as the step ran them: saved and backward-peak bytes on fake tensors
        (:func:`~lightning_ckpt.core.plan.planner.head_and_loss_bytes`), once, when another chunk is priced."""
        return [head_and_loss_bytes(head, self.tokens, self.chunk, self.count.dtypes) for head in self.count.heads]


def _rechunked(run: _HeadRun, chunk: Optional[int]) -> RankMeasurement:
    """The step of ``run`` as it would have been with the LM heads in chunks of ``chunk`` tokens (``None``: whole):
    its bytes, plus what the head and loss alone hold more that way (on fake tensors, per head over its share of the
    tokens). Two chunk sizes of at least every token are one chunk alike."""
    if chunk is not None and min(chunk, run.tokens) == min(run.chunk, run.tokens):
        return run.measured
    saved = peak = 0
    for head, (ran_saved, ran_peak) in zip(run.count.heads, run.alone):
        other_saved, other_peak = head_and_loss_bytes(head, run.tokens, chunk, run.count.dtypes)
        saved, peak = saved + other_saved - ran_saved, peak + other_peak - ran_peak
    measured = run.measured
    return replace(measured, outside_bytes=measured.outside_bytes + saved, head_bytes=measured.head_bytes + saved,
                   head_peak_bytes=max(0, measured.head_peak_bytes + peak))


def _chunked_head(ranks: Ranks, run: _HeadRun, chunk: int) -> ChunkedHead:
    """The :class:`ChunkedHead` of the step of ``run`` with the LM heads in chunks of ``chunk`` tokens, combined over
    ranks."""
    mine, count = _rechunked(run, chunk), run.count
    calls = len(count.heads) * -(-run.tokens // chunk)
    head = count.chunked_head(chunk, 0, 0, mine.head_peak_bytes, calls=calls)
    both, figures = _combine_over_ranks(ranks, replace(mine, head_peak_bytes=head.head_peak_bytes),
                                        [0, head.flops, head.chunks, head.tokens])
    return ChunkedHead(chunk, both.outside_bytes, both.head_bytes, both.head_peak_bytes, *figures[1:])


def _sharded(module: torch.nn.Module) -> bool:
    """Whether any submodule of ``module`` is an FSDP2 unit (``fully_shard``)."""
    fsdp_module = getattr(fsdp2(), "FSDPModule", None)
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in module.modules())


# --------------------------------------------------------------------------------------------- the driver


def _log_info(message: str) -> None:
    log.info(message)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _log_report(line: str, table: str) -> None:
    log.info(line)
    log.debug(f"GradientCheckpointing plan:\n{table}")


class BudgetDriver:
    """The memory budget's plans per batch size, and their cycle around each training step (see the module).

    Args:
        settings: the options by name (:data:`BUDGET_DEFAULTS`' keys), read as they are each time: the caller may
            change them (then call :meth:`settings_changed` where the plans no longer hold).
        info: logs a line (on rank zero); ``warn``: warns (on rank zero).
        report: ``report(line, table)``: a new plan's one line and its whole table, called on rank zero only.
    """

    def __init__(self, settings: Mapping[str, Any], *, info: Callable[[str], None] = _log_info,
                 warn: Callable[[str], None] = _warn, report: Callable[[str, str], None] = _log_report) -> None:
        self.settings = settings
        self.info, self.warn, self.report = info, warn, report
        self.checkpointed_layers: list[str] = []
        self.cycle = BudgetCycle()  # the plans per batch size, and which one the module has
        self.measured: Optional[RankMeasurement] = None  # this rank's, until the plan is made
        self.auto: Optional[AutoBudget] = None  # "auto": the figures of the first plan, whose budget every size keeps
        self.device: Optional[tuple[DeviceProfile, int]] = None  # profile and host memory, for "auto"
        self.tiles_chosen = False  # tile_mlp=None: the longest batch is held only with tiles, so the run tiles
        self.measured_steps = 0  # training steps run as measuring steps
        self._recorder: Optional[LayerCostRecorder] = None
        self._check: Optional[SavedTensorCounter] = None  # a predicted plan's held bytes, this step
        self._longest_checked = False  # the longest batch planned for (or found unknown) before the first step
        self._fake_failed = False  # fake tensors could not run the step (said once)
        # chunk_loss=None: a model whose loss cannot be chunked (found on a fake step) keeps it whole; said once
        self._loss_whole: Optional[str] = None
        self._said_whole = False
        # chunk_loss=None with a budget: the measuring step runs the head chunked; the unchunked head and loss are
        # measured apart on fake tensors, and the plan chooses between them
        self._head_count: Optional[HeadCount] = None
        self._chunked: Optional[_HeadRun] = None  # this rank's step measured, its LM head counted: until the plan

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """The plan of the latest batch (``None`` while a new size is measured)."""
        return self.cycle.latest

    @property
    def longest_due(self) -> bool:
        """Whether the next :meth:`begin_batch` plans the longest batch (the first batch of a budget)."""
        return self.settings["memory_budget"] is not None and self.measured is None and not self._longest_checked

    # ------------------------------------------------------------------ set up, apply

    def prepare(self, ranks: Ranks, num_devices: int = 1, fit: bool = True) -> None:
        """Refuse ``"auto"`` on the CPU, and measure the accelerator once for ``"auto"`` (``num_devices``: the node's,
        which share its host memory)."""
        if self.settings["memory_budget"] == "auto" and ranks.root_device.type == "cpu":
            raise ValueError(
                "`memory_budget='auto'` plans for the accelerator's memory, but this run is on the CPU. Pass a"
                " fraction of the un-checkpointed activation memory (`memory_budget=0.5`) or bytes (`'2GiB'`)."
            )
        if fit and self.device is None and "auto" in (self.settings["memory_budget"], self.settings["offload"]):
            self.device = _measure_device(ranks, num_devices)

    def start(self) -> None:
        """The start of training: no step measured yet."""
        self.measured_steps = 0

    def apply(self, module: torch.nn.Module) -> list[str]:
        """Checkpoint the selected layers of ``module`` (idempotent) and record their names.

        With ``memory_budget``: the plan when there is one, else every matched layer fully checkpointed (the
        measuring step).
        """
        settings = self.settings
        options = {k: v for k, v in settings.items()
                   if k not in ("memory_budget", "every_n_layers", "mode", "max_length", "chunk_loss", "tile_mlp",
                                "tile_tokens", "tile_cls", "lean_layers", "time_layers")}
        chunk_loss = settings["chunk_loss"] is True
        tiles = self.tiles()
        if settings["memory_budget"] is None:
            names = apply_checkpointing(module, every_n_layers=settings["every_n_layers"], mode=settings["mode"],
                                        chunk_loss=chunk_loss, **options, **tiles)
        elif self.plan is not None:
            options.pop("layer_cls")
            options.pop("offload")  # the plan's own, which it was solved for
            options.pop("compress")
            names = self.plan.apply(module, **options)
            if chunk_loss and self.plan.chunk_tokens is None:
                chunk_causal_lm_loss(module)
            if tiles:  # after the plan, which re-wraps each layer whole
                apply_tiling(module, tiles["tile_cls"], tiles["tile_tokens"])
        else:  # measuring: every layer, full, compressed as asked (so it holds no more than the plans can), and the
            # head chunked when the plan may choose it (no more than the unchunked head holds)
            names = apply_checkpointing(module, **{**options, "offload": False}, chunk_loss=chunk_loss, **tiles)
            if self._chooses_chunks(module):
                chunk_causal_lm_loss(module, MEASURED_CHUNK)
        if names != self.checkpointed_layers and settings["memory_budget"] is None:
            # with a budget, the line each new plan logs says it (a switch between plans says nothing)
            shown = ", ".join(names) if len(names) <= 8 else ", ".join(names[:8]) + ", ..."
            self.info(f"GradientCheckpointing: checkpointing {len(names)} layers ({shown})")
        self.checkpointed_layers = names
        return names

    def tiles(self) -> dict[str, Any]:
        """The tiling options :func:`apply_checkpointing` gets: ``tile_mlp=True`` with its ``tile_tokens`` and
        ``tile_cls``, or none (``False``, and ``None``).

        ``None`` with a budget: tiles where the longest batch, planned before the first step, is held only with them
        (then for the whole run, every plan measured with them); else nothing.
        """
        if self.settings["tile_mlp"] is not True and not self.tiles_chosen:
            return {}
        return {"tile_mlp": True, "tile_tokens": self.settings["tile_tokens"], "tile_cls": self.settings["tile_cls"]}

    def _reapply(self, module: torch.nn.Module) -> None:
        """Checkpoint ``module`` as the latest plan says (fully, while a size is measured)."""
        remove_checkpointing(module)
        self.apply(module)
        self.cycle.applied = self.cycle.latest

    # ------------------------------------------------------------------ a training step

    def begin_batch(self, ranks: Ranks, module: torch.nn.Module, batch: Any,
                    length_fn: Optional[Callable[[Any], int]] = None, longest_step: Optional[LongestStep] = None) -> None:
        """Before the forward of ``batch``: the longest batch planned (the first time, with ``longest_step``), then
        this batch's size predicted, run under a plan that covers it, or measured (every rank alike)."""
        if self.settings["memory_budget"] is None or self.measured is not None:
            return  # no budget, or "auto" waits for the first optimizer step to make its first plan
        if not self._longest_checked:
            self._longest_checked = True
            if longest_step is not None:
                self.plan_longest(ranks, module, batch, longest_step, length_fn)
        # Every rank decides from the same size (the largest over ranks) and the same plans, so all of them enter
        # the measuring step's collectives together, or none does.
        size = _largest_over_ranks(ranks, batch_size_of(batch, length_fn))
        step = self.cycle.begin(size, predict=not self._first_auto())
        if step.predicted is not None:
            # Planned from the costs fitted over the sizes measured: no measuring step. The same on every rank (the
            # fit is of rows combined over ranks). A budget the conservative prediction cannot reach is measured.
            try:
                plan = self._solve(ranks, step.predicted)
            except ValueError:
                plan = None
            if plan is not None:
                self.cycle.planned(plan)
                self._report(ranks, plan, self.auto, size, predicted=True)
            else:
                self.cycle.abandon()
            step = self.cycle.begin(size, predict=False)
        if step.switch:
            self._reapply(module)
        if self.cycle.checking:
            # The cheap check of a predicted plan: the bytes this forward leaves held, counted once per storage.
            self._check = SavedTensorCounter(exclude=module.parameters())
            self._check.__enter__()
        if step.measure:
            # Every matched layer is fully checkpointed; measure it during this ordinary step.
            self.measured_steps += 1
            self._chunked = None
            if self._chooses_chunks(module):
                self._head_count = HeadCount(module).__enter__()
            elif self.settings["chunk_loss"] is None:  # sharded since `setup` chunked it: the model's own head
                unchunk_causal_lm_loss(module)
            layers = [(name, module.get_submodule(name)) for name in self.checkpointed_layers]
            if self._first_auto():
                reset_device_peaks(ranks.root_device)
            self._recorder = LayerCostRecorder(module, layers, selective=not self._reentrant(),
                                               time_layers=self.settings["time_layers"])
            self._recorder.__enter__()

    def after_forward(self, ranks: Ranks, module: torch.nn.Module, loss: torch.Tensor) -> None:
        """Before the backward of ``loss``: a predicted plan's check ends, and a measuring step's plan is made (an
        impossible budget fails before any weight has changed)."""
        self._end_check(ranks)
        if self._stop_measuring(loss) and not self._first_auto():
            self._make_plan(ranks, module)

    def end_batch(self, ranks: Ranks, module: torch.nn.Module, stepped: bool = True,
                  optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """After the step (``stepped``: an optimizer step ran since training started; ``optimizers``: their state is
        static memory for ``"auto"``): the plan made where not yet, and applied for the next batch."""
        self._stop_measuring()  # a step that returned no loss ran no backward
        self._end_check(ranks)
        # The first "auto" plan also needs the static memory, optimizer state included: it waits for the first
        # optimizer step.
        if self.measured is not None and (not self._first_auto() or stepped):
            self._make_plan(ranks, module, optimizers)
        if self.cycle.latest is not None and self.cycle.applied is not self.cycle.latest:
            self._reapply(module)  # the plan just made, for the next batch of this size

    def _end_check(self, ranks: Ranks) -> None:
        """End the held-bytes check of a predicted plan (on its first step, at the size it was predicted for): held
        more than its ``planned_bytes`` (on any rank: every rank learns it, so all decide alike) and the bucket is
        measured on its next batch; held no more and the plan's later steps are not checked."""
        check, self._check = self._check, None
        if check is None:
            return
        check.__exit__(None, None, None)
        plan, size = self.cycle.applied, self.cycle.current
        assert plan is not None and size is not None
        held_as_planned = check.bytes + check.offloaded_bytes <= plan.planned_bytes + plan.planned_host_bytes
        if _all_ranks(ranks, held_as_planned):
            self.cycle.check_passed(size)
        else:
            self.cycle.check_failed(size)
            self.info(f"GradientCheckpointing: a batch of {size} held more than its predicted plan"
                      f" ({format_bytes(check.bytes)} > {format_bytes(plan.planned_bytes)} planned); its size"
                      " is measured on its next batch.")

    def _stop_measuring(self, loss: Optional[torch.Tensor] = None) -> bool:
        """Leave the measuring hooks (if measuring; the head's backward measured from ``loss``, when given); ``True``
        when this ended a measurement."""
        recorder, self._recorder = self._recorder, None
        count, self._head_count = self._head_count, None
        if count is not None:
            count.__exit__(None, None, None)
        if recorder is None:
            return False
        if loss is not None:
            recorder.measure_head(loss)
        recorder.__exit__(None, None, None)
        costs = recorder.costs()
        measured = RankMeasurement.from_held_bytes(costs, recorder.held_bytes, recorder.head_bytes,
                                                   recorder.head_peak_bytes, self.settings["compress"])
        held_all = recorder.held_bytes >= measured.layer_bytes
        if not held_all:
            self.warn("GradientCheckpointing: the bytes held outside the checkpointed layers could not be measured"
                      " (other saved-tensor hooks were entered after this callback's); the plan counts them as 0."
                      " Put GradientCheckpointing after such callbacks in `callbacks`.")
        self._take(measured, count if held_all else None, MEASURED_CHUNK)
        return True

    def _take(self, measured: RankMeasurement, count: Optional[HeadCount], ran: int) -> None:
        """Keep ``measured`` for the next plan. Where the plan chooses the LM head's chunks (``count`` saw the head
        run through lm_loss, in chunks of ``ran`` tokens: a step that computes its loss itself is not changed by
        chunking the model's), each chunk and the unchunked head are priced from it."""
        self.measured = measured
        if count is not None and count.calls:
            self._chunked = _HeadRun(measured, count, ran)
            self.measured = _rechunked(self._chunked, None)

    # ------------------------------------------------------------------ solving

    def _make_plan(self, ranks: Ranks, module: Optional[torch.nn.Module],
                   optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        assert self.measured is not None
        budget: object = self.settings["memory_budget"]
        auto: Optional[AutoBudget] = None
        measured = self.measured
        if budget == "auto" and self.auto is not None:
            auto = self.auto
            budget = auto.budget_bytes
            measured, _ = _combine_over_ranks(ranks, measured, [])
        elif budget == "auto":
            device = ranks.root_device
            static = static_bytes(module, optimizers)  # type: ignore[arg-type]
            peak = (device_peak_bytes(device) or (0, 0))[0]
            mine = AutoBudget.from_step(int(device_total_bytes(device)), static, peak, measured.peak_bytes)
            figures = [mine.device_bytes, mine.static_bytes, mine.other_peak_bytes]
            measured, figures = _combine_over_ranks(ranks, measured, figures)
            auto = self.auto = AutoBudget(*figures)
            budget = auto.budget_bytes
        else:
            measured, _ = _combine_over_ranks(ranks, measured, [])
        if self._chooses_chunks(module) and not _all_ranks(ranks, self._chunked is not None):
            self._chunked = None  # a rank whose outside bytes were not measured: no choice, and no unmatched gather
        source, size = self._chunked, self.cycle.measuring
        self.measured = self._chunked = None
        # The head whole first: a plan that checkpoints nothing so is the cheapest there is (a chunked head only adds
        # its forward again). Else chunks of 1024, halved while the budget is missed (as `plan_checkpointing` does),
        # each against the whole head; every rank tries the same (combined over ranks), so all of them solve alike.
        plan: Optional[CheckpointPlan] = None
        error: Optional[ValueError] = None
        for chunk in [None, *(chunk_sizes(DEFAULT_CHUNK_TOKENS) if source is not None else [])]:
            try:
                # An impossible budget raises here; the step's own full checkpointing is undone by `end`.
                plan = self._solve(ranks, measured, budget, None if chunk is None else _chunked_head(ranks, source, chunk))
            except ValueError as err:
                error = err
                continue
            if chunk is not None or plan.checkpoints_nothing:
                break
        if plan is None:
            raise ValueError(f"{error}\n  This was for a batch of {size} (the largest over ranks).") from None
        self.cycle.planned(plan, measured)
        self._report(ranks, plan, auto, size)

    def _solve(self, ranks: Ranks, measured: RankMeasurement, budget: object = None,
               chunked: Optional[ChunkedHead] = None) -> CheckpointPlan:
        """The plan for ``measured`` (combined over ranks) at ``budget`` (``None``: the byte budget, or "auto"'s);
        with ``chunked``, the cheaper of the LM head and loss unchunked (``measured``) or chunked."""
        if budget is None:
            budget = self.auto.budget_bytes if self.auto is not None else self.settings["memory_budget"]
        modes = ("full",) if self._reentrant() else ("full", "selective")
        profile, host_memory = self.device if self.device is not None else (None, None)
        return make_plan(measured.costs, measured.outside_bytes, budget, modes, self.settings["offload"], profile,
                         host_memory=host_memory, min_bytes=offload_min_bytes(ranks.root_device),
                         head_bytes=measured.head_bytes, head_peak_bytes=measured.head_peak_bytes,
                         compress=self.settings["compress"], chunked=chunked)

    def _report(self, ranks: Ranks, plan: CheckpointPlan, auto: Optional[AutoBudget], size: Optional[BatchSize],
                predicted: bool = False) -> None:
        """A new plan's line and table to :attr:`report`, on rank zero."""
        if not ranks.is_global_zero:
            return
        shape = f"batches up to {size}{' (predicted from the sizes measured)' if predicted else ''}, " if size else ""
        line = f"GradientCheckpointing: {shape}{plan_summary(plan, self.settings['memory_budget'], auto)}"
        table = (f"Planned for batches up to {size}\n" if size is not None else "") + plan_table(plan, auto)
        self.report(line, table)

    def _chooses_chunks(self, module: Any) -> bool:
        """Whether the plans choose between the LM head and loss chunked and unchunked: ``chunk_loss=None`` with a
        byte or fraction budget, a model whose loss can be chunked, not sharded by FSDP2 (whose layers cannot run
        on fake tensors)."""
        if (self.settings["chunk_loss"] is not None or self.settings["memory_budget"] in (None, "auto")
                or _sharded(module)):
            return False
        whole = [*losses_kept_whole(module), *([self._loss_whole] if self._loss_whole else [])]
        if whole and not self._said_whole:  # a model whose loss cannot be chunked: None means whole, said once
            self._said_whole = True
            self.info(f"GradientCheckpointing: chunk_loss=None: {'; '.join(whole)}.")
        return self._loss_whole is None and bool(chunked_models(module))

    def _first_auto(self) -> bool:
        return self.settings["memory_budget"] == "auto" and self.auto is None

    def _reentrant(self) -> bool:
        kwargs = self.settings["checkpoint_kwargs"] or {}
        return bool(kwargs.get("use_reentrant", self.settings["use_reentrant"]))

    # ------------------------------------------------------------------ the longest batch, before the first step

    def plan_longest(self, ranks: Ranks, module: torch.nn.Module, batch: Any, longest_step: LongestStep,
                     length_fn: Optional[Callable[[Any], int]] = None) -> None:
        """Before the first step: plan for ``batch`` at the longest length (:mod:`~lightning_ckpt.core.measure.longest`),
        measured on fake tensors through ``longest_step``; an impossible budget raises here, before anything is
        trained."""
        if self._first_auto() or self.cycle.plans or self.settings["max_length"] == 0:
            return  # "auto" needs a real step's static memory first; a resumed run has its plans; 0 turns it off
        longest = longest_length(module, self.settings["max_length"])
        if longest is None:
            return
        # A first batch already that long needs no fake step: its own measuring step plans before its backward (and
        # tile_mlp=None then tiles nothing: tiles are chosen on the fake step). The ranks decide from the longest first
        # batch over them, so that all of them take the same path.
        length = sequence_length_of(batch)  # None: no token ids to make the longest batch from
        first = _largest_over_ranks(ranks, BatchSize(0, length or 0)).length
        shorter = length is not None and first < longest[0]
        if shorter and _sharded(module):
            self.warn("GradientCheckpointing: the longest batch is not planned before the first step under FSDP2"
                      " (its sharded layers gather their weights for real); the budget is checked on each batch"
                      " as it comes.")
            shorter = False
        if not shorter and length is None and self.settings["max_length"] is not None:
            self.warn("GradientCheckpointing: `max_length` needs token ids in the batch (a 2-D integer tensor,"
                      " batch x length); this batch has none, so the longest batch is not planned before the"
                      " first step.")
        fake = functools.partial(self._fake_measured, ranks, module, batch, longest_step=longest_step)
        found = fake(longest) if shorter else None
        # Every rank plans, or none does: the plan combines the ranks' costs.
        if not _all_ranks(ranks, found is not None):
            return
        assert found is not None
        found = self._tiled_if_needed(ranks, module, fake, longest, found)
        if longest[1] != "max_length" and not self._holds(ranks, *found):
            # The model's limit is only a hint (today's models take 32K-131K, beyond most data): not refused here.
            held = self._longest_held(ranks, fake, first, longest[0])
            self.info(f"GradientCheckpointing: the budget does not hold a batch at the model's longest length"
                      f" ({longest[0]}, from {longest[1]}); at this batch size it holds up to length {held}"
                      " (planned before the first step on fake tensors, through your training_step). A longer"
                      " batch will stop the run; pass `max_length=` your data's longest length to plan for it"
                      " instead.")
            return
        size = _largest_over_ranks(ranks, batch_size_of(batch_of_length(batch, longest[0]), length_fn))
        self.cycle.begin(size, predict=False)
        self._take(*found, ONE_CHUNK)
        try:
            self._make_plan(ranks, module)
        except ValueError as err:
            raise ValueError(f"{err}\n  Planned before the first step for the longest sequences the run may see:"
                             f" length {longest[0]}, from {longest[1]}. Nothing was trained. If the data is never"
                             " that long, pass `max_length=` its longest length.") from None
        self.info(f"GradientCheckpointing: the budget holds the longest batch, {size}: planned before the first"
                  f" step for length {longest[0]} (from {longest[1]}) on fake tensors, through your"
                  " training_step.")

    def _tiled_if_needed(self, ranks: Ranks, module: torch.nn.Module, fake: Callable[..., Any],
                         longest: tuple[int, str], found: tuple[RankMeasurement, Optional[HeadCount]]
                         ) -> tuple[RankMeasurement, Optional[HeadCount]]:
        """With ``tile_mlp=None`` and a ``max_length`` (a promise; the model's own limit is only a hint, for which
        the run is not slowed): where no plan holds the longest batch but one with the layers' MLPs over tiles of
        tokens does (measured again on fake tensors), the run tiles from here on and ``found`` becomes the tiled
        measurement. Every rank decides alike (the costs are combined over ranks)."""
        if (self.settings["tile_mlp"] is not None or longest[1] != "max_length" or self._holds(ranks, *found)
                or not token_wise_modules(module, self.settings["tile_cls"])):
            return found
        self.tiles_chosen = True
        tiled = fake(longest)
        if _all_ranks(ranks, tiled is not None) and self._holds(ranks, *tiled):
            self.info(f"GradientCheckpointing: the budget holds the longest batch (length {longest[0]}) only with"
                      " each layer's MLP over tiles of tokens (tile_mlp=None lets the plan choose): tiling them"
                      " for the run.")
            return tiled  # type: ignore[no-any-return]
        self.tiles_chosen = False
        remove_checkpointing(module)  # untiled again (`apply` adds tiles, it never takes them off)
        self.apply(module)
        return found

    def _fake_measured(self, ranks: Ranks, module: torch.nn.Module, batch: Any, longest: tuple[int, str], *,
                       longest_step: LongestStep) -> Optional[tuple[RankMeasurement, Optional[HeadCount]]]:
        """One fully checkpointed step of ``batch`` at length ``longest[0]`` on fake tensors: its costs, and the LM
        head's calls where the plan chooses its chunks; ``None`` (said once) where fake tensors cannot run it."""
        resized = batch_of_length(batch, longest[0])
        modes = ("full",) if self._reentrant() else ("full", "selective")
        chooses = self._chooses_chunks(module)
        remove_checkpointing(module)
        tiles = self.tiles()
        again = False
        try:
            if tiles:  # measured as the run computes it
                apply_tiling(module, tiles["tile_cls"], tiles["tile_tokens"])
            # The head as the run computes it: chunked with chunk_loss=True. Where the plan chooses, through
            # lm_loss in one chunk (fake tensors hold nothing): whole, and seen to reach lm_loss at all; its chunks
            # are priced apart.
            if self.settings["chunk_loss"] is True:
                chunk_causal_lm_loss(module)
            elif chooses:
                chunk_causal_lm_loss(module, ONE_CHUNK)
            with longest_step() as step, HeadCount(module) as count:
                found = measure_fake_step(module, step, resized, self.settings["layer_cls"], modes)
            return (RankMeasurement(found.costs, found.outside_bytes, found.head_bytes, found.head_peak_bytes,
                                    self.settings["compress"]), count if chooses else None)
        except LossNotChunkable as err:
            if not chooses:  # chunk_loss=True: the first step would stop on it; said before anything is trained
                raise
            # chunk_loss=None: this model's loss stays whole (said once), and the step is measured again so
            self._loss_whole = (f"{err.model}'s loss stays whole: its forward changes the logits between the LM head"
                                " and the loss, which a head run in chunks cannot reproduce")
            again = True
        except Exception as err:  # noqa: BLE001 - whatever fake tensors cannot run: carry on as without a length
            if not self._fake_failed:
                self._fake_failed = True
                self.warn(f"GradientCheckpointing: could not measure the longest batch (length {longest[0]}, from"
                          f" {longest[1]}) on fake tensors before the first step ({type(err).__name__}: {err});"
                          " the budget is checked on each batch as it comes.")
            return None
        finally:
            self.apply(module)
        return self._fake_measured(ranks, module, batch, longest, longest_step=longest_step) if again else None

    def _holds(self, ranks: Ranks, measured: RankMeasurement, count: Optional[HeadCount]) -> bool:
        """Whether some plan holds ``measured`` (combined over ranks, so every rank answers alike) within the
        budget: with the LM head whole, or in any of the chunks the plan may choose."""
        run = _HeadRun(measured, count, ONE_CHUNK) if count is not None and count.calls else None
        combined, _ = _combine_over_ranks(ranks, measured if run is None else _rechunked(run, None), [])
        for chunk in [None, *(chunk_sizes(DEFAULT_CHUNK_TOKENS) if run is not None else [])]:
            try:
                self._solve(ranks, combined, None, None if chunk is None or run is None else _chunked_head(ranks, run, chunk))
                return True
            except ValueError:
                continue
        return False

    def _longest_held(self, ranks: Ranks, fake: Callable[..., Any], shortest: int, longest: int) -> int:
        """The longest length the budget holds at the batch's size, to ``longest / 64``: bisected between 0 and
        ``longest`` (which it does not hold) with fake steps, every rank alike; 0 when none is held or fake tensors
        stop running. ``shortest`` (the first batch's length, measured anyway) is tried first."""
        held, missed, probe = 0, longest, max(shortest, 1)
        while missed - held > max(1, longest // 64):
            found = fake((probe, "a search for the longest length held"))
            if not _all_ranks(ranks, found is not None):
                break
            assert found is not None
            if self._holds(ranks, *found):
                held = probe
            else:
                missed = probe
            probe = (held + missed) // 2
        return held

    # ------------------------------------------------------------------ end, state

    def end(self, module: Optional[torch.nn.Module] = None) -> None:
        """Leave every hook and forget the step in progress (the plans are kept); with ``module``, its
        checkpointing removed."""
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._head_count is not None:
            self._head_count.__exit__(None, None, None)
            self._head_count = None
        self._chunked = None
        if self._check is not None:
            self._check.__exit__(None, None, None)
            self._check = None
        self.measured = None
        self._longest_checked = False
        self.cycle.abandon()
        if module is not None:
            remove_checkpointing(module)

    def settings_changed(self) -> None:
        """The plans were solved for other settings: drop them (the next batch is measured)."""
        self.cycle.clear()
        self.auto = None

    def state_dict(self) -> dict[str, Any]:
        """The plans (``plan``: the latest; ``plans``: per size, with the fit), ``"auto"``'s figures and the tiles
        chosen, where there are any."""
        state: dict[str, Any] = {}
        if self.plan is not None:
            state["plan"] = self.plan.state_dict()
        if self.cycle.plans:
            state["plans"] = self.cycle.state_dict()
        if self.auto is not None:
            state["auto_budget"] = [self.auto.device_bytes, self.auto.static_bytes, self.auto.other_peak_bytes]
        if self.tiles_chosen:
            state["tiles_chosen"] = True
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s plans per size (a state with only ``plan`` does not say which sizes it holds
        for: nothing is restored, every size is measured anew)."""
        plans = state_dict.get("plans")
        if plans is None:
            return
        self.cycle.load_state_dict(plans)
        self.tiles_chosen = bool(state_dict.get("tiles_chosen"))  # the plans were measured with tiles
        if "auto_budget" in state_dict:
            self.auto = AutoBudget(*state_dict["auto_budget"])
        self.measured = None
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None


__all__ = ["BUDGET_DEFAULTS", "MEASURED_CHUNK", "ONE_CHUNK", "BudgetDriver", "LongestStep", "OneRank", "Ranks"]
