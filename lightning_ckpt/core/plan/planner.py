"""The memory-budget plan: per-layer costs in, the cheapest checkpointing that fits a budget out.

This module holds the entry points (:func:`plan_checkpointing`, :func:`make_plan`, :func:`predict`,
:func:`predict_peak`, :func:`predict_seconds`) and names every part again, so that ``lightning_ckpt.core.plan.planner``
imports keep working. The parts, each its own module:

- :mod:`lightning_ckpt.core.measure.costs`: what a layer holds and costs (``LayerCost``) and the choices it may get;
- :mod:`lightning_ckpt.core.measure.layer_costs`: measuring those costs in one fully checkpointed step;
- :mod:`lightning_ckpt.core.plan.solver`: the cheapest choice per layer that fits the budget;
- :mod:`lightning_ckpt.core.measure.timing`: the time model a device profile prices choices with;
- :mod:`lightning_ckpt.core.plan.checkpoint_plan`: the result, :class:`CheckpointPlan`.

:func:`plan_checkpointing` measures, for every matched layer, the activation bytes it holds for backward
un-checkpointed (``"none"``) and fully checkpointed (``"full"``: its inputs), and records its forward op by op:
what each op's output would hold if kept and what the op costs to recompute. From that record come the other
choices: ``"selective"`` (keep the outputs of matmul/attention/convolution ops) and ``"ops"``, any point of the
layer's curve of (bytes held, recompute cost) from keeping chosen op outputs (:mod:`lightning_ckpt.core.measure.op_curve`:
in-place and random ops stay with their group). It then picks one choice per layer so that the predicted bytes
fit the budget at the least cost: a multiple-choice knapsack, solved exactly up to a fine quantisation of bytes
(rounded towards safety, so a plan never exceeds its budget). What a plan keeps: the layers (or op outputs) that
hold few bytes per unit of recompute; what it recomputes: those that free most bytes per unit.

The cost is recompute FLOPs by default: exact and the same on every machine. Matmuls, convolutions and attention
count as torch's ``FlopCounterMode`` counts them; every other op counts one FLOP per output element (torch counts
those as zero, which would make element-wise recomputation look free). See :class:`OpCostMode`.

Measuring is safe when memory is short: the step runs once with every matched layer fully
checkpointed, and each layer is re-run alone right before its own checkpointed forward and backpropagated
to its inputs (what its backward has alive at once), its output dropped before that backward (identical layers
called alike are re-run once and share the figures). So a measuring step peaks no higher than full
checkpointing (``tests/core/plan/test_peak.py``), and never runs the whole model
un-checkpointed. The budget bounds the step's activation peak, the backward's included (:func:`held_peak`). The RNG and every buffer are left as they were.
Plain PyTorch; nothing here imports Lightning.

Some 970 lines, left whole so far: :func:`plan_checkpointing`'s steps (the problem, its solve, the plan, the
tiled and chunked-head variants, the predictions and the refusals' messages) share its private helpers; a cut along
them is still to do (issue 43).

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Block(nn.Sequential):
    ...     pass
    >>> torch.manual_seed(0) and None
    >>> model = nn.Sequential(*[Block(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
    >>> x = torch.randn(8, 16, requires_grad=True)
    >>> plan = plan_checkpointing(model, lambda: model(x).sum(), 0.6, layer_cls=Block, time_layers=False)  # by FLOPs
    >>> plan.planned_bytes <= plan.peak_bytes <= plan.budget_bytes < plan.baseline_bytes
    True
    >>> plan.layers
    {'0': 'ops', '1': 'full', '2': 'full', '3': 'none'}
    >>> print(plan)  # doctest: +NORMALIZE_WHITESPACE
    layer  class     none   full  selective  FLOPs full  FLOPs selective  choice
    0      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP     ops
    1      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    full
    2      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    full
    3      Block  4.5 KiB  512 B    3.0 KiB  16.9 KFLOP         512 FLOP    none
      0 (ops): 2.5 KiB, 512 FLOP; keeps addmm; recomputes gelu
    outside the layers: 0 B (in every figure below)
    plan: 3 of 4 layers checkpointed; activations 8.0 KiB (44% of 18.0 KiB without checkpointing), peak 10.5 KiB (budget 12.3 KiB, 20.5 KiB without checkpointing); recompute 34.3 KFLOP per step

The last layer is left plain although it is the one whose inputs are the cheapest to keep: its backward comes
first, while every other layer still holds what it chose, so the step's peak is the 3.5 KiB the first three hold
plus the 7.0 KiB the last one's backward has alive at once.

    >>> plan.apply(model)
    ['0', '1', '2']
"""


from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Optional, Union

import logging

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt.core.checkpoint.chunked_loss import (
    DEFAULT_CHUNK_TOKENS,
    chunk_causal_lm_loss,
    chunk_loss_of,
    chunked_models,
    head_of,
    in_lm_loss,
    lm_loss,
    losses_kept_whole,
    unchunk_causal_lm_loss,
)
from lightning_ckpt.core.checkpoint.compress import COMPRESS, Compress, validate_compress
from lightning_ckpt.core.measure.costs import PLAN_MODES, Choice, LayerCost, Offload, validate_modes, validate_offload
from lightning_ckpt.core.measure.device_profile import DeviceProfile, resolve_device
from lightning_ckpt.core.measure.layer_costs import (
    LayerCostRecorder,
    StepCosts,
    check_module_and_step,
    cuda_devices,
    measure_layer_costs,
    measure_step,
)
from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.plan.checkpoint_plan import CheckpointPlan
from lightning_ckpt.core.measure.profiling import (
    LiveBytes,
    OpCostMode,
    SavedTensorCounter,
    count_cost,
    format_bytes,
    hidden_from_counters,
)
from lightning_ckpt.core.checkpoint.say_once import say_once
from lightning_ckpt.core.checkpoint.selection import LayerClassArg, parse_memory_budget
from lightning_ckpt.core.checkpoint.tiling import (apply_tiling, check_tiling, remove_tiling, tiled_names,
                                                   token_wise_modules)
from lightning_ckpt.core.plan.solver import (
    CURVE_POINTS,
    LayerOption,
    cheapest_choices,
    choose,
    chosen_transients,
    held_peak,
    kept_on_device,
    layer_options,
    layer_transients,
    make_option,
    solve,
)
from lightning_ckpt.core.measure.timing import (
    STEP_FORWARDS,
    exposed_transfer_seconds,
    extra_seconds,
    forward_seconds,
    layer_seconds,
    priced_by_time,
    seconds_per_flop,
    step_seconds,
    transfer_windows,
)

