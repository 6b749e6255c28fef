"""The longest batch planned before the first step: :meth:`BudgetDriver.plan_longest` (when it plans, warns or says
nothing, the plan it makes and the error it raises) and the bisection of the longest length held
(:meth:`BudgetDriver._longest_held`).

The fake step itself (``_fake_measured``) and the budget check (``_holds``) are stood in for where the expected
result must be worked out by hand; the tests that plan run them for real on a small demo Transformer.
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional, Sequence

import pytest
import torch
from torch import nn

from lightning_ckpt.core.plan import budget_driver
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.budget_driver import BUDGET_DEFAULTS, BudgetDriver, OneRank
from lightning_ckpt.demos import Transformer

SEARCH = "a search for the longest length held"


class TwoRanks:
    """Two ranks on the CPU, the other rank's answers given: its first batch's length (``first_length``; by default
    this rank's), whether its fake steps ran (``ran``, one flag per gather, then True), its batch sizes (twice this
    rank's tokens) and its cost rows (twice this rank's)."""

    root_device = torch.device("cpu")
    world_size = 2
    is_global_zero = True

    def __init__(self, first_length: Optional[int] = None, ran: Sequence[bool] = ()) -> None:
        self.first_length, self.ran = first_length, list(ran)
        self.gathered: list[list] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 1:  # a flag
            other = torch.tensor([int(self.ran.pop(0) if self.ran else True)])
        elif tensor.numel() == 2 and tensor[0] == 0:  # the first batch's length
            other = torch.tensor([0, int(tensor[1]) if self.first_length is None else self.first_length])
        elif tensor.numel() == 2:  # a batch size
            other = torch.tensor([2 * int(tensor[0]), int(tensor[1])])
        else:  # cost rows
            other = tensor * 2
        rows = torch.stack([tensor, other])
        if rows.shape[1] <= 2:
            self.gathered.append(rows.tolist())
        return rows

    def broadcast(self, obj, src=0):
        return obj


def gpt(block_size: int = 64) -> Transformer:
    """The demo GPT, its length limit as a LightningModule's hyperparameter (``hparams``) says it."""
    torch.manual_seed(0)
    module = Transformer(vocab_size=32, block_size=block_size, n_layer=2, n_embd=16, n_head=2, dropout=0.0)
    module.hparams = {"block_size": block_size}
    return module


