"""Models and multi-process runs for the distributed tests, importable by spawned processes.

``run_scenarios`` starts two (or ``world_size``) CPU processes (spawn) once and runs many short Trainer fits in
them, one after another on one gloo process group, the way a cluster launcher runs a script. Each scenario writes
its result per rank to ``out_dir/<scenario>.rank<r>.pt``; an exception is recorded, not raised, so a
refused setting does not stop the other scenarios. ``run_as_nodes`` starts this file once per machine instead
(``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``), as a user starts a script on several machines.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.placement import fsdp_units
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.demos import GPT, Block, CountingDataModule, counting_sequences
from lightning_ckpt.strategies import CheckpointingDDPStrategy, CheckpointingFSDPStrategy

WORLD_SIZE = 2
GPT_ARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_embd=32, n_head=2, dropout=0.0, lr=3e-3)
DATA_ARGS = dict(vocab_size=32, block_size=16, batch_size=4, num_samples=32)  # 4 steps per epoch on 2 ranks


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TwoHeads(pl.LightningModule):
    """A trunk of blocks and two heads; head ``b``'s loss only counts on even batches unless ``static``."""

    def __init__(self, static: bool = False, n_layer: int = 3, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.static = static
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.trunk = nn.ModuleList(MLPBlock(width, dropout) for _ in range(n_layer))
        self.head_a = nn.Linear(width, 1)
        self.head_b = nn.Linear(width, 1)
        self.steps_run = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        h = self.embed(x)
        for block in self.trunk:
            h = block(h)
        loss = F.mse_loss(self.head_a(h), y)
        if self.static or batch_idx % 2 == 0:
            loss = loss + F.mse_loss(self.head_b(h), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)),
                          batch_size=4)


class SeededGPT(GPT):
    """The demo GPT with the same initial weights whether built in ``__init__`` or in ``configure_model``."""

    def _build(self) -> nn.Module:
        torch.manual_seed(0)
        return super()._build()