__all__ = ["CURVE_POINTS", "CheckpointPlan", "Choice", "ChunkedHead", "HeadCount", "LayerCost", "LayerCostRecorder",
           "LayerOption", "MIN_CHUNK_TOKENS", "OPS_PER_CHUNK", "Offload", "OpCostMode", "Option", "PLAN_MODES",
           "STEP_FORWARDS", "StepCosts", "StepMeasurement", "cheapest_choices", "choose", "chunk_sizes", "count_cost",
           "exposed_transfer_seconds", "extra_seconds", "forward_seconds", "head_and_loss_bytes", "held_peak",
           "kept_on_device", "layer_options", "layer_seconds", "layer_transients", "make_option", "make_plan",
           "measure_chunked_head", "measure_layer_costs", "measure_step", "plan_checkpointing", "predict",
           "predict_peak", "predict_seconds", "solve", "transfer_windows"]

log = logging.getLogger(__name__)

#: The name :class:`~lightning_ckpt.core.plan.solver.LayerOption` had here before the split; the same class.
Option = LayerOption
#: The name :class:`~lightning_ckpt.core.measure.layer_costs.StepCosts` had here before the split; the same class.
StepMeasurement = StepCosts


def make_plan(costs: Sequence[LayerCost], outside_bytes: int, memory_budget: object,
              modes: Sequence[str] = PLAN_MODES, offload: Offload = False,
              device: Union[None, str, DeviceProfile] = None, outside_ops: Sequence[OpRecord] = (),
              host_memory: Optional[int] = None, min_bytes: int = DEFAULT_MIN_BYTES,
              head_bytes: int = 0, head_peak_bytes: int = 0, compress: Optional[Compress] = None,
              chunked: Optional[ChunkedHead] = None, chunk_loss: Optional[bool] = None) -> CheckpointPlan:
    """Solve for the cheapest plan from measured costs (what :func:`plan_checkpointing` does after measuring).

    Args:
        costs: each matched layer's :class:`LayerCost`, in forward order.
        outside_bytes: activation bytes held outside the layers (embeddings, head, loss).
        memory_budget: a fraction of the bytes held without checkpointing, or bytes: the bound on the step's
            activation peak (:attr:`CheckpointPlan.peak_bytes`).
        modes: the checkpointing modes a layer may get, besides ``"none"`` (as :func:`plan_checkpointing`).
        offload: ``False``, ``True`` or ``"auto"`` (as :func:`plan_checkpointing`; ``"auto"`` needs ``device``).
        device: ``None``, a :class:`~lightning_ckpt.core.measure.device_profile.DeviceProfile` or a preset name: plan for
            the least predicted step time on it (as :func:`plan_checkpointing`).
        host_memory: bytes of host memory offloaded tensors may take (``None``: half of the host memory free now).
        outside_ops: the ops of the step outside the layers (for the predicted step time).
        min_bytes: the offload engine's threshold (smaller tensors stay on the device).
        head_bytes: of ``outside_bytes``, what the step saves after the last layer (head, loss), which the backward
            frees before it reaches the layers; 0 counts all of ``outside_bytes`` as held through the layers' backward.
        head_peak_bytes: what the backward of the head and loss makes alive at once (the logits' gradient) while
            everything the forward holds is still there.
        compress: ``None``, ``"bf16"`` or ``"fp8"``: checkpointed layers hold their inputs compressed
            (:meth:`LayerCost.compressed`); the plan applies it.
        chunked: the same step measured with the LM head and loss in chunks (:class:`ChunkedHead`); ``None``: no
            chunked head to choose.
        chunk_loss: with ``chunked``: ``True`` plans with the chunked head, ``False`` without, ``None`` solves both and
            keeps the cheaper (its recompute, or its predicted time, counts the head's forward run again in chunks),
            so the chunked head is chosen when it is what reaches the budget or what saves more recompute than it
            costs. A fraction budget stays a fraction of the peak without checkpointing and without chunking.

    Raises ``ValueError`` if the budget cannot be met.

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(4)]
        >>> plan = make_plan(costs, outside_bytes=100, memory_budget=0.5)
        >>> plan.layers, plan.planned_bytes, plan.peak_bytes, plan.recompute_flops
        ({'l0': 'full', 'l1': 'full', 'l2': 'full', 'l3': 'none'}, 230, 230, 150)

    The budget is 250 B; when ``l3``'s backward runs, the layers before it hold their choices and ``l3`` has its
    100 B alive (``backward_peak``), so ``l0``-``l2`` may hold 50 B at most: only ``"full"`` (10 B each) fits.
    """
    modes, compress, profile, budget = _check_plan_arguments(memory_budget, modes, offload, device, host_memory,
                                                             compress)
    problem = _plan_problem(costs, outside_bytes, memory_budget, budget, modes, offload, profile, host_memory,
                            min_bytes, head_bytes, head_peak_bytes, compress)
    if chunked is None or chunk_loss is False:
        chosen = _solve_plan(problem)
        if chosen is None:
            raise OutOfReach(_out_of_reach_message(problem))
        return _build_plan(problem, chosen, outside_ops)
    # The chunked head's problem: the same layers under the same bytes (a fraction of the unchunked peak)
    chunked_problem = _plan_problem(costs, chunked.outside_bytes, memory_budget, problem.budget_bytes, modes, offload,
                                    profile, host_memory, min_bytes, chunked.head_bytes, chunked.head_peak_bytes,
                                    compress)
    timed = priced_by_time(problem.costs, profile)
    head_cost = float(chunked.flops)
    if timed:
        head_cost = chunked.seconds(profile) if profile is not None else chunked.flops * seconds_per_flop(problem.costs)
    found = []
    if chunk_loss is None:
        plain = _solve_plan(problem)
        if plain is not None:
            found.append((sum(o.cost(timed) for o in plain), 0, problem, plain))
    with_chunks = _solve_plan(chunked_problem)
    if with_chunks is not None:
        found.append((sum(o.cost(timed) for o in with_chunks) + head_cost, 1, chunked_problem, with_chunks))
    if not found:
        raise OutOfReach(_out_of_reach_message(chunked_problem) + " (with the LM head and loss chunked, "
                         f"{chunked.chunk_tokens} tokens a chunk)")
    _, is_chunked, best, chosen = min(found, key=lambda f: f[:2])  # equal costs: unchunked
    plan = _build_plan(best, chosen, outside_ops)
    if not is_chunked:
        return plan
    seconds = {} if plan.predicted_step_seconds is None else {
        "predicted_step_seconds": plan.predicted_step_seconds + chunked.seconds(profile)}
    return replace(plan, chunk_tokens=chunked.chunk_tokens, recompute_flops=plan.recompute_flops + chunked.flops,
                   baseline_bytes=problem.baseline, baseline_peak_bytes=problem.baseline_peak, **seconds)


#: The ops each chunk's recompute runs again (the head's matmul, the log-softmax, the loss), each launched once.
OPS_PER_CHUNK = 3
#: The smallest chunk the planner tries (:func:`chunk_sizes`): below it a chunk's launches cost more than its bytes.
MIN_CHUNK_TOKENS = 256