def tokens(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(tokens, targets)`` batch of 2 sequences."""
    return torch.randint(0, 32, (2, length)), torch.randint(0, 32, (2, length))


def step_of(module: nn.Module):
    @contextlib.contextmanager
    def step():
        yield lambda batch: module(batch[0], batch[1])
    return step


def driver_of(said: list, warned: list, **settings) -> BudgetDriver:
    settings = dict(BUDGET_DEFAULTS, **{"memory_budget": 0.8, "time_layers": False, **settings})
    return BudgetDriver(settings, info=said.append, warn=warned.append, report=lambda line, table: None)


def spy_fake(driver: BudgetDriver, answer=lambda longest: None) -> list:
    """The driver's fake step stood in for: its calls (``ranks, module, batch, longest, longest_step``), and
    ``answer(longest)`` as its measurement."""
    calls = []

    def fake(ranks, module, batch, longest, *, longest_step):
        calls.append((ranks, module, batch, longest, longest_step))
        assert len(calls) < 40, "a search that does not end"
        return answer(longest)

    driver._fake_measured = fake
    return calls


def holding_up_to(driver: BudgetDriver, limit: int) -> list:
    """The budget check stood in for, on fake steps whose "measurement" is their length: it holds up to ``limit``.
    Returns the ranks it was asked with."""
    asked = []
    driver._holds = lambda ranks, length, count: asked.append(ranks) or length <= limit
    return asked


# ---------------------------------------------------------------------------------------------- nothing to plan


@pytest.mark.parametrize("case", ["auto before its first plan", "plans already there", "max_length=0"])
def test_auto_before_its_first_plan_a_resumed_run_s_plans_and_max_length_0_plan_nothing_and_say_nothing(case):
    said, warned = [], []
    module = gpt()
    batch = tokens(8)
    if case == "auto before its first plan":  # "auto" needs a real step's static memory first
        driver = driver_of(said, warned, memory_budget="auto")
    elif case == "plans already there":
        driver = driver_of(said, warned, max_length=32)
        driver.cycle.plans[64] = "a plan loaded from a checkpoint"
    else:  # a batch without token ids, which would be warned about if max_length=0 did not turn it all off
        driver = driver_of(said, warned, max_length=0)
        batch = torch.randn(2, 8, 16)
    calls = spy_fake(driver)
    driver.plan_longest(OneRank(), module, batch, step_of(module))
    assert calls == [] and said == [] and warned == []
    assert driver.cycle.measuring is None and driver.measured is None


def test_a_model_without_a_length_limit_and_no_max_length_plans_nothing():
    said, warned = [], []
    driver = driver_of(said, warned)
    module = nn.Linear(4, 4)
    calls = spy_fake(driver)
    driver.plan_longest(OneRank(), module, tokens(8), step_of(module))
    assert calls == [] and said == [] and warned == [] and driver.cycle.plans == {}


def test_a_first_batch_already_at_the_longest_length_takes_no_fake_step_even_under_fsdp2(monkeypatch):
    module = gpt()
    for sharded in (False, True):
        monkeypatch.setattr(budget_driver, "_sharded", lambda m: sharded)
        said, warned = [], []
        driver = driver_of(said, warned, max_length=32)
        calls = spy_fake(driver)
        driver.plan_longest(OneRank(), module, tokens(32), step_of(module))  # its own measuring step plans it
        assert calls == [] and said == [] and warned == [] and driver.cycle.plans == {}


FSDP2_WARNING = ("GradientCheckpointing: the longest batch is not planned before the first step under FSDP2 (its"
                 " sharded layers gather their weights for real); the budget is checked on each batch as it comes.")
NO_TOKENS_WARNING = ("GradientCheckpointing: `max_length` needs token ids in the batch (a 2-D integer tensor, batch x"
                     " length); this batch has none, so the longest batch is not planned before the first step.")


def test_under_fsdp2_a_shorter_first_batch_is_not_planned_for_the_longest_length_and_that_is_warned(monkeypatch):
    module = gpt()
    monkeypatch.setattr(budget_driver, "_sharded", lambda m: m is module)
    cases = [(32, tokens(8), [FSDP2_WARNING]),
             # without token ids nothing could be planned anyway: only max_length (a promise) is warned about
             (32, torch.randn(2, 8, 16), [NO_TOKENS_WARNING]),
             (None, torch.randn(2, 8, 16), [])]
    for max_length, batch, warnings in cases:
        said, warned = [], []
        driver = driver_of(said, warned, max_length=max_length)
        calls = spy_fake(driver)
        driver.plan_longest(OneRank(), module, batch, step_of(module))
        assert warned == warnings and calls == [] and said == [] and driver.cycle.plans == {}


def test_a_batch_without_token_ids_takes_no_fake_step_and_max_length_says_why():
    module = gpt()
    for max_length, warnings in [(32, [NO_TOKENS_WARNING]), (None, [])]:  # the model's own limit is only a hint
        said, warned = [], []
        driver = driver_of(said, warned, max_length=max_length)
        calls = spy_fake(driver)
        driver.plan_longest(OneRank(), module, torch.randn(2, 8, 16), step_of(module))
        assert warned == warnings and calls == [] and said == [] and driver.cycle.plans == {}


# ---------------------------------------------------------------------------------------------- ranks disagreeing


def test_another_rank_s_first_batch_at_the_longest_length_means_no_rank_takes_a_fake_step():
    module = gpt()
    for batch, warnings in [(tokens(8), []), (torch.randn(2, 8, 16), [NO_TOKENS_WARNING])]:
        said, warned = [], []
        driver = driver_of(said, warned, max_length=32)
        calls = spy_fake(driver, lambda longest: ("measured", None))
        ranks = TwoRanks(first_length=32, ran=[False])  # it takes none either
        driver.plan_longest(ranks, module, batch, step_of(module))
        assert calls == [] and said == [] and warned == warnings and driver.cycle.plans == {}
        here = batch[0].shape[1] if isinstance(batch, tuple) else 0  # no token ids: length 0
        assert ranks.gathered == [[[0, here], [0, 32]], [[0], [0]]]  # the first lengths, then "found" on no rank


def test_a_fake_step_that_failed_on_another_rank_means_no_rank_plans():
    said, warned = [], []
    module = gpt()
    driver = driver_of(said, warned, max_length=32)
    calls = spy_fake(driver, lambda longest: ("measured", None))
    driver._tiled_if_needed = lambda *args: pytest.fail("no rank goes on to plan")
    ranks = TwoRanks(ran=[False])
    batch = tokens(8)
    driver.plan_longest(ranks, module, batch, step_of(module))
    assert calls == [(ranks, module, batch, (32, "max_length"), calls[0][4])]
    assert ranks.gathered == [[[0, 8], [0, 8]], [[1], [0]]]
    assert said == [] and warned == [] and driver.cycle.plans == {} and driver.measured is None


# ---------------------------------------------------------------------------------------------- not held


def test_the_model_s_own_limit_not_held_says_the_longest_length_held_found_by_bisection():
    said, warned = [], []
    module = nn.Linear(4, 4)
    module.config = types.SimpleNamespace(max_position_embeddings=64)  # as a Hugging Face model's config says it
    driver = driver_of(said, warned)
    calls = spy_fake(driver, lambda longest: (longest[0], None))
    asked = holding_up_to(driver, 40)
    ranks, batch, step = OneRank(), tokens(8), step_of(module)
    driver.plan_longest(ranks, module, batch, step)
    # 64 is not held; from the first batch's 8: 8 and 36 held, 50 and 43 not, 39 held, 41 not, 40 held (to 64 // 64)
    lengths = [(64, "the model's max_position_embeddings"), *((n, SEARCH) for n in [8, 36, 50, 43, 39, 41, 40])]
    assert calls == [(ranks, module, batch, longest, step) for longest in lengths]
    assert asked == [ranks] * 8
    assert said == [
        "GradientCheckpointing: the budget does not hold a batch at the model's longest length (64, from the model's"
        " max_position_embeddings); at this batch size it holds up to length 40 (planned before the first step on"
        " fake tensors, through your training_step). A longer batch will stop the run; pass `max_length=` your"
        " data's longest length to plan for it instead."]
    assert warned == [] and driver.cycle.plans == {} and driver.measured is None


def test_max_length_not_held_raises_before_anything_is_trained_naming_the_length():
    said, warned = [], []
    module = gpt()
    driver = driver_of(said, warned, max_length=32)
    calls = spy_fake(driver, lambda longest: ("measured", None))
    driver._holds = lambda *args: False  # a promise: not held is an error, not a hint
    tiled, planned = [], []
    driver._tiled_if_needed = lambda *args: tiled.append(args) or ("tiled", None)

    def make_plan(ranks, module):
        planned.append((ranks, module, driver.measured, driver.cycle.measuring))
        raise ValueError("no plan fits the budget")

    driver._make_plan = make_plan
    ranks, batch, step = OneRank(), tokens(8), step_of(module)
    with pytest.raises(ValueError) as raised:
        driver.plan_longest(ranks, module, batch, step)
    assert str(raised.value) == (
        "no plan fits the budget\n  Planned before the first step for the longest sequences the run may see: length"
        " 32, from max_length. Nothing was trained. If the data is never that long, pass `max_length=` its longest"
        " length.")
    assert calls == [(ranks, module, batch, (32, "max_length"), step)]
    ((tiled_ranks, tiled_module, fake, longest, found),) = tiled
    assert (tiled_ranks, tiled_module, longest, found) == (ranks, module, (32, "max_length"), ("measured", None))
    assert fake.args == (ranks, module, batch) and fake.keywords == {"longest_step": step}
    # the tiled measurement is taken, at the size of the batch at length 32
    assert planned == [(ranks, module, "tiled", BatchSize(64, 32))]
    assert said == [] and warned == []


# ---------------------------------------------------------------------------------------------- held


def test_max_length_held_is_planned_at_the_size_of_the_longest_batch_on_a_real_fake_step():
    said, warned = [], []
    module = gpt()
    # chunk_loss=None: the plan chooses the LM head's chunks, priced from the head run whole on the fake step
    driver = driver_of(said, warned, max_length=32, chunk_loss=None)
    driver.apply(module)
    batch = tokens(8)
    driver.plan_longest(OneRank(), module, batch, step_of(module))
    assert said == [
        "GradientCheckpointing: the budget holds the longest batch, 64 tokens (length 32): planned before the first"
        " step for length 32 (from max_length) on fake tensors, through your training_step."]
    assert warned == []
    assert driver.cycle.sizes == {64: BatchSize(64, 32)} and driver.measured is None
    # each block's input, all it keeps when checkpointed: 2 sequences x 32 tokens x 16 float32 values
    assert [cost.full_bytes for cost in driver.cycle.plans[64].costs] == [2 * 32 * 16 * 4] * 2
    assert batch[0].shape == (2, 8)


def test_the_model_s_limit_held_over_two_ranks_plans_their_largest_size_and_their_largest_costs():
    said, warned = [], []
    module = gpt(block_size=32)
    driver = driver_of(said, warned)
    driver.apply(module)
    ranks = TwoRanks()
    # tokens from length_fn, on the batch at the longest length: 3 x 32 here, twice that on the other rank
    driver.plan_longest(ranks, module, tokens(8), step_of(module), length_fn=lambda batch: 3 * batch[0].shape[1])
    assert said == [
        "GradientCheckpointing: the budget holds the longest batch, 192 tokens (length 32): planned before the first"
        " step for length 32 (from the model's block_size) on fake tensors, through your training_step."]
    assert warned == []
    assert driver.cycle.sizes == {256: BatchSize(192, 32)}
    assert [cost.full_bytes for cost in driver.cycle.plans[256].costs] == [2 * 2 * 32 * 16 * 4] * 2  # the other's


# ---------------------------------------------------------------------------------------------- the bisection


@pytest.mark.parametrize("shortest, longest, limit, probes, held", [
    # to 1024 // 64 = 16: 100 held, 562 and 331 not, 215 and 273 held, 302 not, 287 held; 302 - 287 <= 16
    (100, 1024, 300, [100, 562, 331, 215, 273, 302, 287], 287),
    # a first batch of no length starts at 1; to 1 token
    (0, 64, 40, [1, 32, 48, 40, 44, 42, 41], 40),
    # to 128 // 64 = 2
    (10, 128, 100, [10, 69, 98, 113, 105, 101, 99], 99),
    # none held: 0
    (100, 1000, 0, [100, 50, 25, 12], 0),
])
def test_the_longest_length_held_is_bisected_from_the_first_batch_s_length(shortest, longest, limit, probes, held):
    driver = driver_of([], [])
    asked = holding_up_to(driver, limit)
    tried = []

    def fake(found):
        tried.append(found)
        assert len(tried) < 40, "a search that does not end"
        return found[0], None

    ranks = OneRank()
    assert driver._longest_held(ranks, fake, shortest, longest) == held
    assert tried == [(n, SEARCH) for n in probes]
    assert asked == [ranks] * len(probes)


def test_the_bisection_stops_at_the_longest_held_so_far_where_a_rank_s_fake_step_fails():
    driver = driver_of([], [])
    holding_up_to(driver, 300)
    ranks = TwoRanks(ran=[True, True, False])
    tried = []
    assert driver._longest_held(ranks, lambda found: tried.append(found[0]) or (found[0], None), 100, 1024) == 100
    assert tried == [100, 562, 331] and ranks.gathered == [[[1], [1]], [[1], [1]], [[1], [0]]]
