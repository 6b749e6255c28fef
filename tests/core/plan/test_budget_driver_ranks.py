"""The budget driver's helpers over ranks and for the LM head's chunks
(:mod:`lightning_ckpt.core.plan.budget_driver`), each alone: what they send to the other ranks and what they make of
the rows that come back (a stand-in :class:`~lightning_ckpt.core.plan.budget_driver.Ranks` returns rows written by
hand), the step's bytes with the head in other chunks (``head_and_loss_bytes`` stood in for by a table), FSDP2 found,
the accelerator measured, and the default ``info``/``warn``/``report`` callables.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lightning_ckpt.core.measure.costs import LayerCost
from lightning_ckpt.core.plan import budget_driver as bd
from lightning_ckpt.core.plan.budget import RankMeasurement
from lightning_ckpt.core.plan.budget_cycle import BatchSize
from lightning_ckpt.core.plan.planner import ChunkedHead, HeadCount


class Gathered:
    """Two ranks (or ``world_size``) whose ``all_gather`` records the tensor this rank sends and returns ``rows``
    (every rank's, written by the test); ``broadcast`` records ``src``."""

    is_global_zero = True

    def __init__(self, rows=None, world_size: int = 2, device: str = "cpu") -> None:
        self.rows, self.world_size, self.root_device = rows, world_size, torch.device(device)
        self.sent: list[torch.Tensor] = []
        self.sources: list[object] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None, "nothing should be gathered"
        self.sent.append(tensor)
        return torch.tensor(self.rows, dtype=torch.int64)

    def broadcast(self, obj, src=None):
        self.sources.append(src)
        return obj

    def sent_row(self) -> list[int]:
        (tensor,) = self.sent
        assert tensor.dtype == torch.int64 and tensor.device == self.root_device
        return tensor.tolist()


# --------------------------------------------------------------------------------------------- over ranks


def test_one_rank_gathers_its_tensor_as_the_only_row_and_broadcasts_the_object_itself():
    assert bd.OneRank().all_gather(torch.tensor([1, 2])).tolist() == [[1, 2]]
    obj = object()
    assert bd.OneRank().broadcast(obj) is obj
    assert bd.OneRank().root_device == torch.device("cpu") and bd.OneRank().world_size == 1


def test_combine_over_ranks_sends_its_row_with_the_device_s_offload_threshold_and_takes_the_maximum(monkeypatch):
    thresholds = []
    monkeypatch.setattr(bd, "offload_min_bytes", lambda device: thresholds.append(device) or 1000)
    cost = LayerCost("a", "B", none_bytes=3000, full_bytes=1000, selective_bytes=2000, offloadable_bytes=1000,
                     full_flops=10, selective_flops=1, input_sizes=(1000,), saved_sizes=(1000, 1500, 500))
    measured = RankMeasurement([cost], outside_bytes=7, head_bytes=5, head_peak_bytes=3)
    # the 15 integer fields, then moved un-checkpointed (1000 + 1500: storages of at least 1000 B) and checkpointed
    # (1000), outside / head / head peak, then the figures
    mine = [3000, 1000, 2000, 1000, 10, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2500, 1000, 7, 5, 3, 900, 20]
    other = [2000, 1200, 1500, 900, 40, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2000, 900, 9, 4, 8, 800, 30]
    ranks = Gathered([mine, other])
    both, figures = bd._combine_over_ranks(ranks, measured, [900, 20])
    assert ranks.sent_row() == mine and thresholds == [torch.device("cpu")]
    (combined,) = both.costs
    assert (combined.name, combined.none_bytes, combined.full_bytes, combined.selective_bytes,
            combined.offloadable_bytes, combined.full_flops, combined.selective_flops) == ("a", 3000, 1200, 2000, 1000,
                                                                                         40, 2)
    assert combined.saved_sizes == (2500,) and combined.input_sizes == (1000,)
    assert (both.outside_bytes, both.head_bytes, both.head_peak_bytes) == (9, 5, 8)
    assert figures == [800, 30]  # the device memory with its minimum, the rest with their maximum


def test_combine_over_ranks_builds_its_row_on_the_ranks_device(monkeypatch):
    monkeypatch.setattr(bd, "offload_min_bytes", lambda device: 1)
    ranks = Gathered([[7, 0, 0], [9, 0, 0]], device="meta")
    both, figures = bd._combine_over_ranks(ranks, RankMeasurement([], outside_bytes=7), [])
    (sent,) = ranks.sent
    assert sent.device.type == "meta" and sent.dtype == torch.int64 and sent.shape == (3,)
    assert both.outside_bytes == 9 and figures == []


def test_all_ranks_holds_only_where_every_rank_s_flag_does():
    alone = Gathered(world_size=1)  # one rank: nothing gathered (its all_gather would fail)
    assert bd._all_ranks(alone, True) is True and bd._all_ranks(alone, False) is False
    one_false = Gathered([[1], [0]])
    assert bd._all_ranks(one_false, True) is False and one_false.sent_row() == [1]
    every = Gathered([[1], [1]])
    assert bd._all_ranks(every, True) is True and every.sent_row() == [1]
    mine_false = Gathered([[0], [1]])
    assert bd._all_ranks(mine_false, False) is False and mine_false.sent_row() == [0]
    on_meta = Gathered([[1], [1]], device="meta")
    assert bd._all_ranks(on_meta, True) is True and on_meta.sent[0].device.type == "meta"


def test_largest_over_ranks_takes_the_most_tokens_and_the_longest_length_each_over_the_ranks():
    size = BatchSize(tokens=100, length=10)
    assert bd._largest_over_ranks(Gathered(world_size=1), size) is size  # one rank: nothing gathered
    ranks = Gathered([[100, 10], [80, 20]])
    assert bd._largest_over_ranks(ranks, size) == BatchSize(tokens=100, length=20)
    assert ranks.sent_row() == [100, 10]
    on_meta = Gathered([[100, 10], [80, 20]], device="meta")
    assert bd._largest_over_ranks(on_meta, size) == BatchSize(tokens=100, length=20)
    assert on_meta.sent[0].device.type == "meta" and on_meta.sent[0].dtype == torch.int64


def test_measure_device_refuses_the_cpu_with_what_to_do_instead(monkeypatch):
    monkeypatch.setattr(bd.DeviceProfile, "measure", lambda device: pytest.fail("measured the CPU"))
    with pytest.raises(ValueError) as err:
        bd._measure_device(bd.OneRank(), 1)
    assert str(err.value) == (
        "`offload='auto'` weighs offload against recompute by the time each takes on the accelerator it measures,"
        " but this run is on the CPU, where nothing is offloaded. Pass offload=False on the CPU, or run on a GPU; to"
        " plan for a GPU from here, use `plan_checkpointing(..., offload='auto', device='h100-sxm')` or"
        " `lightning-ckpt plan --device NAME --offload auto`.")


def test_measure_device_broadcasts_rank_zero_s_profile_and_host_memory(monkeypatch):
    profile = object()
    monkeypatch.setattr(bd.DeviceProfile, "measure", lambda device: profile)
    monkeypatch.setattr(bd.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 << 30))
    ranks = Gathered(device="meta")
    assert bd._measure_device(ranks, 2) == (profile, 4 << 30)  # half of 16 GiB, over 2 devices
    assert ranks.sources == [0]  # src given: a Ranks whose default is another rank still takes rank 0's