def chunk_sizes(largest: int, smallest: Optional[int] = None) -> list[int]:
    """The chunk sizes :func:`plan_checkpointing` tries, largest first: ``largest`` halved down to ``smallest``
    (default :data:`MIN_CHUNK_TOKENS`; ``largest`` alone when it is no larger).

    Example::

        >>> chunk_sizes(1024), chunk_sizes(100), chunk_sizes(96, smallest=16)
        ([1024, 512, 256], [100], [96, 48, 24])
    """
    smallest = MIN_CHUNK_TOKENS if smallest is None else smallest
    sizes = [largest]
    while sizes[-1] // 2 >= smallest and sizes[-1] // 2 >= 1:
        sizes.append(sizes[-1] // 2)
    return sizes


@dataclass(frozen=True)
class ChunkedHead:
    """The step measured with the LM head and loss in chunks of ``chunk_tokens`` tokens
    (:func:`~lightning_ckpt.core.checkpoint.chunked_loss.lm_loss`): its bytes outside the layers (:func:`make_plan`'s
    ``outside_bytes``, ``head_bytes``, ``head_peak_bytes``), and ``flops``, the head's forward that the backward
    runs again chunk by chunk.

    Example::

        >>> ChunkedHead(chunk_tokens=512, outside_bytes=10, head_bytes=4, head_peak_bytes=2, flops=8).seconds(None)
        0.0
    """

    chunk_tokens: int
    outside_bytes: int
    head_bytes: int
    head_peak_bytes: int
    flops: int
    chunks: int = 1  # the head's calls in the forward: each chunk's recompute launches its ops again
    tokens: int = 0  # the tokens the head saw in the forward (0: not counted)

    def seconds(self, profile: Optional[DeviceProfile]) -> float:
        """The recompute's time on ``profile``: a matmul, and the launch of each chunk's ops
        (:data:`OPS_PER_CHUNK`); 0 without one.

        Example::

            >>> from lightning_ckpt.core.measure.device_profile import DeviceProfile
            >>> fast = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e10, op_overhead=1e-5)
            >>> ChunkedHead(256, 0, 0, 0, flops=10**12, chunks=8).seconds(fast)  # 1 s + 8 x 3 x 10 us
            1.00024
        """
        if profile is None:
            return 0.0
        return self.flops / profile.matmul_flops + self.chunks * OPS_PER_CHUNK * profile.op_overhead


def _check_plan_arguments(memory_budget: object, modes: Sequence[str], offload: Offload,
                          device: Union[None, str, DeviceProfile], host_memory: Optional[int],
                          compress: Optional[Compress],
                          ) -> tuple[tuple[str, ...], Optional[Compress], Optional[DeviceProfile], Union[float, int]]:
    """:func:`make_plan`'s settings checked, in this order: ``modes``, ``offload``, ``compress``, ``device`` and
    ``memory_budget``; returns the modes, the compression, the device profile and the budget (a fraction or bytes)
    as understood. Raises ``ValueError`` for a setting not understood, ``memory_budget=None``, ``offload="auto"``
    without a profile or a ``host_memory`` that is not bytes."""
    modes = validate_modes(modes)
    validate_offload(offload)
    compress = validate_compress(compress)
    profile = resolve_device(device)
    budget = parse_memory_budget(memory_budget, min_bytes=1)  # any scale: the 1 KiB floor is for what users type
    if budget is None:
        raise ValueError("`memory_budget=None` asks for no plan. Pass a fraction such as 0.5 or bytes such as '2GiB'.")
    if offload == "auto" and profile is None:
        raise ValueError("`offload='auto'` prices offload against recompute in time, so it needs a device profile: pass"
                         " `device=` a preset such as 'h100-sxm' or a `DeviceProfile` (`DeviceProfile.measure('cuda')`),"
                         " or offload=True / False.")
    if host_memory is not None and (not isinstance(host_memory, int) or host_memory < 0):
        raise ValueError(f"`host_memory` must be bytes (an int >= 0) or None (half of the free host memory), got"
                         f" {host_memory!r}.")
    return modes, compress, profile, budget  # type: ignore[return-value]  # no "auto" without allow_auto


@dataclass(frozen=True)
class _PlanProblem:
    """What :func:`make_plan` solves: its checked settings, the costs as planned and the budget in bytes."""

    costs: list[LayerCost]  # as planned: on the profile's device (inputs movable to the host), compressed
    exact: list[LayerCost]  # the same before compression (for the hint when the budget is out of reach)
    outside_bytes: int
    memory_budget: object  # as passed (for the message when it is out of reach)
    modes: tuple[str, ...]
    offload: Offload
    profile: Optional[DeviceProfile]
    host_memory: Optional[int]  # bytes offloaded tensors may take (set whenever something may be offloaded)
    min_bytes: int
    head_bytes: int
    head_peak_bytes: int
    compress: Optional[Compress]
    transients: list[int]  # each layer's backward peak less what the backward freed before it (the head's bytes)
    baseline: int  # activation bytes held without checkpointing
    baseline_peak: int  # the step's activation peak without checkpointing
    budget_bytes: int  # the bound on the planned peak
    windows: list[tuple[float, float]]  # the compute each layer's offload copies may hide behind (none untimed)


def _plan_problem(costs: Sequence[LayerCost], outside_bytes: int, memory_budget: object, budget: Union[float, int],
                  modes: tuple[str, ...], offload: Offload, profile: Optional[DeviceProfile],
                  host_memory: Optional[int], min_bytes: int, head_bytes: int, head_peak_bytes: int,
                  compress: Optional[Compress]) -> _PlanProblem:
    """:func:`make_plan`'s checked settings (:func:`_check_plan_arguments`) made into what it solves: the costs on
    the profile's device and compressed, half of the free host memory where ``host_memory`` is ``None`` and
    something may be offloaded, the peak without checkpointing and ``budget`` (parsed ``memory_budget``) in bytes."""
    if profile is not None:  # measured on the CPU or on fake tensors, planned for the profile's device
        costs = [replace(c, offloadable_bytes=c.full_bytes) for c in costs]
    exact, costs = list(costs), [c.compressed(compress) for c in costs]
    if offload and host_memory is None:
        host_memory = psutil.virtual_memory().available // 2
    # While the layers' backward runs, the head's and the loss's saved tensors are gone already.
    transients = layer_transients(costs, head_bytes)
    baseline_peak = outside_bytes + held_peak([c.none_bytes for c in costs], transients, head=head_peak_bytes)
    return _PlanProblem(
        costs=costs, exact=exact, outside_bytes=outside_bytes, memory_budget=memory_budget, modes=modes,
        offload=offload, profile=profile, host_memory=host_memory, min_bytes=min_bytes, head_bytes=head_bytes,
        head_peak_bytes=head_peak_bytes, compress=compress,
        transients=transients, baseline=outside_bytes + sum(c.none_bytes for c in costs), baseline_peak=baseline_peak,
        budget_bytes=int(budget * baseline_peak) if isinstance(budget, float) else budget,
        windows=transfer_windows(costs, profile) if profile is not None else [(0.0, 0.0)] * len(costs))


def _solve_plan(problem: _PlanProblem) -> Optional[list[LayerOption]]:
    """The cheapest option per layer whose peak fits ``problem.budget_bytes`` (fewest FLOPs, or least predicted time
    with a profile); ``None`` where none fits. ``offload="auto"`` is solved with ``False`` and ``True`` as well, and
    the cheapest of the three kept (the first of equals: ``"auto"``'s own)."""
    timed = priced_by_time(problem.costs, problem.profile)

    def chosen_for(value: Offload) -> Optional[list[LayerOption]]:
        options = [layer_options(c, problem.modes, value, device=problem.profile, window=w,
                                 min_bytes=problem.min_bytes) for c, w in zip(problem.costs, problem.windows)]
        return choose(options, problem.baseline - problem.budget_bytes, timed,
                      problem.host_memory if value else None, problem.transients, problem.head_peak_bytes)

    # "auto" chooses among supersets of the other two; trying them as well makes "never worse than either" exact
    # whatever the quantisation and the host-memory bisection lose.
    offload = problem.offload
    tried = [chosen_for(v) for v in (("auto", False, True) if offload == "auto" else (offload,))]
    found = [chosen for chosen in tried if chosen is not None]
    return min(found, key=lambda c: sum(o.cost(timed) for o in c)) if found else None


def _build_plan(problem: _PlanProblem, chosen: Sequence[LayerOption],
                outside_ops: Sequence[OpRecord]) -> CheckpointPlan:
    """The :class:`CheckpointPlan` of one option per layer (:func:`_solve_plan`): the choices, the bytes held at the
    end of the forward and at the peak, the recompute, what is offloaded and, with a profile, the step time."""
    costs, outside_bytes, offload = problem.costs, problem.outside_bytes, problem.offload
    return CheckpointPlan(
        layers={c.name: o.choice for c, o in zip(costs, chosen)},
        baseline_bytes=problem.baseline,
        baseline_peak_bytes=problem.baseline_peak,
        planned_bytes=outside_bytes + sum(o.device_bytes for o in chosen) + kept_on_device(chosen),
        peak_bytes=outside_bytes + held_peak([o.device_bytes for o in chosen],
                                             chosen_transients(problem.transients, chosen),
                                             [o.host_bytes for o in chosen], problem.head_peak_bytes),
        budget_bytes=problem.budget_bytes,
        recompute_flops=sum(o.flops for o in chosen),
        outside_bytes=outside_bytes,
        planned_host_bytes=sum(o.host_bytes for o in chosen),
        offload=offload,
        costs=list(costs),
        kept_ops={c.name: list(o.keep) for c, o in zip(costs, chosen) if o.choice == "ops"},
        offloaded=[c.name for c, o in zip(costs, chosen) if o.host_bytes or (offload is True and o.choice != "none")],
        compress=problem.compress,
        **_step_seconds(costs, outside_ops, chosen, problem.profile),
    )


class OutOfReach(ValueError):
    """No plan reaches the budget (the message gives the least reachable and what else would help)."""


def _out_of_reach_message(problem: _PlanProblem) -> str:
    """Why no plan fits ``problem.budget_bytes`` and what would (:func:`_impossible_message`), with the compression
    that would reach it (:func:`_compress_hint`)."""
    p = problem
    return (_impossible_message(p.costs, p.outside_bytes, p.baseline_peak, p.budget_bytes, p.memory_budget, p.modes,
                                p.offload, p.host_memory, p.min_bytes, p.head_bytes, p.head_peak_bytes)
            + _compress_hint(p.exact, p.compress, p.outside_bytes, p.budget_bytes, p.modes, p.offload, p.min_bytes,
                             p.head_bytes, p.head_peak_bytes))


def _step_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], chosen: Sequence[LayerOption],
                  profile: Optional[DeviceProfile]) -> dict[str, Any]:
    if profile is None:
        return {}
    baseline = step_seconds(costs, outside_ops, profile)
    return {"baseline_step_seconds": baseline, "predicted_step_seconds": baseline + sum(o.seconds for o in chosen),
            "device": profile.name}


