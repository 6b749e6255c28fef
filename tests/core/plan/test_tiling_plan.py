"""The planner chooses tiles of tokens (``tile_mlp``) where only they reach a budget, and prices them."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import Callback

from helpers import counted_peak
from lightning_ckpt import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint.tiling import tiled_names
from lightning_ckpt.core.plan.checkpoint_plan import CheckpointPlan
from lightning_ckpt.core.plan.planner import plan_checkpointing
from lightning_ckpt.demos import Transformer

B, T, WIDTH, LAYERS = 2, 256, 16, 2


def model_and_step():
    torch.manual_seed(0)
    model = Transformer(vocab_size=32, block_size=T, n_layer=LAYERS, n_embd=WIDTH, n_head=2, dropout=0.0)
    model.train()
    idx = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(idx, idx)


def least_reachable(error: ValueError) -> int:
    return int(re.search(r"pass a budget of at least (\d+) bytes", str(error)).group(1))


def test_a_budget_only_tiles_reach_is_planned_with_tiles_and_the_applied_step_holds_it():
    model, step = model_and_step()
    with pytest.raises(ValueError) as untiled:
        plan_checkpointing(model, step, "1KiB", tile_mlp=False)
    with pytest.raises(ValueError) as tiled:
        plan_checkpointing(model, step, "1KiB", tile_mlp=True)
    floor, tiled_floor = least_reachable(untiled.value), least_reachable(tiled.value)
    # by hand, what tiles remove from a layer's backward: its MLP's [B*T, 4*WIDTH] float32 intermediates (the first
    # Linear's output and GELU's) less one tile's; at least one of them is gone
    assert floor - tiled_floor >= B * T * 4 * WIDTH * 4 * (1 - 1 / 16)
    budget = (floor + tiled_floor) // 2
    plan = plan_checkpointing(model, step, budget)  # tile_mlp=None: the plan chooses
    assert plan.tile_mlp is True and plan.tile_tokens is None and plan.peak_bytes <= budget
    assert tiled_names(model) == []  # planning leaves the module as it was
    plan.apply(model)
    assert tiled_names(model) == [f"blocks.{i}.{m}" for i in range(LAYERS) for m in ("ln1", "ln2", "mlp")] + ["ln_f"]
    measured = counted_peak(model, step)
    assert measured <= budget, (measured, budget)
    remove_checkpointing(model)
    assert tiled_names(model) == []


def test_a_budget_reached_without_tiles_is_planned_without_them():
    model, step = model_and_step()
    with pytest.raises(ValueError) as untiled:
        plan_checkpointing(model, step, "1KiB", tile_mlp=False)
    plan = plan_checkpointing(model, step, least_reachable(untiled.value))
    assert plan.tile_mlp is False and not plan.applies_like(CheckpointPlan(**{**plan.__dict__, "tile_mlp": True}))


def test_the_tiles_second_forward_is_priced_as_its_matmuls_by_hand():
    """Tiled, with a budget that checkpoints nothing: the only recompute is each tile's second forward in backward,
    the MLP's two Linears (WIDTH x 4*WIDTH each) over every token of both layers: 2 FLOPs a multiply-add."""
    model, step = model_and_step()
    plan = plan_checkpointing(model, step, 1.0, tile_mlp=True)
    assert all(mode == "none" for mode in plan.layers.values())
    assert plan.recompute_flops == LAYERS * 2 * (B * T) * (2 * WIDTH * 4 * WIDTH)
    assert plan.tile_mlp and not plan.checkpoints_nothing
    assert "MLPs in tiles" in str(plan)


def test_tile_mlp_must_be_a_bool_or_none():
    model, step = model_and_step()
    with pytest.raises(TypeError, match=r"`tile_mlp` is True, False or None, got 'yes'"):
        plan_checkpointing(model, step, 0.5, tile_mlp="yes")


def test_plan_with_tile_mlp_measures_every_setting_with_tiles(tmp_path):
    """``lightning-ckpt plan --tile-mlp true`` on tiny.yaml at 256 tokens, dropout off (SDPA keeps no T x T tensor; 8
    tiles of 32 by ALST's rule, hidden 32):
    every layer checkpointed, a layer's backward no longer holds its MLP's [8 x 256, 128] float32 intermediates whole
    (the first Linear's output and GELU's: at least one of them less one tile's, by hand)."""
    import json
    from pathlib import Path

    from lightning_ckpt.commands.plan import main as plan_main

    config = Path(__file__).parents[3] / "configs" / "tiny.yaml"
    longer = ["--model.init_args.block_size=256", "--data.init_args.block_size=256", "--model.init_args.dropout=0.0"]
    peaks = {}
    for tiles in ("true", "false"):
        out = tmp_path / tiles
        assert plan_main(["--config", str(config), "--fake", "--tile-mlp", tiles, "--output-dir", str(out),
                          *longer]) == 0
        report = json.loads((out / "plan.json").read_text())
        assert report["tile_mlp"] is (tiles == "true")
        peaks[tiles] = {s["name"]: s["peak_bytes"] for s in report["settings"]}
    rows, intermediate = 8 * 256, 4 * 32
    assert peaks["false"]["every_layer"] - peaks["true"]["every_layer"] >= rows * intermediate * 4 * (1 - 1 / 8)


