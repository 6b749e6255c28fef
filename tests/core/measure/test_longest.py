"""GradientCheckpointing(memory_budget=..., max_length=...): the longest batch planned before the first step, on fake
tensors (lightning_ckpt.core.measure.longest).

The demo GPT has ``block_size=64``; the data is 16 tokens long, batches of 4. Dropout is off.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.measure.longest import (
    batch_of_length,
    length_limit,
    longest_length,
    measure_fake_step,
    sequence_length_of,
)
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.measure.layer_costs import measure_step
from lightning_ckpt.core.plan.planner import make_plan
from lightning_ckpt.demos import GPT, CountingDataModule

#: Holds a 16-token batch (least reachable about 200 KiB) but not a 64-token one (least reachable 776.5 KiB).
SHORT_ONLY = "400KiB"


class CountingGPT(GPT):
    """The demo GPT counting its training_step calls (the fake step's included) and optimizer steps."""

    def __init__(self, block_size: int = 64) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=32, block_size=block_size, n_layer=4, n_embd=32, n_head=2, dropout=0.0)
        self.calls = 0
        self.optimizer_steps = 0
        self.seen: list[list[str]] = []  # the checkpointed layers at each training_step

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.seen.append(checkpointed_names(self))
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.optimizer_steps += 1


class ItemGPT(CountingGPT):
    """A training_step fake tensors cannot run: it reads a value (``.item()``) computed from the weights (a value read
    from the batch's token ids alone is answered on fake tensors: see core/measure/fake_values.py)."""

    def training_step(self, batch, batch_idx):
        if torch.isnan(self.model.tok_emb(batch[0])).any().item():
            raise AssertionError("the embeddings are never NaN")
        return super().training_step(batch, batch_idx)


def fit(model, callback, max_steps: int = 2, length: int = 16) -> Trainer:
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=length, batch_size=4, num_samples=64))
    return trainer


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_impossible_budget_is_refused_before_the_first_step_naming_the_longest_length():
    model = CountingGPT()
    before = weights(model)
    with pytest.raises(ValueError) as info:
        fit(model, GradientCheckpointing(memory_budget=SHORT_ONLY, max_length=64))
    message = str(info.value)
    assert "but the least reachable is 776.5 KiB" in message, message
    assert "This was for a batch of 256 tokens (length 64)" in message, message
    assert "length 64, from max_length. Nothing was trained." in message, message
    assert model.optimizer_steps == 0 and model.calls == 2  # the fake steps only: whole, then with tiles (tile_mlp=None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert checkpointed_names(model) == []  # nothing left applied


def test_the_models_own_limit_is_a_hint_the_budget_is_not_refused_for_and_the_longest_length_held_is_said(caplog):
    """Without ``max_length`` the model's block_size (64) is only a hint: a budget that holds the data (16 tokens)
    but not 64 trains, says the longest length it holds at this batch size, and that length is right on real tensors:
    the budget holds it and not one step (64 / 64 = 1 token) further."""
    model = CountingGPT()
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY)
    with caplog.at_level("INFO"):
        trainer = fit(model, callback)
    assert trainer.global_step == 2 and list(callback.plans) == [64]  # nothing planned for length 64
    said = [r.getMessage() for r in caplog.records if "does not hold a batch at the model's longest" in r.getMessage()]
    assert len(said) == 1 and "(64, from the model's block_size)" in said[0], said
    held = int(said[0].split("it holds up to length ")[1].split(" ")[0])
    assert 16 <= held < 64
    batch = next(iter(CountingDataModule(32, 16, 4, 64).train_dataloader()))
    real = CountingGPT()
    real.train()

    def least_peak(length):
        resized = batch_of_length(batch, length)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measured = measure_step(real, lambda: real.training_step(resized, 0), modes=("full", "selective"))
        try:
            make_plan(measured.costs, measured.outside_bytes, SHORT_ONLY, ("full", "selective"),
                      head_bytes=measured.head_bytes, head_peak_bytes=measured.head_peak_bytes)
            return True
        except ValueError:
            return False

    assert least_peak(held) and not least_peak(held + 1)


def test_a_batch_longer_than_the_budget_holds_stops_the_run_when_it_comes():
    model = CountingGPT()
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY)
    trainer = Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    short = list(CountingDataModule(32, 16, 4, 64).train_dataloader())[:2]
    long = list(CountingDataModule(32, 64, 4, 64).train_dataloader())[:1]
    with pytest.raises(ValueError, match="but the least reachable is 776.5 KiB"):
        trainer.fit(model, DataLoader(short + long, batch_size=None))
    assert model.optimizer_steps == 2  # the two short batches trained; the long one was refused before its backward