def plan_checkpointing(
    module: nn.Module,
    step: Callable[[], Any],
    memory_budget: object,
    layer_cls: LayerClassArg = None,
    modes: Sequence[str] = PLAN_MODES,
    offload: Offload = False,
    device: Union[None, str, DeviceProfile] = None,
    host_memory: Optional[int] = None,
    compress: Optional[Compress] = None,
    chunk_loss: Optional[bool] = None,
    tile_mlp: Optional[bool] = None,
    tile_tokens: Optional[int] = None,
    tile_cls: LayerClassArg = None,
    time_layers: bool = True,
) -> CheckpointPlan:
    """Measure one step and return the cheapest :class:`CheckpointPlan` whose activations fit ``memory_budget``.

    Args:
        module: the model (in training mode). It is left exactly as it was: apply the plan with ``plan.apply``.
        step: runs what a training step runs before backward and returns the loss; called once here, and
            not backpropagated (no gradient is touched).
        memory_budget: a fraction of the activation bytes held without checkpointing (``0.3``), or bytes
            (``"2GiB"``, ``500_000_000``). ``1.0``, or a budget already met, checkpoints nothing.
        layer_cls: the layers to choose among, as in :func:`~lightning_ckpt.core.checkpoint.wrapping.apply_checkpointing`.
        modes: the checkpointing modes a layer may get, besides ``"none"``.
        offload: ``False``; ``True``: every checkpointed layer's inputs live in host memory (they count as host
            bytes, not device bytes); ``"auto"``: per layer, the planner chooses whether its held tensors live in
            host memory (a checkpointed layer's inputs, or all an un-checkpointed layer saves), pricing the part of
            each transfer the device profile says cannot hide behind compute. ``"auto"`` needs a ``device``, or a
            module on a CUDA device (whose profile is then measured, a few seconds).
        device: ``None``, a :class:`~lightning_ckpt.core.measure.device_profile.DeviceProfile` or a preset name
            (``"h100-sxm"``): plan for the least predicted step time on that device rather than the fewest FLOPs.
        host_memory: bytes of host memory offloaded tensors may take (default: half of the host memory free now).
        compress: ``None``, ``"bf16"`` or ``"fp8"``: checkpointed layers hold their inputs compressed (and offload
            moves the compressed bytes); the plan counts those bytes and applies the compression.
        chunk_loss: for a model whose loss :func:`~lightning_ckpt.core.checkpoint.chunked_loss.chunk_causal_lm_loss` can chunk
            (Transformers ``*ForCausalLM`` with labels, litgpt ``GPT``, the demo GPT): ``True`` plans with the LM head
            and loss in chunks of tokens, ``False`` without, ``None`` measures the step both ways and keeps the
            cheaper plan (:func:`make_plan`), so chunking is chosen when the budget needs it. The chunk is the
            largest of :func:`chunk_sizes` whose plan fits: from
            :data:`~lightning_ckpt.core.checkpoint.chunked_loss.DEFAULT_CHUNK_TOKENS` tokens (or ``chunk_tokens`` the module
            already has) halved down to :data:`MIN_CHUNK_TOKENS`, each smaller one measured (one more step) only
            when the larger misses the budget; ``plan.chunk_tokens`` says what was chosen. Other models: ignored.
        tile_mlp: ``True`` plans with the layers' token-wise submodules (their MLPs and the norms next to them, see
            :func:`~lightning_ckpt.core.checkpoint.tiling.apply_tiling`) over tiles of ``tile_tokens`` tokens (``None``: ALST's
            ``ceil(length / hidden)`` tiles), measured so; ``False`` without; ``None`` plans without first and with
            tiles only when no plan without them fits (a tile's second forward costs time), for a model that has
            something to tile (``tile_cls`` names its MLP class where it is not known). ``plan.tile_mlp`` says
            what was chosen; ``recompute_flops`` counts the tiles' second forward (their matmuls).
        time_layers: time each distinct layer's forward and backward on its device in the measuring step, plainly,
            fully and selectively checkpointed (a few more runs of it: :mod:`~lightning_ckpt.core.measure.layer_timing`), and
            price its choices by those times: the plan has the least measured time, here, where FLOPs and rates
            mislead (on a CPU, selective checkpointing's dispatch costs more than the matmuls it saves). ``False``:
            priced by FLOPs or by ``device``'s rates alone, the same plan on every run. Not on fake tensors.

    With ``time_layers`` (the default) on real tensors, each layer's choices are priced by the times measured here
    (without ``device``, and with a profile measured here, :meth:`DeviceProfile.measure`); for a preset ``device``
    they are priced by its rates. Without ``device`` or times the plan has the fewest recompute FLOPs among those whose predicted bytes fit: layers
    (and op outputs) that free most bytes per recomputed FLOP go first, whatever their position; FLOPs are exact
    and machine-independent. With ``device`` it has the least predicted step time: recomputed matmuls at the
    device's matmul rate, other ops at its memory bandwidth, and a fixed cost per op recomputed or run under an
    op-level policy, so on small layers full checkpointing can beat keeping matmul outputs. Tensors measured on
    the CPU or as fake tensors count as living on that device. With ``offload="auto"`` a layer may also keep its
    tensors in host memory: a transfer costs only what the compute of the next layer (forward) and its backward
    cannot hide at the device's host bandwidth, so offload wins where layers are big and bandwidth is ample, and
    recompute where it is not; what does not fit in ``host_memory`` is recomputed instead. Raises ``ValueError``
    (nothing changed) when even checkpointing (and offloading) every layer would not fit; the message gives the
    minimum and what else would help.
    """
    check_module_and_step(module, step)
    validate_modes(modes)
    validate_offload(offload)
    validate_compress(compress)
    if parse_memory_budget(memory_budget, min_bytes=1) is None:  # plain PyTorch: any bytes (a toy model may hold 896)
        raise ValueError("`memory_budget=None` asks for no plan. Pass a fraction such as 0.5 or bytes such as '2GiB'.")
    if chunk_loss is not None and not isinstance(chunk_loss, bool):
        raise TypeError(f"`chunk_loss` is True, False or None, got {chunk_loss!r}. Pass True (the LM head and loss in"
                        " chunks), False (whole) or None (the plan chooses).")
    if tile_mlp is not None and not isinstance(tile_mlp, bool):
        raise TypeError(f"`tile_mlp` is True, False or None, got {tile_mlp!r}. Pass True (the MLPs over tiles of"
                        " tokens), False (whole) or None (the plan chooses).")
    tileable = tile_mlp is not False and bool(token_wise_modules(module, tile_cls))
    if tile_mlp is True:
        check_tiling(module, tile_cls, tile_tokens)  # refuses a model with nothing to tile, before anything runs
    options = (memory_budget, layer_cls, modes, offload, device, host_memory, compress, chunk_loss, time_layers)
    untiled: Optional[ValueError] = None
    if tile_mlp is not True:
        try:
            return _plan_whole(module, step, *options)
        except OutOfReach as err:
            if not tileable or tiled_names(module):
                raise
            untiled = err
    with _tiled(module, tile_cls, tile_tokens) as flops:
        try:
            plan = _plan_whole(module, step, *options)
        except OutOfReach as err:
            if untiled is None:
                raise
            # The untiled error says what else would help; tiles are said to miss too, with their least.
            least = re.search(r"the least reachable is ([^(]+?) \(", str(err))
            untiled.args = (f"{untiled}\n  - (tile_mlp=True, each layer's MLP over tiles of tokens, would not reach it"
                            f" either{': least reachable ' + least.group(1) if least else ''}.)",)
            raise untiled from None
    return _with_tiles(plan, tile_tokens, flops.flops, resolve_device(device))