class CallsModelGPT(SeededGPT):
    """``training_step`` calls ``self.model(...)``, not ``self(...)``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        return F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())


class ShardsItselfGPT(SeededGPT):
    """Shards itself in ``configure_model``, as ``ModelParallelStrategy`` asks: one unit per block, then the rest."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        if fsdp_units(self.model):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class TensorParallelMLP(pl.LightningModule):
    """An input layer, ``n_layer`` MLP blocks and a head, for 2-D parallelism (tensor parallel x FSDP).

    Under Lightning's ``ModelParallelStrategy``, ``configure_model`` splits each block's two linear layers over the
    ``tensor_parallel`` mesh (column-wise, then row-wise: one all-reduce per block) and shards each block, then the
    input layer and the head, with FSDP2 over the ``data_parallel`` mesh. Data-parallel rank ``r`` of ``d`` reads
    samples ``r, r + d, ...`` in batches of ``batch_size // d``, so its batch ``k`` is its share of batch ``k`` of
    one process. In one process (no device mesh) nothing is split: the reference.
    """

    def __init__(self, n_layer: int = 2, width: int = 16, batch_size: int = 8, num_samples: int = 32) -> None:
        super().__init__()
        self.batch_size, self.num_samples = batch_size, num_samples
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(MLPBlock(width, dropout=0.0) for _ in range(n_layer))
        self.head = nn.Linear(width, 1)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None or fsdp_units(self):
            return
        tensor_parallel, data_parallel = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.blocks:
            parallelize_module(block, tensor_parallel, {"mlp.0": ColwiseParallel(), "mlp.3": RowwiseParallel()})
            fully_shard(block, mesh=data_parallel)
        fully_shard(self.embed, mesh=data_parallel)
        fully_shard(self.head, mesh=data_parallel)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(self.num_samples, 8, generator=gen),
                             torch.randn(self.num_samples, 1, generator=gen))
        if self.device_mesh is None:
            return DataLoader(data, batch_size=self.batch_size)
        rank, ranks = self.device_mesh["data_parallel"].get_local_rank(), self.device_mesh["data_parallel"].size()
        return DataLoader(torch.utils.data.Subset(data, range(rank, self.num_samples, ranks)),
                          batch_size=self.batch_size // ranks)


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------


class CollectiveCounter(TorchDispatchMode):
    """Count the ``c10d`` collectives dispatched while active (all-gathers, reduce-scatters, ...), by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CountCollectives(Callback):
    """Count the collectives of one training step's forward and backward (``batch_idx`` of the first epoch)."""

    def __init__(self, batch_idx: int = 1) -> None:
        self.batch_idx = batch_idx
        self.counts: dict[str, int] = {}
        self._mode: Optional[CollectiveCounter] = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            self._mode = CollectiveCounter()
            self._mode.__enter__()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.counts = dict(self._mode.counts)
            self._mode = None


class RecordGatheredDtype(Callback):
    """Record the dtype of a block's parameters while its forward runs (after FSDP gathered them)."""

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        block = pl_module.model.blocks[0]
        block.register_forward_pre_hook(lambda mod, args: self.dtypes.append(str(mod.ln1.weight.dtype)))


class RecordTraining(Callback):
    """Record, on this rank, what training really ran: steps, forward runs of ``block``, and the layout.

    ``forward_runs`` counts the training-mode runs of ``block.forward``, patched at class level from
    ``on_train_start`` to ``on_train_end``. A checkpointed block runs its forward again when backward
    recomputes it (``checkpoint`` calls the class's forward a second time; module hooks would not see that),
    so a step runs each checkpointed block twice and each plain one once. ``units`` and ``checkpointed`` are
    the FSDP units and the checkpointed layers of the LightningModule at the start of training, after the
    strategy wrapped or sharded it (the callback undoes checkpointing in ``teardown``). At the end, every
    rank's ``[forward_runs, steps]`` is gathered into ``trainer.callback_metrics["record/per_rank"]``, which
    Lightning's spawn launcher hands back to the main process.
    """

    def __init__(self, block: type[nn.Module]) -> None:
        self.block = block
        self.steps = 0
        self.forward_runs = 0
        self.units: list[str] = []
        self.checkpointed: list[str] = []
        self._original: Optional[Callable[..., Any]] = None

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.units = fsdp_units(pl_module)
        self.checkpointed = checkpointed_names(pl_module)
        original = self._original = self.block.forward

        @functools.wraps(original)
        def counted(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if module.training:
                self.forward_runs += 1
            return original(module, *args, **kwargs)

        self.block.forward = counted  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.steps += 1

    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        mine = torch.tensor([self.forward_runs, self.steps])
        trainer.callback_metrics["record/per_rank"] = trainer.strategy.all_gather(mine).reshape(-1, 2).cpu()

    def on_exception(self, trainer: Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._original is not None:
            self.block.forward = self._original  # type: ignore[method-assign]
            self._original = None

    def results(self) -> dict[str, Any]:
        return {"forward_runs": self.forward_runs, "layout": {"units": self.units, "checkpointed": self.checkpointed}}


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's copy of the unsharded weights (collective when ``module`` is sharded)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().float().cpu().clone()
    return out


# ------------------------------------------------------------------------------------------------
# Scenarios: each returns a dict of results for its rank
# ------------------------------------------------------------------------------------------------


def _trainer(strategy: Any, callbacks: list[Callback] = (), **kwargs: Any) -> Trainer:
    defaults = dict(accelerator="cpu", devices=WORLD_SIZE, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return Trainer(strategy=strategy, callbacks=list(callbacks), **defaults)


def _fit_two_heads(strategy: Any, callback: Optional[GradientCheckpointing], static: bool = False,
                   **trainer_kwargs: Any) -> dict[str, Any]:
    seed_everything(0)
    model = TwoHeads(static=static)
    record = RecordTraining(MLPBlock)
    trainer = _trainer(strategy, [callback, record] if callback is not None else [record], **trainer_kwargs)
    try:
        trainer.fit(model)
    except ValueError as err:  # a refused setting: record it with how many steps ran before it
        return {"error": f"{type(err).__name__}: {err}", "steps": model.steps_run}
    checkpointed = callback.checkpointed_layers if callback is not None else []
    return {"weights": full_weights(model), "steps": model.steps_run, "checkpointed": checkpointed,
            **_ranks(trainer), **record.results()}


def _ranks(trainer: Trainer) -> dict[str, int]:
    return {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "world_size": trainer.world_size}


def ddp_two_heads_reference() -> dict[str, Any]:
    return _fit_two_heads(DDPStrategy(find_unused_parameters=True), None)


def ddp_two_heads_checkpointed() -> dict[str, Any]:
    return _fit_two_heads(CheckpointingDDPStrategy(find_unused_parameters=True), GradientCheckpointing())


def ddp_two_heads_reentrant() -> dict[str, Any]:
    return _fit_two_heads(CheckpointingDDPStrategy(find_unused_parameters=True),
                          GradientCheckpointing(use_reentrant=True))


def ddp_two_heads_reentrant_default_flags() -> dict[str, Any]:
    return _fit_two_heads("ddp_ckpt", GradientCheckpointing(use_reentrant=True))


def fsdp_two_heads_checkpointed() -> dict[str, Any]:
    """FSDP with several roots (embed, heads, blocks called from ``training_step``) and a head unused on odd steps."""
    return _fit_two_heads(CheckpointingFSDPStrategy(), GradientCheckpointing())


def ddp_static_reference() -> dict[str, Any]:
    return _fit_two_heads(DDPStrategy(), None, static=True)


def ddp_static_reentrant() -> dict[str, Any]:
    return _fit_two_heads(CheckpointingDDPStrategy(static_graph=True), GradientCheckpointing(use_reentrant=True),
                          static=True)


def _fit_gpt(model: GPT, strategy: Any, callbacks: list[Callback], **trainer_kwargs: Any) -> dict[str, Any]:
    counter = CountCollectives()
    record = RecordTraining(Block)
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer = _trainer(strategy, [*callbacks, counter, record], **trainer_kwargs)
    trainer.fit(model, CountingDataModule(**DATA_ARGS), ckpt_path=ckpt_path)
    return {"weights": full_weights(model), "counts": counter.counts, "units": fsdp_units(model),
            "strategy": type(trainer.strategy).__name__, "steps": record.steps, **_ranks(trainer), **record.results()}


def gpt_ddp_reference() -> dict[str, Any]:
    seed_everything(0)
    return _fit_gpt(SeededGPT(**GPT_ARGS), DDPStrategy(), [])


def gpt_fsdp_plain() -> dict[str, Any]:
    seed_everything(0)
    return _fit_gpt(SeededGPT(**GPT_ARGS), CheckpointingFSDPStrategy(), [])


def gpt_fsdp_checkpointed() -> dict[str, Any]:
    seed_everything(0)
    callback = GradientCheckpointing()
    result = _fit_gpt(SeededGPT(**GPT_ARGS), "fsdp_ckpt", [callback])
    return {**result, "checkpointed": callback.checkpointed_layers}


def gpt_fsdp_fp8() -> dict[str, Any]:
    seed_everything(0)
    callback = GradientCheckpointing(compress="fp8")
    result = _fit_gpt(SeededGPT(**GPT_ARGS), "fsdp_ckpt", [callback])
    return {**result, "checkpointed": callback.checkpointed_layers}


def gpt_fsdp_checkpointed_configure_model() -> dict[str, Any]:
    seed_everything(0)
    callback = GradientCheckpointing(layer_cls=Block)
    model = CallsModelGPT(build_in_configure_model=True, **GPT_ARGS)
    result = _fit_gpt(model, CheckpointingFSDPStrategy(), [callback])
    return {**result, "checkpointed": callback.checkpointed_layers}


def gpt_model_parallel_with_callback() -> dict[str, Any]:
    seed_everything(0)
    callback = GradientCheckpointing(layer_cls=Block)
    model = ShardsItselfGPT(build_in_configure_model=True, **GPT_ARGS)
    result = _fit_gpt(model, ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1), [callback])
    return {**result, "checkpointed": callback.checkpointed_layers}


def gpt_fsdp_bf16() -> dict[str, Any]:
    seed_everything(0)
    recorder = RecordGatheredDtype()
    model = SeededGPT(**GPT_ARGS)
    result = _fit_gpt(model, CheckpointingFSDPStrategy(), [GradientCheckpointing(), recorder], precision="bf16-mixed")
    sharded_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {**result, "gathered_dtypes": sorted(set(recorder.dtypes)), "sharded_dtypes": sharded_dtypes}


def gpt_fsdp_two_epochs_saving(ckpt_dir: str) -> dict[str, Any]:
    seed_everything(0)
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    result = _fit_gpt(SeededGPT(**GPT_ARGS), CheckpointingFSDPStrategy(), [GradientCheckpointing(), saver],
                      max_epochs=2, enable_checkpointing=True)
    return {**result, "saved": sorted(os.listdir(ckpt_dir))}


def gpt_fsdp_resumed(ckpt_dir: str) -> dict[str, Any]:
    seed_everything(0)
    model = SeededGPT(**GPT_ARGS)
    path = os.path.join(ckpt_dir, "epoch=0.ckpt")
    result = _fit_gpt(model, CheckpointingFSDPStrategy(), [GradientCheckpointing()], max_epochs=2, ckpt_path=path)
    plain = SeededGPT.load_from_checkpoint(os.path.join(ckpt_dir, "epoch=1.ckpt"), map_location="cpu")
    return {**result, "plain_loaded": {k: v.float() for k, v in plain.state_dict().items()},
            "plain_is_sharded": bool(fsdp_units(plain))}


def gpt_fsdp_sharded_saving(ckpt_dir: str) -> dict[str, Any]:
    seed_everything(0)
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="sharded-{epoch}", save_top_k=-1, every_n_epochs=1)
    result = _fit_gpt(SeededGPT(**GPT_ARGS), CheckpointingFSDPStrategy(save_distributed_checkpoint=True),
                      [GradientCheckpointing(), saver], max_epochs=2, enable_checkpointing=True)
    return {**result, "saved_is_dir": os.path.isdir(os.path.join(ckpt_dir, "sharded-epoch=0.ckpt"))}


def gpt_fsdp_sharded_resumed(ckpt_dir: str) -> dict[str, Any]:
    seed_everything(0)
    path = os.path.join(ckpt_dir, "sharded-epoch=0.ckpt")
    return _fit_gpt(SeededGPT(**GPT_ARGS), CheckpointingFSDPStrategy(save_distributed_checkpoint=True),
                    [GradientCheckpointing()], max_epochs=2, ckpt_path=path)


def ddp_two_heads_one_device_per_node() -> dict[str, Any]:
    """Run on each of two nodes (``run_as_nodes``): Lightning's own multi-node setup, one device each."""
    return _fit_two_heads(CheckpointingDDPStrategy(find_unused_parameters=True), GradientCheckpointing(), devices=1,
                          num_nodes=2)


def gpt_fsdp_one_device_per_node() -> dict[str, Any]:
    seed_everything(0)
    callback = GradientCheckpointing()
    result = _fit_gpt(SeededGPT(**GPT_ARGS), "fsdp_ckpt", [callback], devices=1, num_nodes=2)
    return {**result, "checkpointed": callback.checkpointed_layers}


def model_parallel_2d_checkpointed(accelerator: str = "cpu") -> dict[str, Any]:
    """``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``, a TP plan and the callback: 4 ranks."""
    seed_everything(0)
    model = TensorParallelMLP()
    callback = GradientCheckpointing(layer_cls=MLPBlock)
    record = RecordTraining(MLPBlock)
    trainer = _trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), [callback, record],
                       accelerator=accelerator, devices=4, use_distributed_sampler=False)
    trainer.fit(model)
    from torch.distributed.tensor import DTensor

    meshes = {name: list(p.device_mesh.mesh_dim_names or ()) for name, p in model.named_parameters()
              if isinstance(p, DTensor)}
    return {"weights": full_weights(model), "steps": record.steps, "checkpointed": callback.checkpointed_layers,
            "meshes": meshes, **_ranks(trainer), **record.results()}


