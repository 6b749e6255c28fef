"""Beyond DDP and FSDP: 2-D parallelism (tensor parallel x FSDP) trains correctly with the callback; DeepSpeed is refused.

The 2-D run uses 4 CPU processes with gloo (``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``)
and a tensor-parallel plan in ``configure_model``; it must end with the weights of one process that splits nothing,
with every block recomputed in backward on every rank. The same run on 4 GPUs is marked ``accelerator``.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from _dist_helpers import MLPBlock, TensorParallelMLP, model_parallel_2d_reference, run_scenarios
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names

BLOCKS = ["blocks.0", "blocks.1"]


def assert_trains_like_one_process(result: list[dict], reference: dict) -> None:
    assert [r["global_rank"] for r in result] == [0, 1, 2, 3]
    initial = {k: v.float() for k, v in TensorParallelMLP().state_dict().items()}
    assert max(float((reference["weights"][k] - initial[k]).abs().max()) for k in initial) > 1e-3  # it trained
    for rank, ran in enumerate(result):
        assert ran["checkpointed"] == BLOCKS and ran["layout"]["checkpointed"] == BLOCKS, f"rank {rank}"
        # the tensor-parallel plan was applied: the blocks' linear layers live on the 2-D mesh, the norms on FSDP's
        assert ran["meshes"]["blocks.0.mlp.0.weight"] == ["data_parallel", "tensor_parallel"], f"rank {rank}"
        assert ran["meshes"]["blocks.0.norm.weight"] == ["data_parallel"], f"rank {rank}"
        # each block ran twice per step (forward, then recomputed in backward): checkpointing ran on every rank
        assert ran["steps"] == reference["steps"] == 4
        assert ran["forward_runs"] == 2 * len(BLOCKS) * ran["steps"], f"rank {rank}: {ran['forward_runs']} runs"
        assert ran["weights"].keys() == reference["weights"].keys()
        for key, value in ran["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=0, atol=1e-5,
                                       msg=lambda m, key=key, rank=rank: f"rank {rank}, {key}: {m}")
    assert reference["forward_runs"] == len(BLOCKS) * reference["steps"]  # the reference did not checkpoint


def test_tensor_parallel_with_fsdp_trains_to_the_weights_of_one_process(tmp_path):
    result = run_scenarios([("model_parallel_2d_checkpointed", {})], tmp_path, world_size=4)
    for rank, ran in enumerate(result["model_parallel_2d_checkpointed"]):
        assert "error" not in ran, f"rank {rank}:\n{ran.get('traceback', ran['error'])}"
    assert_trains_like_one_process(result["model_parallel_2d_checkpointed"], model_parallel_2d_reference())


@pytest.mark.accelerator
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (a 2 x 2 device mesh)")
def test_tensor_parallel_with_fsdp_on_gpus_trains_to_the_weights_of_one_gpu(tmp_path):
    result = run_scenarios([("model_parallel_2d_checkpointed", {"accelerator": "cuda"})], tmp_path, world_size=4)
    for rank, ran in enumerate(result["model_parallel_2d_checkpointed"]):
        assert "error" not in ran, f"rank {rank}:\n{ran.get('traceback', ran['error'])}"
    assert_trains_like_one_process(result["model_parallel_2d_checkpointed"],
                                   model_parallel_2d_reference(accelerator="cuda"))


def test_deepspeed_is_refused_at_setup_naming_its_own_activation_checkpointing(monkeypatch):
    # DeepSpeed itself is not installed here: Lightning's strategy is built against a stand-in that only has the
    # logger its constructor sets (nothing of DeepSpeed runs before the callback's setup refuses).
    stand_in = types.ModuleType("deepspeed")
    stand_in.utils = types.SimpleNamespace(logging=types.SimpleNamespace(logger=logging.getLogger("deepspeed")))
    monkeypatch.setitem(sys.modules, "deepspeed", stand_in)
    monkeypatch.setattr("lightning.pytorch.strategies.deepspeed._DEEPSPEED_AVAILABLE", True)
    monkeypatch.setattr("lightning.pytorch.strategies.deepspeed._DEEPSPEED_GREATER_EQUAL_0_16", True)
    trainer = Trainer(strategy=DeepSpeedStrategy(stage=3), accelerator="cpu", devices=1, logger=False)
    model = TensorParallelMLP()
    callback = GradientCheckpointing(layer_cls=MLPBlock)
    with pytest.raises(ValueError, match=r"`GradientCheckpointing` does not support `DeepSpeedStrategy`") as raised:
        callback.setup(trainer, model, "fit")
    message = str(raised.value)
    for setting in ("activation_checkpointing", "deepspeed.checkpointing.checkpoint", "partition_activations",
                    "cpu_checkpointing", "strategy='fsdp_ckpt'"):
        assert setting in message
    assert checkpointed_names(model) == [] and callback.checkpointed_layers == []  # refused before any change
