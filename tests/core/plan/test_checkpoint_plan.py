"""CheckpointPlan on its own (core/plan/checkpoint_plan.py): its printed table and summary, whole and worked out by
hand; which plans apply alike; its state round trip."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.costs import LayerCost
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.plan.checkpoint_plan import CheckpointPlan

#: Each layer: 1000 B held plainly, 100 B of inputs fully checkpointed (all offloadable), 400 B selectively.
COSTS = [LayerCost(f"blocks.{i}", "Block", none_bytes=1000, full_bytes=100, selective_bytes=400, offloadable_bytes=100,
                   full_flops=5000, selective_flops=500) for i in range(2)]
HEAD = "layer     class    none   full  selective  FLOPs full  FLOPs selective  choice"


def _plan(**changes) -> CheckpointPlan:
    plan = CheckpointPlan({"blocks.0": "full", "blocks.1": "none"}, baseline_bytes=2500, planned_bytes=1600,
                          budget_bytes=2000, recompute_flops=5000, outside_bytes=500, costs=list(COSTS),
                          peak_bytes=1800, baseline_peak_bytes=3000)
    return replace(plan, **changes)


def test_a_plain_plan_prints_its_table_and_summary():
    assert str(_plan()) == "\n".join([
        HEAD,
        "blocks.0  Block  1000 B  100 B      400 B   5.0 KFLOP         500 FLOP    full",
        "blocks.1  Block  1000 B  100 B      400 B   5.0 KFLOP         500 FLOP    none",
        "outside the layers: 500 B (in every figure below)",
        "plan: 1 of 2 layers checkpointed; activations 1.6 KiB (64% of 2.4 KiB without checkpointing), peak 1.8 KiB"
        " (budget 2.0 KiB, 2.9 KiB without checkpointing); recompute 5.0 KFLOP per step",
    ])


def test_a_plan_with_every_setting_prints_each():
    plan = _plan(layers={"blocks.0": "full", "blocks.1": "selective"}, planned_bytes=1200, peak_bytes=1400,
                 recompute_flops=5500, offload="auto", offloaded=["blocks.1"], planned_host_bytes=300, compress="bf16",
                 chunk_tokens=1024, tile_mlp=True, tile_tokens=256, predicted_step_seconds=0.041,
                 baseline_step_seconds=0.0366, device="h100-sxm")
    assert str(plan) == "\n".join([
        HEAD[:-len("choice")] + " " * 12 + "choice",
        "blocks.0  Block  1000 B  100 B      400 B   5.0 KFLOP         500 FLOP  " + " " * 14 + "full",
        "blocks.1  Block  1000 B  100 B      400 B   5.0 KFLOP         500 FLOP  selective +offload",
        "outside the layers: 500 B (in every figure below)",
        "plan: 2 of 2 layers checkpointed; activations 1.2 KiB (48% of 2.4 KiB without checkpointing), peak 1.4 KiB"
        " (budget 2.0 KiB, 2.9 KiB without checkpointing); recompute 5.5 KFLOP per step; 300 B offloaded to host"
        " (1 layers); inputs held as bf16; LM head and loss in chunks of 1024 tokens; MLPs in tiles of 256 tokens;"
        " +12% step time (41.0 ms vs 36.6 ms without checkpointing on h100-sxm)",
    ])
    assert plan.step_time_increase == pytest.approx(0.041 / 0.0366 - 1)


def test_offload_everywhere_prints_device_bytes_without_the_inputs_and_tiles_by_alst_s_rule():
    plan = _plan(offload=True, baseline_bytes=0, tile_mlp=True)  # offloaded: every checkpointed layer
    assert plan.offloaded == ["blocks.0"]
    lines = str(plan).splitlines()
    assert lines[1] == "blocks.0  Block  1000 B   0 B      300 B   5.0 KFLOP         500 FLOP    full"
    assert lines[-1] == ("plan: 1 of 2 layers checkpointed; activations 1.6 KiB (0% of 0 B without checkpointing),"
                         " peak 1.8 KiB (budget 2.0 KiB, 2.9 KiB without checkpointing); recompute 5.0 KFLOP per"
                         " step; 0 B offloaded to host (1 layers); MLPs in tiles")


def test_an_ops_layer_prints_what_it_keeps_and_recomputes():
    ops = (OpRecord("aten.mm.default", 64, 1000, 128), OpRecord("aten.gelu.default", 64, 10, 128),
           OpRecord("aten.mm.default", 64, 1000, 128))
    costs = [replace(COSTS[0], ops=ops), COSTS[1]]
    plan = _plan(layers={"blocks.0": "ops", "blocks.1": "none"}, kept_ops={"blocks.0": [0]}, costs=costs)
    # keeping the first mm: its inputs' 100 B and the mm's 64 B; recomputing all but that mm: 5000 - 1000 FLOPs
    assert str(plan).splitlines()[3] == "  blocks.0 (ops): 164 B, 4.0 KFLOP; keeps mm; recomputes gelu, mm"
    assert plan.step_time_increase is None  # no times predicted
    assert _plan(predicted_step_seconds=1.0, baseline_step_seconds=0.0).step_time_increase is None


def test_plans_apply_alike_exactly_when_what_applying_them_does_is_the_same():
    ops = (OpRecord("aten.mm.default", 64, 1000, 128), OpRecord("aten.gelu.default", 64, 10, 128))
    costs = [replace(COSTS[0], ops=ops), COSTS[1]]
    base = _plan(layers={"blocks.0": "ops", "blocks.1": "full"}, kept_ops={"blocks.0": [0]}, costs=costs,
                 offloaded=["blocks.0", "blocks.1"], compress="fp8", chunk_tokens=512, tile_mlp=True, tile_tokens=64)
    alike = [replace(base, planned_bytes=1, budget_bytes=3, recompute_flops=7, peak_bytes=9),  # predictions only
             replace(base, offloaded=["blocks.1", "blocks.0"])]  # the same layers offloaded, listed otherwise
    different = [replace(base, layers={"blocks.0": "ops", "blocks.1": "none"}),
                 replace(base, kept_ops={"blocks.0": [1]}),
                 replace(base, costs=[replace(costs[0], ops=(ops[0], replace(ops[1], op="aten.relu.default"))),
                                      COSTS[1]]),
                 replace(base, offloaded=["blocks.0"]),
                 replace(base, compress="bf16"),
                 replace(base, chunk_tokens=None),
                 replace(base, tile_mlp=False),
                 replace(base, tile_tokens=128)]
    assert [base.applies_like(p) for p in alike] == [True, True]
    assert [base.applies_like(p) for p in different] == [False] * len(different)
    # what does nothing is not compared: the compression of a plan that checkpoints no layer, tiles' size untiled
    nothing = _plan(layers={"blocks.0": "none", "blocks.1": "none"})
    assert nothing.applies_like(replace(nothing, compress="fp8"))
    assert _plan().applies_like(_plan(tile_tokens=64)) and not _plan(compress="fp8").applies_like(_plan())


def test_a_plan_saved_and_loaded_is_the_same_plan():
    plan = _plan(offload="auto", offloaded=["blocks.0"], compress="bf16", chunk_tokens=1024)
    loaded = CheckpointPlan.from_state_dict(plan.state_dict())
    assert loaded == plan and all(isinstance(c, LayerCost) for c in loaded.costs)
    state = plan.state_dict()
    del state["costs"]  # a plan saved without its costs
    assert CheckpointPlan.from_state_dict(state).costs == []


def test_a_plan_saved_before_offloaded_existed_offloads_its_checkpointed_layers_only_when_offload_was_true():
    assert _plan().offloaded == [] and _plan(offload=True).offloaded == ["blocks.0"]


def test_the_step_time_text_in_ms_and_percent_and_without_a_baseline():
    plan = _plan(predicted_step_seconds=0.19, baseline_step_seconds=0.1, device="h200")
    assert plan.step_time_text() == "+90% step time (190.0 ms vs 100.0 ms without checkpointing on h200)"
    no_baseline = _plan(predicted_step_seconds=0.19, baseline_step_seconds=0.0, device="h200")
    assert no_baseline.step_time_text() == "+0% step time (190.0 ms vs 0.0 ms without checkpointing on h200)"
    assert _plan(device="h200").step_time_text() == "+0% step time (0.0 ms vs 0.0 ms without checkpointing on h200)"


def test_a_measured_layer_the_plan_does_not_name_is_marked_unknown():
    plan = _plan(layers={"blocks.0": "full"})  # blocks.1 measured, not planned
    assert str(plan).splitlines()[2].endswith("    ?")


def test_each_layer_s_options_carry_the_plan_s_compression_and_an_ops_layer_s_policy():
    ops = (OpRecord("aten.mm.default", 64, 1000, 128), OpRecord("aten.gelu.default", 64, 10, 128))
    plan = _plan(layers={"blocks.0": "ops", "blocks.1": "none"}, kept_ops={"blocks.0": [0]}, compress="bf16",
                 costs=[replace(COSTS[0], ops=ops), COSTS[1]], offloaded=["blocks.1"])
    assert plan._mode_options("blocks.1", "none", {}) == {"compress": None, "mode": "none"}  # offloaded, not recomputed
    assert plan._mode_options("blocks.1", "full", {"use_reentrant": False}) == {
        "use_reentrant": False, "compress": "bf16", "mode": "full"}
    ops_options = plan._mode_options("blocks.0", "ops", {"checkpoint_kwargs": {"determinism_check": "none"}})
    assert ops_options["mode"] == "full" and ops_options["compress"] == "bf16"
    assert set(ops_options["checkpoint_kwargs"]) == {"determinism_check", "context_fn"}


def _gpt():
    from lightning_ckpt.demos import GPT

    return GPT(vocab_size=16, block_size=32, n_layer=2, n_embd=16, n_head=2)


def test_apply_chunks_the_loss_and_tiles_as_planned_with_the_tile_class_it_is_given():
    from lightning_ckpt.core.checkpoint.chunked_loss import chunk_loss_of
    from lightning_ckpt.core.checkpoint.tiling import tiles_of

    model = _gpt()
    names = [f"model.blocks.{i}" for i in range(2)]
    plan = CheckpointPlan(dict.fromkeys(names, "full"), 0, 0, 0, 0, 0, chunk_tokens=8, tile_mlp=True, tile_tokens=4)
    assert plan.apply(model, tile_cls=torch.nn.LayerNorm) == names
    assert chunk_loss_of(model.model) == 8  # the Transformer inside, whose loss the GPT computes
    assert tiles_of(model) == {f"{n}.{norm}": 4 for n in names for norm in ("ln1", "ln2")} | {"model.ln_f": 4}
    plain = _gpt()
    CheckpointPlan(dict.fromkeys(names, "full"), 0, 0, 0, 0, 0).apply(plain)
    assert chunk_loss_of(plain.model) is None and tiles_of(plain) == {}


def test_apply_refuses_options_the_plan_decides_and_layers_the_module_lacks_before_changing_anything():
    model = _gpt()
    plan = CheckpointPlan({"model.blocks.0": "full"}, 0, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="^" + re.escape(
            "`apply` takes use_reentrant, preserve_rng_state, checkpoint_kwargs and tile_cls; got ['mode', 'offload']."
            " Layer selection, mode and offload come from the plan.") + "$"):
        plan.apply(model, mode="full", offload=True, use_reentrant=False)
    missing = CheckpointPlan({"model.blocks.0": "full", "model.blocks.9": "full"}, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="^" + re.escape(
            "The plan names layer `model.blocks.9`, which GPT does not have: apply a plan to the module it was made"
            " for (names are relative to it).") + "$"):
        missing.apply(model)
    assert checkpointed_names(model) == []  # nothing wrapped


def test_apply_checks_every_layer_s_options_before_wrapping_any():
    """A later layer's mode refusing an option leaves the earlier layers as they were, not half the plan applied."""
    model = _gpt()
    plan = CheckpointPlan({"model.blocks.0": "full", "model.blocks.1": "selective"}, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=re.escape("Reentrant checkpointing cannot run a `context_fn`, which"
                                                   " `mode='selective'` uses.")):
        plan.apply(model, use_reentrant=True)
    assert checkpointed_names(model) == []  # blocks.0, which reentrant full checkpointing could take, is not wrapped