def _plan_whole(module: nn.Module, step: Callable[[], Any], memory_budget: object, layer_cls: LayerClassArg,
                modes: Sequence[str], offload: Offload, device: Union[None, str, DeviceProfile],
                host_memory: Optional[int], compress: Optional[Compress], chunk_loss: Optional[bool],
                time_layers: bool) -> CheckpointPlan:
    """:func:`plan_checkpointing` of ``module`` as it is (tiled or not); its settings already checked."""
    modes = validate_modes(modes)
    profile = resolve_device(device)
    cuda = cuda_devices(module)
    if offload == "auto" and profile is None and cuda:
        profile = DeviceProfile.measure(torch.device("cuda", cuda[0]))
    chunk = _chunk_of(module) if chunk_loss is not False else None
    for reason in losses_kept_whole(module) if chunk_loss is not False else []:
        say_once(log, f"lightning_ckpt: chunk_loss={chunk_loss!r}: {reason}.")
    if chunk_loss is True and chunk is None:
        say_once(log, f"lightning_ckpt: chunk_loss=True found no loss it can chunk in {type(module).__name__}; the plan"
                      " counts its head and loss as measured, outside the layers.")
    with _unchunked(module):
        measured = (measure_step(module, step, layer_cls, modes, time_layers=time_layers)
                    if chunk_loss is not True or chunk is None else None)
    if chunk is None:
        assert measured is not None
        return make_plan(measured.costs, measured.outside_bytes, memory_budget, modes, offload, profile,
                         measured.outside_ops, host_memory, head_bytes=measured.head_bytes,
                         head_peak_bytes=measured.head_peak_bytes, compress=compress)
    # The largest chunk whose plan fits: a smaller one only adds launches, measured only when the larger misses
    error: Optional[ValueError] = None
    tokens = None
    for size in chunk_sizes(chunk):
        if tokens is not None and size >= tokens:
            continue  # still one chunk of every token: the bytes already measured
        steps, head = measure_chunked_head(module, step, layer_cls, modes, size, time_layers and measured is None)
        tokens = head.tokens or None
        # chunk_loss=True: the chunked step alone, its head's peak with the weight gradient's extra copy
        base = measured if measured is not None else replace(steps, head_peak_bytes=head.head_peak_bytes)
        try:
            return make_plan(base.costs, base.outside_bytes, memory_budget, modes, offload, profile, base.outside_ops,
                             host_memory, head_bytes=base.head_bytes, head_peak_bytes=base.head_peak_bytes,
                             compress=compress, chunked=head, chunk_loss=chunk_loss)
        except ValueError as missed:
            error = missed
    assert error is not None
    raise error


