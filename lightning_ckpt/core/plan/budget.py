"""The arithmetic behind ``GradientCheckpointing(memory_budget=...)``, as plain functions.

- :class:`RankMeasurement`: what the measuring step found on one rank;
- :func:`pack_costs` and :func:`combine_costs`: one rank's measurement as a row of integers, and the rows gathered
  from every rank combined into the costs every rank plans with;
- :class:`AutoBudget`, :func:`auto_memory_budget` and :func:`static_bytes`: what ``memory_budget="auto"`` leaves
  for activations;
- :func:`host_memory_share` and :func:`offload_min_bytes`: what offload may use and what it moves;
- :func:`plan_summary` and :func:`plan_table`: how a plan is reported.

The callback only decides *when*: it measures, gathers and broadcasts over ranks, and logs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES, engine_for
from lightning_ckpt.core.measure.profiling import format_bytes, format_flops, optimizer_state_bytes, tensor_bytes
from lightning_ckpt.core.plan.planner import CheckpointPlan, LayerCost, held_peak, layer_transients

__all__ = ["AUTO_MEMORY_FRACTION", "AutoBudget", "Measurement", "RankMeasurement", "auto_memory_budget",
           "combine_costs", "host_memory_share", "offload_min_bytes", "pack_costs", "plan_layout", "plan_summary",
           "plan_table", "static_bytes"]

AUTO_MEMORY_FRACTION = 0.9
"""``memory_budget="auto"`` plans for this fraction of the accelerator's memory; the rest is headroom
(allocator fragmentation, the CUDA context, buffers this package cannot see)."""

_COST_FIELDS = [f.name for f in fields(LayerCost)
                if f.name not in ("name", "cls", "ops", "input_sizes", "saved_sizes", "codec_bytes")]
"""The integer fields of :class:`~lightning_ckpt.core.plan.planner.LayerCost`, in the order :func:`pack_costs` writes them."""


# ------------------------------------------------------------------------------------------ one rank's measurement


@dataclass(frozen=True)
class RankMeasurement:
    """What the measuring step found on one rank: each checkpointed layer's costs and the bytes held outside them.

    Example::

        >>> costs = [LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5),
        ...          LayerCost("b", "B", none_bytes=200, full_bytes=5, selective_bytes=30, offloadable_bytes=0,
        ...                    full_flops=60, selective_flops=6)]
        >>> measured = RankMeasurement.from_held_bytes(costs, held_bytes=22)
        >>> measured.layer_bytes, measured.outside_bytes, measured.held_bytes  # 10 + 5 in the layers
        (15, 7, 22)
    """

    costs: list[LayerCost]
    outside_bytes: int  # held for backward outside the measured layers (embeddings, head, loss)
    head_bytes: int = 0  # of those, what the step saved after the last layer (head, loss)
    head_peak_bytes: int = 0  # what the head's and loss's backward makes alive at once (the logits' gradient)
    #: How the measuring step held the layers' inputs (its layers ran with this ``compress``); ``costs`` stay exact.
    compress: Optional[Compress] = None

    @classmethod
    def from_held_bytes(cls, costs: Sequence[LayerCost], held_bytes: int, head_bytes: int = 0,
                        head_peak_bytes: int = 0, compress: Optional[Compress] = None) -> RankMeasurement:
        """From the bytes the whole (fully checkpointed) step held: what the layers do not hold is outside them
        (``head_bytes`` of it saved after the last layer; the head's backward makes ``head_peak_bytes``). With
        ``compress`` the step held the layers' inputs compressed, and that is what is taken off.

        Never negative: where the step's count is short (other saved-tensor hooks), the outside counts as 0.

        Example::

            >>> costs = [LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
            ...                    full_flops=50, selective_flops=5)]
            >>> RankMeasurement.from_held_bytes(costs, held_bytes=4).outside_bytes
            0
        """
        costs = list(costs)
        outside = max(0, held_bytes - sum(c.compressed(compress).full_bytes for c in costs))
        return cls(costs, outside, min(outside, head_bytes), head_peak_bytes, compress)

    @property
    def layer_bytes(self) -> int:
        """Bytes the layers hold fully checkpointed (as in the measuring step, compressed with ``compress``)."""
        return sum(c.full_bytes for c in self._as_measured())

    @property
    def held_bytes(self) -> int:
        """Activation bytes the measuring step held: in the layers and outside them."""
        return self.outside_bytes + self.layer_bytes

    @property
    def peak_bytes(self) -> int:
        """The measuring (fully checkpointed) step's activation peak, as a plan predicts it
        (:func:`~lightning_ckpt.core.plan.planner.held_peak`): usually the last layer's backward.

        Example::

            >>> costs = [LayerCost(f"l{i}", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
            ...                    full_flops=50, selective_flops=5, transient_bytes=150) for i in range(3)]
            >>> RankMeasurement(costs, outside_bytes=30, head_bytes=20).peak_bytes  # 10 outside, 10 + 10 held, 150
            180
        """
        costs = self._as_measured()
        transients = layer_transients(costs, self.head_bytes)
        return self.outside_bytes + held_peak([c.full_bytes for c in costs], transients, head=self.head_peak_bytes)

    def _as_measured(self) -> list[LayerCost]:
        return [c.compressed(self.compress) for c in self.costs]


# ------------------------------------------------------------------------------------------ combined over ranks


#: The name :class:`RankMeasurement` had before (``commands.plan.measure.Measurement`` and
#: ``measure.StepCosts`` are other things); the same class.
Measurement = RankMeasurement


def pack_costs(measured: RankMeasurement, figures: Sequence[int] = (), min_bytes: int = DEFAULT_MIN_BYTES) -> list[int]:
    """``measured`` and ``figures`` as one row of integers, for gathering from every rank.

    Per layer its integer costs, then the bytes the offload engine would move of it un-checkpointed and checkpointed
    (its storages of at least ``min_bytes``: the sizes themselves are each rank's own); then the bytes outside the
    layers, the part of it saved after them and what their backward makes; then ``figures`` (for ``"auto"``: ``[device_bytes, static_bytes, other_peak_bytes]``).

    Example::

        >>> measured = RankMeasurement([LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40,
        ...                                       offloadable_bytes=0, full_flops=50, selective_flops=5)],
        ...                            outside_bytes=7)
        >>> pack_costs(measured, figures=[1000])  # a's 15 integers, moved 100 and 0; 7 outside, 0 after, 0; 1000
        [100, 10, 40, 0, 50, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 100, 0, 7, 0, 0, 1000]
    """
    row = [v for c in measured.costs
           for v in [*(getattr(c, f) for f in _COST_FIELDS), c.movable_bytes("none", min_bytes),
                     c.movable_bytes("full", min_bytes)]]
    return [*row, measured.outside_bytes, measured.head_bytes, measured.head_peak_bytes, *figures]


def combine_costs(gathered: torch.Tensor, measured: RankMeasurement) -> tuple[RankMeasurement, list[int]]:
    """Every rank's :func:`pack_costs` row, ``gathered`` as ``[world_size, n]``, combined into one measurement.

    Every integer is combined with its maximum over ranks (the plan must fit every rank), except the first figure,
    the device memory, with its minimum. The layers' names and classes are ``measured``'s (this rank's). The op
    records are left out: they are each rank's own, and the callback plans without op-level choices. The bytes to
    move come back as one storage each, which the offload threshold keeps whole. Returns the measurement and the
    combined figures.

    Example::

        >>> mine = RankMeasurement([LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40,
        ...                                   offloadable_bytes=0, full_flops=50, selective_flops=5)], outside_bytes=7)
        >>> other = RankMeasurement([LayerCost("a", "B", none_bytes=120, full_bytes=8, selective_bytes=45,
        ...                                    offloadable_bytes=0, full_flops=40, selective_flops=9)], outside_bytes=3)
        >>> gathered = torch.tensor([pack_costs(mine, [1000]), pack_costs(other, [900])])
        >>> measured, figures = combine_costs(gathered, mine)
        >>> measured.costs[0].none_bytes, measured.costs[0].full_flops, measured.outside_bytes, figures
        (120, 50, 7, [900])
    """
    rows = gathered.reshape(-1, gathered.shape[-1])
    width = len(_COST_FIELDS) + 2
    n_costs = len(measured.costs) * width + 3  # the layers, then the bytes outside them, after them, their backward
    combined = rows.max(dim=0).values.tolist()
    if rows.shape[1] > n_costs:
        combined[n_costs] = int(rows[:, n_costs].min())
    costs = []
    for i, c in enumerate(measured.costs):
        *ints, moved_none, moved_full = combined[i * width:(i + 1) * width]
        costs.append(LayerCost(c.name, c.cls, **dict(zip(_COST_FIELDS, ints)), saved_sizes=(moved_none,),
                               input_sizes=(moved_full,)))
    return RankMeasurement(costs, *combined[n_costs - 3:n_costs], measured.compress), combined[n_costs:]


# ------------------------------------------------------------------------------------------ memory_budget="auto"


@dataclass(frozen=True)
class AutoBudget:
    """The figures behind ``memory_budget="auto"``: what is left of the device for activations.

    Example::

        >>> auto = AutoBudget(device_bytes=80 * 2**30, static_bytes=30 * 2**30, other_peak_bytes=2 * 2**30)
        >>> auto.budget_bytes / 2**30  # 0.9 * 80 - 30 - 2
        40.0
    """

    device_bytes: int  # the accelerator's total memory
    static_bytes: int  # weights, gradients and optimizer state
    other_peak_bytes: int  # the step's peak beyond static memory and the activation peak (temporaries)
    fraction: float = AUTO_MEMORY_FRACTION

    @classmethod
    def from_step(cls, device_bytes: int, static_bytes: int, step_peak_bytes: int, activation_bytes: int,
                  fraction: float = AUTO_MEMORY_FRACTION) -> AutoBudget:
        """The figures from a measured step: its peak allocated memory, less static memory and its activations.

        Example::

            >>> auto = AutoBudget.from_step(device_bytes=1000, static_bytes=400, step_peak_bytes=650, activation_bytes=200)
            >>> auto.other_peak_bytes, auto.budget_bytes  # 650 - 400 - 200; 0.9 * 1000 - 400 - 50
            (50, 450)
        """
        return cls(device_bytes, static_bytes, max(0, step_peak_bytes - static_bytes - activation_bytes), fraction)

    @property
    def budget_bytes(self) -> int:
        return auto_memory_budget(self.device_bytes, self.static_bytes, self.other_peak_bytes, self.fraction)

    def __str__(self) -> str:
        return (f"auto: {self.fraction:g} x {format_bytes(self.device_bytes)} device memory - {format_bytes(self.static_bytes)}"
                f" weights, gradients and optimizer state - {format_bytes(self.other_peak_bytes)} other peak of the step"
                f" = {format_bytes(self.budget_bytes)} for activations")


def auto_memory_budget(device_bytes: int, static_bytes: int, other_peak_bytes: int,
                       fraction: float = AUTO_MEMORY_FRACTION) -> int:
    """Bytes of activations that fit: ``device_bytes * fraction - static_bytes - other_peak_bytes``.

    Raises ``ValueError`` when nothing is left: then weights and optimizer state, not activations, fill the device,
    and checkpointing cannot help.

    Example::

        >>> auto_memory_budget(device_bytes=1000, static_bytes=500, other_peak_bytes=100)
        300
    """
    budget = int(device_bytes * fraction) - static_bytes - other_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"`memory_budget='auto'`: {fraction:g} x {format_bytes(device_bytes)} of device memory leaves nothing for"
            f" activations after {format_bytes(static_bytes)} of weights, gradients and optimizer state and"
            f" {format_bytes(other_peak_bytes)} of other peak memory in the step. Checkpointing only saves activations:"
            " shard the weights and optimizer state (`strategy='fsdp_ckpt'`), train fewer parameters (PEFT), or use a"
            " smaller model."
        )
    return budget


def static_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Weights, gradients (as large as the trainable weights, whether allocated yet or not) and optimizer state.

    Example::

        >>> model = torch.nn.Linear(4, 4)  # 20 float32 parameters: 80 bytes
        >>> _ = model.bias.requires_grad_(False)
        >>> static_bytes(model, [])  # 80 of weights, 64 of gradients
        144
    """
    params = list(module.parameters())
    return tensor_bytes(params) + tensor_bytes(p for p in params if p.requires_grad) + optimizer_state_bytes(optimizers)