class TilesSeen(Callback):
    """The tiled submodules at each training step (after the checkpointing callback has applied its plan)."""

    def __init__(self) -> None:
        self.names: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.names.append(tiled_names(pl_module))


def _fit(callback, steps: int = 3, *extra, length: int = T // 2):
    from lightning.pytorch import Trainer

    from helpers import StepPeaks
    from lightning_ckpt.demos import GPT, CountingDataModule

    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=T, n_layer=LAYERS, n_embd=WIDTH, n_head=2, dropout=0.0)
    peaks = StepPeaks()
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback, peaks, *extra], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # batches shorter than max_length (T): the longest batch is planned on fake tensors before the first step, where
    # tile_mlp=None chooses the tiles
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=length, batch_size=B, num_samples=16))
    return model, peaks.peaks


def test_the_callback_tiles_where_only_tiles_hold_the_longest_batch_and_every_step_holds_the_budget(caplog):
    from helpers import least_reachable_bytes
    from lightning_ckpt import GradientCheckpointing

    floors = {}
    for tiles in (False, True):
        with pytest.raises(ValueError) as info:
            _fit(GradientCheckpointing(memory_budget="1KiB", max_length=T, tile_mlp=tiles))
        floors[tiles] = least_reachable_bytes(str(info.value))
    assert floors[True] < floors[False]
    budget = (floors[True] + floors[False]) // 2
    callback, seen = GradientCheckpointing(memory_budget=budget, max_length=T), TilesSeen()  # tile_mlp=None
    with caplog.at_level("INFO"):
        model, peaks = _fit(callback, 3, seen)
    assert "only with each layer's MLP over tiles of tokens" in caplog.text
    assert seen.names == [[f"model.blocks.{i}.{m}" for i in range(LAYERS) for m in ("ln1", "ln2", "mlp")]
                          + ["model.ln_f"]] * 3
    assert tiled_names(model) == []  # undone with the rest at the end of fit
    assert len(peaks) == 3 and max(peaks) <= budget, (peaks, budget)
    assert callback.state_dict()["tiles_chosen"] is True


def test_the_callback_does_not_tile_where_the_budget_holds_without_tiles():
    from helpers import least_reachable_bytes
    from lightning_ckpt import GradientCheckpointing

    with pytest.raises(ValueError) as info:
        _fit(GradientCheckpointing(memory_budget="1KiB", max_length=T, tile_mlp=False))
    callback, seen = GradientCheckpointing(memory_budget=least_reachable_bytes(str(info.value)), max_length=T), TilesSeen()
    _fit(callback, 3, seen)
    assert seen.names == [[]] * 3 and "tiles_chosen" not in callback.state_dict()


def test_the_tiles_second_forward_is_priced_in_seconds_on_a_profile():
    """``_with_tiles``: the tiles' FLOPs at the profile's matmul rate on top of the plan's predicted step time."""
    from dataclasses import replace

    from lightning_ckpt.core.measure.device_profile import DeviceProfile
    from lightning_ckpt.core.plan.planner import _with_tiles

    plan = CheckpointPlan(layers={"a": "none"}, baseline_bytes=10, planned_bytes=10, budget_bytes=10,
                          recompute_flops=5, outside_bytes=0, predicted_step_seconds=1.0)
    profile = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e9)
    tiled = _with_tiles(plan, 64, 2 * 10**12, profile)
    assert (tiled.tile_mlp, tiled.tile_tokens, tiled.recompute_flops, tiled.predicted_step_seconds) == (
        True, 64, 5 + 2 * 10**12, 3.0)
    assert _with_tiles(plan, None, 10**12, None).predicted_step_seconds == 1.0  # no profile: no time added
    assert _with_tiles(replace(plan, predicted_step_seconds=None), 64, 10**12, profile).predicted_step_seconds is None


def test_the_tiles_flops_count_the_rows_of_the_first_call():
    from torch import nn

    from lightning_ckpt.core.plan.planner import _TileFlops

    holder = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))})
    counter = _TileFlops(holder, ["mlp"])
    holder["mlp"](input=torch.ones(5, 4))  # no positional tensor: nothing to count rows from
    assert counter.rows == {} and counter.flops == 0
    holder["mlp"](torch.ones(6, 4))  # a [tokens, hidden] input: 6 rows
    holder["mlp"](torch.ones(2, 9, 4))  # the first call's rows stay
    assert counter.rows == {"mlp": 6} and type(counter.rows["mlp"]) is int
    assert counter.flops == 2 * 6 * (4 * 8 + 8 * 4)
    counter.close()
    holder["mlp"](torch.ones(1, 4))
    assert counter.rows == {"mlp": 6}  # closed: no longer counting