class _TileFlops:
    """The FLOPs of the tiled submodules' second forward (each tile recomputed in backward), as torch's
    ``FlopCounterMode`` counts them: ``2 x rows x in x out`` for each ``nn.Linear`` inside (element-wise ops are not
    counted), with the rows each tiled module first ran on in the step."""

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        self.rows: dict[str, int] = {}
        self.weights = {name: sum(m.weight.numel() for m in module.get_submodule(name).modules()
                                  if isinstance(m, nn.Linear)) for name in names}
        self.handles = [module.get_submodule(name).register_forward_pre_hook(self._hook(name)) for name in names]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None and x.dim() >= 2:
                self.rows.setdefault(name, x.numel() // x.shape[-1])
        return record

    @property
    def flops(self) -> int:
        return sum(2 * self.rows.get(name, 0) * weights for name, weights in self.weights.items())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextmanager
def _tiled(module: nn.Module, tile_cls: LayerClassArg, tile_tokens: Optional[int]) -> Iterator[_TileFlops]:
    """``module`` tiled while inside (untiled again after), with what its tiles' second forward costs."""
    names = apply_tiling(module, tile_cls, tile_tokens)
    counter = _TileFlops(module, names)
    try:
        yield counter
    finally:
        counter.close()
        remove_tiling(module)


def _with_tiles(plan: CheckpointPlan, tile_tokens: Optional[int], flops: int,
                profile: Optional[DeviceProfile]) -> CheckpointPlan:
    """``plan`` (solved from a tiled step) marked tiled, priced with its tiles' second forward."""
    seconds = plan.predicted_step_seconds
    if seconds is not None and profile is not None:
        seconds += flops / profile.matmul_flops
    return replace(plan, tile_mlp=True, tile_tokens=tile_tokens, recompute_flops=plan.recompute_flops + flops,
                   predicted_step_seconds=seconds)


def _chunk_of(module: nn.Module) -> Optional[int]:
    """The chunk size to plan ``module``'s chunked loss with; ``None`` when it has no loss to chunk."""
    names = chunked_models(module)
    if not names:
        return None
    return chunk_loss_of(module.get_submodule(names[0])) or DEFAULT_CHUNK_TOKENS


@contextmanager
def _unchunked(module: nn.Module) -> Iterator[None]:
    """``module`` with its loss unchunked, chunked again afterwards as it was."""
    before = {name: chunk_loss_of(module.get_submodule(name)) for name in chunked_models(module)}
    unchunk_causal_lm_loss(module)
    try:
        yield
    finally:
        for name, chunk in before.items():
            if chunk is not None:
                chunk_causal_lm_loss(module.get_submodule(name), chunk)


class HeadCount:
    """Counts, while entered, the forward calls of ``module``'s LM heads (:func:`chunked_models`) inside
    :func:`~lightning_ckpt.core.checkpoint.chunked_loss.lm_loss`: their matmul FLOPs (what the chunked backward runs again), the
    calls (chunks) and the tokens; calls inside a backward (the recompute) or outside ``lm_loss`` are not counted.
    :meth:`chunked_head` turns a step measured meanwhile into a :class:`ChunkedHead`.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> model = Transformer(16, 8, 1, 8, 2, 0.0)
        >>> idx = torch.zeros(2, 8, dtype=torch.long)
        >>> _ = chunk_causal_lm_loss(model, 8)
        >>> with HeadCount(model) as count:
        ...     _ = model(idx, idx)  # the loss, in two chunks of 8 tokens
        ...     _ = model(idx)  # logits: the head whole, outside lm_loss
        >>> count.flops, count.calls, count.tokens  # 2 x 16 tokens x 8 in x 16 out, the logits not counted
        (4096, 2, 16)
    """

    def __init__(self, module: nn.Module) -> None:
        self.heads = [head_of(module.get_submodule(name)) for name in chunked_models(module)]
        self.flops = self.calls = self.tokens = 0
        self.dtypes: Optional[tuple[torch.dtype, torch.dtype]] = None  # the last call's input and output dtypes
        self._handles: list[Any] = []

    def _count(self, head: nn.Module, args: tuple, out: Any) -> None:
        if torch.is_tensor(out) and args and torch.is_tensor(args[0]) and torch._C._current_graph_task_id() == -1:
            # Outside lm_loss: a step that computes its loss itself (litgpt's own way: chunking the model's changes
            # nothing), or the head swapped to hand the hidden states through on their way to lm_loss.
            if not in_lm_loss():
                return
            self.flops += 2 * out.numel() * args[0].shape[-1]
            self.calls += 1
            self.tokens += args[0].numel() // args[0].shape[-1]
            self.dtypes = (args[0].dtype, out.dtype)

    def __enter__(self) -> "HeadCount":
        self._handles = [head.register_forward_hook(self._count) for head in self.heads]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def chunked_head(self, chunk: int, outside_bytes: int, head_bytes: int, head_peak_bytes: int,
                     calls: Optional[int] = None) -> ChunkedHead:
        """The :class:`ChunkedHead` of a step measured with these bytes while counted (``calls``: the head's calls
        with chunks of ``chunk`` where those bytes are for another chunk than the counted step's). A trained head also
        makes, from its second chunk on, a weight gradient that is added into ``.grad`` and freed: one more copy of
        its trainable parameters' bytes on top of the measured ``head_peak_bytes``."""
        calls = self.calls if calls is None else calls
        grads = sum(p.numel() * p.element_size() for head in self.heads for p in head.parameters() if p.requires_grad)
        head_peak = head_peak_bytes + (grads if calls > len(self.heads) else 0)
        return ChunkedHead(chunk, outside_bytes, head_bytes, head_peak, self.flops, calls, self.tokens)


def head_and_loss_bytes(head: nn.Module, tokens: int, chunk: Optional[int],
                        dtypes: Optional[tuple[torch.dtype, torch.dtype]] = None) -> tuple[int, int]:
    """``(saved, backward peak)`` bytes of the LM head and the cross-entropy alone over ``tokens`` tokens, unchunked
    (``chunk=None``: ``cross_entropy(head(hidden).float(), labels)``) or through
    :func:`~lightning_ckpt.core.checkpoint.chunked_loss.lm_loss`; measured on fake tensors (nothing allocated, the head left as
    it was). ``dtypes``: the hidden states' and the logits' (the logits' differ under autocast).

    Example::

        >>> head = nn.Linear(8, 100, bias=False)
        >>> head_and_loss_bytes(head, 10, None)
        (4404, 8004)

    Saved: the input (10 x 8 x 4 B), the labels (10 x 8 B), the log-softmax (10 x 100 x 4 B) and a 4-byte count;
    the backward's peak: two 10 x 100 fp32 gradients (the log-softmax's, the logits') and the loss's own.
    """
    from torch._subclasses import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    weight = next(head.parameters())
    hidden_dtype, out_dtype = dtypes if dtypes is not None else (weight.dtype, weight.dtype)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        fakes = {name: mode.from_tensor(t).requires_grad_(t.requires_grad)
                 for name, t in (*head.named_parameters(remove_duplicate=False),
                                 *head.named_buffers(remove_duplicate=False))}
    autocast = torch.autocast(weight.device.type, dtype=out_dtype, enabled=out_dtype not in (weight.dtype, hidden_dtype))
    with _reparametrize_module(head, fakes), mode, autocast:
        hidden = torch.empty(tokens, head.in_features if hasattr(head, "in_features") else weight.shape[-1],
                             dtype=hidden_dtype, device=weight.device, requires_grad=True)
        labels = torch.zeros(tokens, dtype=torch.long, device=weight.device)
        with hidden_from_counters(), SavedTensorCounter(exclude=list(fakes.values())) as saved:
            if chunk is None:
                loss = F.cross_entropy(head(hidden).float(), labels)
            else:
                loss = lm_loss(hidden, head, labels, chunk_tokens=chunk)
        with hidden_from_counters(), LiveBytes() as live:
            torch.autograd.grad(loss, hidden)
    return saved.bytes, live.peak()


def measure_chunked_head(module: nn.Module, step: Callable[[], Any], layer_cls: LayerClassArg, modes: Sequence[str],
                         chunk: int, time_layers: bool = True) -> tuple[StepCosts, ChunkedHead]:
    """The step measured with ``module``'s loss in chunks of ``chunk`` tokens (as :func:`measure_step`), and its
    :class:`ChunkedHead` for :func:`make_plan`'s ``chunked`` (counted by :class:`HeadCount`). The head's backward
    peak is measured as gradients to the last layer's output."""
    with _unchunked(module):
        chunk_causal_lm_loss(module, chunk)
        try:
            with HeadCount(module) as count:
                measured = measure_step(module, step, layer_cls, modes, time_layers=time_layers)
        finally:
            unchunk_causal_lm_loss(module)
    return measured, count.chunked_head(chunk, measured.outside_bytes, measured.head_bytes, measured.head_peak_bytes)


def predict(costs: Sequence[LayerCost], outside_bytes: int, choices: Mapping[str, str],
            offload: Union[bool, Collection[str]] = False,
            kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
            ) -> tuple[int, int]:
    """``(device bytes, recompute FLOPs)`` that the layer modes ``choices`` (name -> mode; missing: ``"none"``) hold
    and cost; an ``"ops"`` layer keeps the ops at positions ``kept_ops[name]`` (as in :class:`CheckpointPlan`).
    ``offload``: ``True`` for every checkpointed layer's inputs in host memory, or the names of the layers offloaded
    (``min_bytes``: the offload engine's threshold).

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(4)]
        >>> predict(costs, 100, {"l0": "full", "l2": "full"})  # every 2nd layer
        (320, 100)
    """
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes)
    newest = kept_on_device(chosen)
    return outside_bytes + sum(o.device_bytes for o in chosen) + newest, sum(o.flops for o in chosen)


