"""How ``lightning-ckpt plan`` reads a configured strategy's sharding (``commands/plan/sharding.py``): every way a
strategy can be written in a config, each with its shares worked out by hand."""

from __future__ import annotations

import pytest
from jsonargparse import Namespace
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import ShardingStrategy

from lightning_ckpt.commands.plan.sharding import CPU_OFFLOAD_NOTE, Sharding, _import_class, device_count, sharding_of

FSDP = "lightning.pytorch.strategies.FSDPStrategy"
MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
OURS = "lightning_ckpt.strategies.CheckpointingFSDPStrategy"


def tp_note(size: int) -> str:
    return (f"tensor parallelism (tensor_parallel_size={size}) is the model's own `configure_model`; it is not counted,"
            " so each device may hold less than shown")


TP4 = tp_note(4)
FSDP_OFFLOAD = "`cpu_offload` keeps the shards in host memory, so the device holds less than shown"


def spec(path: str, **init_args) -> dict:
    return {"class_path": path, "init_args": init_args}


@pytest.mark.parametrize("strategy, devices, nodes, expected", [
    # no sharding: every device holds everything
    ("ddp", 8, 1, Sharding("ddp", 8)),
    ("auto", 2, 2, Sharding("auto", 4)),
    ("nonsense.NoSuchStrategy", 2, 1, Sharding("nonsense.NoSuchStrategy", 2)),
    (DDPStrategy(), 4, 1, Sharding("DDPStrategy", 4)),
    ({"init_args": {}}, 2, 1, Sharding("", 2)),  # a mapping with no class path names nothing
    # a class path given as a plain string is imported; an instance is read by its class (not its options)
    (FSDP, 4, 1, Sharding(FSDP, 4, 4, 4)),
    (FSDPStrategy(), 4, 1, Sharding("FSDPStrategy", 4, 4, 4)),
    # the package's FSDP2: parameters, gradients and state over every device
    ("fsdp_ckpt", 4, 2, Sharding("fsdp_ckpt", 8, 8, 8)),
    ("fsdp_ckpt_cpu_offload", 1, 1, Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, CPU_OFFLOAD_NOTE, True)),
    (spec(OURS, cpu_offload=True, reshard_after_forward=False), 2, 1,
     Sharding("CheckpointingFSDPStrategy", 2, 2, 2, CPU_OFFLOAD_NOTE, True, False)),
    (spec(OURS, cpu_offload="nonsense", reshard_after_forward=None), 2, 1, Sharding("CheckpointingFSDPStrategy", 2, 2, 2)),
    (spec(OURS, tensor_parallel_size=4), 8, 1, Sharding("CheckpointingFSDPStrategy", 8, 2, 2, TP4)),
    (spec(OURS, data_parallel_size=3), 8, 1, Sharding("CheckpointingFSDPStrategy", 8, 3, 3)),
    (spec(OURS, tensor_parallel_size=3), 8, 1, Sharding("CheckpointingFSDPStrategy", 8, 2, 2, tp_note(3))),  # 8 // 3
    (spec(OURS, tensor_parallel_size=2, cpu_offload=True), 4, 1,
     Sharding("CheckpointingFSDPStrategy", 4, 2, 2, CPU_OFFLOAD_NOTE + "; " + tp_note(2), True)),
    ({"class_path": OURS, "init_args": None}, 3, 1, Sharding("CheckpointingFSDPStrategy", 3, 3, 3)),
    (Namespace(class_path=OURS, init_args=Namespace(cpu_offload=True)), 2, 2,
     Sharding("CheckpointingFSDPStrategy", 4, 4, 4, CPU_OFFLOAD_NOTE, True)),
    # Lightning's ModelParallelStrategy: "auto" is tensor parallel over one node's devices, data parallel over nodes
    (spec(MODEL_PARALLEL), 4, 2, Sharding("ModelParallelStrategy", 8, 2, 2, TP4)),
    (spec(MODEL_PARALLEL, data_parallel_size=8, tensor_parallel_size=1), 4, 2, Sharding("ModelParallelStrategy", 8, 8, 8)),
    (spec(MODEL_PARALLEL, data_parallel_size=0, tensor_parallel_size="1"), 4, 1, Sharding("ModelParallelStrategy", 4, 1, 1)),
    (spec(MODEL_PARALLEL, cpu_offload=True, reshard_after_forward=False, tensor_parallel_size=1), 2, 1,
     Sharding("ModelParallelStrategy", 2, 1, 1)),  # not ours: neither option is read
    # Lightning's FSDPStrategy, as its sharding_strategy says
    ("fsdp", 8, 2, Sharding("fsdp", 16, 16, 16)),
    (spec(FSDP, sharding_strategy="SHARD_GRAD_OP"), 8, 2, Sharding("FSDPStrategy", 16, 1, 16)),
    (spec(FSDP, sharding_strategy="HYBRID_SHARD"), 8, 2, Sharding("FSDPStrategy", 16, 8, 8)),
    (spec(FSDP, sharding_strategy="_hybrid_shard_zero2"), 8, 2, Sharding("FSDPStrategy", 16, 1, 8)),
    (spec(FSDP, sharding_strategy=ShardingStrategy.NO_SHARD), 8, 2, Sharding("FSDPStrategy", 16, 1, 1)),
    (spec(FSDP, sharding_strategy="SOMETHING_NEW"), 4, 1, Sharding("FSDPStrategy", 4, 4, 4)),
    (spec(FSDP, cpu_offload=True), 4, 1, Sharding("FSDPStrategy", 4, 4, 4, FSDP_OFFLOAD)),
])
def test_each_way_of_writing_a_strategy_shards_as_worked_out_by_hand(strategy, devices, nodes, expected):
    assert sharding_of(strategy, devices, nodes) == expected


def test_a_class_path_that_cannot_be_imported_is_none_and_a_name_without_a_dot_is_not_imported(monkeypatch):
    assert _import_class(FSDP).__name__ == "FSDPStrategy"
    assert _import_class("lightning.pytorch.strategies.NoSuchThing") is None
    assert _import_class("no_such_module_here.Thing") is None
    imported = []
    monkeypatch.setattr("lightning_ckpt.commands.plan.sharding._import_class", lambda p: imported.append(p))
    assert sharding_of("mystrategy", 2, 1) == Sharding("mystrategy", 2) and imported == []
    assert sharding_of(spec("my.Strategy"), 2, 1) == Sharding("Strategy", 2) and imported == ["my.Strategy"]


@pytest.mark.parametrize("devices, expected", [
    (4, 4), (1, 1), ("1", 1), ("2", 2), (" 3 ", 3), ([0, 3], 2), ((1,), 1), ("0,1,", 2), ("0, 2 , 5", 3),
    ("auto", None), (-1, None), ("-1", None), (0, None), ("0", None),
])
def test_device_count(devices, expected):
    assert device_count(devices) == expected