def test_max_length_short_enough_lets_the_same_budget_run():
    model = CountingGPT()
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY, max_length=24)
    trainer = fit(model, callback)
    assert trainer.global_step == 2 and model.calls == 3  # one fake step at length 24, then two real ones
    # The first real step measures its size with every layer checkpointed, as without the fake step before it.
    assert model.seen[1] == [f"model.blocks.{i}" for i in range(4)]
    assert callback.driver.cycle.sizes[128].length == 24 and callback.driver.cycle.sizes[64].length == 16


def test_the_plan_for_the_longest_batch_is_kept_and_equals_one_from_a_real_measurement(caplog):
    model = CountingGPT()
    callback = GradientCheckpointing(memory_budget="1MiB")
    with caplog.at_level("INFO"):
        trainer = fit(model, callback, max_steps=1)
    assert trainer.global_step == 1
    assert ("GradientCheckpointing: the budget holds the longest batch, 256 tokens (length 64): planned before the"
            " first step for length 64 (from the model's block_size) on fake tensors, through your training_step.") in caplog.text
    kept = callback.plans[256]
    # The same step measured on real tensors at length 64, on a fresh copy of the model.
    real = CountingGPT()
    real.train()
    batch = batch_of_length(next(iter(CountingDataModule(32, 16, 4, 64).train_dataloader())), 64)
    modes = ("full", "selective")  # the callback's, without reentrant checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a Trainer
        measured = measure_step(real, lambda: real.training_step(batch, 0), modes=modes)
    expected = make_plan(measured.costs, measured.outside_bytes, "1MiB", modes, head_bytes=measured.head_bytes,
                         head_peak_bytes=measured.head_peak_bytes)
    assert (kept.layers, kept.peak_bytes, kept.planned_bytes) == (expected.layers, expected.peak_bytes,
                                                                   expected.planned_bytes)


def test_a_batch_of_another_length_owns_exactly_its_bytes():
    """The fake step counts a saved tensor's whole storage: a view of the longer batch (cut) or of the tiled copy
    (tiled to a length that is not a multiple) would count the bytes beyond the length as well."""
    ids = torch.arange(6).view(2, 3)  # int64: 8 bytes a token
    mask = torch.ones(2, 3, 5)  # float32, dim 1 the length: 20 bytes a token
    for length, tokens in ((2, [[0, 1], [3, 4]]), (8, [[0, 1, 2, 0, 1, 2, 0, 1], [3, 4, 5, 3, 4, 5, 3, 4]])):
        cut_ids, cut_mask = batch_of_length((ids, mask), length)
        assert cut_ids.tolist() == tokens
        # by hand: 2 rows x length x 8 B, and 2 x length x 5 x 4 B; a view would keep 2 x 3 (cut) or 2 x 9 (tiled 3x)
        assert cut_ids.untyped_storage().nbytes() == 2 * length * 8
        assert cut_mask.untyped_storage().nbytes() == 2 * length * 5 * 4
    assert batch_of_length((ids, mask), 3)[0].untyped_storage().nbytes() == 48  # the same length: a copy of 48 B


def test_a_resumed_run_has_its_plans_and_plans_the_longest_batch_no_more():
    first = GradientCheckpointing(memory_budget="1MiB", max_length=64)
    fit(CountingGPT(), first, max_steps=1)
    assert sorted(first.plans) == [64, 256]  # the longest batch (4 x 64 tokens) on fake tensors, the 16-token step
    model, resumed = CountingGPT(), GradientCheckpointing(memory_budget="1MiB", max_length=64)
    resumed.load_state_dict(first.state_dict())
    trainer = fit(model, resumed)
    assert trainer.global_step == 2 and model.calls == 2  # two real steps, no fake one before them
    assert resumed.driver.cycle.measured_steps == 0  # both run the plan saved for their size
    assert {b: p.state_dict() for b, p in resumed.plans.items()} == {b: p.state_dict() for b, p in first.plans.items()}


def test_the_length_limit_is_read_from_hparams_or_a_config_and_only_from_positive_ints():
    import argparse

    transformers, litgpt = pytest.importorskip("transformers"), pytest.importorskip("litgpt")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=48))
    assert length_limit(llama) == ("max_position_embeddings", 48)  # a plain nn.Module: no hparams, its config's
    gpt = litgpt.GPT(litgpt.Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, padded_vocab_size=32, block_size=24))
    assert length_limit(gpt) == ("block_size", 24)
    assert length_limit(torch.nn.Linear(2, 2)) is None

    class Limited(torch.nn.Module):
        def __init__(self, hparams) -> None:
            super().__init__()
            self.hparams = hparams

    # 0 says nothing (the next name is read), 1 is a length; an hparams that is not a mapping is not read
    assert length_limit(Limited({"block_size": 0, "max_position_embeddings": 1})) == ("max_position_embeddings", 1)
    assert length_limit(Limited(argparse.Namespace(block_size=8))) is None


