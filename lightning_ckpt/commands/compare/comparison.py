"""One ``compare`` run, whole (:class:`Comparison`): every variant's result, the settings they ran with, and the time
model behind the predicted column. It is what :mod:`~lightning_ckpt.commands.compare.report` renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_ckpt.commands.compare.run import schedule
from lightning_ckpt.commands.compare.stats import TimeModel, VariantResult

#: The default gradient and loss tolerances: relative, and absolute.
RTOL, ATOL = 1e-3, 1e-6


@dataclass
class Comparison:
    """Every variant's result, the baseline (no checkpointing) first, with the settings of the runs.

    ``time_model`` is what the predicted column is priced from (``None``: there is none, ``no_time_model`` says
    why); ``unpredicted`` lists the variants it could not price, and why
    (:func:`~lightning_ckpt.commands.compare.stats.predict_variants`).

    Example::

        >>> c = Comparison([VariantResult("none"), VariantResult("every_2nd")], Path("tiny.yaml"), [5, 5])
        >>> c.steps, c.baseline.name, c.order
        (10, 'none', [(0, 'none'), (0, 'every_2nd'), (1, 'every_2nd'), (1, 'none')])
    """

    results: list[VariantResult]
    config: Path
    steps_per_round: list[int]  # timed steps of each round's processes
    warmup: int = 0  # untimed steps at the start of each process
    seed: int = 0
    rtol: float = RTOL
    atol: float = ATOL
    time_model: Optional[TimeModel] = None
    unpredicted: list[str] = field(default_factory=list)
    no_time_model: str = ""

    @property
    def steps(self) -> int:
        """Timed steps per variant, all rounds together."""
        return sum(self.steps_per_round)

    @property
    def baseline(self) -> VariantResult:
        return self.results[0]

    @property
    def order(self) -> list[tuple[int, str]]:
        """The processes in the order they ran, ``(round, variant)``
        (:func:`~lightning_ckpt.commands.compare.run.schedule`)."""
        return schedule([r.name for r in self.results], len(self.steps_per_round))

    @property
    def exit_status(self) -> int:
        """2 when a variant failed to run, else 1 when one's loss or gradients differ from the baseline's, else 0."""
        if any(r.error for r in self.results):
            return 2
        return 1 if any(r.mismatch for r in self.results) else 0
