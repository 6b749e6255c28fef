"""What one run of ``lightning-ckpt plan`` found: :class:`PlanResult`, with a :class:`LengthResult` per ``--lengths``
length and the :class:`LongestPlan`, which the Markdown report (:mod:`~lightning_ckpt.commands.plan.report`) and
``plan.json`` and ``plan.png`` (:mod:`~lightning_ckpt.commands.plan.plan_files`) write out.

Example::

    >>> plan = CheckpointPlan({"a": "full"}, 100, 50, 60, 9, 10, predicted_step_seconds=4.0)
    >>> LongestPlan(fitted=1000, length=1000, batch_size=4, plan=plan, plan_error=None).seconds_per_token()
    0.001
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_ckpt.commands.plan.build import Built
from lightning_ckpt.commands.plan.measure import Measurement
from lightning_ckpt.commands.plan.static_memory import HostMemory, StaticMemory
from lightning_ckpt.commands.plan.predictions import SettingRow
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import CheckpointPlan


@dataclass
class LengthResult:
    """One length of ``--lengths``: the step measured at ``batch_size`` x ``length``, the plan for the budget there
    (or why there is none) and every setting's predictions."""

    length: int
    batch_size: int
    plan: Optional[CheckpointPlan]
    plan_error: Optional[str]
    rows: list[SettingRow]
    #: the least activation peak a plan with the plan's own settings (offload, compression) reaches at this length
    least_peak_bytes: int = 0


@dataclass
class LongestPlan:
    """The plan at the longest length its own settings fit in device memory: ``fitted`` from the fit of the least
    peak over ``--lengths``, ``length`` where the step was measured again and the plan made for device memory less
    static memory (or why there is none: ``plan_error``). ``capped``: the model's length limit, where it is below
    ``fitted``."""

    fitted: int
    length: int
    batch_size: int
    plan: Optional[CheckpointPlan]
    plan_error: Optional[str]
    least_peak_bytes: int = 0
    capped: Optional[tuple[str, int]] = None
    #: why each shorter length was measured: ``"overshot"`` (the least peak was over the room), ``"host_memory"`` (no
    #: plan fit the host memory for offload) or ``"no_plan"`` (none within the room all the same)
    shortened: list[str] = field(default_factory=list)

    def seconds_per_token(self) -> Optional[float]:
        """The plan's predicted step time over the tokens of its step; ``None`` without a plan or a device.

        Example::

            >>> plan = CheckpointPlan({"a": "full"}, 100, 50, 60, 9, 10, predicted_step_seconds=2.0)
            >>> LongestPlan(1000, 1000, 2, plan, None).seconds_per_token()
            0.001
        """
        if self.plan is None or self.plan.predicted_step_seconds is None:
            return None
        return self.plan.predicted_step_seconds / (self.batch_size * self.length)


@dataclass
class PlanResult:
    """What ``lightning-ckpt plan`` found: everything :func:`~lightning_ckpt.commands.plan.report.render`,
    :func:`~lightning_ckpt.commands.plan.plan_files.report_data` and
    :func:`~lightning_ckpt.commands.plan.plan_files.plot` report.

    ``rows`` are the settings at ``main``'s batch (with the fit over ``batch_sizes`` and the largest batch when
    ``device_memory`` is given); ``lengths``, ``length_fit`` and ``largest_length`` are only filled with
    ``--lengths``.
    """

    title: str
    built: Built
    main: Measurement
    plan: Optional[CheckpointPlan]
    plan_error: Optional[str]
    budget: object
    rows: list[SettingRow]
    static: StaticMemory
    device_memory: Optional[int] = None
    batch_sizes: list[int] = field(default_factory=list)
    front: list[dict[str, Any]] = field(default_factory=list)
    profile: Optional[DeviceProfile] = None
    lengths: list[LengthResult] = field(default_factory=list)
    #: "quadratic" (3 or more lengths), "linear" (2), or None: how each setting's peak is fitted over the length.
    length_fit: Optional[str] = None
    #: setting -> the largest length that fits ``device_memory`` at ``main``'s batch (``None``: unbounded); ``"plan"``:
    #: the longest at which the plan's own settings reach it (see ``longest``).
    largest_length: dict[str, Optional[int]] = field(default_factory=dict)
    #: the plan at its longest length (with ``--device-memory`` and 2 or more lengths)
    longest: Optional[LongestPlan] = None
    #: the host memory planned with (``--host-memory`` or this machine's); ``None``: not told (the planner's default)
    host_memory: Optional[HostMemory] = None
