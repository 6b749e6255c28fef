"""CheckpointingDDPStrategy and CheckpointingFSDPStrategy: same weights, recomputation on every rank, safe settings.

The distributed runs use 2 CPU processes with gloo. Most of them share one spawned pair of processes
(``runs`` below: many short fits on one process group, as under a cluster launcher); the two
``test_spawn_*`` tests use the strategies' own ``start_method="spawn"`` launcher from this process, and the
two-node tests start two separate processes as two machines on loopback (``node_runs``).

Weights alone cannot show that checkpointing survived the wrapping: a model trains to the same weights with or
without it. So every distributed run also counts, per rank, how often the block's forward ran in training
(``_dist_helpers.RecordTraining``: twice per step for a checkpointed block, once for a plain one) and records
which layers were checkpointed and which were FSDP units once training started.
"""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import GPT_ARGS, MLPBlock, RecordTraining, SeededGPT, TwoHeads, run_as_nodes, run_scenarios
from helpers import assert_moved_alike
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, StrategyRegistry
from torch import nn

from lightning_ckpt import GradientCheckpointing, apply_checkpointing
from lightning_ckpt.callbacks.gradient_checkpointing import check_lightning_strategy
from lightning_ckpt.core.checkpoint.placement import check_checkpointing_placement
from lightning_ckpt.demos import Block, CountingDataModule
import lightning_ckpt.strategies  # noqa: F401  (registers "ddp_ckpt" and "fsdp_ckpt")
from lightning_ckpt.strategies import CheckpointingDDPStrategy, CheckpointingFSDPStrategy
from lightning_ckpt.strategies.ddp import check_ddp_settings, reentrant_layers
from lightning_ckpt.strategies.fsdp import mixed_precision_policy

SCENARIOS = [
    "ddp_two_heads_reference", "ddp_two_heads_checkpointed", "ddp_two_heads_reentrant", "fsdp_two_heads_checkpointed",
    "ddp_two_heads_reentrant_default_flags", "ddp_static_reference", "ddp_static_reentrant",
    "gpt_ddp_reference", "gpt_fsdp_plain", "gpt_fsdp_checkpointed", "gpt_fsdp_fp8", "gpt_fsdp_checkpointed_configure_model",
    "gpt_model_parallel_with_callback", "gpt_fsdp_bf16", "gpt_fsdp_two_epochs_saving", "gpt_fsdp_resumed",
    "gpt_fsdp_sharded_saving", "gpt_fsdp_sharded_resumed", "placement_checks",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("runs")
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir()
    needs_dir = {"gpt_fsdp_two_epochs_saving", "gpt_fsdp_resumed", "gpt_fsdp_sharded_saving",
                 "gpt_fsdp_sharded_resumed"}
    return run_scenarios([(name, {"ckpt_dir": str(ckpt_dir)} if name in needs_dir else {}) for name in SCENARIOS], out)


def ok(runs: dict[str, list[dict]], name: str) -> list[dict]:
    """Both ranks' results of a scenario that must have succeeded."""
    for rank, result in enumerate(runs[name]):
        assert "error" not in result, f"{name} failed on rank {rank}:\n{result.get('traceback', result['error'])}"
    return runs[name]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=lambda m, key=key: f"{key}: {m}", **tolerance)


def max_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max(float((after[k] - before[k]).abs().max()) for k in before)


TRUNK = ["trunk.0", "trunk.1", "trunk.2"]  # TwoHeads' blocks
GPT_BLOCKS = ["model.blocks.0", "model.blocks.1"]


def assert_each_rank_ran(result: list[dict], n_layer: int, checkpointed: bool) -> None:
    """Every rank trained, and ran each block's forward once per step, twice when backward recomputed it."""
    per_step = n_layer * (2 if checkpointed else 1)
    for rank, ran in enumerate(result):
        assert ran["steps"] > 0, f"rank {rank} trained no step"
        assert ran["forward_runs"] == per_step * ran["steps"], (
            f"rank {rank}: {ran['forward_runs']} block forward runs in {ran['steps']} steps,"
            f" expected {per_step} per step ({'checkpointed' if checkpointed else 'plain'})")


def assert_checkpointed_in_training(result: list[dict], names: list[str]) -> None:
    """On every rank, ``names`` were the checkpointed layers once training started (after any wrapping)."""
    for rank, ran in enumerate(result):
        assert ran["layout"]["checkpointed"] == names, f"rank {rank}"