# ------------------------------------------------------------------------------------------ offload


def host_memory_share(available_bytes: int, devices: int) -> int:
    """The host memory offload may use on one rank: half of ``available_bytes``, shared by the node's ``devices``.

    Example::

        >>> host_memory_share(available_bytes=64 * 2**30, devices=4) / 2**30
        8.0
    """
    return available_bytes // (2 * max(1, devices))


def offload_min_bytes(device: Union[str, torch.device]) -> int:
    """The threshold of the offload engine in charge of ``device``: smaller tensors stay on it.

    Example::

        >>> offload_min_bytes("cpu") == DEFAULT_MIN_BYTES  # no engine on the CPU: the default
        True
    """
    engine = engine_for(device)
    return engine.min_bytes if engine is not None else DEFAULT_MIN_BYTES


# ------------------------------------------------------------------------------------------ the report


def plan_summary(plan: CheckpointPlan, memory_budget: object, auto: Optional[AutoBudget] = None) -> str:
    r"""One line on ``plan``: what it checkpoints, the bytes it predicts against the budget, what it recomputes.

    Example::

        >>> from lightning_ckpt.core.plan.planner import make_plan
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(4)]
        >>> line = plan_summary(make_plan(costs, outside_bytes=100, memory_budget=0.5), memory_budget=0.5)
        >>> print(line.replace("; ", ";\n"))
        memory_budget=0.5: checkpointing 3 of 4 layers (3 full);
        activation peak 230 B predicted against a budget of 250 B (230 B held at the end of the forward, 46% of 500 B without checkpointing);
        150 FLOP recomputed per step
    """
    pct = 100 * plan.planned_bytes / plan.baseline_bytes if plan.baseline_bytes else 0.0
    return (
        f"memory_budget={memory_budget!r}: {plan_layout(plan)};"
        f" activation peak {format_bytes(plan.peak_bytes)} predicted against a budget of {format_bytes(plan.budget_bytes)}"
        f" ({format_bytes(plan.planned_bytes)} held at the end of the forward, {pct:.0f}% of"
        f" {format_bytes(plan.baseline_bytes)} without checkpointing); {format_flops(plan.recompute_flops)}"
        " recomputed per step" + (f"; {plan.step_time_text()}" if plan.predicted_step_seconds is not None else "")
        + (f" ({auto})" if auto is not None else "")
    )