def model_parallel_2d_reference(accelerator: str = "cpu") -> dict[str, Any]:
    """The same training in one process, nothing split and nothing checkpointed (run in the test's own process)."""
    seed_everything(0)
    model = TensorParallelMLP()
    record = RecordTraining(MLPBlock)
    _trainer("auto", [record], accelerator=accelerator, devices=1).fit(model)
    return {"weights": full_weights(model), "steps": record.steps, **record.results()}


class _RecordingBudgetCallback(GradientCheckpointing):
    """Keeps this rank's own measurement (before the ranks are combined), for the test to compare."""

    local_none_bytes: list[int] = []
    local_outside_bytes = 0

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        stop_measuring = self.driver._stop_measuring

        def _stop_measuring(loss: Any = None) -> bool:
            stopped = stop_measuring(loss)
            if stopped and self.driver.measured is not None:
                self.local_none_bytes = [c.none_bytes for c in self.driver.measured.costs]
                self.local_outside_bytes = self.driver.measured.outside_bytes
            return stopped

        self.driver._stop_measuring = _stop_measuring  # type: ignore[method-assign]


class RecordCheckpointedPerBatch(Callback):
    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen.append(checkpointed_names(pl_module))


def _fit_budget(strategy: Any, memory_budget: Optional[int]) -> dict[str, Any]:
    """A budget in bytes that rank 0's batch (2 samples) meets un-checkpointed and rank 1's (4 samples) does not.

    ``memory_budget=None``: the same run without the callback (the reference weights).
    """
    seed_everything(0)
    rank = int(os.environ["LOCAL_RANK"])
    # priced by FLOPs: FSDP2's layers are not timed, and the test compares its plans with DDP's byte for byte
    callback = (_RecordingBudgetCallback(memory_budget=memory_budget, time_layers=False) if memory_budget is not None
                else None)
    record = RecordCheckpointedPerBatch()
    model = SeededGPT(**{**GPT_ARGS, "n_layer": 4})
    data = CountingDataModule(**{**DATA_ARGS, "batch_size": 2 if rank == 0 else 4, "num_samples": 64})
    trainer = _trainer(strategy, [callback, record] if callback is not None else [record], max_steps=3)
    trainer.fit(model, data)
    result = {"seen": record.seen, "weights": full_weights(model), "units": fsdp_units(model)}
    if callback is not None:
        result.update(checkpointed=callback.checkpointed_layers, plan=callback.plan.state_dict(),
                      local_none_bytes=callback.local_none_bytes, local_outside_bytes=callback.local_outside_bytes,
                      local_baseline_bytes=sum(callback.local_none_bytes) + callback.local_outside_bytes)
    return result