def assert_checkpointing_inside_units(result: list[dict], blocks: list[str]) -> None:
    """On every rank, each checkpointed block is its own FSDP unit and holds no unit inside: FSDP(checkpoint(block))."""
    assert_checkpointed_in_training(result, blocks)
    for rank, ran in enumerate(result):
        units = ran["layout"]["units"]
        assert set(blocks) <= set(units), f"rank {rank}: units {units}"
        assert not [u for u in units for b in blocks if u.startswith(b + ".")], f"rank {rank}: units {units}"


# ------------------------------------------------------------------------------------------------
# Registration and settings (no processes)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls", "attributes"),
    [
        ("ddp_ckpt", CheckpointingDDPStrategy, {"_start_method": "popen"}),
        ("ddp_ckpt_spawn", CheckpointingDDPStrategy, {"_start_method": "spawn"}),
        ("ddp_ckpt_find_unused_parameters_true", CheckpointingDDPStrategy,
         {"_ddp_kwargs": {"find_unused_parameters": True}}),
        ("fsdp_ckpt", CheckpointingFSDPStrategy, {"_start_method": "popen"}),
        ("fsdp_ckpt_spawn", CheckpointingFSDPStrategy, {"_start_method": "spawn"}),
        ("ddp", DDPStrategy, {"_start_method": "popen"}),  # Lightning's own names are left alone
    ],
)
def test_registered_names(name, cls, attributes):
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is cls
    for attribute, value in attributes.items():
        assert getattr(trainer.strategy, attribute) == value
    assert issubclass(CheckpointingDDPStrategy, DDPStrategy)
    assert issubclass(CheckpointingFSDPStrategy, ModelParallelStrategy)


OUR_NAMES = {
    "ddp_ckpt": (CheckpointingDDPStrategy, {"start_method": "popen"}),
    "ddp_ckpt_spawn": (CheckpointingDDPStrategy, {"start_method": "spawn"}),
    "ddp_ckpt_fork": (CheckpointingDDPStrategy, {"start_method": "fork"}),
    "ddp_ckpt_notebook": (CheckpointingDDPStrategy, {"start_method": "fork"}),
    "ddp_ckpt_find_unused_parameters_true": (CheckpointingDDPStrategy, {"find_unused_parameters": True}),
    "fsdp_ckpt": (CheckpointingFSDPStrategy, {}),
    "fsdp_ckpt_spawn": (CheckpointingFSDPStrategy, {"start_method": "spawn"}),
    "fsdp_ckpt_cpu_offload": (CheckpointingFSDPStrategy, {"cpu_offload": True}),
}


def _registry_entries() -> list[tuple[str, type, str, dict]]:
    return [(name, entry["strategy"], entry["description"], dict(entry["init_params"]))
            for name, entry in StrategyRegistry.items()]


def test_registering_again_changes_nothing():
    before = _registry_entries()
    ours = {name: (cls, params) for name, cls, _, params in before if "_ckpt" in name}
    assert ours == OUR_NAMES
    for _ in range(2):  # as on a second import: no error, no entry replaced, renamed, added or reordered
        CheckpointingFSDPStrategy.register_strategies(StrategyRegistry)
        CheckpointingDDPStrategy.register_strategies(StrategyRegistry)
    after = _registry_entries()
    assert [name for name, *_ in after] == [name for name, *_ in before]
    for (name, cls, description, params), (_, cls_before, description_before, params_before) in zip(after, before):
        assert cls is cls_before and description == description_before and params == params_before, name


def test_registering_does_not_replace_another_class_under_our_name():
    class Other(DDPStrategy):
        pass

    ours = StrategyRegistry["ddp_ckpt"]
    StrategyRegistry.register("ddp_ckpt", Other, description="someone else's", override=True)
    try:
        with pytest.raises(ValueError, match="'ddp_ckpt' is already present"):
            CheckpointingDDPStrategy.register_strategies(StrategyRegistry)
        assert StrategyRegistry["ddp_ckpt"]["strategy"] is Other
    finally:
        StrategyRegistry["ddp_ckpt"] = ours