# --------------------------------------------------------------------------------------------- the LM head's chunks

HEADS = [nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)]  # 24 fp32 weights each: 96 B of gradient
DTYPES = (torch.bfloat16, torch.float32)
#: (head, chunk) -> what the stand-in head_and_loss_bytes says the head and loss alone hold: (saved, backward peak)
ALONE = {(0, 64): (300, 500), (1, 64): (200, 400), (0, None): (1300, 2500), (1, None): (700, 1400),
         (0, 32): (250, 450), (1, 32): (150, 350)}


@pytest.fixture
def priced(monkeypatch):
    """The calls to the stand-in ``head_and_loss_bytes``: (head index, tokens, chunk, dtypes)."""
    calls = []

    def head_and_loss_bytes(head, tokens, chunk, dtypes=None):
        calls.append((HEADS.index(head), tokens, chunk, dtypes))
        return ALONE[HEADS.index(head), chunk]

    monkeypatch.setattr(bd, "head_and_loss_bytes", head_and_loss_bytes)
    return calls


def head_run(chunk: int = 64) -> bd._HeadRun:
    """A step measured with two LM heads over 200 tokens (100 each) in chunks of ``chunk``, 4 calls counted."""
    count = HeadCount.__new__(HeadCount)  # counted by hand: the heads, and what their calls added up to
    count.heads, count.flops, count.calls, count.tokens, count.dtypes = HEADS, 12345, 4, 200, DTYPES
    return bd._HeadRun(RankMeasurement([], outside_bytes=10_000, head_bytes=4_000, head_peak_bytes=60), count, chunk)