def ddp_memory_budget_ranks_differ() -> dict[str, Any]:
    return _fit_budget(CheckpointingDDPStrategy(), 300_000)


def fsdp_memory_budget_ranks_differ() -> dict[str, Any]:
    """The same under FSDP2: each layer is its own unit, measured with its parameters gathered again."""
    return _fit_budget(CheckpointingFSDPStrategy(), 300_000)


def fsdp_memory_budget_reference() -> dict[str, Any]:
    return _fit_budget(CheckpointingFSDPStrategy(), None)


VARYING_LENGTHS = ([4, 16, 8, 16], [16, 4, 8, 8])
"""Each rank's sequence lengths, step by step (4 sequences a batch): rank 0's first batch is short, rank 1's long.
The largest over ranks: 16, 16, 8, 16."""


PREDICTED_LENGTHS = ([4, 3, 12, 16, 1, 14], [2, 8, 6, 10, 2, 7])
"""Lengths whose largest over ranks (4, 8, 12, 16, 2, 14) measure three sizes, then plan 16 (64 tokens, not covered
by 12's 48 in the same bucket) from the fit; 2 (8 tokens, a new bucket) runs the plan made at 4, which checkpoints
nothing; 14 runs 16's predicted plan."""


def _fit_varying(strategy: Any, memory_budget: Optional[int], compress: Optional[str] = None,
                 lengths: tuple[list[int], list[int]] = VARYING_LENGTHS) -> dict[str, Any]:
    """Batches whose lengths differ between ranks and steps, under a byte budget (``None``: without the callback)."""
    seed_everything(0)
    rank = int(os.environ["LOCAL_RANK"])
    callback = (GradientCheckpointing(memory_budget=memory_budget, compress=compress) if memory_budget is not None
                else None)
    record = RecordCheckpointedPerBatch()
    model = SeededGPT(**{**GPT_ARGS, "n_layer": 4})
    del model.hparams["block_size"]  # no longest length known ahead: the per-batch cycle from the first batch
    batches = []
    for step, length in enumerate(lengths[rank]):
        seqs = counting_sequences(4, length + 1, GPT_ARGS["vocab_size"], seed=10 * step + rank)
        batches.append((seqs[:, :-1], seqs[:, 1:]))
    initial = full_weights(model)
    trainer = _trainer(strategy, [callback, record] if callback is not None else [record], max_steps=len(batches),
                       use_distributed_sampler=False)
    trainer.fit(model, DataLoader(batches, batch_size=None))
    result: dict[str, Any] = {"seen": record.seen, "weights": full_weights(model), "initial": initial}
    if callback is not None:
        result["plans"] = {bucket: plan.state_dict() for bucket, plan in callback.plans.items()}
        result.update(measured_steps=callback.driver.cycle.measured_steps, predicted=sorted(callback.driver.cycle.predicted))
    return result


