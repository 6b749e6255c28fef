"""What ``lightning-ckpt plan`` plans from its measurements: the settings every plan is made with
(:func:`plan_settings`), the host memory it plans with (:func:`host_memory_of`), every setting's predictions
(:func:`_rows`) and, with ``--lengths``, the same at each length with the fit over the length
(:func:`_across_lengths`) and the plan at the longest length its settings fit (:func:`_plan_longest`).

The command (:mod:`lightning_ckpt.commands.plan`) builds, measures and writes; the predictions themselves are
:mod:`~lightning_ckpt.commands.plan.predictions`.

Example::

    >>> _why_shorter(120, 100, "least reachable")  # the fit over lengths promised more than the room holds
    'overshot'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

from lightning_ckpt.commands.plan.build import Built
from lightning_ckpt.commands.plan.measure import Measurement
from lightning_ckpt.commands.plan.static_memory import HostMemory, StaticMemory, this_machine_host_memory
from lightning_ckpt.commands.plan.predictions import (
    CALLBACK_MODES,
    PlanSettings,
    SettingRow,
    fit_peak,
    host_memory_short,
    largest_length,
    setting_choices,
    setting_rows,
)
from lightning_ckpt.commands.plan.result import LengthResult, LongestPlan, PlanResult
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import CheckpointPlan, Offload


def plan_settings(built: Built, profile: Optional[DeviceProfile], host: Optional[HostMemory] = None) -> PlanSettings:
    """The settings every plan of the command is made with: the one place they are gathered (offload, compression,
    the chunked LM head and loss, and the host memory offloaded activations may take, :attr:`HostMemory.for_offload`;
    ``None``: the planner's default, half of this machine's available memory)."""
    return PlanSettings(offload=built.offload, device=profile, compress=built.compress, chunk_loss=built.chunk_loss,
                        host_memory=None if host is None else host.for_offload, tile_mlp=built.tile_mlp,
                        modes=("full",) if built.reentrant else CALLBACK_MODES)


def host_memory_of(given: Optional[int], static: StaticMemory) -> HostMemory:
    """The host memory the command plans with: ``--host-memory`` when ``given``, else this machine's
    (:func:`~lightning_ckpt.commands.plan.static_memory.this_machine_host_memory`), less what ``static`` keeps there under
    CPU offload.

    Example::

        >>> from lightning_ckpt.commands.plan.static_memory import StaticMemory
        >>> host_memory_of(2**30, StaticMemory(0, 0, 0, "AdamW", host_weights=2**28))
        HostMemory(total=1073741824, given=True, static=268435456)
    """
    total = given if given is not None else this_machine_host_memory()
    return HostMemory(total, given is not None, static.host_total)


def _rows(measured: Measurement, plan: Optional[CheckpointPlan], offload: Offload, profile: Optional[DeviceProfile],
          other: Optional[Measurement] = None, room: Optional[int] = None) -> list[SettingRow]:
    """Every standard setting's predictions on ``measured``, and the plan's when there is one."""
    names = [c.name for c in measured.costs]
    return setting_rows(measured, setting_choices(names, plan, measured.chunked is not None), offload, other, room,
                        plan.kept_ops if plan is not None else {}, profile, plan.offloaded if plan is not None else (),
                        plan_chunked=plan is not None and plan.chunk_tokens is not None)


def _across_lengths(result: PlanResult, at_lengths: Sequence[Measurement], room: Optional[int],
                    settings: PlanSettings) -> None:
    """Fill ``result``'s plan, settings and least reachable peak (``settings``'s) at each length and, with 2 or more
    lengths, the fit of each standard setting's peak, and of that least peak, over the length and (with ``room``)
    the largest length each fits."""
    offload, profile = result.built.offload, result.profile
    for m in at_lengths:
        plan, error = settings.plan(m, result.budget)
        assert m.length is not None  # measured at a length: the batch has token ids
        result.lengths.append(LengthResult(m.length, m.batch_size, plan, error, _rows(m, plan, offload, profile),
                                           settings.least_peak(m)))
    if len(at_lengths) < 2:
        return
    result.length_fit = "quadratic" if len(at_lengths) >= 3 else "linear"
    lengths = [at.length for at in result.lengths]
    for name in (r.name for r in result.rows if r.name != "plan"):
        peaks = [next(r.peak_bytes for r in at.rows if r.name == name) for at in result.lengths]
        result.largest_length[name] = None if room is None else largest_length(fit_peak(lengths, peaks), room)
    least = fit_peak(lengths, [at.least_peak_bytes for at in result.lengths])
    result.largest_length["plan"] = None if room is None else largest_length(least, room)


#: Tries at the plan's longest length: each measures the step again where the last fell short.
_LONGEST_TRIES = 6


def _plan_longest(result: PlanResult, room: int, settings: PlanSettings,
                  measure_length: Callable[[int], Measurement], limit: Optional[tuple[str, int]]) -> None:
    """The plan at the longest length its settings fit (``result.largest_length["plan"]``, from the fitted least
    peak), planned for ``room`` (device memory less static memory) on the step measured again at that length. Where
    the fit promised too much, the length shrinks by what the least peak there overshoots (or by 1% where the least
    peak fits but the planner found no plan: no plan fit the host memory, or its knapsack's rounding), and is
    measured again, up to :data:`_LONGEST_TRIES` times, each shrink's reason kept in ``LongestPlan.shortened``;
    ``result.largest_length["plan"]`` ends as the length the plan was made at, except where the model's ``limit``
    capped it (the plan is then made at the limit, and the fitted length stays, as every setting's does)."""
    fitted = result.largest_length.get("plan")
    if fitted is None or fitted < 1:
        return
    length = fitted if limit is None else min(fitted, limit[1])
    longest = LongestPlan(fitted, length, result.main.batch_size, None, None, capped=limit if length < fitted else None)
    for _ in range(_LONGEST_TRIES):
        measured = measure_length(length)
        longest.length, longest.least_peak_bytes = length, settings.least_peak(measured)
        longest.plan, longest.plan_error = settings.plan(measured, room)
        if longest.plan is not None or length <= 1:
            break
        # Past the room: shrink by what the least peak overshoots. Within it, the planner still found no plan (the host
        # memory is short, or its knapsack's rounding): 1% shorter.
        longest.shortened.append(_why_shorter(longest.least_peak_bytes, room, longest.plan_error))
        length = max(1, min(length - max(1, length // 100), math.floor(length * room / longest.least_peak_bytes)))
    result.longest = longest
    if longest.plan is not None and longest.capped is None:  # capped: the fit's length stays, as every setting's
        result.largest_length["plan"] = longest.length


def _why_shorter(least_peak_bytes: int, room: int, plan_error: Optional[str]) -> str:
    """Why no plan was made at a length: ``"overshot"`` (the least peak is over the room: the fit promised too much),
    ``"host_memory"`` (the device could hold it, but no plan fits the host memory for offload) or ``"no_plan"`` (the
    planner found none within the room all the same).

    Example::

        >>> _why_shorter(120, 100, "least reachable"), _why_shorter(90, 100, "needs more than `host_memory=5`")
        ('overshot', 'host_memory')
    """
    if least_peak_bytes > room:
        return "overshot"
    return "host_memory" if host_memory_short(plan_error) else "no_plan"