def _never() -> None:
    raise AssertionError("the step ran: the settings should have been refused first")


def test_plan_checkpointing_refuses_bad_settings_before_running_the_step_with_their_whole_messages():
    model, _ = model_and_step()
    with pytest.raises(ValueError, match="compress"):
        plan_checkpointing(model, _never, 0.5, compress="fp7")
    with pytest.raises(ValueError) as info:
        plan_checkpointing(model, _never, None)
    assert str(info.value) == ("`memory_budget=None` asks for no plan. Pass a fraction such as 0.5 or bytes such as"
                               " '2GiB'.")
    with pytest.raises(TypeError) as info:
        plan_checkpointing(model, _never, 0.5, chunk_loss="yes")
    assert str(info.value) == ("`chunk_loss` is True, False or None, got 'yes'. Pass True (the LM head and loss in"
                               " chunks), False (whole) or None (the plan chooses).")
    with pytest.raises(TypeError) as info:
        plan_checkpointing(model, _never, 0.5, tile_mlp="yes")
    assert str(info.value) == ("`tile_mlp` is True, False or None, got 'yes'. Pass True (the MLPs over tiles of"
                               " tokens), False (whole) or None (the plan chooses).")


def test_a_budget_of_one_byte_is_a_budget_and_a_model_without_tiles_is_refused_as_untiled():
    """Plain PyTorch takes any bytes, even 1; out of reach, a model with nothing to tile gets the untiled refusal
    (``tile_mlp=None`` tries tiles only where there are some)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(2)))
    x = torch.randn(4, 8)
    with pytest.raises(ValueError) as info:
        plan_checkpointing(model, lambda: model(x).square().sum(), 1, layer_cls=nn.Sequential)
    assert "asks for an activation peak of at most 1 B" in str(info.value)
    assert "least reachable" in str(info.value) and "tile" not in str(info.value)


class WideMLP(torch.nn.Module):
    """An MLP of a class the package does not know, with [tokens, 64] intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class OwnBlock(torch.nn.Module):
    """A block of a model of one's own: attention-free, its MLP a ``WideMLP``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = WideMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x).tanh()


def own_model_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(OwnBlock() for _ in range(2))).train()
    x = torch.randn(2, 64, 8)
    return model, lambda: model(x).square().sum()


def test_a_model_of_ones_own_is_planned_with_tiles_of_its_named_class_and_tile_tokens():
    model, step = own_model_and_step()
    with pytest.raises(ValueError) as untiled:
        plan_checkpointing(model, step, 1, layer_cls=OwnBlock, tile_mlp=False)
    floors = {}
    for tokens in (64, 8):  # one tile of the whole sequence holds what untiled does; tiles of 8 hold less
        with pytest.raises(ValueError) as tiled:
            plan_checkpointing(model, step, 1, layer_cls=OwnBlock, tile_mlp=True, tile_cls=WideMLP, tile_tokens=tokens)
        floors[tokens] = least_reachable(tiled.value)
    assert floors[8] < floors[64]
    budget = (floors[8] + least_reachable(untiled.value)) // 2
    plan = plan_checkpointing(model, step, budget, layer_cls=OwnBlock, tile_cls=WideMLP, tile_tokens=8)  # None
    assert plan.tile_mlp is True and plan.tile_tokens == 8 and plan.peak_bytes <= budget
    assert tiled_names(model) == []
    # tile_mlp=False: nothing about tiles is checked (this model has nothing the package knows to tile)
    assert plan_checkpointing(model, step, 0.99, layer_cls=OwnBlock, tile_mlp=False).tile_mlp is False


def test_a_budget_out_of_reach_with_tiles_too_says_so_in_the_untiled_refusal():
    model, step = model_and_step()
    with pytest.raises(ValueError) as info:
        plan_checkpointing(model, step, 1)  # tile_mlp=None: tried without tiles, then with them
    message = str(info.value)
    assert "asks for an activation peak of at most 1 B" in message
    assert re.search(r"\(tile_mlp=True, each layer's MLP over tiles of tokens, would not reach it either: least"
                     r" reachable [^)]+\.\)$", message), message


def test_on_a_device_profile_the_tiles_second_forward_is_the_only_extra_time_of_a_plan_that_checkpoints_nothing():
    from lightning_ckpt.core.measure.device_profile import DeviceProfile

    model, step = model_and_step()
    profile = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e10, host_bandwidth=1e9)
    plan = plan_checkpointing(model, step, 1.0, tile_mlp=True, tile_tokens=32, device=profile)
    assert all(mode == "none" for mode in plan.layers.values()) and plan.tile_tokens == 32
    assert plan.recompute_flops == LAYERS * 2 * (B * T) * (2 * WIDTH * 4 * WIDTH)  # the tiles' matmuls, by hand
    assert plan.predicted_step_seconds - plan.baseline_step_seconds == pytest.approx(plan.recompute_flops / 1e9)