def ddp_budget_predicted() -> dict[str, Any]:
    return _fit_varying(CheckpointingDDPStrategy(), 300_000, lengths=PREDICTED_LENGTHS)


def ddp_budget_predicted_reference() -> dict[str, Any]:
    return _fit_varying(CheckpointingDDPStrategy(), None, lengths=PREDICTED_LENGTHS)


def ddp_budget_varying_lengths() -> dict[str, Any]:
    return _fit_varying(CheckpointingDDPStrategy(), 300_000)


def ddp_budget_varying_lengths_fp8() -> dict[str, Any]:
    return _fit_varying(CheckpointingDDPStrategy(), 300_000, compress="fp8")


def ddp_budget_varying_lengths_reference() -> dict[str, Any]:
    return _fit_varying(CheckpointingDDPStrategy(), None)


def fsdp_budget_varying_lengths() -> dict[str, Any]:
    return _fit_varying(CheckpointingFSDPStrategy(), 300_000)


def fsdp_budget_varying_lengths_reference() -> dict[str, Any]:
    return _fit_varying(CheckpointingFSDPStrategy(), None)


def fsdp_recorder_layer_not_a_unit() -> dict[str, Any]:
    """The whole model one FSDP unit: its layers' parameters are sharded, but no layer can be gathered alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ckpt.core.plan.planner import LayerCostRecorder
    from lightning_ckpt.demos import Transformer

    model = Transformer(32, 16, 2, 32, 2, 0.0)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
    hooks_before = len(model.blocks[0]._forward_hooks)
    try:
        LayerCostRecorder(model, [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)])
    except ValueError as err:
        return {"error_text": str(err), "hooks_added": len(model.blocks[0]._forward_hooks) - hooks_before}
    return {"error_text": None}


def placement_checks() -> dict[str, Any]:
    """The placement check on real FSDP2 units: no warning for blocks as units, one for units inside a block."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ckpt import apply_checkpointing
    from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement
    from lightning_ckpt.demos import Transformer
    from lightning_ckpt.strategies.fsdp import shard_for_checkpointing

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    result: dict[str, Any] = {}
    good = Transformer(32, 16, 2, 32, 2, 0.0)
    apply_checkpointing(good, layer_cls=Block)
    result["units"] = shard_for_checkpointing(nn.ModuleDict({"model": good}), mesh, Block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_checkpointing_placement(good)
    result["good_warnings"] = [str(w.message) for w in caught]
    bad = Transformer(32, 16, 2, 32, 2, 0.0)
    apply_checkpointing(bad, layer_cls=Block)
    for block in bad.blocks:
        fully_shard(block.mlp, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_checkpointing_placement(bad)
    result["bad_warnings"] = [str(w.message) for w in caught]
    return result


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (ddp_two_heads_reference, ddp_two_heads_checkpointed, ddp_two_heads_reentrant, fsdp_two_heads_checkpointed,
              ddp_two_heads_reentrant_default_flags, ddp_static_reference, ddp_static_reentrant, gpt_ddp_reference,
              gpt_fsdp_plain, gpt_fsdp_checkpointed, gpt_fsdp_fp8, gpt_fsdp_checkpointed_configure_model,
              gpt_model_parallel_with_callback, gpt_fsdp_bf16, gpt_fsdp_two_epochs_saving, gpt_fsdp_resumed,
              gpt_fsdp_sharded_saving, gpt_fsdp_sharded_resumed, ddp_two_heads_one_device_per_node,
              gpt_fsdp_one_device_per_node,
              placement_checks, ddp_memory_budget_ranks_differ, fsdp_memory_budget_ranks_differ,
              fsdp_memory_budget_reference, fsdp_recorder_layer_not_a_unit, model_parallel_2d_checkpointed,
              ddp_budget_varying_lengths, ddp_budget_varying_lengths_fp8, ddp_budget_varying_lengths_reference,
              fsdp_budget_varying_lengths, ddp_budget_predicted, ddp_budget_predicted_reference,
              fsdp_budget_varying_lengths_reference)
}


# ------------------------------------------------------------------------------------------------
# Running them
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, scenarios: list[tuple[str, dict[str, Any]]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world_size))
    for name, kwargs in scenarios:
        torch.save(_run_scenario(name, kwargs), Path(out_dir) / f"{name}.rank{rank}.pt")
    leave_process_group()