def predict_peak(costs: Sequence[LayerCost], outside_bytes: int, choices: Mapping[str, str],
                 offload: Union[bool, Collection[str]] = False,
                 kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
                 head_bytes: int = 0, head_peak_bytes: int = 0) -> int:
    """The step's activation peak (:func:`held_peak`) for the layer modes ``choices``, as :func:`predict` takes them;
    ``head_bytes`` and ``head_peak_bytes`` as :func:`make_plan` takes them.

    Example::

        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=50, selective_flops=5) for i in range(4)]
        >>> predict_peak(costs, 100, {"l0": "full", "l2": "full"})  # l3's backward: 100 + 10 + 100 + 10 held, its 100
        320
    """
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes)
    return outside_bytes + held_peak([o.device_bytes for o in chosen],
                                     chosen_transients(layer_transients(costs, head_bytes), chosen),
                                     [o.host_bytes for o in chosen], head_peak_bytes)


def predict_seconds(costs: Sequence[LayerCost], outside_ops: Sequence[OpRecord], choices: Mapping[str, str],
                    device: Union[str, DeviceProfile], offload: Union[bool, Collection[str]] = False,
                    kept_ops: Mapping[str, Sequence[int]] = MappingProxyType({}), min_bytes: int = DEFAULT_MIN_BYTES,
                    compress: Optional[Compress] = None) -> tuple[float, float]:
    """``(step seconds, step seconds without checkpointing)`` predicted on ``device`` for the layer modes ``choices``
    (as :func:`predict` takes them), the checkpointed layers' inputs held under ``compress``; measured tensors count
    as living on ``device``.

    Example::

        >>> from lightning_ckpt.core.measure.op_curve import OpRecord
        >>> ops = (OpRecord("aten.mm.default", 64, 10**9, 96),)
        >>> costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                    full_flops=10**9, selective_flops=0, ops=ops) for i in range(2)]
        >>> device = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e9)
        >>> predict_seconds(costs, (), {"l0": "full"}, device)  # 3 forwards of 2 ms, and 1 ms recomputed
        (0.007, 0.006)
    """
    profile = resolve_device(device)
    assert profile is not None
    costs = [replace(c, offloadable_bytes=c.full_bytes).compressed(compress) for c in costs]
    baseline = step_seconds(costs, outside_ops, profile)
    chosen = _predicted_options(costs, choices, offload, kept_ops, min_bytes, profile)
    return baseline + sum(o.seconds for o in chosen), baseline


def _predicted_options(costs: Sequence[LayerCost], choices: Mapping[str, str], offload: Union[bool, Collection[str]],
                       kept_ops: Mapping[str, Sequence[int]], min_bytes: int,
                       device: Optional[DeviceProfile] = None) -> list[LayerOption]:
    windows = transfer_windows(costs, device) if device is not None else [(0.0, 0.0)] * len(costs)
    out = []
    for cost, window in zip(costs, windows):
        mode = choices.get(cost.name, "none")
        moved = cost.name in offload if isinstance(offload, Collection) else offload and mode != "none"
        out.append(make_option(cost, mode, kept_ops.get(cost.name, ()), moved, device, window, min_bytes))  # type: ignore[arg-type]
    return out


