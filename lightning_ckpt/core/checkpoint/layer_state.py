"""Layer state: what a layer's forward changes in its own buffers, so that a recompute changes nothing.

A recomputed layer runs its forward a second time. Any buffer that forward updates (BatchNorm's running
statistics and ``num_batches_tracked``, a step counter) would be updated twice, and the recompute would
see the state the first forward left behind instead of the state it saw. :class:`LayerState` learns on
a layer's first training call which buffers its forward changes, snapshots only those before each later
forward (a constant buffer, such as a causal mask, is never copied again), and
:meth:`CallState.replayed` puts the snapshot back around the recompute and the forward's own result
after it. Plain PyTorch; nothing here imports Lightning.

Writes go through ``tensor.data``, which has a version counter of its own: autograd's saved copies of
a buffer (BatchNorm saves its running statistics for backward) are not invalidated, and the version
checks of reentrant and selective checkpointing do not fire.

Example::

    >>> import torch
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> with buffers_restored(bn):
    ...     _ = bn(torch.randn(4, 3))
    >>> int(bn.num_batches_tracked), bn.running_mean.abs().sum().item()
    (0, 0.0)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CallState", "LayerState", "Slot", "Snapshot", "buffer_slots", "buffers_restored"]

Slot = tuple[nn.Module, str]  # (owner module, buffer name): survives `.to()`, which replaces the tensors


def buffer_slots(module: nn.Module) -> list[Slot]:
    """Every buffer of ``module`` and its submodules, as (owner, name)."""
    return [(owner, name) for owner in module.modules() for name, buf in owner._buffers.items() if buf is not None]


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.data.copy_(src)


class Snapshot:
    """The buffers in ``slots`` as they are now: which tensor each name holds, and a copy of its values."""

    def __init__(self, slots: list[Slot]) -> None:
        self.entries = []
        for owner, name in slots:
            tensor = owner._buffers[name]
            self.entries.append((owner, name, tensor, tensor.detach().clone()))

    def restore(self) -> None:
        """Put every buffer back: the same tensor object under its name, with the values it had."""
        for owner, name, tensor, value in self.entries:
            owner._buffers[name] = tensor
            _write(tensor, value)

    def changed(self) -> list[Slot]:
        """The slots whose tensor was replaced or holds other values since the snapshot."""
        return [(owner, name) for owner, name, tensor, value in self.entries
                if owner._buffers[name] is not tensor or not torch.equal(tensor, value)]

    def keep_only(self, slots: set[Slot]) -> None:
        self.entries = [e for e in self.entries if (e[0], e[1]) in slots]


@contextmanager
def buffers_restored(module: nn.Module) -> Iterator[None]:
    """Run the block and then restore every buffer of ``module`` (values and identity) to what it was.

    For one-off extra forwards (measuring a layer) that must leave no trace in the model's state.
    """
    snapshot = Snapshot(buffer_slots(module))
    try:
        yield
    finally:
        snapshot.restore()


class CallState:
    """One forward call of a layer: the state of its changing buffers before the call."""

    def __init__(self, before: Snapshot, unchecked: list[tuple[Slot, torch.Tensor, int]]) -> None:
        self.before = before
        # Buffers not snapshotted: their tensor and version, to notice a forward that starts changing them.
        self.unchecked = unchecked

    @property
    def needs_replay(self) -> bool:
        return bool(self.before.entries)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Around a recompute: the buffers as the forward saw them, then as the forward left them.

        The copies run outside any dispatch mode: selective checkpointing replays the recompute's ops against
        what its forward recorded, and these copies are not the layer's.
        """
        with _disable_current_modes():
            after = Snapshot([(owner, name) for owner, name, _, _ in self.before.entries])
            self.before.restore()
        try:
            yield
        finally:
            with _disable_current_modes():
                after.restore()


class LayerState:
    """Which buffers of one layer its forward changes; learned on the first call, checked on every call.

    Example::

        >>> bn = torch.nn.BatchNorm1d(3)
        >>> state = LayerState(bn)
        >>> call = state.begin()
        >>> _ = bn(torch.randn(4, 3))
        >>> state.end(call)
        >>> sorted(name for _, name in state.changing)
        ['num_batches_tracked', 'running_mean', 'running_var']
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.changing: set[Slot] | None = None  # None until the first call has shown what forward changes

    def begin(self) -> CallState:
        """Before a forward: snapshot the buffers it changes (all of them on the first call)."""
        slots = buffer_slots(self.module)
        if self.changing is None:
            return CallState(Snapshot(slots), [])
        tracked = [s for s in slots if s in self.changing]
        unchecked = [(s, s[0]._buffers[s[1]], s[0]._buffers[s[1]]._version) for s in slots if s not in self.changing]
        return CallState(Snapshot(tracked), unchecked)

    def end(self, call: CallState) -> None:
        """After a forward: learn (first call) which buffers changed, and keep only their snapshot."""
        if self.changing is None:
            self.changing = set(call.before.changed())
            call.before.keep_only(self.changing)
            return
        surprises = [(owner, name) for (owner, name), tensor, version in call.unchecked
                     if owner._buffers[name] is not tensor or tensor._version != version]
        if surprises:
            names = ", ".join(name for _, name in surprises)
            warnings.warn(
                f"lightning_ckpt: the forward of {type(self.module).__name__} changed buffers ({names}) that its"
                " first training call left alone; this step's recompute may see their new values. From now on"
                " they are restored around every recompute.",
                stacklevel=3,
            )
            self.changing.update(surprises)