def leave_process_group() -> None:
    """End a spawned worker like the strategies' own spawn launcher: destroy the process group, then leave without
    interpreter finalization, where leftover gloo state can abort the process."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_scenarios(
    scenarios: list[tuple[str, dict[str, Any]]], out_dir: Path, timeout: float = 300.0, world_size: int = WORLD_SIZE
) -> dict[str, list[dict[str, Any]]]:
    """Run ``scenarios`` in ``world_size`` spawned processes; return ``{name: [rank0_result, rank1_result, ...]}``."""
    return spawn_ranks(_worker, (world_size, free_port(), scenarios, str(out_dir)), out_dir,
                       [name for name, _ in scenarios], timeout, world_size)


def spawn_ranks(worker: Any, args: tuple, out_dir: Path, names: list[str], timeout: float,
                world_size: int = WORLD_SIZE) -> dict[str, list[dict[str, Any]]]:
    """Run ``worker(rank, *args)`` in ``world_size`` spawned processes (killed past ``timeout`` seconds); each rank
    writes ``{name}.rank{r}.pt`` under ``out_dir`` for each of ``names``: ``{name: [rank0_result, ...]}``."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=world_size, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"The {world_size}-process run did not finish within {timeout} s.")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return {name: [torch.load(Path(out_dir) / f"{name}.rank{r}.pt", weights_only=False) for r in range(world_size)]
            for name in names}


_LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT")


def run_as_nodes(scenario: str, out_dir: Path, nodes: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run ``scenario`` as ``nodes`` machines of one device each, on loopback; return each node's result.

    As a user starts the same script on every machine: each process is started on its own (not spawned), told
    its node by ``NODE_RANK`` and where node 0 listens by ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT``, and
    Lightning's ``Trainer(num_nodes=..., devices=1)`` sets up the process group. The processes end the way a
    script does, through interpreter shutdown, and each result holds its ``returncode`` and ``output``.
    """
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
    here = str(Path(__file__).parent)
    # One thread, as each of the spawned ranks gets (Lightning gives a lone process per machine every core).
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")])))
    processes = [
        subprocess.Popen([sys.executable, __file__, scenario, str(out_dir)], env={**env, "NODE_RANK": str(node)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    results = []
    for node, (process, output) in enumerate(zip(processes, outputs)):
        path = out_dir / f"{scenario}.node{node}.pt"
        result = torch.load(path, weights_only=False) if path.exists() else {"error": "no result written"}
        results.append({**result, "returncode": process.returncode, "output": output[-4000:]})
    return results


def _run_scenario(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run one scenario in this process; an exception is recorded in the result, for the test to assert on."""
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    try:
        result = SCENARIOS[name](**kwargs)
    except Exception as err:
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    return {**result, "seconds": time.perf_counter() - start}


if __name__ == "__main__":  # one node of `run_as_nodes`: python _dist_helpers.py SCENARIO OUT_DIR
    name, out = sys.argv[1:3]
    torch.save(_run_scenario(name, {}), Path(out) / f"{name}.node{os.environ['NODE_RANK']}.pt")
