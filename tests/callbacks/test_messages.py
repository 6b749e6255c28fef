"""Issue 42, item 5: the lines a budget run logs.

- Transformers' ``use_cache`` turned off is said once a run, naming the model: a decoder layer holds its model's
  config, and checkpointing it alone (as measuring the longest batch does) said it again, naming
  ``Gemma2DecoderLayer``.
- Each new plan's line says how it checkpoints: each mode, the layers offloaded, how the inputs are held, the LM head
  in chunks, the MLPs in tiles (it said "checkpointing 4 of 4 layers" for selective and full alike).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from lightning_ckpt.core.plan.budget import plan_layout, plan_summary
from lightning_ckpt.core.plan.planner import LayerCost, make_plan

from test_unchunkable_loss import fit, gemma2


def test_the_plan_line_names_each_mode_the_offload_the_compression_and_the_head_s_chunks():
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=10,
                       full_flops=50, selective_flops=5) for i in range(6)]
    plan = replace(make_plan(costs, outside_bytes=100, memory_budget=0.5),
                   layers={"l0": "full", "l1": "full", "l2": "full", "l3": "selective", "l4": "none", "l5": "none"},
                   offloaded=["l0", "l1"], compress="fp8", chunk_tokens=1024)
    assert plan_summary(plan, "250B").split("; activation peak")[0] == (
        "memory_budget='250B': checkpointing 4 of 6 layers (3 full, 1 selective; 2 offloaded); their inputs held as"
        " fp8; the LM head and loss in chunks of 1,024 tokens")
    assert plan_layout(replace(plan, layers=dict.fromkeys(plan.layers, "none"), offloaded=[], compress="fp8",
                               chunk_tokens=None)) == "checkpointing 0 of 6 layers"
    assert plan_layout(replace(plan, layers={"l0": "ops", "l1": "none"}, offloaded=["l1"], compress=None,
                               chunk_tokens=None, tile_mlp=True, tile_tokens=256)) == (
        "checkpointing 1 of 2 layers (1 op-level; 1 offloaded); the MLPs over tiles of 256 tokens")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_gemma2_budget_run_says_use_cache_once_naming_the_model_and_each_plan_s_modes(caplog):
    from lightning_ckpt import GradientCheckpointing

    caplog.set_level(logging.INFO)
    fit([GradientCheckpointing(memory_budget=0.5)])
    lines = [r.getMessage() for r in caplog.records]
    # Before: a second line, "turned off `config.use_cache` of Gemma2DecoderLayer ...", from the longest batch's step.
    assert [line for line in lines if "use_cache" in line] == [
        "lightning_ckpt: turned off `config.use_cache` of Gemma2ForCausalLM while its layers are checkpointed (the"
        " recompute must not see a cache that forward filled); removing checkpointing turns it back on."]
    plans = [line for line in lines if line.startswith("GradientCheckpointing: batches up to")]
    # Before: "memory_budget=0.5: checkpointing 4 of 4 layers; activation peak ...".
    assert plans[0].startswith("GradientCheckpointing: batches up to 128 tokens (length 64), memory_budget=0.5:"
                               " checkpointing 4 of 4 layers (1 full, 3 selective); activation peak"), plans[0]


def test_a_layer_checkpointed_alone_does_not_say_its_model_s_cache_again(caplog):
    from lightning_ckpt import apply_checkpointing, remove_checkpointing

    caplog.set_level(logging.INFO)
    model = gemma2()
    apply_checkpointing(model)
    remove_checkpointing(model)
    layer = model.model.layers[0]
    apply_checkpointing(layer, layer_cls=type(layer))  # its config is the model's: turned off again, not said again
    assert model.config.use_cache is False
    remove_checkpointing(layer)
    assert model.config.use_cache is True
    said = [r.getMessage() for r in caplog.records if "use_cache" in r.getMessage()]
    assert len(said) == 1 and "of Gemma2ForCausalLM" in said[0]
