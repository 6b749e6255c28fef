"""Choosing one option per layer: what each checkpointing (and offload) choice of a layer holds and costs
(:class:`LayerOption`, :func:`layer_options`), and the cheapest choice per layer that fits a bound on the step's
activation peak (:func:`solve`, :func:`choose`, :func:`held_peak`). Plain PyTorch (numpy for the knapsack).

Example::

    >>> a = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
    ...               full_flops=50, selective_flops=5)
    >>> [o.choice for o in solve([layer_options(a), layer_options(a)], 120)]
    ['selective', 'selective']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy

from lightning_ckpt.core.checkpoint.offload import DEFAULT_MIN_BYTES
from lightning_ckpt.core.measure.costs import PLAN_MODES, Choice, LayerCost, Offload
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.op_curve import op_curve, spread
from lightning_ckpt.core.measure.timing import exposed_transfer_seconds, extra_seconds

__all__ = ["CURVE_POINTS", "LayerOption", "cheapest_choices", "choose", "held_peak", "kept_on_device", "layer_options",
           "chosen_transients", "layer_transients", "make_option", "solve"]

# Where the bytes' common divisor would make too many quanta, bytes are counted in quanta of the shortfall (the bytes
# to free): max(8192, 256 * layers) of them, fewer when the layers have many points (the work is layers x points x
# quanta). Rounding each option down costs at most one quantum per layer.
_UNITS = 1 << 13
_WORK = 4 * 10**8
_MIN_UNITS = 2048
#: Points of a layer's op-level curve offered to the solver (both ends and points evenly spaced in bytes between).
CURVE_POINTS = 24


@dataclass(frozen=True)
class LayerOption:
    """One choice for one layer: its mode, what it holds on the device (and, offloaded, in host memory), what it
    costs, and (``"ops"``) the positions of the ops whose outputs it keeps. (``planner.Option`` is the same class.)"""

    choice: Choice
    device_bytes: int
    flops: int
    keep: tuple[int, ...] = ()
    seconds: float = 0.0  # predicted extra step time on a device profile (0 without one)
    host_bytes: int = 0  # moved to host memory by the offload engine (0: not offloaded)
    #: What its backward has alive beyond the layer's measured backward peak: a selectively checkpointed layer's
    #: recompute brings back a hidden state (its input's size, exact) next to the outputs it kept. Also where its
    #: forward peaks above that backward (:attr:`LayerCost.selective_forward_bytes`): the layers before it hold the
    #: same then, and the head holds nothing yet, so the bound of its backward bounds its forward too.
    backward_extra: int = 0

    def cost(self, timed: bool) -> float:
        return self.seconds if timed else self.flops


def make_option(cost: LayerCost, choice: Choice, keep: Sequence[int] = (), moved: bool = False,
                device: Optional[DeviceProfile] = None, window: tuple[float, float] = (0.0, 0.0),
                min_bytes: int = DEFAULT_MIN_BYTES) -> LayerOption:
    """``cost``'s layer checkpointed as ``choice`` (keeping the ops at ``keep``), its held tensors offloaded when
    ``moved``: what that holds and costs (seconds on ``device``, see :func:`layer_options`)."""
    host = cost.movable_bytes(choice, min_bytes) if moved else 0
    seconds = 0.0
    if device is not None:
        seconds = extra_seconds(cost, choice, keep, device) + exposed_transfer_seconds(host, device, window)
    elif cost.timed:  # on the device it ran on (see timing.priced_by_time)
        seconds = extra_seconds(cost, choice, keep, None)
    # A selective layer's backward brings back a hidden state next to the outputs it kept; a layer that keeps
    # outputs may peak higher still in its forward (LayerCost.forward_bytes), counted as much more here.
    extra = cost.exact_input_bytes if choice == "selective" else 0
    forward = cost.forward_bytes(choice, keep)
    if forward is not None:
        extra = max(extra, forward - cost.backward_peak)
    return LayerOption(choice, cost.device_bytes(choice, False, keep) - host, cost.flops(choice, keep), tuple(keep),
                       seconds, host, extra)


def layer_options(cost: LayerCost, modes: Sequence[str] = PLAN_MODES, offload: Offload = False,
                  points: int = CURVE_POINTS, device: Optional[DeviceProfile] = None,
                  window: tuple[float, float] = (0.0, 0.0), min_bytes: int = DEFAULT_MIN_BYTES) -> list[LayerOption]:
    """``"none"`` first, then each mode in ``modes`` that frees device bytes; ``"ops"``: points of the layer's
    op-level curve (:func:`~lightning_ckpt.core.measure.op_curve.op_curve`) other than keeping nothing.

    ``offload=True`` moves every checkpointed choice's inputs to host memory; ``"auto"`` offers each choice both
    ways, ``"none"`` included (all the layer saves goes to the host). What moves is what the engine moves
    (:meth:`LayerCost.movable_bytes`). With a ``device`` profile each option is priced in seconds
    (:func:`extra_seconds`, plus the part of its transfers that ``window`` cannot hide: see
    :func:`exposed_transfer_seconds`), and its cost is that; else its FLOPs. An option that holds (on the device
    and the host) and costs no less than another is left out (of equals, the first stays).

    Example::

        >>> cost = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                  full_flops=50, selective_flops=5)
        >>> [(o.choice, o.device_bytes, o.flops) for o in layer_options(cost)]
        [('none', 100, 0), ('full', 10, 50), ('selective', 40, 5)]
    """
    def option(choice: Choice, keep: tuple[int, ...] = (), moved: bool = False) -> LayerOption:
        return make_option(cost, choice, keep, moved, device, window, min_bytes)

    plain: list[tuple[Choice, tuple[int, ...]]] = [("none", ())] + [(m, ()) for m in ("full", "selective") if m in modes]  # type: ignore[misc]
    if "ops" in modes and cost.ops:
        plain += [("ops", p.keep) for p in spread(op_curve(cost.ops), points)[1:]]  # [0] keeps nothing: full
    if offload == "auto":
        options = [option(c, k) for c, k in plain] + [option(c, k, True) for c, k in plain if cost.movable_bytes(c, min_bytes)]
    else:
        options = [option(c, k, bool(offload) and c != "none") for c, k in plain]
    useful = [o for o in options if o.choice == "none" or o.device_bytes < cost.none_bytes]
    timed = device is not None or cost.timed

    def dominated(i: int, option: LayerOption) -> bool:
        mine = (option.device_bytes, option.cost(timed), option.host_bytes)
        return any(all(a <= b for a, b in zip(theirs, mine)) and (j < i or theirs != mine)
                   for j, o in enumerate(useful) if j != i
                   for theirs in [(o.device_bytes, o.cost(timed), o.host_bytes)])

    return [option for i, option in enumerate(useful) if not dominated(i, option)]


def solve(options: Sequence[Sequence[LayerOption]], need_bytes: int, timed: bool = False,
          host_price: float = 0.0, transients: Sequence[int] = (), head: int = 0) -> list[LayerOption]:
    """One option per layer (``options[i][0]`` holding the most) that frees at least ``need_bytes`` of device memory
    with the least total cost (``timed``: predicted seconds, else FLOPs; plus ``host_price`` per host byte, the
    Lagrange multiplier :func:`choose` uses to keep host memory in bounds).

    With ``transients`` (each layer's :attr:`LayerCost.backward_peak`) the bound holds over the backward too: when
    layer ``i``'s backward runs, the layers before it still hold what they chose and layer ``i`` has
    ``transients[i]`` alive (and what its option adds there, :attr:`LayerOption.backward_extra`), and that must not
    exceed what the forward of all layers is allowed to end with. So the layers before ``i`` must free at least
    ``need_bytes - sum(options[j][0] for j >= i) + transients[i] + backward_extra``: a floor per option.
    With ``head``, what the head's backward makes at its start (all the forward holds still held), all layers
    together must free ``need_bytes + head``.

    A multiple-choice knapsack by dynamic programming over freed bytes, in quanta of the bytes' greatest common
    divisor (exact) where that makes few enough steps, else in at least 2048 steps; the backward's bounds are floors
    on what the layers before each one free. Each option's freed bytes are rounded down and each floor up, so the result always frees what is asked.
    Ties go to the earlier option: the result is deterministic. Raises ``ValueError`` when even the largest saving
    of every layer is not enough.

    Example::

        >>> a = [LayerOption("none", 100, 0), LayerOption("full", 10, 50)]
        >>> [o.choice for o in solve([a, a, a], 90)]  # the end of the forward alone: the first layer frees 90
        ['full', 'none', 'none']
        >>> [o.choice for o in solve([a, a, a], 90, transients=[120] * 3)]  # the last backward: 200 - 90 + 120
        ['full', 'full', 'none']
    """
    base = [opts[0] for opts in options]
    freed = [[opts[0].device_bytes - o.device_bytes for o in opts] for opts in options]
    floors = _backward_floors(base, need_bytes, transients)
    # A layer's own option can add to its backward (LayerOption.backward_extra): its floor is per option.
    option_floors = [[f + o.backward_extra if transients else f for o in opts] for f, opts in zip(floors, options)]
    need_bytes += head
    hardest = max([need_bytes, *(max(fs) for fs in option_floors)])
    if hardest <= 0:
        return base
    most = list(itertools.accumulate((max(f) for f in freed), initial=0))
    short = [(floor, most[i]) for i, floor in enumerate([*floors, need_bytes]) if most[i] < floor]
    if short:
        floor, reach = short[0]
        raise ValueError(f"at most {reach} bytes can be freed, {floor} are needed")
    points = sum(len(opts) for opts in options)
    most_units = max(_MIN_UNITS, min(max(_UNITS, 256 * len(options)), _WORK // max(points, 1)))
    # What the options free shares a divisor (element sizes, shapes): every sum of them is a multiple of it, so in
    # quanta of it (the floors rounded up) the knapsack is exact, where that makes few enough quanta.
    divisor = math.gcd(*(f for fs in freed for f in fs)) or 1
    if math.ceil(hardest / divisor) <= most_units:
        quantum, units = divisor, math.ceil(hardest / divisor)
    else:
        quantum, units = hardest / most_units, most_units
    def in_units(nbytes: float) -> int:  # rounded up: towards safety
        return min(units, math.ceil(nbytes / quantum)) if nbytes > 0 else 0

    end = in_units(need_bytes)
    index = numpy.arange(units + 1)
    best = numpy.full(units + 1, math.inf)  # best[j]: least cost of the layers so far freeing >= j quanta
    best[0] = 0.0
    picks, steps, lows = [], [], []
    for opts, layer_freed, floors_here in zip(options, freed, option_floors):
        step = [min(units, int(f // quantum)) for f in layer_freed]
        # Option k: the layers before free >= its floor (this layer's backward), then it frees step[k] more.
        low = [in_units(f) for f in floors_here]
        new, pick = numpy.full(units + 1, math.inf), numpy.zeros(units + 1, dtype=numpy.int16)
        for k in range(len(opts)):
            candidate = best[numpy.maximum(index - step[k], low[k])] + _priced(opts[k], timed, host_price)
            better = candidate < new  # strict: ties keep the earlier option
            new[better] = candidate[better]
            pick[better] = k
        best = new  # non-decreasing in j, as each candidate is
        picks.append(pick)
        steps.append(step)
        lows.append(low)
    if math.isinf(float(best[end])):  # rounding lost the little slack there was
        return [opts[max(range(len(opts)), key=lambda k: (f[k], -_priced(opts[k], timed, host_price)))]
                for opts, f in zip(options, freed)]
    chosen, j = [], end
    for opts, step, pick, low in zip(reversed(options), reversed(steps), reversed(picks), reversed(lows)):
        k = int(pick[j])
        chosen.append(opts[k])
        j = max(j - step[k], low[k])
    return chosen[::-1]


def _backward_floors(base: Sequence[LayerOption], need_bytes: int, transients: Sequence[int]) -> list[int]:
    """What the layers before each layer must free for its backward to fit (see :func:`solve`); none without
    ``transients``."""
    if not transients:
        return [0] * len(base)
    after = list(itertools.accumulate((o.device_bytes for o in reversed(base)), initial=0))[::-1]
    return [need_bytes - after[i] + t for i, t in enumerate(transients)]


def layer_transients(costs: Sequence[LayerCost], head_bytes: int = 0) -> list[int]:
    """What each layer's backward has alive at once (:attr:`LayerCost.backward_peak`), less the ``head_bytes`` the
    step saved after the last layer: the backward frees those before it reaches the layers. The ``transients`` of
    :func:`held_peak` and :func:`solve`.

    Example::

        >>> cost = LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...                  full_flops=50, selective_flops=5, transient_bytes=150)
        >>> layer_transients([cost], head_bytes=20)
        [130]
    """
    return [c.backward_peak - head_bytes for c in costs]


def chosen_transients(transients: Sequence[int], chosen: Sequence[LayerOption]) -> list[int]:
    """Each layer's backward transient (:func:`layer_transients`) with its chosen option's
    :attr:`LayerOption.backward_extra`."""
    return [t + o.backward_extra for t, o in zip(transients, chosen)]


def held_peak(held: Sequence[int], transients: Sequence[int], host: Sequence[int] = (), head: int = 0) -> int:
    """The most bytes the layers hold at once in a step: at the start of the backward (all the forward holds, with
    the offload engine's newest offloaded layer still on the device, and the ``head`` bytes the head's backward
    makes), or during any layer's backward, where the layers before it still hold ``held`` and it has
    ``transients[i]`` alive (and the engine brings back the next offloaded layer's inputs).

    Example::

        >>> held_peak([10, 10, 100], [120, 120, 120])  # the last layer's backward: 10 + 10 + 120
        140
        >>> held_peak([10, 0, 0], [120, 120, 120], host=[0, 90, 90])  # one offloaded layer back, one kept
        220
    """
    def newest(upto: int) -> int:  # the host bytes of the newest offloaded layer before `upto`
        return next((b for b in reversed(host[:upto]) if b), 0)

    end = sum(held) + newest(len(held)) + head
    during = [sum(held[:i]) + t + newest(i) for i, t in enumerate(transients)]
    return max([end, *during])


def _priced(option: LayerOption, timed: bool, host_price: float) -> float:
    return float(option.cost(timed)) + host_price * option.host_bytes


def choose(options: Sequence[Sequence[LayerOption]], need_bytes: int, timed: bool = False,
           host_memory: Optional[int] = None, transients: Sequence[int] = (),
           head: int = 0) -> Optional[list[LayerOption]]:
    """:func:`solve` with at most ``host_memory`` bytes offloaded (``None``: no limit), the engine's newest
    offloaded layer counted on the device, and (with ``transients`` and ``head``) the backward bounded as
    :func:`held_peak` predicts it; ``None`` when nothing fits.

    Host memory is a second constraint: each host byte is priced (a Lagrange multiplier, found by bisection) until
    the choice fits, so what no longer fits in host memory is recomputed instead. The offload engine keeps the newest
    offloaded layer's tensors on the device as well (backward needs them first), so those bytes are freed only on
    paper; when that breaks the budget the choice is made again, asked to free that much more (at most 8 rounds).
    Where that finds nothing (a choice that frees more than asked on paper comes back unchanged until the rounds run
    out), the repair is run once more, each round asking for the bytes over past what the last choice frees on
    paper, so that it cannot come back: a choice that fits is returned wherever either finds one, and the first
    repair's choice wherever it finds one.

    Example::

        >>> a = [LayerOption("none", 100, 0), LayerOption("full", 10, 50),
        ...      LayerOption("none", 0, 0, host_bytes=100)]
        >>> [(o.choice, o.host_bytes) for o in choose([a, a, a], 150)]  # the newest offloaded layer frees nothing
        [('none', 100), ('none', 100), ('none', 100)]
        >>> [(o.choice, o.host_bytes) for o in choose([a, a, a], 150, host_memory=100)]  # one offload would free 0
        [('full', 0), ('full', 0), ('none', 0)]
        >>> [(o.choice, o.host_bytes) for o in choose([a, a, a], 1)]  # one offload frees 100 on paper, 0 for real
        [('none', 100), ('none', 100), ('none', 0)]

    The bisection is a Lagrangian relaxation: where host memory binds, its choice can cost up to about one layer's
    cost more than the best that fits.
    """
    plain = sum(o[0].device_bytes for o in options)
    allowed = plain - need_bytes
    tried: dict[int, Optional[list[LayerOption]]] = {}  # by `need`: the second repair does not solve twice

    def within(need: int) -> Optional[list[LayerOption]]:
        if need not in tried:
            tried[need] = _within_host(options, need, timed, host_memory, transients, head)
        return tried[need]

    for past_paper in (False, True):  # the second repair only where the first finds nothing
        need = need_bytes
        for _ in range(8):  # `need` only grows, by the offloaded bytes still on the device: a few rounds settle it
            chosen = within(need)
            if chosen is None:
                break
            over = held_peak([c.device_bytes for c in chosen], chosen_transients(transients, chosen),
                             [c.host_bytes for c in chosen], head) - allowed
            if over <= 0:
                return chosen
            if past_paper:  # past what this choice frees on paper (it may free more than `need`): it cannot repeat
                need = max(need, plain - sum(c.device_bytes for c in chosen))
            need += over
    return None


def kept_on_device(chosen: Sequence[LayerOption]) -> int:
    """Offloaded bytes the engine still holds on the device at the end of forward: those of the newest offloaded
    layer, which backward needs first (:mod:`lightning_ckpt.core.checkpoint.offload`)."""
    return next((o.host_bytes for o in reversed(chosen) if o.host_bytes), 0)


def _within_host(options: Sequence[Sequence[LayerOption]], need: int, timed: bool, host_memory: Optional[int],
                 transients: Sequence[int] = (), head: int = 0) -> Optional[list[LayerOption]]:
    def host(chosen: Sequence[LayerOption]) -> int:
        return sum(o.host_bytes for o in chosen)

    try:
        chosen = solve(options, need, timed, transients=transients, head=head)
    except ValueError:
        return None
    if host_memory is None or host(chosen) <= host_memory:
        return chosen
    # A price above every cost there is makes host bytes the first thing to save; bisect down from there.
    high = 1.0 + sum(max(o.cost(timed) for o in opts) for opts in options)
    best = solve(options, need, timed, high, transients, head)
    if host(best) > host_memory:
        return None
    low = high * 1e-15
    for _ in range(40):
        price = math.sqrt(low * high)
        chosen = solve(options, need, timed, price, transients, head)
        if host(chosen) <= host_memory:
            best, high = chosen, price
        else:
            low = price
        if high / low < 1.01:
            break
    return best


def cheapest_choices(costs: Sequence[LayerCost], need_bytes: int, modes: Sequence[str] = PLAN_MODES,
                     offload: bool = False) -> list[Choice]:
    """The modes (one per layer) that free at least ``need_bytes`` of device memory with the fewest recompute FLOPs.

    :func:`solve` over :func:`layer_options`. Ties go to ``"none"``, then to the order of ``modes``.

    Example::

        >>> a = LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...               full_flops=50, selective_flops=5)
        >>> b = LayerCost("b", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
        ...               full_flops=80, selective_flops=8)
        >>> cheapest_choices([a, b], 120)  # 60 + 60 bytes for 5 + 8 FLOPs
        ['selective', 'selective']
        >>> cheapest_choices([a, b], 150)  # 90 + 60 for 50 + 8 is cheaper than 60 + 90 for 5 + 80
        ['full', 'selective']
    """
    return [o.choice for o in solve([layer_options(c, modes, offload) for c in costs], need_bytes)]