#: How :func:`plan_layout` names each mode.
_MODE_WORDS = {"full": "full", "selective": "selective", "ops": "op-level"}


def plan_layout(plan: CheckpointPlan) -> str:
    r"""What ``plan`` does to the module, in words: the layers it checkpoints and how (each mode, the layers
    offloaded), how their inputs are held, the LM head and loss in chunks, the MLPs in tiles.

    Example::

        >>> from dataclasses import replace
        >>> from lightning_ckpt.core.plan.planner import make_plan
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(5)]
        >>> plan = replace(make_plan(costs, outside_bytes=100, memory_budget=1.0), offloaded=["l0", "l1"],
        ...                layers={"l0": "full", "l1": "full", "l2": "full", "l3": "selective", "l4": "none"},
        ...                compress="fp8", chunk_tokens=1024)
        >>> print(plan_layout(plan).replace("; the", ";\nthe"))
        checkpointing 4 of 5 layers (3 full, 1 selective; 2 offloaded);
        their inputs held as fp8;
        the LM head and loss in chunks of 1,024 tokens
    """
    modes = [mode for mode in plan.layers.values() if mode != "none"]
    how = [", ".join(f"{modes.count(mode)} {word}" for mode, word in _MODE_WORDS.items() if mode in modes)]
    if plan.offloaded:
        how.append(f"{len(plan.offloaded)} offloaded")
    how = [part for part in how if part]
    text = f"checkpointing {len(modes)} of {len(plan.layers)} layers" + (f" ({'; '.join(how)})" if how else "")
    if plan.compress is not None and modes:
        text += f"; their inputs held as {plan.compress}"
    if plan.chunk_tokens is not None:
        text += f"; the LM head and loss in chunks of {plan.chunk_tokens:,} tokens"
    if plan.tile_mlp:
        text += "; the MLPs over tiles of " + (f"{plan.tile_tokens:,} tokens" if plan.tile_tokens else "tokens")
    return text


def plan_table(plan: CheckpointPlan, auto: Optional[AutoBudget] = None) -> str:
    """``plan``'s table, and with ``"auto"`` the figures its budget came from on a last line.

    Example::

        >>> from lightning_ckpt.core.plan.planner import make_plan
        >>> plan = make_plan([LayerCost("l0", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
        ...                             offloadable_bytes=0, full_flops=50, selective_flops=5)],
        ...                  outside_bytes=0, memory_budget=100)
        >>> auto = AutoBudget(device_bytes=1000, static_bytes=400, other_peak_bytes=50)
        >>> plan_table(plan).splitlines() == str(plan).splitlines(), plan_table(plan, auto).splitlines()[-1] == str(auto)
        (True, True)
    """
    return str(plan) + (f"\n{auto}" if auto is not None else "")
