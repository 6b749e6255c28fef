"""Small models and measurements shared by the core tests."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn

from lightning_ckpt.core.measure.costs import LayerCost
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.core.plan.budget import RankMeasurement
from lightning_ckpt.demos import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _peak import LiveStorages, counted_peak, grad_storages  # noqa: E402  (the benchmarks' count, which uses no package counter)

VOCAB, SEQ, BATCH, WIDTH = 32, 16, 4, 32


def tiny_transformer(n_layer: int = 6, dropout: float = 0.1, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(VOCAB, SEQ, n_layer, WIDTH, n_head=4, dropout=dropout)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, idx: torch.Tensor, rng_seed: int = 123) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward from a fixed RNG state: the loss and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    loss = model(idx).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes held for backward (parameters excluded) after one forward."""
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(idx)
    return saved.bytes


def two_ranks() -> tuple[RankMeasurement, list[int]]:
    """This rank's measurement of two layers (7 B outside them), and another rank's row as ``pack_costs`` writes it:
    per layer its 15 integers (the last three its times), then the bytes offload would move un-checkpointed and
    checkpointed; then 13 outside, 4 of them after the layers, 60 made by their backward; then the figures 900, 50,
    9."""
    mine = RankMeasurement([LayerCost("a", "B", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                                      full_flops=50, selective_flops=5, plain_ns=4000, full_ns=2500, selective_ns=1000),
                            LayerCost("b", "B", none_bytes=200, full_bytes=5, selective_bytes=30, offloadable_bytes=0,
                                      full_flops=60, selective_flops=6)], 7)
    other_row = ([120, 8, 45, 0, 40, 9, 1, 300, 4, 2, 0, 0, 5000, 2000, 3000, 130, 0]
                 + [150, 12, 20, 0, 70, 1, 1, 0, 6, 3, 0, 0, 0, 0, 0, 180, 0]
                 + [13, 4, 60]
                 + [900, 50, 9])
    return mine, other_row


def assert_moved_alike(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                       start: dict[str, torch.Tensor], least_cosine: float = 0.99) -> None:
    """``weights`` moved from ``start`` about as ``reference`` did (the cosine of the two changes above
    ``least_cosine``), but not to the same values: what a run whose backward saw compressed inputs does next to an
    exact one."""
    keys = [k for k in start if start[k].is_floating_point()]
    moved = torch.cat([(weights[k] - start[k]).flatten() for k in keys]).double()
    moved_reference = torch.cat([(reference[k] - start[k]).flatten() for k in keys]).double()
    assert not torch.equal(moved, moved_reference)
    assert float(F.cosine_similarity(moved, moved_reference, dim=0)) > least_cosine


class StepPeaks(Callback):
    """Each training step's activation peak, from its forward through its backward, counted by ``_peak.py`` (the
    parameters' gradients left out). Put it after the checkpointing callback: its plan is applied by then."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._live = LiveStorages()
        self._live.__enter__()

    def on_after_backward(self, trainer, pl_module) -> None:
        self._live.__exit__(None, None, None)
        self._live, live = None, self._live
        self.peaks.append(live.peak(exclude=grad_storages(pl_module)))

    def on_exception(self, trainer, pl_module, exception) -> None:
        if getattr(self, "_live", None) is not None:  # a step that raised must not leave the counter on for good
            self._live.__exit__(None, None, None)
            self._live = None


def least_reachable_bytes(message: str) -> int:
    """The least reachable budget in bytes from an out-of-reach error: "at least 0.347 (or 397440 bytes)" after a
    fraction, "at least 397440 bytes (388.1 KiB)" after bytes."""
    found = re.search(r"pass a budget of at least (?:\d+\.\d+ \(or )?(\d+) bytes", message)
    assert found is not None, message
    return int(found.group(1))


def token_batches(lengths: list[int], rows: int = 4, vocab: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, targets)`` batches of the demo GPT, one per length: counting sequences, targets shifted by one."""
    from lightning_ckpt.demos import counting_sequences

    out = []
    for i, length in enumerate(lengths):
        seqs = counting_sequences(rows, length + 1, vocab, i)
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out



class OwnMLP(nn.Module):
    """A model's own MLP, which takes a second (optional) tensor: tiled (``tile_cls=OwnMLP``), called with both, it is
    refused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x) if scale is None else self.fc(x) * scale


class Block(nn.Module):
    """A residual MLP 16 wide (64 inside): the budget driver's tests' layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def blocks(n: int = 4) -> nn.Sequential:
    """``n`` :class:`Block` s in a row, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


class TwoRanks:
    """Two ranks on the CPU for the budget driver (its ``Ranks``): the other rank's cost rows (more than 2 figures)
    are this rank's times ``scale``, its batch sizes (2 figures) this rank's, its flags (1 figure) ``other_flag``
    (``None``: this rank's). Every gather is kept in ``gathered`` (both rows)."""

    root_device = torch.device("cpu")
    world_size = 2

    def __init__(self, scale: int = 2, other_flag: Optional[int] = None, is_global_zero: bool = True) -> None:
        self.scale, self.other_flag, self.is_global_zero = scale, other_flag, is_global_zero
        self.gathered: list[torch.Tensor] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 1 and self.other_flag is not None:
            other = torch.full_like(tensor, self.other_flag)
        else:
            other = tensor * self.scale if tensor.numel() > 2 else tensor
        self.gathered.append(torch.stack([tensor, other]))
        return self.gathered[-1]

    def broadcast(self, obj, src=0):
        return obj


def one_step(driver, ranks, module: nn.Module, batch: torch.Tensor, stepped: bool = True) -> None:
    """One training step of ``module`` on ``batch`` (loss: the output's mean square) driven by a ``BudgetDriver``."""
    driver.begin_batch(ranks, module, batch)
    loss = module(batch).square().mean()
    driver.after_forward(ranks, module, loss)
    loss.backward()
    driver.end_batch(ranks, module, stepped=stepped)
