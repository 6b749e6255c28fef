"""Op-level recompute: for one layer, which op outputs to keep, and what each choice holds and costs.

Under torch's selective checkpointing (``create_selective_checkpoint_contexts``), a checkpointed layer keeps its
inputs plus the outputs of the ops its policy marks ``MUST_SAVE``; in backward it re-runs its forward, returning
the kept outputs from the cache and recomputing every other op up to the last one that saves a tensor for backward
(torch stops recomputing there). So keeping op ``i`` costs the bytes of the storages it creates and saves its
recompute cost, independently of the other ops: a layer's choices form a curve of (bytes held, recompute cost)
points, from keeping nothing (full checkpointing) to keeping every op that may be kept.

Not every op may be kept (:func:`op_records` classifies them):

- views and ops whose outputs alias their inputs create nothing to keep; they are recomputed (mostly for free);
- an op that writes a storage in place, and the op that created that storage, are always recomputed: torch refuses
  a cached tensor that was mutated, and a cached in-place result would not reach the tensor the code goes on using;
- ops that create the layer's outputs are recomputed (the caller may mutate them);
- random ops (``nondeterministic_seeded``: dropout, attention kernels) are kept all together or recomputed all
  together: the recompute replays the RNG from the layer's start, so skipping one would shift the others' numbers;
- ops after the last one that saves for backward are neither recomputed nor worth keeping.

Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    >>> records = record_ops(mlp, torch.randn(4, 8, requires_grad=True))
    >>> [(r.op.split(".")[1], r.kind) for r in records]  # t: a view; the last addmm runs after the last save
    [('t', 'recompute'), ('addmm', 'free'), ('tanh', 'free'), ('t', 'recompute'), ('addmm', 'after')]
    >>> [(p.keep, p.bytes, p.flops) for p in op_curve(records)]  # keep nothing; the first matmul; the tanh too
    [((), 0, 2176), ((1,), 512, 128), ((1, 2), 1024, 0)]
    >>> describe(records, (1,))
    'keeps addmm; recomputes tanh'
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch.utils._pytree import tree_leaves

from lightning_ckpt.core.checkpoint.policies import COMPUTE_HEAVY_OPS
from lightning_ckpt.core.measure.profiling import OpRecordMode, OpRun, storage_key

__all__ = ["CurvePoint", "OpKind", "OpRecord", "add_records", "describe", "forward_peak", "op_curve", "op_records",
           "record_ops", "spread"]

OpKind = Literal["free", "random", "recompute", "after"]
_HEAVY = frozenset(str(op) for op in COMPUTE_HEAVY_OPS)
# A layer's curve is exact (every Pareto-optimal choice) up to this many points; beyond, thinned evenly in bytes.
_MAX_CURVE_POINTS = 512


@dataclass(frozen=True)
class OpRecord:
    """One op of a layer's forward, at its position among the ops a selective-checkpoint policy sees."""

    op: str  # the ATen overload, e.g. "aten.addmm.default"
    bytes: int  # bytes of the storages it creates: what keeping its outputs holds
    flops: int  # its recompute cost (see lightning_ckpt.core.measure.profiling.op_cost)
    io_bytes: int  # bytes it reads and writes (for a memory-bound time estimate)
    kind: OpKind = "free"
    #: In a forward that keeps no op's outputs (checkpointed), the position of the op before which what this op
    #: created is freed (the number of ops: alive to the end); ``None``: not recorded. See :func:`forward_peak`.
    freed: Optional[int] = None

    @property
    def heavy(self) -> bool:
        """Matmul, convolution or attention: the ops ``mode="selective"`` keeps."""
        return self.op in _HEAVY

    @property
    def recomputed_if_dropped(self) -> bool:
        return self.kind != "after"


def op_records(runs: Sequence[OpRun], last_position: int, outputs: Iterable[tuple[Any, int]]) -> tuple[OpRecord, ...]:
    """Classify the ops of one plain forward of a layer (see the module docstring).

    ``runs`` from :class:`~lightning_ckpt.core.measure.profiling.OpRecordMode`; ``last_position``: the mode's log length when
    the last tensor was saved for backward; ``outputs``: the storages of the layer's outputs.
    """
    kinds: list[OpKind] = ["free" if run.created else "recompute" for run in runs]
    creator: dict[tuple[Any, int], int] = {}  # storage -> the op that created it (addresses are reused: the latest)
    output_creators = set()
    for i, run in enumerate(runs):
        for key in run.written:
            kinds[i] = "recompute"
            if key in creator:
                kinds[creator[key]] = "recompute"
        creator.update(dict.fromkeys(run.created, i))
    for key in outputs:
        if key in creator:
            output_creators.add(creator[key])
    for i in output_creators:
        kinds[i] = "recompute"
    for i, run in enumerate(runs):
        if run.position > last_position:
            kinds[i] = "after"
    seeded = torch.Tag.nondeterministic_seeded
    random = [i for i, run in enumerate(runs) if kinds[i] != "after" and seeded in run.op.tags]
    together: OpKind = "recompute" if any(kinds[i] == "recompute" for i in random) else "random"
    for i in random:
        kinds[i] = together
    return tuple(OpRecord(str(run.op), sum(run.created.values()), run.flops, run.io_bytes, kind)
                 for run, kind in zip(runs, kinds))


def add_records(a: Optional[tuple[OpRecord, ...]], b: tuple[OpRecord, ...]) -> Optional[tuple[OpRecord, ...]]:
    """Two calls of one layer, position by position (``None`` when their ops differ: no op-level choice then)."""
    if a is None or [(r.op, r.kind) for r in a] != [(r.op, r.kind) for r in b]:
        return None
    return tuple(OpRecord(x.op, x.bytes + y.bytes, x.flops + y.flops, x.io_bytes + y.io_bytes, x.kind,
                          None if x.freed is None or y.freed is None else max(x.freed, y.freed))
                 for x, y in zip(a, b))


