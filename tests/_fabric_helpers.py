"""Fabric loops for tests/callbacks/test_fabric.py, importable by the spawned processes of its 2-process tests.

``fabric_loop`` trains the demo ``Transformer`` in a plain Fabric loop, with :class:`FabricCheckpointing` (``ckpt``
options) or without (``ckpt=None``: the reference), and records per step what the tests compare: the loss, the
layers checkpointed, the blocks' forward calls, whether the step measured, its activation peak (``PeakProbe``, the
figure a budget bounds) and the collectives of its forward and backward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from torch import nn

from _dist_helpers import CollectiveCounter, full_weights, leave_process_group
from lightning_ckpt import FabricCheckpointing
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.memory_stats import PeakProbe
from lightning_ckpt.demos import Block, Transformer, counting_sequences

VOCAB, N_LAYER, BATCH = 32, 4, 4
#: Each rank's sequence lengths, step by step: they differ between ranks and steps (rank 0 starts short, rank 1 long).
LENGTHS = ([8, 32, 16, 32, 8, 24], [32, 8, 16, 12, 4, 16])


def tiny_lm() -> Transformer:
    torch.manual_seed(0)
    return Transformer(VOCAB, 64, N_LAYER, 32, 2, 0.0)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``ids`` (``[batch, length + 1]``)."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def batches(rank: int, lengths: tuple[list[int], ...] = LENGTHS, start: int = 0) -> list[torch.Tensor]:
    """Rank ``rank``'s batches of token ids, ``[BATCH, length + 1]``; the first one is step ``start``'s."""
    return [counting_sequences(BATCH, length + 1, VOCAB, seed=10 * step + rank)
            for step, length in enumerate(lengths[rank], start)]


def fabric_loop(fabric: Fabric, ckpt: Optional[dict[str, Any]], rank: int = 0, count_collectives: bool = False,
                lengths: tuple[list[int], ...] = LENGTHS, load_from: Optional[Path] = None,
                save_to: Optional[Path] = None, start: int = 0) -> dict[str, Any]:
    """Train ``tiny_lm`` on ``batches(rank)`` for one AdamW step per batch; see the module docstring. ``load_from``:
    resume from ``fabric.save``'s file (model, optimizer and ``FabricCheckpointing``) first; ``save_to``: save last;
    ``start``: the step the first batch is (its data)."""
    seed_everything(0, verbose=False)
    model = tiny_lm()
    calls = [0]
    for block in model.blocks:  # on a part of each block: a recompute runs it again (the block's own hook, not)
        block.attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    checkpointing = FabricCheckpointing(fabric, **ckpt) if ckpt is not None else None
    module = model
    model = checkpointing.setup(model) if checkpointing is not None else fabric.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer = (checkpointing.setup_optimizers(optimizer) if checkpointing is not None
                 else fabric.setup_optimizers(optimizer))
    state = {"model": model, "optimizer": optimizer, **({"ckpt": checkpointing} if checkpointing is not None else {})}
    if load_from is not None:
        fabric.load(load_from, state)
    record: dict[str, list[Any]] = {"loss": [], "seen": [], "calls": [], "measuring": [], "peak": [],
                                    "collectives": []}
    probe = PeakProbe()
    for ids in batches(rank, lengths, start):
        calls[0] = 0
        with (checkpointing.step(ids) if checkpointing is not None else _nothing()):
            record["seen"].append(checkpointed_names(module))
            record["measuring"].append(checkpointing is not None and checkpointing.callback.driver.cycle.measuring is not None)
            counter = CollectiveCounter() if count_collectives else None
            probe.start()
            if counter is not None:
                counter.__enter__()
            loss = loss_of(model, ids)
            if checkpointing is not None:
                checkpointing.backward(loss)
            else:
                fabric.backward(loss)
            if counter is not None:
                counter.__exit__(None, None, None)
                record["collectives"].append(counter.counts)
            record["peak"].append(probe.stop(module.parameters()))
        record["calls"].append(calls[0])
        record["loss"].append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    if save_to is not None:
        fabric.save(save_to, state)
    result: dict[str, Any] = {**record, "weights": full_weights(module)}
    if checkpointing is not None:
        cycle = checkpointing.callback.driver.cycle
        result.update(plans={bucket: plan.state_dict() for bucket, plan in checkpointing.plans.items()},
                      measured_steps=cycle.measured_steps, predicted=sorted(cycle.predicted),
                      state=checkpointing.state_dict())
        checkpointing.teardown()
        result["after_teardown"] = checkpointed_names(module)
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------------------------------------ two processes


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """``ModelParallelStrategy``'s ``parallelize_fn``: each block its own FSDP2 unit, then the rest."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def parallelize_and_wrap(model: nn.Module, mesh: Any) -> nn.Module:
    """A ``parallelize_fn`` that also checkpoints each block with torch's ``checkpoint_wrapper`` (as torchtitan's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return parallelize(model, mesh)


def _strategy(kind: str) -> Any:
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    if kind == "ddp":
        return DDPStrategy()
    return ModelParallelStrategy(parallelize_fn=parallelize_and_wrap if kind == "fsdp2_wrapped" else parallelize,
                                 data_parallel_size=2, tensor_parallel_size=1)


def _worker(rank: int, port: int, scenarios: list[tuple[str, str, Optional[dict[str, Any]]]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    for name, kind, ckpt in scenarios:
        fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy(kind))
        fabric.launch()
        try:
            result = fabric_loop(fabric, ckpt, rank=rank, count_collectives=True)
        except Exception as err:  # recorded: a refusal is a result
            result = {"error": f"{type(err).__name__}: {err}"}
        torch.save(result, Path(out_dir) / f"{name}.rank{rank}.pt")
    leave_process_group()


def run_two_processes(scenarios: list[tuple[str, str, Optional[dict[str, Any]]]], out_dir: Path,
                      timeout: float = 240.0) -> dict[str, list[dict[str, Any]]]:
    """Run ``(name, "ddp" | "fsdp2" | "fsdp2_wrapped", ckpt options or None)`` scenarios in 2 spawned gloo processes,
    one after another; ``{name: [rank0_result, rank1_result]}``."""
    from _dist_helpers import free_port, spawn_ranks

    return spawn_ranks(_worker, (free_port(), scenarios, str(out_dir)), out_dir, [name for name, _, _ in scenarios],
                       timeout, world_size=2)
