"""Timing one layer on the device it runs on: its forward and backward plainly, fully checkpointed and selectively
checkpointed, interleaved, medians. What the planner prices a layer's choice by when it was measured here
(:func:`~lightning_ckpt.core.measure.timing.extra_seconds`), instead of a roofline from FLOPs and bytes. Plain PyTorch.

The runs are timed with every outer dispatch mode (op recorders, FLOP counters) and saved-tensor hook (byte
counters) set aside, so they cost what a training step's layer costs, not what a measuring step's does. On an
accelerator each run is synchronized before the clock is read.

Example::

    >>> from torch import nn
    >>> layer, x = nn.Linear(64, 64), torch.randn(8, 64, requires_grad=True)
    >>> def run(mode: str) -> None:
    ...     torch.autograd.grad(layer(x).sum(), [x])
    >>> times = time_modes(run, ("plain", "full"), torch.device("cpu"))
    >>> sorted(times), all(ns > 0 for ns in times.values())
    (['full', 'plain'], True)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["TIMING_ROUNDS", "TIMING_SECONDS", "time_modes", "timing_limits"]

#: Rounds of each mode a layer is timed in, at most: the median is taken. Three keep a measuring step's extra cost
#: near nine forward and backward runs of one layer (five, with a warm-up run of each, cost twice as much: a second on
#: a 60-step CPU run of the long-tailed benchmark, where the plans gained nothing from the steadier figures).
TIMING_ROUNDS = 3
#: No round starts once the rounds so far took this many seconds: a large layer, whose one run is long enough to time
#: well, is timed once (a demo GPT's layer at 3,072 tokens on a 2-core CPU: 60 ms a run). At 0.1 s the timing cost a
#: 60-step run of the long-tailed benchmark about a tenth of its time (budget runs 0.92-0.98 of every layer's, against
#: 0.80-0.88 priced by FLOPs); at 0.03 s, 0.81-0.88.
TIMING_SECONDS = 0.03


#: The limits :func:`time_modes` takes when not given: :data:`TIMING_ROUNDS` and :data:`TIMING_SECONDS`, or what
#: :func:`timing_limits` sets.
_LIMITS: ContextVar[tuple[int, float]] = ContextVar("timing_limits", default=(TIMING_ROUNDS, TIMING_SECONDS))


@contextmanager
def timing_limits(rounds: int, seconds: float) -> Iterator[None]:
    """Layers timed inside are timed in up to ``rounds`` rounds and ``seconds``: for a one-off measurement whose
    figures are read as they are (``compare``'s predicted column), where a measuring step in training keeps its
    timing short. A longer window lets the median pass over a slow spell of a shared machine.

    Example::

        >>> with timing_limits(9, 0.5):
        ...     times = time_modes(lambda mode: None, ("plain",), torch.device("cpu"))
    """
    if rounds < 1 or seconds <= 0:
        raise ValueError(f"`timing_limits({rounds!r}, {seconds!r})`: pass at least 1 round and more than 0 seconds.")
    token = _LIMITS.set((rounds, seconds))
    try:
        yield
    finally:
        _LIMITS.reset(token)


def time_modes(run: Callable[[str], None], modes: Sequence[str], device: torch.device,
               rounds: Optional[int] = None, warm_up: bool = False, seconds: Optional[float] = None) -> dict[str, int]:
    """Nanoseconds of ``run(mode)`` for each of ``modes`` on ``device``: the median of up to ``rounds`` runs each,
    interleaved and in alternately reversed order (so a slow spell of a shared machine falls on every mode alike),
    no round started once ``seconds`` have been spent timing (either not given: :func:`timing_limits`'s, else
    :data:`TIMING_ROUNDS` and :data:`TIMING_SECONDS`); with ``warm_up``, after one untimed run of each (the
    measuring step's re-run of a layer has warmed it already)."""
    default_rounds, default_seconds = _LIMITS.get()
    rounds = default_rounds if rounds is None else rounds
    seconds = default_seconds if seconds is None else seconds
    if rounds < 1:
        raise ValueError(f"`rounds={rounds!r}` must be 1 or more: the number of timed runs of each mode.")
    samples: dict[str, list[int]] = {mode: [] for mode in modes}
    with _undisturbed():
        for mode in modes if warm_up else ():
            run(mode)
        for i in range(rounds):
            for mode in modes if i % 2 == 0 else reversed(modes):
                _synchronize(device)
                start = time.perf_counter_ns()
                run(mode)
                _synchronize(device)
                samples[mode].append(time.perf_counter_ns() - start)
            if sum(map(sum, samples.values())) >= seconds * 1e9:
                break
    return {mode: int(statistics.median(ns)) for mode, ns in samples.items()}


@contextmanager
def _undisturbed() -> Iterator[None]:
    """No outer dispatch mode and no saved-tensor hook, whatever counters the caller runs under."""
    with _disable_current_modes(), _no_saved_tensors_hooks():
        yield


@contextmanager
def _no_saved_tensors_hooks() -> Iterator[None]:
    """The saved-tensor hooks set aside (popped, and pushed back in order after), so that a plain run saves its
    tensors as a training step does. Identity hooks pushed on top would not do: each saved tensor would go through
    Python, in a plain run but not in a checkpointed one (whose own hooks are innermost), which on a 2-core CPU put
    about 0.1 ms on a small transformer block's plain run and took it off what checkpointing it adds. Where torch
    does not show the stack, identity hooks are what it gets."""
    autograd = torch._C._autograd
    if not hasattr(autograd, "_top_saved_tensors_default_hooks"):
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            yield
        return
    hooks = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        hooks.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
