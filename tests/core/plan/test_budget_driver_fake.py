"""The budget driver's fake steps of the longest batch, called directly on a driver (no Trainer):
``BudgetDriver._fake_measured`` (one fully checkpointed step on fake tensors: what it measures, with which modes, the
LM head as the plan will see it, tiles, the module checkpointed again afterwards, the failures), ``_tiled_if_needed``
(``tile_mlp=None``: tiles where only they hold the longest batch) and ``_holds`` (whether some plan, the head whole or
in chunks, holds a measurement combined over ranks).

The demo GPT (:class:`lightning_ckpt.demos.Transformer`) is the model whose loss can be chunked; plain ``nn.Module``
blocks and hand-made :class:`~lightning_ckpt.core.plan.budget.RankMeasurement` s stand in where only the plan matters.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Optional

import pytest
import torch
from torch import nn

from lightning_ckpt.core.checkpoint.chunked_loss import LossNotChunkable, chunk_causal_lm_loss, chunk_loss_of
from lightning_ckpt.core.checkpoint.tiling import apply_tiling, tiled_names
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.longest import batch_of_length, measure_fake_step
from lightning_ckpt.core.plan.budget import RankMeasurement
from lightning_ckpt.core.plan.budget_driver import (
    BUDGET_DEFAULTS,
    MEASURED_CHUNK,
    ONE_CHUNK,
    BudgetDriver,
    OneRank,
    _chunked_head,
    _HeadRun,
    _rechunked,
)
from lightning_ckpt.core.plan.planner import HeadCount, LayerCost
from lightning_ckpt.demos import CausalSelfAttention, Transformer

from helpers import TwoRanks, blocks

LENGTH = 640  # the longest batch: 2 x 640 = 1280 tokens, more than a measuring chunk (1024) holds
LONGEST = (LENGTH, "max_length")
BATCH = (torch.arange(8).view(2, 4), torch.arange(1, 9).view(2, 4))  # (tokens, targets), 4 long
LAYERS = ["blocks.0", "blocks.1"]


def gpt() -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=2048, block_size=1024, n_layer=2, n_embd=16, n_head=2, dropout=0.0)


def loss_of(model: nn.Module, fails: bool = False, whole_only: bool = False):
    """``longest_step`` for ``model``: its loss of a ``(tokens, targets)`` batch. ``fails``: the step reads the loss's
    value, which fake tensors do not have; ``whole_only``: its loss cannot be chunked (as a model that soft-caps its
    logits: chunked, it raises)."""

    def loss(batch):
        if whole_only and chunk_loss_of(model) is not None:
            raise LossNotChunkable(type(model).__name__)
        value = model(batch[0], batch[1])
        return value * value.item() if fails else value

    @contextlib.contextmanager
    def step():
        yield loss

    return step


def driver_for(said: Optional[list] = None, warned: Optional[list] = None, **settings) -> BudgetDriver:
    settings = dict(BUDGET_DEFAULTS, **{"memory_budget": 0.5, "max_length": 0, "time_layers": False, **settings})
    return BudgetDriver(settings, info=(said if said is not None else []).append,
                        warn=(warned if warned is not None else []).append)


@functools.lru_cache(maxsize=None)
def by_hand(chunk: Optional[int] = None, tiles: Optional[tuple] = None, modes=("full", "selective"),
            compress=None, layer_cls=None, length=LENGTH) -> tuple[RankMeasurement, HeadCount]:
    """``measure_fake_step`` of a fresh GPT on the batch at ``length``, its loss in chunks of ``chunk`` (``None``:
    whole) and its MLPs over ``tiles`` (``(tile_cls, tile_tokens)``), its head counted."""
    model = gpt()
    if chunk is not None:
        chunk_causal_lm_loss(model, chunk)
    if tiles is not None:
        apply_tiling(model, *tiles)
    with HeadCount(model) as count:
        found = measure_fake_step(model, lambda b: model(b[0], b[1]), batch_of_length(BATCH, length), layer_cls,
                                   modes)
    return RankMeasurement(found.costs, found.outside_bytes, found.head_bytes, found.head_peak_bytes, compress), count


def layers_of(scale: int) -> RankMeasurement:
    """Two layers (100 B each unchecked, 10 B fully checkpointed) and 20 B outside them, every figure times
    ``scale``."""
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100 * scale, full_bytes=10 * scale, selective_bytes=40 * scale,
                       offloadable_bytes=0, full_flops=50, selective_flops=5) for i in range(2)]
    return RankMeasurement(costs, outside_bytes=20 * scale)


# --------------------------------------------------------------------------------------------- _tiled_if_needed


BUDGET = 1000  # holds layers_of(1) (least peak 130), not layers_of(100) (13000)
TILED_INFO = ("GradientCheckpointing: the budget holds the longest batch (length 640) only with each layer's MLP over"
              " tiles of tokens (tile_mlp=None lets the plan choose): tiling them for the run.")


class Fake:
    """A stand-in for the fake step of ``driver``: returns ``found``; records its argument and the tiles the driver
    asks for, and leaves the module checkpointed with them (as ``_fake_measured`` does)."""

    def __init__(self, driver: BudgetDriver, module: nn.Module, found) -> None:
        self.driver, self.module, self.found = driver, module, found
        self.calls: list = []

    def __call__(self, longest):
        self.calls.append((longest, self.driver.tiles()))
        self.driver.apply(self.module)
        return self.found


def tiling_case(found, **settings):
    said = []
    driver = driver_for(said, memory_budget=BUDGET, **{"tile_cls": nn.Linear, "tile_tokens": 8, **settings})
    module = blocks(2)
    driver.apply(module)
    return driver, module, Fake(driver, module, found), said


def test_tile_mlp_none_tiles_where_only_tiles_hold_the_longest_batch():
    untiled, tiled = (layers_of(100), None), (layers_of(1), None)
    driver, module, fake, said = tiling_case(tiled)
    assert driver._tiled_if_needed(OneRank(), module, fake, LONGEST, untiled) is tiled
    assert driver.tiles_chosen is True
    assert fake.calls == [(LONGEST, {"tile_mlp": True, "tile_tokens": 8, "tile_cls": nn.Linear})]
    assert said == [TILED_INFO]
    assert tiled_names(module) == ["0.up", "0.down", "1.up", "1.down"]


@pytest.mark.parametrize("tiled, ranks", [
    ((layers_of(50), None), OneRank()),  # tiles do not hold it either
    (None, OneRank()),  # fake tensors could not run the tiled step
    ((layers_of(1), None), TwoRanks(scale=1, other_flag=0)),  # they could here, not on the other rank: no rank tiles
], ids=["not-held-tiled", "tiled-step-failed", "failed-on-another-rank"])
def test_tile_mlp_none_keeps_the_untiled_measurement_where_tiles_do_not_help(tiled, ranks):
    untiled = (layers_of(100), None)
    driver, module, fake, said = tiling_case(tiled)
    assert driver._tiled_if_needed(ranks, module, fake, LONGEST, untiled) is untiled
    assert driver.tiles_chosen is False and driver.tiles() == {}
    assert fake.calls == [(LONGEST, {"tile_mlp": True, "tile_tokens": 8, "tile_cls": nn.Linear})]
    assert said == [] and checkpointed_names(module) == ["0", "1"] and tiled_names(module) == []


@pytest.mark.parametrize("settings, longest, scale", [
    (dict(tile_mlp=False), LONGEST, 100),  # the user said
    (dict(tile_mlp=True), LONGEST, 100),
    ({}, (LENGTH, "the model's block_size"), 100),  # the model's limit is only a hint: not slowed for it
    ({}, LONGEST, 1),  # held untiled
    (dict(tile_cls=None), LONGEST, 100),  # plain blocks: nothing known to be token-wise
], ids=["tile_mlp-false", "tile_mlp-true", "model-limit", "held", "nothing-to-tile"])
def test_tile_mlp_none_measures_nothing_again_where_tiles_are_not_its_to_choose_or_not_needed(settings, longest, scale):
    found = (layers_of(scale), None)
    driver, module, fake, said = tiling_case((layers_of(1), None), **settings)
    assert driver._tiled_if_needed(OneRank(), module, fake, longest, found) is found
    assert fake.calls == [] and driver.tiles_chosen is False and said == []


# --------------------------------------------------------------------------------------------- _holds


def test_holds_says_whether_the_least_peak_fits_the_budget_the_ranks_costs_combined():
    measured = layers_of(1)
    least = measured.peak_bytes  # every layer fully checkpointed: the least peak a plan reaches
    assert least == 130  # 20 outside, 10 held by the other layer, 100 alive in the last layer's backward
    assert driver_for(memory_budget=least)._holds(OneRank(), measured, None)
    assert not driver_for(memory_budget=least - 1)._holds(OneRank(), measured, None)
    # another rank whose every figure is twice this one's: the plan is solved for it
    two = TwoRanks(scale=2)
    assert not driver_for(memory_budget=least)._holds(two, measured, None)
    assert driver_for(memory_budget=2 * least)._holds(two, measured, None)
    assert two.gathered[-1][1].tolist() == (2 * two.gathered[-1][0]).tolist()


@pytest.fixture(scope="module")
def head_run():
    """A step of the GPT at the longest length, its head in one chunk through lm_loss, and its head count."""
    return by_hand(ONE_CHUNK)


def test_holds_with_a_head_count_prices_the_head_whole_and_in_each_chunk_the_plan_may_choose(head_run):
    measured, count = head_run
    run = _HeadRun(measured, count, ONE_CHUNK)
    whole = _rechunked(run, None).peak_bytes

    def chunked(chunk: int) -> int:
        head = _chunked_head(OneRank(), run, chunk)
        return replace(measured, outside_bytes=head.outside_bytes, head_bytes=head.head_bytes,
                       head_peak_bytes=head.head_peak_bytes).peak_bytes

    # the logits (1280 tokens x 2048 fp32) dominate: each halving of the chunk lowers the peak
    assert whole > chunked(1024) > chunked(512) > chunked(256)
    for budget, held in [(whole, True), (chunked(1024), True), (chunked(256), True), (chunked(256) - 1, False)]:
        assert driver_for(memory_budget=budget)._holds(OneRank(), measured, count) is held, budget
    # Without the count, nothing but the head as measured (in one chunk, nearly the whole head's peak)
    assert not driver_for(memory_budget=chunked(1024))._holds(OneRank(), measured, None)
    # A count that saw no call of the head (a step that computes its loss itself): the measurement as it is
    idle = HeadCount(gpt())
    assert not driver_for(memory_budget=chunked(1024))._holds(OneRank(), measured, idle)
    assert driver_for(memory_budget=measured.peak_bytes)._holds(OneRank(), measured, idle)
    # a rank whose costs are twice these: chunks of 256 no longer hold
    assert not driver_for(memory_budget=chunked(256))._holds(TwoRanks(scale=2), measured, count)


def test_holds_prices_the_head_whole_from_its_one_chunk_step_where_every_chunk_is_one_chunk():
    measured, count = by_hand(ONE_CHUNK, length=64)  # 128 tokens: fewer than the smallest chunk (256)
    whole = _rechunked(_HeadRun(measured, count, ONE_CHUNK), None).peak_bytes
    assert whole == measured.peak_bytes - 4  # the whole head's peak, a little under lm_loss's in one chunk
    assert driver_for(memory_budget=whole)._holds(OneRank(), measured, count)
    assert not driver_for(memory_budget=whole - 1)._holds(OneRank(), measured, count)


# --------------------------------------------------------------------------------------------- _fake_measured


def test_a_fraction_budget_on_a_chunkable_model_measures_the_longest_batch_with_the_head_in_one_chunk_and_counts_it():
    said, warned = [], []
    driver, model = driver_for(said, warned, compress="bf16"), gpt()
    driver.apply(model)  # every layer, its head in measuring chunks: undone for the fake step
    measured, count = driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=loss_of(model))
    assert measured == by_hand(ONE_CHUNK, compress="bf16")[0]
    assert [c.full_bytes for c in measured.costs] == [2 * LENGTH * 16 * 4] * 2  # each layer's input, 2 x 640 x 16 fp32
    assert measured.compress == "bf16"
    # one call of the head, inside lm_loss, over every token of the batch at its longest
    assert (count.heads, count.calls, count.tokens, count.flops) == ([model.head], 1, 2 * LENGTH, 2 * 1280 * 2048 * 16)
    assert checkpointed_names(model) == LAYERS and chunk_loss_of(model) == MEASURED_CHUNK  # as `apply` leaves it
    assert said == [] and warned == []


def test_a_reentrant_run_is_measured_for_full_checkpointing_only_and_without_a_head_count():
    for kwargs in (dict(use_reentrant=True), dict(checkpoint_kwargs={"use_reentrant": True})):
        driver, model = driver_for(chunk_loss=False, **kwargs), gpt()
        driver.apply(model)
        measured, count = driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=loss_of(model))
        assert measured == by_hand(modes=("full",))[0] != by_hand()[0]
        assert count is None
        assert checkpointed_names(model) == LAYERS and chunk_loss_of(model) is None


def test_no_head_count_where_the_plan_does_not_choose_chunks():
    for settings in (dict(chunk_loss=False), dict(memory_budget="auto")):
        driver, model = driver_for(**settings), gpt()
        measured, count = driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=loss_of(model))
        assert measured == by_hand()[0] and count is None


def test_chunk_loss_true_is_measured_with_the_head_in_the_run_s_chunks_and_the_layers_asked():
    driver, model = driver_for(chunk_loss=True, layer_cls=CausalSelfAttention), gpt()
    driver.apply(model)
    measured, count = driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=loss_of(model))
    assert measured == by_hand(MEASURED_CHUNK, layer_cls=CausalSelfAttention)[0]
    assert measured != by_hand(layer_cls=CausalSelfAttention)[0]
    assert [c.name for c in measured.costs] == ["blocks.0.attn", "blocks.1.attn"]
    assert count is None
    assert checkpointed_names(model) == ["blocks.0.attn", "blocks.1.attn"] and chunk_loss_of(model) == MEASURED_CHUNK


def test_tiles_asked_or_chosen_are_applied_for_the_fake_step_and_left_as_apply_leaves_them():
    tiled = ["blocks.0.mlp", "blocks.1.mlp"]  # nn.Sequential: the MLPs, not the norms the GPT's defaults also tile
    expected = by_hand(tiles=(nn.Sequential, 24), length=48)[0]  # 2 tiles of 24 tokens (ALST's rule: 3 of 16)
    assert expected != by_hand(tiles=(None, 24), length=48)[0]
    assert expected != by_hand(tiles=(nn.Sequential, None), length=48)[0]
    asked = driver_for(chunk_loss=False, tile_mlp=True, tile_tokens=24, tile_cls=nn.Sequential)
    chosen = driver_for(chunk_loss=False, tile_mlp=None, tile_tokens=24, tile_cls=nn.Sequential)
    chosen.tiles_chosen = True
    for driver in (asked, chosen):
        model = gpt()
        driver.apply(model)
        measured, _ = driver._fake_measured(OneRank(), model, BATCH, (48, "max_length"), longest_step=loss_of(model))
        assert measured == expected
        assert checkpointed_names(model) == LAYERS and tiled_names(model) == tiled


def test_a_step_fake_tensors_cannot_run_is_none_said_once_and_leaves_the_module_checkpointed():
    warned = []
    driver, model = driver_for(warned=warned), gpt()
    driver.apply(model)
    step = loss_of(model, fails=True)
    assert driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=step) is None
    assert driver._fake_measured(OneRank(), model, BATCH, (512, "the model's block_size"), longest_step=step) is None
    assert warned == [
        "GradientCheckpointing: could not measure the longest batch (length 640, from max_length) on fake tensors"
        " before the first step (DataDependentOutputException: aten._local_scalar_dense.default); the budget is"
        " checked on each batch as it comes."
    ]
    assert checkpointed_names(model) == LAYERS and chunk_loss_of(model) == MEASURED_CHUNK


def test_a_loss_that_cannot_be_chunked_is_measured_again_whole_where_the_plan_chooses_chunks():
    said, warned = [], []
    driver, model = driver_for(said, warned), gpt()
    driver.apply(model)
    measured, count = driver._fake_measured(OneRank(), model, BATCH, LONGEST,
                                            longest_step=loss_of(model, whole_only=True))
    whole = ("Transformer's loss stays whole: its forward changes the logits between the LM head and the loss, which"
             " a head run in chunks cannot reproduce")
    assert driver._loss_whole == whole
    assert said == [f"GradientCheckpointing: chunk_loss=None: {whole}."] and warned == []
    assert measured == by_hand()[0] and count is None
    assert checkpointed_names(model) == LAYERS and chunk_loss_of(model) is None  # no chunks to choose any more


def test_a_loss_that_cannot_be_chunked_under_chunk_loss_true_is_raised_before_anything_is_trained():
    driver, model = driver_for(chunk_loss=True), gpt()
    driver.apply(model)
    with pytest.raises(LossNotChunkable):
        driver._fake_measured(OneRank(), model, BATCH, LONGEST, longest_step=loss_of(model, whole_only=True))
    assert driver._loss_whole is None
    assert checkpointed_names(model) == LAYERS and chunk_loss_of(model) == MEASURED_CHUNK