def forward_peak(records: Sequence[OpRecord], keep: Iterable[int]) -> Optional[int]:
    """The most bytes the ops of a layer's forward have alive at once, checkpointed and keeping the outputs of the
    ops at positions ``keep`` (alive from their op to the end of the forward; every other op's outputs are freed when
    they are in a forward that keeps nothing, ``OpRecord.freed``): beyond the layer's inputs. ``None`` where the
    records have no ``freed``.

    Example::

        >>> mm, exp, mul = (OpRecord(op, 100, 1, 0, freed=f)
        ...                 for op, f in [("aten.mm.default", 2), ("aten.exp.default", 3), ("aten.mul.Tensor", 3)])
        >>> forward_peak([mm, exp, mul], ()), forward_peak([mm, exp, mul], [0])  # mm's output freed once exp ran
        (200, 300)
    """
    if any(r.freed is None for r in records):
        return None
    kept = set(keep)
    freed_before = [0] * (len(records) + 1)
    for i, r in enumerate(records):
        if i not in kept:
            freed_before[min(max(r.freed or 0, i + 1), len(records))] += r.bytes
    alive = most = 0
    for i, r in enumerate(records):
        alive += r.bytes - freed_before[i]
        most = max(most, alive)
    return most


def record_ops(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[OpRecord, ...]:
    """:func:`op_records` of one plain forward of ``layer`` (run here, its result dropped)."""
    with OpRecordMode() as mode:
        last = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            last[0] = len(mode.log)
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = layer(*args, **kwargs)
    keys = [storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return op_records(mode.runs, last[0], keys)


@dataclass(frozen=True)
class CurvePoint:
    """Keep the outputs of the ops at positions ``keep``: ``bytes`` held beyond the layer's inputs, ``flops``
    recomputed."""

    keep: tuple[int, ...]
    bytes: int
    flops: int


def _items(records: Sequence[OpRecord]) -> list[tuple[int, int, tuple[int, ...]]]:
    """What may be kept: ``(bytes, flops saved, positions)``, each free op alone and the random ops as one."""
    items = [(r.bytes, r.flops, (i,)) for i, r in enumerate(records) if r.kind == "free"]
    random = tuple(i for i, r in enumerate(records) if r.kind == "random")
    if random:
        items.append((sum(records[i].bytes for i in random), sum(records[i].flops for i in random), random))
    return [item for item in items if item[1] > 0]  # keeping what costs nothing to recompute only holds bytes


@functools.lru_cache(maxsize=4096)
def op_curve(records: tuple[OpRecord, ...]) -> tuple[CurvePoint, ...]:
    """The Pareto front of (bytes held, recompute FLOPs) over what may be kept, fewest bytes first.

    Exact (a 0/1 knapsack front, built item by item) while it has at most 512 points; thinned evenly in bytes
    beyond. The first point keeps nothing (full checkpointing); every point is reachable as it stands.
    """
    full = sum(r.flops for r in records if r.recomputed_if_dropped)
    # (bytes, -flops saved, kept), bytes ascending: tuples sort without a key, and two sorted runs merge in one pass
    front: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, ())]
    for nbytes, saved, keep in sorted(_items(records), key=lambda item: -item[1] / max(item[0], 1)):
        merged = sorted(front + [(b + nbytes, s - saved, k + keep) for b, s, k in front])
        front = []
        for point in merged:  # keep a point only if it saves more than every point with fewer bytes
            if not front or point[1] < front[-1][1]:
                front.append(point)
        if len(front) > _MAX_CURVE_POINTS:
            front = _thin(front, _MAX_CURVE_POINTS)
    return tuple(CurvePoint(tuple(sorted(k)), b, full + s) for b, s, k in front)


def _thin(front: list[Any], n: int) -> list[Any]:
    """At most ``n`` points of a front sorted by bytes: the first, the last, and the most saving in each of
    ``n - 2`` equal slices of bytes between."""
    lo, hi = front[0][0], front[-1][0]
    width = (hi - lo) / max(n - 2, 1) or 1
    best: dict[int, Any] = {}
    for point in front[1:-1]:
        slot = int((point[0] - lo) / width)
        if slot not in best or point[1] < best[slot][1]:
            best[slot] = point
    return [front[0], *(best[s] for s in sorted(best)), front[-1]]


def spread(points: Sequence[CurvePoint], n: int) -> list[CurvePoint]:
    """At most ``n`` of a curve's points for the knapsack across layers: both ends, and points evenly spaced in
    bytes between (the solver's cost grows with points per layer)."""
    if len(points) <= n:
        return list(points)
    lo, hi = points[0].bytes, points[-1].bytes
    chosen = {0, len(points) - 1}
    j = 0
    for k in range(1, n - 1):
        target = lo + (hi - lo) * k / (n - 1)
        while j < len(points) - 1 and points[j].bytes < target:
            j += 1
        chosen.add(j)
    return [points[i] for i in sorted(chosen)]


def describe(records: Sequence[OpRecord], keep: Iterable[int]) -> str:
    """What an op-level choice keeps and recomputes, by op name: ``'keeps addmm; recomputes gelu, mul x2'``."""
    kept = set(keep)

    def names(positions: Iterable[int]) -> str:
        counts = Counter(records[i].op.split(".")[1] for i in positions)
        return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items()) or "nothing"

    recomputed = [i for i, r in enumerate(records) if r.recomputed_if_dropped and i not in kept and r.bytes]
    return f"keeps {names(sorted(kept))}; recomputes {names(recomputed)}"