def test_reentrant_is_only_accepted_with_a_static_graph():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    apply_checkpointing(model, layer_cls=nn.Linear, every_n_layers=2, checkpoint_kwargs={"use_reentrant": True})
    assert reentrant_layers(model) == ["0", "2"]
    with pytest.raises(ValueError, match=r"Reentrant checkpointing \(2 layers: 0, 2\).*find_unused_parameters=True.*"
                                         r"use_reentrant=False"):
        check_ddp_settings(model, {"find_unused_parameters": True})
    with pytest.raises(ValueError, match=r"Reentrant checkpointing.*static_graph=True.*use_reentrant=False"):
        check_ddp_settings(model, {})
    check_ddp_settings(model, {"static_graph": True})

    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    apply_checkpointing(plain, layer_cls=nn.Linear)  # non-reentrant: any DDP setting is fine
    assert reentrant_layers(plain) == []
    check_ddp_settings(plain, {"find_unused_parameters": True})


def test_torch_reentrant_checkpoint_wrapper_counts_as_reentrant():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 4), checkpoint_impl=CheckpointImpl.REENTRANT),
                          checkpoint_wrapper(nn.Linear(4, 4), checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    assert reentrant_layers(model) == ["0"]
    with pytest.raises(ValueError, match="Reentrant checkpointing"):
        check_ddp_settings(model, {})


def test_checkpointing_twice_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.ModuleDict({"blocks": nn.ModuleList([Block(8, 2), Block(8, 2)])})
    # A wrapper that is already there when applying is left alone (see test_real_models); one added afterwards,
    # as Lightning's FSDPStrategy(activation_checkpointing_policy=...) does, is refused here.
    apply_checkpointing(model, layer_cls=Block)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.raises(ValueError, match=r"`blocks.0._checkpoint_wrapped_module` is checkpointed by"
                                         r" GradientCheckpointing and by torch's `CheckpointWrapper`.*twice"):
        check_checkpointing_placement(model)


def test_lightning_fsdp_with_its_own_activation_checkpointing_is_refused():
    with pytest.raises(ValueError, match="activation_checkpointing_policy.*recomputing layers twice"):
        check_lightning_strategy(FSDPStrategy(activation_checkpointing_policy={Block}))
    check_lightning_strategy(FSDPStrategy(auto_wrap_policy={Block}))
    check_lightning_strategy(DDPStrategy())


def test_mixed_precision_follows_the_trainer_precision():
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    policy = mixed_precision_policy(MixedPrecision("bf16-mixed", "cpu"))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(Precision()) is None
    assert mixed_precision_policy(HalfPrecision("bf16-true")) is None  # the module itself is converted
    with pytest.raises(ValueError, match="16-mixed.*Pass `precision='bf16-mixed'`"):
        mixed_precision_policy(MixedPrecision("16-mixed", "cuda"))


# ------------------------------------------------------------------------------------------------
# DDP (2 processes)
# ------------------------------------------------------------------------------------------------


def test_ddp_unused_head_trains_to_the_same_weights_with_checkpointing(runs):
    reference = ok(runs, "ddp_two_heads_reference")
    checkpointed = ok(runs, "ddp_two_heads_checkpointed")
    assert checkpointed[0]["checkpointed"] == TRUNK
    assert reference[0]["steps"] == checkpointed[0]["steps"] == 4
    assert_each_rank_ran(reference, n_layer=3, checkpointed=False)
    assert_each_rank_ran(checkpointed, n_layer=3, checkpointed=True)
    assert_checkpointed_in_training(checkpointed, TRUNK)
    assert max_change(TwoHeads().state_dict(), reference[0]["weights"]) > 1e-3  # it trained
    for rank in (0, 1):
        assert_same_weights(checkpointed[rank]["weights"], reference[rank]["weights"], rtol=0, atol=0)
    assert_same_weights(checkpointed[0]["weights"], checkpointed[1]["weights"], rtol=0, atol=0)


@pytest.mark.parametrize(("scenario", "names"), [
    ("ddp_two_heads_reentrant", "find_unused_parameters=True"),
    ("ddp_two_heads_reentrant_default_flags", "static_graph=True"),
])
def test_ddp_reentrant_with_unused_parameters_is_refused_before_training(runs, scenario, names):
    for result in runs[scenario]:
        assert result["error"].startswith("ValueError: Reentrant checkpointing (3 layers: trunk.0, trunk.1, trunk.2)")
        assert names in result["error"]
        assert "GradientCheckpointing(use_reentrant=False)" in result["error"]
        assert result["steps"] == 0


def test_ddp_reentrant_with_static_graph_matches(runs):
    reference = ok(runs, "ddp_static_reference")
    reentrant = ok(runs, "ddp_static_reentrant")
    assert reentrant[0]["checkpointed"] == TRUNK
    assert_each_rank_ran(reference, n_layer=3, checkpointed=False)
    assert_each_rank_ran(reentrant, n_layer=3, checkpointed=True)
    assert_checkpointed_in_training(reentrant, TRUNK)
    for rank in (0, 1):
        assert_same_weights(reentrant[rank]["weights"], reference[rank]["weights"], rtol=0, atol=0)
    assert_same_weights(reentrant[0]["weights"], reentrant[1]["weights"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# FSDP2 (2 processes)
# ------------------------------------------------------------------------------------------------


def test_fsdp_with_several_roots_and_an_unused_head_matches_ddp(runs):
    reference = ok(runs, "ddp_two_heads_reference")
    result = ok(runs, "fsdp_two_heads_checkpointed")
    assert result[0]["checkpointed"] == TRUNK
    assert_each_rank_ran(result, n_layer=3, checkpointed=True)
    assert_checkpointing_inside_units(result, TRUNK)
    for rank in (0, 1):
        assert_same_weights(result[rank]["weights"], reference[rank]["weights"], rtol=1e-5, atol=1e-6)

FSDP_RUNS = ["gpt_fsdp_plain", "gpt_fsdp_checkpointed", "gpt_fsdp_checkpointed_configure_model",
             "gpt_model_parallel_with_callback"]


@pytest.mark.parametrize("scenario", FSDP_RUNS)
def test_fsdp_trains_to_the_weights_of_ddp_without_checkpointing(runs, scenario):
    reference = ok(runs, "gpt_ddp_reference")
    result = ok(runs, scenario)
    assert max_change(SeededGPT(**GPT_ARGS).state_dict(), reference[0]["weights"]) > 1e-3
    assert_each_rank_ran(reference, GPT_ARGS["n_layer"], checkpointed=False)
    checkpointed = scenario != "gpt_fsdp_plain"
    assert_each_rank_ran(result, GPT_ARGS["n_layer"], checkpointed=checkpointed)
    if checkpointed:
        assert result[0]["checkpointed"] == GPT_BLOCKS
        assert_checkpointing_inside_units(result, GPT_BLOCKS)
    else:
        assert_checkpointed_in_training(result, [])
    for rank in (0, 1):
        assert result[rank]["layout"]["units"] == ["model", *GPT_BLOCKS], f"rank {rank}"
    for rank in (0, 1):
        assert_same_weights(result[rank]["weights"], reference[rank]["weights"], rtol=1e-5, atol=1e-6)
    assert_same_weights(result[0]["weights"], result[1]["weights"], rtol=0, atol=0)


def test_fsdp_with_fp8_inputs_trains_close_to_exact_checkpointing_with_the_same_collectives(runs):
    """compress='fp8' under FSDP2: every rank checkpoints inside its units as without it, the collectives are the
    same, the ranks end bit-equal, and the weights move as exact checkpointing moves them, close but not equal."""
    exact, fp8 = ok(runs, "gpt_fsdp_checkpointed"), ok(runs, "gpt_fsdp_fp8")
    assert fp8[0]["checkpointed"] == GPT_BLOCKS
    assert_checkpointing_inside_units(fp8, GPT_BLOCKS)
    assert [r["counts"] for r in fp8] == [r["counts"] for r in exact]
    assert_same_weights(fp8[0]["weights"], fp8[1]["weights"], rtol=0, atol=0)
    assert_moved_alike(fp8[0]["weights"], exact[0]["weights"], SeededGPT(**GPT_ARGS).state_dict())


def test_fsdp_collectives_per_step_are_the_same_with_and_without_checkpointing(runs):
    """A guard on the collectives of one step: one all-gather per unit in forward, one per block again in backward.

    This does not tell where checkpointing sits: on this torch, FSDP2 skips the unshard while recomputing, so
    ``checkpoint(FSDP(block))`` would all-gather as often as ``FSDP(checkpoint(block))``. The placement itself is
    asserted from the unit layout (``assert_checkpointing_inside_units``) in the tests above.
    """
    n_layer = GPT_ARGS["n_layer"]
    for name in FSDP_RUNS:
        assert_each_rank_ran(ok(runs, name), n_layer, checkpointed=name != "gpt_fsdp_plain")
    counts = {(name, rank): ok(runs, name)[rank]["counts"] for name in FSDP_RUNS for rank in (0, 1)}
    for name, count in counts.items():
        # forward: the root and every block; backward: every block again (resharded after forward), the root not
        assert count["_allgather_base_"] == 2 * n_layer + 1, name
        assert count["_reduce_scatter_base_"] == n_layer + 1, name


def test_fsdp_bf16_mixed_gathers_in_bf16_and_keeps_fp32_shards(runs):
    result = ok(runs, "gpt_fsdp_bf16")
    assert_each_rank_ran(result, GPT_ARGS["n_layer"], checkpointed=True)
    assert_checkpointing_inside_units(result, GPT_BLOCKS)
    for rank in (0, 1):
        assert result[rank]["gathered_dtypes"] == ["torch.bfloat16"]
        assert result[rank]["sharded_dtypes"] == ["torch.float32"]
    reference = ok(runs, "gpt_ddp_reference")[0]["weights"]
    assert_same_weights(result[0]["weights"], reference, rtol=0, atol=5e-2)  # bf16 compute: close, not equal
    assert_same_weights(result[0]["weights"], result[1]["weights"], rtol=0, atol=0)


def test_fsdp_checkpoint_round_trip_restores_training_exactly(runs):
    full = ok(runs, "gpt_fsdp_two_epochs_saving")
    resumed = ok(runs, "gpt_fsdp_resumed")
    assert full[0]["saved"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert [r["steps"] for r in full] == [8, 8] and [r["steps"] for r in resumed] == [4, 4]  # resumed: epoch 2 only
    for result in (full, resumed):
        assert_each_rank_ran(result, GPT_ARGS["n_layer"], checkpointed=True)
        assert_checkpointing_inside_units(result, GPT_BLOCKS)
    for rank in (0, 1):
        assert_same_weights(resumed[rank]["weights"], full[rank]["weights"], rtol=0, atol=0)
        # the last checkpoint loads into a plain, unsharded model with the trained weights
        assert not resumed[rank]["plain_is_sharded"]
        assert_same_weights(resumed[rank]["plain_loaded"], full[rank]["weights"], rtol=0, atol=0)
    assert max_change(ok(runs, "gpt_fsdp_checkpointed")[0]["weights"], full[0]["weights"]) > 1e-3  # epoch 2 trained


def test_fsdp_sharded_checkpoint_round_trip_restores_training_exactly(runs):
    full = ok(runs, "gpt_fsdp_sharded_saving")
    resumed = ok(runs, "gpt_fsdp_sharded_resumed")
    assert full[0]["saved_is_dir"]  # one folder of shards, not a file
    assert [r["steps"] for r in full] == [8, 8] and [r["steps"] for r in resumed] == [4, 4]
    for result in (full, resumed):
        assert_each_rank_ran(result, GPT_ARGS["n_layer"], checkpointed=True)
        assert_checkpointing_inside_units(result, GPT_BLOCKS)
    for rank in (0, 1):
        assert_same_weights(resumed[rank]["weights"], full[rank]["weights"], rtol=0, atol=0)
    # and the same training as with the full-file checkpoints
    assert_same_weights(full[0]["weights"], ok(runs, "gpt_fsdp_two_epochs_saving")[0]["weights"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("node_runs")
    return {name: run_as_nodes(name, out) for name in ("ddp_two_heads_one_device_per_node",
                                                       "gpt_fsdp_one_device_per_node")}


@pytest.mark.parametrize(("scenario", "one_node", "blocks", "fsdp"), [
    ("ddp_two_heads_one_device_per_node", "ddp_two_heads_checkpointed", TRUNK, False),
    ("gpt_fsdp_one_device_per_node", "gpt_fsdp_checkpointed", GPT_BLOCKS, True),
])
def test_two_nodes_of_one_device_train_like_one_node_of_two(runs, node_runs, scenario, one_node, blocks, fsdp):
    """Two processes started as two machines (NODE_RANK, MASTER_ADDR=127.0.0.1, ``num_nodes=2``, one device each)."""
    nodes = node_runs[scenario]
    for node, result in enumerate(nodes):
        assert result["returncode"] == 0, f"node {node} exited with {result['returncode']}:\n{result['output']}"
    nodes = ok(node_runs, scenario)
    assert [(r["node_rank"], r["global_rank"], r["world_size"]) for r in nodes] == [(0, 0, 2), (1, 1, 2)]
    assert nodes[0]["checkpointed"] == blocks
    assert_each_rank_ran(nodes, n_layer=len(blocks), checkpointed=True)  # the recompute ran on every node
    if fsdp:
        assert_checkpointing_inside_units(nodes, blocks)
    else:
        assert_checkpointed_in_training(nodes, blocks)
    reference = ok(runs, one_node)
    assert [r["steps"] for r in nodes] == [r["steps"] for r in reference]
    for rank in (0, 1):
        assert_same_weights(nodes[rank]["weights"], reference[rank]["weights"], rtol=0, atol=0)


def test_fsdp_units_inside_a_checkpointed_layer_get_a_warning(runs):
    result = ok(runs, "placement_checks")[0]
    assert result["units"] == ["model.blocks.0", "model.blocks.1", "model"]
    assert result["good_warnings"] == []
    assert len(result["bad_warnings"]) == 1
    assert "`blocks.0` contains FSDP units (blocks.0.mlp)" in result["bad_warnings"][0]


# ------------------------------------------------------------------------------------------------
# The strategies' own spawn launcher, from this process
# ------------------------------------------------------------------------------------------------


def assert_spawned_ranks_recomputed(trainer: Trainer, n_layer: int, steps: int) -> None:
    """The ``[forward_runs, steps]`` of each spawned rank, handed back by ``RecordTraining``: checkpointed blocks."""
    per_rank = trainer.callback_metrics["record/per_rank"].tolist()
    assert per_rank == [[2 * n_layer * steps, steps]] * 2, f"[forward runs, steps] per rank: {per_rank}"


def test_spawn_ddp_hands_back_the_trained_weights(runs):
    seed_everything(0)
    model = TwoHeads()
    callback = GradientCheckpointing()
    trainer = Trainer(strategy=CheckpointingDDPStrategy(start_method="spawn", find_unused_parameters=True),
                      accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[callback, RecordTraining(MLPBlock)])
    trainer.fit(model)
    assert_spawned_ranks_recomputed(trainer, n_layer=3, steps=4)
    expected = ok(runs, "ddp_two_heads_checkpointed")[0]["weights"]
    assert_same_weights({k: v.float() for k, v in model.state_dict().items()}, expected, rtol=0, atol=0)
    assert trainer.state.finished


def test_spawn_fsdp_hands_back_the_unsharded_weights(runs):
    from torch.distributed.tensor import DTensor

    seed_everything(0)
    model = SeededGPT(**GPT_ARGS)
    trainer = Trainer(strategy="fsdp_ckpt_spawn", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing(), RecordTraining(Block)])
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=32))
    assert_spawned_ranks_recomputed(trainer, GPT_ARGS["n_layer"], steps=4)
    state = model.state_dict()
    assert not any(isinstance(v, DTensor) for v in state.values())
    expected = ok(runs, "gpt_fsdp_checkpointed")[0]["weights"]
    assert_same_weights({k: v.float() for k, v in state.items()}, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# memory_budget: one plan on every rank
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def budget_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return run_scenarios([("ddp_memory_budget_ranks_differ", {}), ("fsdp_memory_budget_ranks_differ", {}),
                          ("fsdp_memory_budget_reference", {}), ("fsdp_recorder_layer_not_a_unit", {}),
                          ("ddp_budget_varying_lengths", {}), ("ddp_budget_varying_lengths_reference", {}),
                          ("ddp_budget_varying_lengths_fp8", {}),
                          ("fsdp_budget_varying_lengths", {}), ("fsdp_budget_varying_lengths_reference", {}),
                          ("ddp_budget_predicted", {}), ("ddp_budget_predicted_reference", {})],
                         tmp_path_factory.mktemp("budget_runs"))


def assert_one_plan_for_ranks_that_differ(result: list[dict]) -> None:
    """Each rank measured its own batch (rank 1's twice rank 0's); both solved one plan from the maximum."""
    rank0, rank1 = result
    # Alone, rank 0 would need no checkpointing.
    assert all(b > a for a, b in zip(rank0["local_none_bytes"], rank1["local_none_bytes"]))
    assert rank0["local_baseline_bytes"] <= 300_000 < rank1["local_baseline_bytes"]
    plan = rank0["plan"]
    assert sum(c["none_bytes"] for c in plan["costs"]) + plan["outside_bytes"] == plan["baseline_bytes"]
    assert [c["none_bytes"] for c in plan["costs"]] == rank1["local_none_bytes"]  # the maximum over ranks
    assert rank1["plan"] == plan  # the same plan, costs and all, on both ranks
    chosen = [name for name, mode in plan["layers"].items() if mode != "none"]
    assert chosen and rank0["checkpointed"] == rank1["checkpointed"] == chosen
    every = [f"model.blocks.{i}" for i in range(4)]
    assert rank0["seen"] == rank1["seen"] == [every, chosen, chosen]  # measured in step 1, planned from step 2
    assert_same_weights(rank0["weights"], rank1["weights"], rtol=0, atol=0)


def test_memory_budget_gives_every_rank_the_same_plan_when_their_batches_differ(budget_runs):
    assert_one_plan_for_ranks_that_differ(ok(budget_runs, "ddp_memory_budget_ranks_differ"))


def test_memory_budget_under_fsdp_measures_sharded_layers_like_ddp(budget_runs):
    fsdp = ok(budget_runs, "fsdp_memory_budget_ranks_differ")
    assert_one_plan_for_ranks_that_differ(fsdp)
    every = [f"model.blocks.{i}" for i in range(4)]
    for rank in (0, 1):
        assert set(every) <= set(fsdp[rank]["units"])  # each layer its own FSDP unit, sharded
    # Gathered again for the re-runs and left out of the counts: each rank measures what DDP's rank measures for
    # the same batch, byte for byte, so both strategies plan the same.
    for fsdp_rank, ddp_rank in zip(fsdp, ok(budget_runs, "ddp_memory_budget_ranks_differ")):
        assert fsdp_rank["local_none_bytes"] == ddp_rank["local_none_bytes"]
        assert fsdp_rank["local_outside_bytes"] == ddp_rank["local_outside_bytes"]
        # The one difference: under FSDP2 the head's backward (the logits' gradient) is not measured (FSDP2's hooks
        # expect one backward per forward), so both predicted peaks lack the same bytes, which DDP measured.
        fsdp_plan, ddp_plan = dict(fsdp_rank["plan"]), dict(ddp_rank["plan"])
        head = ddp_plan["baseline_peak_bytes"] - fsdp_plan["baseline_peak_bytes"]
        assert head > 0 and ddp_plan["peak_bytes"] - fsdp_plan["peak_bytes"] == head
        for key in ("peak_bytes", "baseline_peak_bytes"):
            del fsdp_plan[key], ddp_plan[key]
        assert fsdp_plan == ddp_plan
    # And it trains as FSDP without the callback.
    reference = ok(budget_runs, "fsdp_memory_budget_reference")
    assert reference[0]["seen"] == [[], [], []]
    for rank in (0, 1):
        assert_same_weights(fsdp[rank]["weights"], reference[rank]["weights"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_whose_lengths_differ_agree_on_each_step_s_size_and_train_as_without_the_callback(budget_runs, strategy):
    """Rank 0's first batch is short and rank 1's long, then the other way round: every rank plans for the largest
    (16, 16, 8, 16 per step), measures the same steps and enters the same collectives; none waits for another."""
    rank0, rank1 = ok(budget_runs, f"{strategy}_budget_varying_lengths")
    every = [f"model.blocks.{i}" for i in range(4)]
    assert rank0["plans"] == rank1["plans"] and sorted(rank0["plans"]) == [32, 64]  # 4 x 8 and 4 x 16 tokens
    # DDP's layers timed, each the slowest rank's time (the plans, times included, are equal on both ranks);
    # FSDP2's not (its hooks expect one backward per forward): its plans count FLOPs
    assert {c["full_ns"] > 0 for plan in rank0["plans"].values() for c in plan["costs"]} == {strategy == "ddp"}
    long = [name for name, mode in rank0["plans"][64]["layers"].items() if mode != "none"]
    assert long and rank0["seen"] == rank1["seen"] == [every, long, every, long]  # steps 1 and 3 measure
    assert_same_weights(rank0["weights"], rank1["weights"], rtol=0, atol=0)
    reference = ok(budget_runs, f"{strategy}_budget_varying_lengths_reference")
    assert reference[0]["seen"] == [[], [], [], []]
    for rank in (0, 1):
        assert_same_weights(rank0["weights"] if rank == 0 else rank1["weights"], reference[rank]["weights"],
                            rtol=0, atol=0 if strategy == "ddp" else 1e-5)


def test_ranks_predict_the_same_sizes_alike_from_the_fit_of_their_combined_costs(budget_runs):
    """The largest lengths over ranks 4, 8, 12 are measured; 16 is planned from the fit of the rows combined over
    ranks, and checked; 2 runs 4's plan, which checkpoints nothing: on both ranks the same steps, the same predicted
    plans, weights bit-equal and equal to the run without the callback."""
    rank0, rank1 = ok(budget_runs, "ddp_budget_predicted")
    every = [f"model.blocks.{i}" for i in range(4)]
    assert rank0["measured_steps"] == rank1["measured_steps"] == 3
    assert rank0["predicted"] == rank1["predicted"] == [64]  # 16 x 4 tokens
    assert rank0["plans"] == rank1["plans"] and sorted(rank0["plans"]) == [16, 32, 64]
    assert rank0["seen"] == rank1["seen"] and rank0["seen"][:3] == [every] * 3 and every not in rank0["seen"][3:]
    assert rank0["seen"][4] == []  # length 2, under the plan made at length 4
    assert_same_weights(rank0["weights"], rank1["weights"], rtol=0, atol=0)
    reference = ok(budget_runs, "ddp_budget_predicted_reference")
    for rank, result in enumerate((rank0, rank1)):
        assert_same_weights(result["weights"], reference[rank]["weights"], rtol=0, atol=0)


def test_compressed_ranks_whose_lengths_differ_plan_alike_and_stay_bit_equal(budget_runs):
    """compress='fp8' with the lengths above: the ranks measure the same steps (compressed) and solve the same fp8
    plans; DDP's all-reduce keeps them bit-equal; the weights move close to the exact run's, not equal to them."""
    rank0, rank1 = ok(budget_runs, "ddp_budget_varying_lengths_fp8")
    exact = ok(budget_runs, "ddp_budget_varying_lengths")[0]
    assert rank0["plans"] == rank1["plans"] and sorted(rank0["plans"]) == [32, 64]
    assert {plan["compress"] for plan in rank0["plans"].values()} == {"fp8"}
    assert rank0["seen"] == rank1["seen"] and rank0["seen"][0] == rank0["seen"][2] == [f"model.blocks.{i}" for i in range(4)]
    assert_same_weights(rank0["weights"], rank1["weights"], rtol=0, atol=0)
    start = ok(budget_runs, "ddp_budget_varying_lengths_reference")[0]["initial"]
    assert_moved_alike(rank0["weights"], exact["weights"], start)


def test_measuring_layers_that_are_not_their_own_fsdp_unit_is_refused_with_what_to_do(budget_runs):
    for result in ok(budget_runs, "fsdp_recorder_layer_not_a_unit"):
        assert "`blocks.0` has sharded (DTensor) parameters but is not an FSDP unit" in result["error_text"]
        assert "strategy='fsdp_ckpt'" in result["error_text"] and result["hooks_added"] == 0


def test_reentrant_with_find_unused_parameters_is_refused_even_with_a_static_graph():
    # docs/troubleshooting.md: reentrant checkpointing "cannot be combined with DDP's find_unused_parameters=True";
    # static_graph=True lifts only the other refusal.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    apply_checkpointing(model, layer_cls=nn.Linear, use_reentrant=True)
    with pytest.raises(ValueError, match=r"^Reentrant checkpointing \(2 layers: 0, 1\) cannot be combined with DDP's"
                                         r" `find_unused_parameters=True`"):
        check_ddp_settings(model, {"find_unused_parameters": True, "static_graph": True})
    check_ddp_settings(model, {"find_unused_parameters": False, "static_graph": True})