def test_rechunked_adds_what_each_head_alone_holds_more_in_the_other_chunk(priced):
    run = head_run()
    # whole: saved (1300 - 300) + (700 - 200) = 1500 more, peak (2500 - 500) + (1400 - 400) = 3000 more
    assert bd._rechunked(run, None) == RankMeasurement([], outside_bytes=11_500, head_bytes=5_500,
                                                       head_peak_bytes=3_060)
    assert priced == [(0, 100, 64, DTYPES), (1, 100, 64, DTYPES), (0, 100, None, DTYPES), (1, 100, None, DTYPES)]
    # in chunks of 32: 100 saved and 100 of peak less; the peak of 60 does not go below 0
    assert bd._rechunked(run, 32) == RankMeasurement([], outside_bytes=9_900, head_bytes=3_900, head_peak_bytes=0)
    assert priced[4:] == [(0, 100, 32, DTYPES), (1, 100, 32, DTYPES)]  # the step's own chunk priced once


def test_rechunked_returns_the_step_itself_for_its_own_chunk_or_any_chunk_as_large_as_the_tokens(priced):
    run = head_run()
    assert bd._rechunked(run, 64) is run.measured
    whole = head_run(bd.ONE_CHUNK)
    assert bd._rechunked(whole, 128) is whole.measured  # 128 and 2**62 tokens: both one chunk of the 100
    assert priced == []


def test_chunked_head_sends_the_step_rechunked_with_its_calls_and_combines_the_ranks(priced):
    mine = [9_900, 3_900, 192, 0, 12_345, 8, 200]  # 0 + 2 x 96 B of weight gradients: the head runs in 8 chunks
    other = [9_000, 5_000, 100, 7, 20_000, 6, 300]
    ranks = Gathered([mine, other])
    head = bd._chunked_head(ranks, head_run(), 32)
    # outside, head, head peak; then the figures: 0 (combined with its minimum, not returned), FLOPs, calls
    # (2 heads x ceil(100 / 32)), tokens
    assert ranks.sent_row() == mine
    assert head == ChunkedHead(chunk_tokens=32, outside_bytes=9_900, head_bytes=5_000, head_peak_bytes=192,
                               flops=20_000, chunks=8, tokens=300)


# --------------------------------------------------------------------------------------------- FSDP2


class Unit:
    """Stands in for FSDP2's ``FSDPModule``."""


class ShardedLinear(nn.Linear, Unit):
    pass


def test_sharded_finds_a_submodule_of_fsdp2_s_unit_class(monkeypatch):
    monkeypatch.setattr(bd, "fsdp2", lambda: types.SimpleNamespace(FSDPModule=Unit))
    assert bd._sharded(nn.Sequential(nn.Linear(2, 2), nn.Sequential(ShardedLinear(2, 2)))) is True
    assert bd._sharded(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is False
    monkeypatch.setattr(bd, "fsdp2", lambda: types.SimpleNamespace())  # a torch without FSDP2's unit class
    assert bd._sharded(nn.Sequential(ShardedLinear(2, 2))) is False


# --------------------------------------------------------------------------------------------- the default callables


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, message: str) -> None:
        self.lines.append(("info", message))

    def debug(self, message: str) -> None:
        self.lines.append(("debug", message))


def test_log_info_and_log_report_log_the_line_at_info_and_the_table_at_debug(monkeypatch):
    log = Log()
    monkeypatch.setattr(bd, "log", log)
    bd._log_info("GradientCheckpointing: said.")
    bd._log_report("GradientCheckpointing: a plan.", "layer | mode")
    assert log.lines == [("info", "GradientCheckpointing: said."), ("info", "GradientCheckpointing: a plan."),
                         ("debug", "GradientCheckpointing plan:\nlayer | mode")]


def test_warn_warns_with_the_message_naming_the_line_that_called_the_driver_s_method(monkeypatch):
    warned = []
    warn = lambda *args, **kwargs: warned.append((args, kwargs))  # noqa: E731
    monkeypatch.setattr(bd, "warnings", types.SimpleNamespace(warn=warn))
    bd._warn("GradientCheckpointing: careful.")
    # 3: past _warn and the driver's method that calls it (a real warning's frame is checked through mutmut's
    # trampoline otherwise, which adds frames of its own)
    assert warned == [(("GradientCheckpointing: careful.",), {"stacklevel": 3})]