def test_token_ids_are_the_first_2_d_integer_tensor_and_other_leaves_are_left_as_they_are():
    ids = torch.arange(6).view(2, 3)
    # a 2-D float tensor (a mask) and a 1-D integer one (a label per sample) before the ids are not the ids
    batch = {"a_mask": torch.ones(2, 5), "b_label": torch.tensor([1, 0]), "c_ids": ids, "d_weights": torch.ones(2, 5),
             "e_name": "shard-0"}
    assert sequence_length_of(batch) == 3
    longer = batch_of_length(batch, 4)
    assert longer["c_ids"].tolist() == [[0, 1, 2, 0], [3, 4, 5, 3]]
    for key in ("a_mask", "b_label", "d_weights", "e_name"):  # not of the ids' length, or not a tensor: as they were
        assert longer[key] is batch[key]
    no_ids = (torch.randn(2, 3), torch.tensor([1, 2]))
    assert sequence_length_of(no_ids) is None and batch_of_length(no_ids, 8) is None


def test_a_fake_step_measures_the_layers_and_modes_asked_on_a_batch_with_values_and_metadata():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def step(batch):  # reads a value of its batch, as a real step may (a check, a length, a mask from the ids)
        if batch["ids"].max().item() >= 10:
            raise ValueError("a token id past the vocabulary")
        return model(batch["ids"]).sum()

    batch = {"ids": torch.randint(0, 10, (4, 6)), "name": "shard-0", "rows": 4}
    full = measure_fake_step(model, step, batch, layer_cls=torch.nn.Tanh, modes=("full",))
    both = measure_fake_step(model, step, batch, layer_cls=torch.nn.Tanh, modes=("full", "selective"))
    assert [(c.name, c.cls) for c in full.costs] == [("1", "Tanh")]
    # by hand: the Tanh's input, 4 x 6 x 8 float32, is what it holds fully checkpointed; selective recomputes the
    # tanh (a cheap op) from the same input; with only "full" asked, selective is not measured (0)
    assert full.costs[0].full_bytes == both.costs[0].full_bytes == 4 * 6 * 8 * 4
    assert both.costs[0].selective_bytes == 4 * 6 * 8 * 4 and full.costs[0].selective_bytes == 0


def test_fake_measurement_equals_the_real_one_and_leaves_the_module_as_it_was():
    model = CountingGPT()
    model.train()
    before = weights(model)
    batch = batch_of_length(next(iter(CountingDataModule(32, 16, 4, 64).train_dataloader())), 48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a Trainer
        fake = measure_fake_step(model, lambda b: model.training_step(b, 0), batch)
        real = measure_step(model, lambda: model.training_step(batch, 0))
    assert fake.costs == real.costs
    assert (fake.outside_bytes, fake.head_bytes, fake.head_peak_bytes) == (
        real.outside_bytes, real.head_bytes, real.head_peak_bytes)
    assert fake.costs[0].full_bytes == 4 * 48 * 32 * 4  # the block's input: batch x length x n_embd float32
    # as the callback's real measuring step: the ops outside the layers are not recorded (one more dispatch mode on
    # every op of the fake step, for a time estimate the callback does not make)
    assert fake.outside_ops == () and len(real.outside_ops) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_max_length_above_the_models_limit_is_refused_naming_both():
    with pytest.raises(ValueError) as info:
        fit(CountingGPT(), GradientCheckpointing(memory_budget="1MiB", max_length=128))
    assert str(info.value).startswith("`max_length=128` is longer than the model can take: its block_size is 64"
                                      " (its position table ends there). Pass max_length=64 or less"), str(info.value)
    assert longest_length(CountingGPT(), 64) == (64, "max_length")


@pytest.mark.parametrize("bad", [-1, -3, "64", True, 1.5])  # 0 turns the longest batch off (test_longest_off.py)
def test_max_length_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"`max_length` is the longest sequence .* got {bad!r}"):
        GradientCheckpointing(memory_budget=0.5, max_length=bad)


def test_a_model_without_a_known_length_runs_as_before():
    model = CountingGPT()
    del model.hparams["block_size"]  # nothing says how long its sequences may be
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY)
    fit(model, callback)
    assert model.calls == 2 and list(callback.plans) == [64]  # no fake step; only the real size planned


def test_a_first_batch_as_long_as_the_longest_needs_no_fake_step():
    model = CountingGPT(block_size=16)
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY)
    fit(model, callback)
    assert model.calls == 2 and list(callback.plans) == [64]


def test_a_model_fake_tensors_cannot_run_says_so_once_and_runs_as_before():
    model = ItemGPT()
    callback = GradientCheckpointing(memory_budget=SHORT_ONLY)
    with pytest.warns(UserWarning, match=r"could not measure the longest batch \(length 64, from the model's"
                                         r" block_size\) on fake tensors before the first step") as record:
        trainer = fit(model, callback)
    assert sum("could not measure the longest batch" in str(w.message) for w in record) == 1
    assert trainer.global_step == 2 and list(callback.plans) == [64]
