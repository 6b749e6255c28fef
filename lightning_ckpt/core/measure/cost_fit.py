"""Costs fitted over the batch shape: predict a new batch size's layer costs from the sizes measured so far.

A layer's activations grow with the batch's tokens ``T`` (everything per token) and with ``T * L`` for a sequence
length ``L`` (attention's scores, ``batch * heads * L * L``), plus a constant. So every integer cost of a
measurement (held bytes, the peak's parts, FLOPs: the row :func:`~lightning_ckpt.core.plan.budget.pack_costs` writes)
is fitted as ``a + b * T + c * T * L`` by least squares over the measured sizes (:class:`CostFit`), and a new size
is planned from the fit, without a measuring step, where the fit is trusted (:meth:`CostFit.trusted`):

* it was made from at least :data:`MIN_SIZES` measured sizes and reproduces each of them within
  :data:`RESIDUAL_TOLERANCE` (costs that do not follow the model are never predicted);
* the new size lies inside the measured range, or at most :data:`EXTRAPOLATION` times beyond it, in tokens and in
  length, above the largest or below the smallest measured (the bounded extrapolation);
* its bucket has no failed check pending (:class:`~lightning_ckpt.core.plan.budget_cycle.BudgetCycle`).

Predictions are conservative: every cost is raised by :data:`MARGIN`, rounded up, kept at least what a measured
size it covers cost and at most what a measured size covering it cost. :func:`fit_peak` (the quadratic over
lengths of ``plan --lengths``) uses the same least squares.

Example::

    >>> fit = CostFit()
    >>> for tokens, length in [(32, 8), (128, 32), (256, 64)]:  # costs 100 + 3 T + 2 T L, then 7 (a count)
    ...     fit.add(tokens, length, [100 + 3 * tokens + 2 * tokens * length, 7])
    >>> fit.predict(64, 16, margin=0.0)  # 100 + 192 + 2048: a fourth size, exactly
    [2340, 7]
    >>> fit.trusted(64, 16), fit.trusted(256 * 16, 1024), fit.trusted(256 * 16 + 4, 1024)
    (True, True, False)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Optional

import torch

#: Measured sizes a fit needs before it predicts (three coefficients).
MIN_SIZES = 3
#: How far past the measured range (in tokens and in length, either way) a fit may predict.
EXTRAPOLATION = 16.0
#: How much each predicted cost is raised: the planned bytes of a predicted plan carry it.
MARGIN = 0.02
#: A fit must reproduce every measured cost within this fraction (of the largest measured value of that cost).
RESIDUAL_TOLERANCE = 0.01


def least_squares(columns: Sequence[Sequence[float]], values: Sequence[Sequence[float]]) -> torch.Tensor:
    """The coefficients ``[n_columns, n_values]`` minimising ``|columns^T @ coeffs - values|``, each column scaled by
    its largest magnitude first (``T * L`` in the millions beside a constant 1 is ill-conditioned).

    Example::

        >>> [round(c, 9) for c in least_squares([[1, 1, 1], [1, 2, 3]], [[3], [5], [7]]).squeeze(1).tolist()]  # 1 + 2 x
        [1.0, 2.0]
    """
    a = torch.tensor(columns, dtype=torch.float64).T
    scale = a.abs().amax(dim=0).clamp(min=1.0)
    b = torch.tensor(values, dtype=torch.float64)
    solution = torch.linalg.lstsq(a / scale, b, driver="gelsd").solution
    return solution / scale.unsqueeze(1)


def fit_peak(lengths: Sequence[int], peaks: Sequence[float]) -> tuple[float, float, float]:
    """``(c0, c1, c2)`` of ``peak = c0 + c1 * T + c2 * T**2`` over the sequence lengths ``T``: a quadratic (least
    squares) through 3 or more points, for attention's ``T**2`` terms; a line (``c2 = 0``) through 2.

    Example::

        >>> [round(c, 6) for c in fit_peak([1, 2, 3], [6, 17, 34])]  # 1 + 2 T + 3 T^2
        [1.0, 2.0, 3.0]
        >>> [round(c, 6) for c in fit_peak([4, 8], [140, 260])]
        [20.0, 30.0, 0.0]
    """
    if len(lengths) != len(peaks) or len(set(lengths)) < 2:
        raise ValueError(f"fit_peak: needs 2 or more distinct lengths with a peak each, got {list(lengths)}")
    degree = 2 if len(set(lengths)) >= 3 else 1
    columns = [[float(t) ** i for t in lengths] for i in range(degree + 1)]
    coeffs = least_squares(columns, [[float(p)] for p in peaks]).squeeze(1).tolist()
    return coeffs[0], coeffs[1], coeffs[2] if degree == 2 else 0.0


def _features(tokens: int, length: int) -> list[float]:
    return [1.0, float(tokens), float(tokens) * float(length)]


class CostFit:
    """Rows of integer costs measured at ``(tokens, length)`` sizes, fitted as ``a + b T + c T L`` each; see the
    module docstring. ``sizes`` lists the measured sizes, in order. All ranks add the same (combined) rows, so they
    fit, trust and predict alike.
    """

    def __init__(self) -> None:
        self.sizes: list[tuple[int, int]] = []
        self.rows: list[list[int]] = []
        self._coeffs: Optional[torch.Tensor] = None
        self._fits = False
        self.loose: frozenset[int] = frozenset()

    def add(self, tokens: int, length: int, row: Sequence[int], loose: Collection[int] = ()) -> None:
        """Record the costs ``row`` measured at ``tokens`` and ``length``; a row of another width (other layers)
        starts the fit anew. The entries at the positions ``loose`` (measured times: never twice the same) are
        fitted and predicted like the rest, but the fit is trusted whether or not it reproduces them."""
        if self.rows and len(row) != len(self.rows[0]):
            self.__init__()
        self.loose = frozenset(loose)
        if (tokens, length) in self.sizes:  # measured again (a failed check): the new row replaces the old
            i = self.sizes.index((tokens, length))
            del self.sizes[i], self.rows[i]
        self.sizes.append((tokens, length))
        self.rows.append([int(v) for v in row])
        self._refit()

    def _refit(self) -> None:
        self._coeffs, self._fits = None, False
        if len(self.sizes) < MIN_SIZES:
            return
        columns = list(zip(*(_features(t, n) for t, n in self.sizes)))
        coeffs = least_squares(columns, self.rows)
        fitted = torch.tensor([_features(t, n) for t, n in self.sizes], dtype=torch.float64) @ coeffs
        measured = torch.tensor(self.rows, dtype=torch.float64)
        scale = measured.abs().amax(dim=0).clamp(min=1.0)
        self._coeffs = coeffs
        close = (fitted - measured).abs() <= RESIDUAL_TOLERANCE * scale + 0.5
        close[:, sorted(self.loose)] = True
        self._fits = bool(close.all())

    def trusted(self, tokens: int, length: int) -> bool:
        """Whether the fit may predict ``(tokens, length)``: it reproduces what was measured, and the size is inside
        the measured range or at most :data:`EXTRAPOLATION` times past it (tokens and length, either way)."""
        if not self._fits:
            return False
        for value, measured in ((tokens, [t for t, _ in self.sizes]), (length, [n for _, n in self.sizes])):
            if value > max(measured) * EXTRAPOLATION or value * EXTRAPOLATION < min(measured):
                return False
        return True

    def predict(self, tokens: int, length: int, margin: float = MARGIN, keep: Sequence[int] = ()) -> list[int]:
        """The predicted row at ``(tokens, length)``: the fit raised by ``margin`` and rounded up, no less than any
        measured size it covers and no more than any measured size covering it; entries at the positions ``keep``
        (counts, not sizes) are the fit rounded, without the margin. Call only where :meth:`trusted` (or in tests).
        """
        if self._coeffs is None:
            raise RuntimeError(f"CostFit.predict: no fit yet ({len(self.sizes)} sizes measured, {MIN_SIZES} needed).")
        fitted = (torch.tensor([_features(tokens, length)], dtype=torch.float64) @ self._coeffs).squeeze(0).tolist()
        kept = set(keep)
        # A fit of integer rows reproduces them only to float precision (880,000.0000000016 on one CPU, exact on
        # another): a relative tolerance keeps that from adding a byte, as an absolute one cannot at millions.
        row = [round(v) if i in kept else max(0, math.ceil(v * (1 + margin) - 1e-9 * max(1.0, abs(v))))
               for i, v in enumerate(fitted)]
        for (t, n), measured in zip(self.sizes, self.rows):
            if t <= tokens and n <= length:  # a smaller measured size: costs do not shrink as the batch grows
                row = [r if i in kept else max(r, m) for i, (r, m) in enumerate(zip(row, measured))]
        for (t, n), measured in zip(self.sizes, self.rows):
            if t >= tokens and n >= length:  # a larger one: nor grow as it shrinks
                row = [r if i in kept else min(r, m) for i, (r, m) in enumerate(zip(row, measured))]
        return row


__all__ = ["EXTRAPOLATION", "MARGIN", "MIN_SIZES", "RESIDUAL_TOLERANCE", "CostFit", "fit_peak", "least_squares"]
