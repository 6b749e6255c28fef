"""The memory-budget cycle over batches of different sizes: which plan a batch runs under, and when to measure.

A budget is a promise for every batch. Batches vary in size (dynamic padding, packing, a short first batch), and
a plan solved for a short batch holds far more than its budget on a long one. So plans are kept per size bucket
(:meth:`BatchSize.bucket`: the tokens rounded up to a power of two), each with the size it was measured at, and a
batch runs under a bucket's plan only when that size *covers* it (no more tokens and no longer sequences, so terms
that grow with the square of the length are covered too); a plan that checkpoints nothing covers the smaller batches
of every bucket (no plan is cheaper). Any other batch is predicted (below) or a measuring step: every matched layer
fully checkpointed (it holds no more than full checkpointing does) while its costs are recorded, and its plan,
solved for it, replaces the bucket's. A short batch so gets the cheaper plan its own size allows, and a long one
never runs under a plan made for a shorter one.

Measuring is rare: each measurement's costs (combined over ranks) are fitted over the batch shape
(:class:`~lightning_ckpt.core.measure.cost_fit.CostFit`: every cost as ``a + b * tokens + c * tokens * length``), and a
batch that no measured size covers is planned from the fit, with no measuring step, wherever the fit is trusted:
from :data:`~lightning_ckpt.core.measure.cost_fit.MIN_SIZES` (3) measured sizes on, when it reproduces them, for sizes inside
the measured range or at most :data:`~lightning_ckpt.core.measure.cost_fit.EXTRAPOLATION` (16) times past it in tokens and in
length. The prediction is conservative (every cost raised by 2%, never below a smaller measured size's, never above
a larger one's), and checked: the first step that runs a predicted plan counts the bytes its forward leaves held
(once per bucket and layout: a plan predicted for a larger size of a bucket whose check passed, checkpointing the
module alike, is not checked again), and where they exceed the plan's ``planned_bytes`` (:meth:`BudgetCycle.check_failed`) the bucket's plan is dropped and its next
batch is measured. So a run measures its first three sizes, then only a size more than 16 times past everything
measured, or one whose check failed: on long-tailed lengths (8..768, a lognormal, batch 4, 60 steps) at most 4
measuring steps, in any order (random, ascending or descending; ``tests/core/plan/test_budget_cycle.py``).

Each bucket is in one of three states (:class:`BucketState`): ``MEASURING`` (its size is being recorded, no plan
yet), ``PLANNED`` (a plan exists, not applied to the module now) and ``APPLIED`` (its plan is the module's now).
Plain Python; the callback calls :meth:`BudgetCycle.begin` before each training batch and
:meth:`BudgetCycle.planned` once the measuring step's plan is solved.

Example::

    >>> from lightning_ckpt.core.plan.planner import LayerCost, make_plan
    >>> cycle = BudgetCycle()
    >>> step = cycle.begin(BatchSize(tokens=64, length=16))  # nothing planned yet: measure this batch
    >>> step.measure, step.plan
    (True, None)
    >>> plan = make_plan([LayerCost("l0", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
    ...                             offloadable_bytes=0, full_flops=50, selective_flops=5)],
    ...                  outside_bytes=0, memory_budget=1.0)
    >>> cycle.planned(plan)
    >>> cycle.begin(BatchSize(tokens=48, length=12)).plan is plan  # covered by the 64-token measurement
    True
    >>> cycle.begin(BatchSize(tokens=256, length=64)).measure  # longer than anything measured: measure again
    True
    >>> step.predicted is None  # fewer than 3 sizes measured: nothing to predict from
    True
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from lightning_ckpt.core.measure.cost_fit import CostFit
from lightning_ckpt.core.measure.memory_stats import main_tensor, tokens_in_batch
from lightning_ckpt.core.plan.budget import _COST_FIELDS, RankMeasurement, combine_costs, pack_costs
from lightning_ckpt.core.plan.planner import CheckpointPlan, LayerCost


@dataclass(frozen=True)
class BatchSize:
    """How large a batch is for its activations: ``tokens`` (samples where it has no token ids) and ``length``
    (its sequence length; ``1`` where it has none).

    Example::

        >>> size = BatchSize(tokens=8 * 100, length=100)
        >>> size.bucket, str(size), size.covers(BatchSize(tokens=400, length=100))
        (1024, '800 tokens (length 100)', True)
    """

    tokens: int
    length: int = 1

    @property
    def bucket(self) -> int:
        """The tokens rounded up to a power of two: the key its plan is kept under."""
        return 1 << max(0, self.tokens - 1).bit_length()

    def covers(self, other: BatchSize) -> bool:
        """Whether a plan measured at this size holds for ``other``: no more tokens and no longer sequences."""
        return self.tokens >= other.tokens and self.length >= other.length

    def __str__(self) -> str:
        return f"{self.tokens} tokens (length {self.length})" if self.length > 1 else f"{self.tokens} samples"


def batch_size_of(batch: Any, length_fn: Optional[Callable[[Any], int]] = None) -> BatchSize:
    """The :class:`BatchSize` of a training batch, from its main tensor (the first tensor, depth first).

    A 2-D integer main tensor ``[batch, seq]`` is token ids: ``batch * seq`` tokens of length ``seq``. ``length_fn``
    gives the tokens instead (for example the attention mask's sum); any other batch counts its samples (the main
    tensor's first dimension), and a batch with no tensor counts as one sample.

    Example::

        >>> batch_size_of({"input_ids": torch.zeros(4, 32, dtype=torch.long)})
        BatchSize(tokens=128, length=32)
        >>> batch_size_of((torch.zeros(8, 3, 32, 32), torch.zeros(8)))
        BatchSize(tokens=8, length=1)
    """
    tensor, tokens = main_tensor(batch), tokens_in_batch(batch)
    length = int(tensor.shape[1]) if tokens is not None else 1
    if length_fn is not None:
        return BatchSize(int(length_fn(batch)), length)
    if tokens is not None:
        return BatchSize(tokens, length)
    return BatchSize(int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1)


class BucketState(enum.Enum):
    MEASURING = "measuring"
    PLANNED = "planned"
    APPLIED = "applied"


@dataclass(frozen=True)
class Step:
    """What :meth:`BudgetCycle.begin` decided for one batch: run ``plan``, plan it from the ``predicted`` costs (then
    :meth:`BudgetCycle.planned`), or measure it (neither); ``switch`` when the module's checkpointing must change."""

    size: BatchSize
    plan: Optional[CheckpointPlan]
    switch: bool
    predicted: Optional[RankMeasurement] = None

    @property
    def measure(self) -> bool:
        return self.plan is None and self.predicted is None


class BudgetCycle:
    """One plan per size bucket, each with the size it was measured at; see the module docstring.

    ``plans`` maps each bucket to its plan; ``latest`` is the plan of the latest batch (``None`` while measuring).
    """

    def __init__(self) -> None:
        self.sizes: dict[int, BatchSize] = {}  # bucket -> the size its plan was measured at
        self.plans: dict[int, CheckpointPlan] = {}
        self.latest: Optional[CheckpointPlan] = None
        self.measuring: Optional[BatchSize] = None
        # The plan the module has now; None: every matched layer fully checkpointed (the measuring layout). The
        # callback applies `latest` whenever it (re)checkpoints the module, so the two start equal.
        self.applied: Optional[CheckpointPlan] = None
        self.fit = CostFit()  # the measured costs over the batch shape
        self.template: Optional[RankMeasurement] = None  # the latest measurement: layer names, compress
        self.predicting: Optional[BatchSize] = None  # the size being planned from the fit
        self.predicted: set[int] = set()  # buckets whose plan was predicted (their first step is checked)
        self.checked: set[int] = set()  # of those, the buckets whose check passed
        self.remeasure: set[int] = set()  # buckets whose check failed: their next batch is measured
        self.current: Optional[BatchSize] = None  # the latest batch's size
        self.measured_steps = 0  # measuring steps begun (a measurement abandoned included)

    def state(self, bucket: int) -> Optional[BucketState]:
        """The bucket's state, ``None`` for a bucket never seen."""
        if self.measuring is not None and self.measuring.bucket == bucket:
            return BucketState.MEASURING
        if bucket not in self.plans:
            return None
        return BucketState.APPLIED if self.plans[bucket] is self.applied else BucketState.PLANNED

    def plan_for(self, size: BatchSize) -> Optional[CheckpointPlan]:
        """The plan a batch of ``size`` may run under, or ``None`` when it must be measured."""
        measured = self.sizes.get(size.bucket)
        if measured is not None and measured.covers(size):
            return self.plans[size.bucket]
        # A plan that checkpoints nothing holds for every size its own covers, in any bucket: none is cheaper.
        return next((plan for bucket, plan in self.plans.items()
                     if plan.checkpoints_nothing and self.sizes[bucket].covers(size)), None)

    def predict(self, size: BatchSize) -> Optional[RankMeasurement]:
        """The costs of ``size`` predicted from the fit, or ``None`` where it is not trusted (see the module
        docstring) or the size's bucket failed its check."""
        if self.template is None or size.bucket in self.remeasure or not self.fit.trusted(size.tokens, size.length):
            return None
        calls = [i * (len(_COST_FIELDS) + 2) + _CALLS for i in range(len(self.template.costs))]
        row = self.fit.predict(size.tokens, size.length, keep=calls)
        return combine_costs(torch.tensor([row], dtype=torch.int64), self.template)[0]

    def begin(self, size: BatchSize, predict: bool = True) -> Step:
        """Before a training batch of ``size`` (the largest over ranks, so that every rank decides alike). A size
        no plan covers is predicted where the fit allows (``predict=False``: measured): plan it from
        ``step.predicted``, call :meth:`planned`, then :meth:`begin` again to run it."""
        plan = self.plan_for(size)
        predicted = self.predict(size) if plan is None and predict else None
        if predicted is not None:
            self.predicting, self.measuring = size, None
            return Step(size, None, False, predicted)
        self.predicting, self.measuring, self.current = None, size if plan is None else None, size
        self.measured_steps += plan is None
        # Another plan that checkpoints the module alike (a size's own plan beside a smaller one's): nothing to change.
        switch = plan is not self.applied and (plan is None or self.applied is None or not plan.applies_like(self.applied))
        self.applied = self.latest = plan
        return Step(size, plan, switch)

    def planned(self, plan: CheckpointPlan, measured: Optional[RankMeasurement] = None) -> None:
        """The plan solved for the batch being measured (with ``measured``, its costs combined over ranks, which
        the fit takes in) or predicted; batches it covers run under it from the next one on."""
        size = self.measuring or self.predicting
        if size is None:
            raise RuntimeError("BudgetCycle.planned() needs a measuring or predicted step: call begin() first.")
        previous = self.plans.get(size.bucket)
        if self.measuring is not None or previous is None or not plan.applies_like(previous):
            # a new plan for the bucket: checked anew if predicted. One predicted for a larger size of a bucket
            # whose check passed, checkpointing alike, is not: the same costs were checked at up to half its tokens.
            self.checked.discard(size.bucket)
        if self.measuring is not None:
            self.predicted.discard(size.bucket)
            self.remeasure.discard(size.bucket)
            if measured is not None:
                self.fit.add(size.tokens, size.length, _row(measured), _times(measured))
                self.template = measured
        else:
            self.predicted.add(size.bucket)
        self.measuring = self.predicting = None
        self.sizes[size.bucket], self.plans[size.bucket], self.latest = size, plan, plan

    @property
    def checking(self) -> bool:
        """Whether the plan the module runs now was predicted and not yet checked: this step's held bytes are
        checked against it."""
        return self.applied is not None and self.measuring is None and any(
            self.plans.get(b) is self.applied for b in self.predicted - self.checked)

    def check_passed(self, size: BatchSize) -> None:
        """A step of ``size`` (its predicted plan's own size: the first step that runs it) held no more than the plan
        said: batches its bucket covers hold no more than that, so its later steps are not checked, nor the plans
        later predicted for larger sizes of the bucket that checkpoint alike (:meth:`planned`)."""
        self.checked.add(size.bucket)

    def check_failed(self, size: BatchSize) -> None:
        """A step of ``size`` held more than its predicted plan said: drop that plan; the bucket's next batch is
        measured (and the fit takes the measurement in)."""
        bucket = size.bucket
        if bucket in self.predicted:
            self.predicted.discard(bucket)
            self.sizes.pop(bucket, None)
            self.plans.pop(bucket, None)
        self.remeasure.add(bucket)

    def abandon(self) -> None:
        """Forget the measurement or prediction in progress (a step that ended without a plan)."""
        self.measuring = self.predicting = None

    def clear(self) -> None:
        """Forget every plan: the settings they were solved for changed."""
        self.__init__()

    def state_dict(self) -> dict[str, Any]:
        """The plans with their sizes, and the fit (its measured sizes and rows, the latest measurement as the
        template it predicts with): a resumed run plans new sizes from it instead of measuring three again."""
        return {"plans": [{"tokens": self.sizes[b].tokens, "length": self.sizes[b].length,
                           "plan": self.plans[b].state_dict()} for b in sorted(self.plans)],
                "latest": None if self.latest is None else self.latest.state_dict(),
                "fit": {"sizes": [list(size) for size in self.fit.sizes], "rows": [list(row) for row in self.fit.rows],
                        "template": None if self.template is None else asdict(self.template)},
                "predicted": sorted(self.predicted), "checked": sorted(self.checked),
                "remeasure": sorted(self.remeasure)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clear()
        for entry in state.get("plans", []):
            size = BatchSize(int(entry["tokens"]), int(entry["length"]))
            self.sizes[size.bucket], self.plans[size.bucket] = size, CheckpointPlan.from_state_dict(entry["plan"])
        fit = state.get("fit")  # absent from checkpoints made before the fit was saved: measured again
        if fit is not None and fit["template"] is not None:
            template = dict(fit["template"])
            template = RankMeasurement(**{**template, "costs": [LayerCost(**c) for c in template["costs"]]})
            rows = [row for row in fit["rows"] if len(row) == len(_row(template))]  # else saved before a field was
            for (tokens, length), row in zip(fit["sizes"], rows):
                self.fit.add(tokens, length, row, _times(template))
            self.template = template if rows else None
        self.predicted = set(state.get("predicted", ())) & set(self.plans)
        self.checked = set(state.get("checked", ())) & self.predicted
        self.remeasure = set(state.get("remeasure", ()))
        latest = state.get("latest")
        if latest is not None:
            self.latest = next((p for p in self.plans.values() if p.state_dict() == latest),
                               CheckpointPlan.from_state_dict(latest))
        self.applied = self.latest


def _row(measured: RankMeasurement) -> list[int]:
    """``measured`` (combined over ranks: one storage per layer and kind) as the row the fit takes; ``min_bytes=0``
    keeps its bytes to move exactly, for the planner's threshold to apply to the prediction as to a measurement."""
    return pack_costs(measured, min_bytes=0)


_CALLS = _COST_FIELDS.index("calls")  # a count: predicted without the margin
_TIMES = [_COST_FIELDS.index(name) for name in ("plain_ns", "full_ns", "selective_ns")]


def _times(measured: RankMeasurement) -> list[int]:
    """The positions of the layers' measured times in ``_row(measured)``: fitted, but not what the fit is trusted by."""
    width = len(_COST_FIELDS) + 2
    return [i * width + field for i in range(len(measured.costs)) for field in _TIMES]


__all__ = ["BatchSize", "BucketState", "BudgetCycle", "Step", "batch_size_of"]