def _impossible_message(costs: Sequence[LayerCost], outside: int, baseline: int, budget_bytes: int,
                        memory_budget: object, modes: Sequence[str], offload: Offload,
                        host_memory: Optional[int] = None, min_bytes: int = DEFAULT_MIN_BYTES,
                        head_bytes: int = 0, head_peak_bytes: int = 0) -> str:
    def least(value: Offload) -> int:
        return _least_peak(costs, outside, modes, value, min_bytes, head_bytes, head_peak_bytes)

    minimum = least(offload)
    head = (f"`memory_budget={memory_budget!r}` asks for an activation peak of at most {format_bytes(budget_bytes)}"
            f" ({_pct(budget_bytes, baseline)} of the {format_bytes(baseline)} peak without checkpointing), but the least"
            f" reachable is {format_bytes(minimum)} ({_pct(minimum, baseline)}), with every matched layer checkpointed"
            + (" or offloaded" if offload == "auto" else "") + ". Nothing was applied.")
    floor = (f"  Floor: {format_bytes(outside)} of it is outside the matched layers (embeddings, head, loss)"
             + _outside_parts(outside, head_bytes, head_peak_bytes)
             + _floor_text(costs, [o.device_bytes for o in _smallest(costs, modes, offload, min_bytes)],
                           outside - head_bytes, outside + head_peak_bytes) + ".")
    if bool(offload) and minimum <= budget_bytes:  # the device could hold it: host memory is what is short
        return (f"`memory_budget={memory_budget!r}` ({format_bytes(budget_bytes)} of activations) needs more than"
                f" `host_memory={host_memory}` ({format_bytes(host_memory or 0)}) of offloaded tensors. Nothing was"
                " applied.\n  To fit: pass a larger `host_memory` (bytes of host memory the offloaded tensors may use).")
    in_bytes = not isinstance(parse_memory_budget(memory_budget, allow_auto=True, min_bytes=1), float)
    ways = [f"  To fit: pass a budget of at least {minimum} bytes ({format_bytes(minimum)})" if in_bytes else
            f"  To fit: pass a budget of at least {minimum / baseline:.3f} (or {minimum} bytes)"]
    if offload is False:
        with_offload = least(True)
        if with_offload < minimum:
            ways.append(f"or offload=True, which reaches {format_bytes(with_offload)} ({_pct(with_offload, baseline)})")
        else:
            why = ("the layer inputs are in CPU memory, there is no device memory for it to free"
                   if not any(c.offloadable_bytes for c in costs) else
                   "what sets the floor is a layer's backward, whose inputs come back to the device for it")
            ways.append(f"(offload=True would not help here: {why})")
    if offload != "auto" and least("auto") < min(minimum, least(True)):
        ways.append(f"or offload='auto' with a device profile, which can reach {format_bytes(least('auto'))}")
    if "full" not in modes:
        ways.append("or allow modes=('full', 'selective')")
    ways.append(f"or a smaller batch or shorter sequences (activations grow about linearly with them: about"
                f" {math.ceil(100 * budget_bytes / minimum)}% of the current size would fit)")
    ways.append("or checkpoint more of the model by adding the classes outside the layers to `layer_cls`.")
    return "\n".join([head, floor, ways[0], *(f"  - {way}" for way in ways[1:])])


def _smallest(costs: Sequence[LayerCost], modes: Sequence[str], offload: Offload, min_bytes: int) -> list[LayerOption]:
    """Each layer's option that holds the least; what an offloaded layer moves comes back to the device for its
    backward, so it counts too."""
    return [min(layer_options(c, modes, offload, min_bytes=min_bytes),
                key=lambda o: (o.device_bytes + o.host_bytes, o.device_bytes)) for c in costs]


def _least_peak(costs: Sequence[LayerCost], outside: int, modes: Sequence[str], offload: Offload, min_bytes: int,
                head_bytes: int, head_peak_bytes: int) -> int:
    """The least activation peak any plan reaches: every layer at its :func:`_smallest` option."""
    chosen = _smallest(costs, modes, offload, min_bytes)
    return outside + held_peak([o.device_bytes for o in chosen], chosen_transients(layer_transients(costs, head_bytes),
                                                                                   chosen),
                               [o.host_bytes for o in chosen], head_peak_bytes)


def _compress_hint(exact: Sequence[LayerCost], compress: Optional[Compress], outside: int, budget_bytes: int,
                   modes: Sequence[str], offload: Offload, min_bytes: int, head_bytes: int, head_peak_bytes: int) -> str:
    """For a budget the device cannot reach: the widest compression of the layer inputs that reaches it, or what the
    narrowest reaches; nothing where compressing would not lower the floor (or where host memory is what is short)."""

    def least(kind: Optional[Compress]) -> int:
        return _least_peak([c.compressed(kind) for c in exact], outside, modes, offload, min_bytes, head_bytes,
                           head_peak_bytes)

    now = least(compress)
    narrower = [k for k in COMPRESS[COMPRESS.index(compress) + 1 if compress else 0:] if least(k) < now]
    if now <= budget_bytes or not narrower:
        return ""
    for kind in narrower:
        if least(kind) <= budget_bytes:
            return (f"\n  - or compress='{kind}' (the checkpointed layers' inputs held as {_WIDTH_TEXT[kind]}; gradients"
                    f" close, not equal), which reaches {format_bytes(least(kind))}.")
    kind = narrower[-1]
    return (f"\n  - (compress='{kind}', the checkpointed layers' inputs held as {_WIDTH_TEXT[kind]}, would reach"
            f" {format_bytes(least(kind))}: not enough either.)")


_WIDTH_TEXT = {"bf16": "bfloat16, 2 bytes a value", "fp8": "float8 with a scale per 128 values, about 1 byte a value"}


def _floor_text(costs: Sequence[LayerCost], held: Sequence[int], outside_during: int, at_start: int) -> str:
    """Which layer's backward sets the least reachable peak, when one does (not the start of the backward, where
    ``at_start`` is alive besides the layers' ``held``)."""
    during = [outside_during + sum(held[:i]) + c.backward_peak for i, c in enumerate(costs)]
    i = max(range(len(costs)), key=during.__getitem__)
    if during[i] <= at_start + sum(held):
        return ""
    return (f"; the backward of `{costs[i].name}` sets that floor: it has {format_bytes(costs[i].backward_peak)} alive"
            " at once (its recompute, what it saves and its gradients) while the layers before it hold their inputs")


def _outside_parts(outside: int, head_bytes: int, head_peak_bytes: int) -> str:
    """The bytes outside the layers by part: saved before them (embeddings), after them (final norm, LM head and
    loss), and what the head's and loss's backward makes alive at once (the logits' gradient), when measured.

    Example::

        >>> _outside_parts(3 * 2**20, 2**20, 4 * 2**20)
        ': 2.0 MiB saved before them (embeddings), 1.0 MiB after them (final norm, head, loss), and 4.0 MiB made alive at once by the backward of the head and loss'
    """
    if not head_bytes and not head_peak_bytes:
        return ""
    return (f": {format_bytes(outside - head_bytes)} saved before them (embeddings), {format_bytes(head_bytes)} after"
            " them (final norm, head, loss)"
            + (f", and {format_bytes(head_peak_bytes)} made alive at once by the backward of the head and loss"
               if head_peak_bytes else ""))


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"
