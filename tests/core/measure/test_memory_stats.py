"""The arithmetic of MemoryMonitor without a Trainer: reductions over ranks on hand-made gathered tensors, the summary's
breakdown and its advice, batches' tokens, and the probes on a tiny model (bytes checked with torch's own hooks)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ckpt.core.measure.memory_stats import (
    ACTIVATION_PEAK,
    ACTIVATIONS,
    ACTIVATIONS_OFFLOADED,
    GIB,
    HOST_RSS,
    METRIC_KEYS,
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    RECOMPUTE_FLOPS_SHARE,
    REDUCTIONS,
    SAMPLES_PER_SEC,
    STEP_SEC,
    TOKENS_PER_SEC,
    ActivationProbe,
    FlopProbe,
    all_gather_released,
    device_peak_bytes,
    device_total_bytes,
    format_summary,
    interval_metrics,
    local_summary,
    main_tensor,
    metrics_vector,
    reduce_metrics,
    reduce_summary,
    reset_device_peaks,
    tokens_in_batch,
)
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
from lightning_ckpt.core.measure.profiling import count_cost

NAN = math.nan
MIB, KIB = 2**20, 2**10


# ------------------------------------------------------------------------------------------------
# Over ranks
# ------------------------------------------------------------------------------------------------


def test_reductions_are_max_for_memory_and_time_and_sum_for_rates():
    assert {key for key, how in REDUCTIONS.items() if how == "sum"} == {SAMPLES_PER_SEC, TOKENS_PER_SEC}
    assert set(REDUCTIONS.values()) == {"max", "sum"} and METRIC_KEYS == tuple(REDUCTIONS)
    ranks = [
        {PEAK_ALLOCATED: 3.0, PEAK_RESERVED: 4.0, HOST_RSS: 1.5, ACTIVATIONS: 0.25, ACTIVATIONS_OFFLOADED: 0.0,
         ACTIVATION_PEAK: 0.5, SAMPLES_PER_SEC: 100.0, TOKENS_PER_SEC: 1600.0, STEP_SEC: 0.2, RECOMPUTE_FLOPS_SHARE: 0.3},
        {PEAK_ALLOCATED: 5.0, PEAK_RESERVED: 6.0, HOST_RSS: 1.0, ACTIVATIONS: 0.5, ACTIVATIONS_OFFLOADED: 0.125,
         ACTIVATION_PEAK: 0.75, SAMPLES_PER_SEC: 80.0, TOKENS_PER_SEC: 1280.0, STEP_SEC: 0.25, RECOMPUTE_FLOPS_SHARE: 0.2},
        {PEAK_ALLOCATED: 4.0, PEAK_RESERVED: 7.0, HOST_RSS: 2.0, ACTIVATIONS: 0.375, ACTIVATIONS_OFFLOADED: 0.0,
         ACTIVATION_PEAK: 0.625, SAMPLES_PER_SEC: 90.0, TOKENS_PER_SEC: 1440.0, STEP_SEC: 0.3, RECOMPUTE_FLOPS_SHARE: 0.25},
    ]
    gathered = torch.stack([metrics_vector(rank) for rank in ranks])
    assert gathered.shape == (3, len(METRIC_KEYS)) and gathered.dtype == torch.float64
    reduced = reduce_metrics(gathered)
    assert reduced == {PEAK_ALLOCATED: 5.0, PEAK_RESERVED: 7.0, HOST_RSS: 2.0, ACTIVATIONS: 0.5,
                       ACTIVATIONS_OFFLOADED: 0.125, ACTIVATION_PEAK: 0.75, SAMPLES_PER_SEC: 270.0, TOKENS_PER_SEC: 4320.0, STEP_SEC: 0.3,
                       RECOMPUTE_FLOPS_SHARE: 0.3}
    assert list(reduced) == list(METRIC_KEYS)  # logged in the keys' order
    assert all(type(value) is float for value in reduced.values())


def test_a_key_missing_on_any_rank_is_dropped_and_one_rank_is_its_own_metrics():
    one = {HOST_RSS: 1.0, SAMPLES_PER_SEC: 10.0, STEP_SEC: 0.5, PEAK_ALLOCATED: 2.0}
    two = {HOST_RSS: 3.0, SAMPLES_PER_SEC: 20.0, STEP_SEC: 0.25}  # a rank without device peaks, say
    assert reduce_metrics(metrics_vector(one).unsqueeze(0)) == one
    assert reduce_metrics(torch.stack([metrics_vector(one), metrics_vector(two)])) == {
        HOST_RSS: 3.0, SAMPLES_PER_SEC: 30.0, STEP_SEC: 0.5}
    assert reduce_metrics(torch.full((2, len(METRIC_KEYS)), NAN, dtype=torch.float64)) == {}


def test_metrics_vector_puts_each_key_in_its_column():
    row = metrics_vector({TOKENS_PER_SEC: 7.0, PEAK_RESERVED: 2.0})
    assert row[METRIC_KEYS.index(TOKENS_PER_SEC)] == 7.0 and row[METRIC_KEYS.index(PEAK_RESERVED)] == 2.0
    assert int(torch.isnan(row).sum()) == len(METRIC_KEYS) - 2


def test_summary_reduction_sums_rates_takes_the_largest_bytes_as_ints_and_none_for_missing():
    keys = ["peak_allocated_bytes", "parameter_bytes", "samples_per_sec", "tokens_per_sec"]
    gathered = torch.tensor([[2.0 * GIB, 1024.0, 10.5, NAN],
                             [3.0 * GIB, 2048.0, 12.0, 100.0]], dtype=torch.float64)
    summary = reduce_summary(keys, gathered)
    assert summary == {"peak_allocated_bytes": 3 * GIB, "parameter_bytes": 2048, "samples_per_sec": 22.5,
                       "tokens_per_sec": None}
    assert type(summary["parameter_bytes"]) is int and type(summary["samples_per_sec"]) is float


def test_all_gather_released_without_a_process_group_is_this_rank_alone():
    local = torch.tensor([1.0, NAN, 3.0], dtype=torch.float64)
    gathered = all_gather_released(local)
    assert gathered.shape == (1, 3) and torch.equal(gathered[0, [0, 2]], local[[0, 2]])
    assert reduce_metrics(all_gather_released(metrics_vector({STEP_SEC: 0.5}))) == {STEP_SEC: 0.5}


# ------------------------------------------------------------------------------------------------
# One rank's figures
# ------------------------------------------------------------------------------------------------


def test_interval_metrics_in_gib_and_per_second_unmeasured_left_out():
    metrics = interval_metrics(host_rss=3 * GIB // 2, samples_per_sec=64.0, batches_per_sec=8.0, tokens_per_sec=1024.0,
                               device_peaks=(GIB, 2 * GIB), activations=(GIB // 4, GIB // 8), recompute_share=0.3)
    assert metrics == {PEAK_ALLOCATED: 1.0, PEAK_RESERVED: 2.0, HOST_RSS: 1.5, ACTIVATIONS: 0.25,
                       ACTIVATIONS_OFFLOADED: 0.125, SAMPLES_PER_SEC: 64.0, TOKENS_PER_SEC: 1024.0, STEP_SEC: 0.125,
                       RECOMPUTE_FLOPS_SHARE: 0.3}
    cpu = interval_metrics(host_rss=GIB, samples_per_sec=NAN, batches_per_sec=2.0)
    assert cpu == {HOST_RSS: 1.0, STEP_SEC: 0.5}  # a rate that is not a number is left out too
    assert interval_metrics(host_rss=0, samples_per_sec=1.0, batches_per_sec=1.0, recompute_share=0.0)[
        RECOMPUTE_FLOPS_SHARE] == 0.0  # 0 (nothing recomputed) is a figure, not a missing one


def test_local_summary_counts_parameters_once_and_adam_state_and_rates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 10, bias=True))
    model[1].weight = model[0].weight  # tied: one storage, counted once
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 10 * 6 + 10
    adam = torch.optim.Adam(model.parameters())
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    adam.step()
    figures = local_summary(parameters=model.parameters(), optimizers=[adam], gradient_bytes=4 * n_params,
                            activations=(3 * 2**20, 2**20), activation_peak=5 * 2**20, peak_host_rss=GIB, peak_device=(5 * GIB, 6 * GIB),
                            samples=300, tokens=900, elapsed=4.0)
    assert figures == {
        "peak_allocated_bytes": 5.0 * GIB, "peak_reserved_bytes": 6.0 * GIB, "peak_host_rss_bytes": 1.0 * GIB,
        "activation_bytes": 3.0 * 2**20, "offloaded_activation_bytes": 1.0 * 2**20, "activation_peak_bytes": 5.0 * 2**20,
        "parameter_bytes": 4.0 * n_params, "gradient_bytes": 4.0 * n_params,
        # two float32 moments per parameter, and a float32 `step` per parameter tensor (2 tensors: the tied one once)
        "optimizer_state_bytes": 8.0 * n_params + 4 * 2,
        "samples_per_sec": 75.0, "tokens_per_sec": 225.0,
    }
    cpu = local_summary(parameters=[], optimizers=[], gradient_bytes=None, activations=(0, 0), peak_host_rss=1,
                        samples=5, elapsed=0.0)
    assert cpu["gradient_bytes"] == 0.0
    assert all(math.isnan(cpu[key]) for key in
               ("peak_allocated_bytes", "peak_reserved_bytes", "activation_peak_bytes", "samples_per_sec",
                "tokens_per_sec"))


# ------------------------------------------------------------------------------------------------
# The summary's text
# ------------------------------------------------------------------------------------------------


def summary(**figures) -> dict:
    base = {"steps": 10, "world_size": 1, "device": "cpu", "peak_allocated_bytes": None, "peak_reserved_bytes": None,
            "peak_host_rss_bytes": 2 * GIB, "activation_bytes": GIB, "offloaded_activation_bytes": 0,
            "parameter_bytes": GIB // 8, "gradient_bytes": GIB // 8, "optimizer_state_bytes": GIB // 4,
            "samples_per_sec": 1234.5, "tokens_per_sec": None, "chooser": "every_n_layers"}
    return {**base, **figures}


def test_summary_says_activations_are_the_largest_part_when_they_are():
    lines = format_summary(summary()).splitlines()
    assert lines == [
        "MemoryMonitor summary (10 steps):",
        "  peak device memory: n/a (cpu run); peak host RSS 2.0 GiB",
        "  peak activations:   1.0 GiB held for backward at the end of the forward",
        "  throughput:         1,234.5 samples/s",
        "  memory breakdown: parameters 128.0 MiB, gradients 128.0 MiB, optimizer state 256.0 MiB, activations 1.0 GiB"
        " held at the end of the forward",
        "  Activations held at the end of the forward (1.0 GiB) are the largest part: checkpointing more layers (smaller `every_n_layers`) or"
        " `offload=True` shrinks them.",
    ]


def test_summary_says_weights_outweigh_activations_and_names_the_processes():
    text = format_summary(summary(world_size=4, device="cuda", peak_allocated_bytes=3 * GIB,
                                  peak_reserved_bytes=4 * GIB, activation_bytes=GIB // 4,
                                  offloaded_activation_bytes=GIB // 16, optimizer_state_bytes=5 * GIB // 4,
                                  tokens_per_sec=98765.4))
    lines = text.splitlines()
    assert lines[0] == "MemoryMonitor summary (10 steps, 4 processes):"
    assert lines[1] == "  peak device memory: 3.0 GiB allocated, 4.0 GiB reserved; peak host RSS 2.0 GiB"
    assert lines[2] == ("  peak activations:   256.0 MiB held for backward at the end of the forward (+ 64.0 MiB offloaded"
                        " to host memory)")
    assert lines[3] == "  throughput:         1,234.5 samples/s, 98,765 tokens/s"
    assert lines[4].startswith("  memory breakdown per process: parameters 128.0 MiB")
    # 0.125 + 0.125 + 1.25 GiB of weights against 0.25 GiB of activations
    assert lines[5] == ("  Parameters, gradients and optimizer state (1.5 GiB) outweigh activations held at the end of"
                        " the forward (256.0 MiB):"
                        " checkpointing cannot shrink them. Instead, shard them across devices (FSDP, DeepSpeed ZeRO)"
                        " or train fewer parameters (parameter-efficient tuning such as LoRA).")
    assert "largest part" not in text


def test_summary_says_equal_weights_and_activations_are_about_equal_and_missing_throughput_reads_na():
    # weights (128 + 128 + 256 MiB) equal to the activations: neither outweighs the other, and each has its remedy
    lines = format_summary(summary(samples_per_sec=None, activation_bytes=GIB // 2)).splitlines()
    assert lines[3] == "  throughput:         n/a"
    assert lines[5] == ("  Parameters, gradients and optimizer state (512.0 MiB) are about equal to activations held at"
                        " the end of the forward (512.0 MiB): both count. For activations, checkpointing more layers (smaller"
                        " `every_n_layers`) or `offload=True` shrinks them. For the rest, shard them across devices (FSDP, DeepSpeed"
                        " ZeRO) or train fewer parameters (parameter-efficient tuning such as LoRA).")


@pytest.mark.parametrize("activations, words", [
    # weights of 9 MiB (2 + 2 + 5): about equal while they are at least 90% of the activations, 9 / 10 exactly
    (10 * MIB, "  Parameters, gradients and optimizer state (9.0 MiB) are about equal to activations at the step's peak"
               " (10.0 MiB): both"),
    # 1 KiB more and they are 9216 / 10241 = 89.99%: the activations are the largest part, though both print 10.0 MiB
    (10 * MIB + KIB, "  Activations at the step's peak (10.0 MiB) are the largest part:"),
], ids=["90% exactly", "89.99%"])
def test_summary_about_equal_boundary_on_the_activations_side(activations, words):
    weights = {"parameter_bytes": 2 * MIB, "gradient_bytes": 2 * MIB, "optimizer_state_bytes": 5 * MIB}
    lines = format_summary(summary(activation_peak_bytes=activations, activation_bytes=activations // 2, **weights))
    assert lines.splitlines()[5].startswith(words)


@pytest.mark.parametrize("activations, words", [
    # weights of 10 MiB (2 + 2 + 6): activations of 9 MiB are 90% of them exactly, about equal
    (9 * MIB, "  Parameters, gradients and optimizer state (10.0 MiB) are about equal to activations at the step's peak"
              " (9.0 MiB): both"),
    # 1 KiB less, 9215 / 10240 = 89.99%: the weights outweigh them, though the activations still print as 9.0 MiB
    (9 * MIB - KIB, "  Parameters, gradients and optimizer state (10.0 MiB) outweigh activations at the step's peak"
                    " (9.0 MiB):"
                    " checkpointing cannot shrink them."),
], ids=["90% exactly", "89.99%"])
def test_summary_about_equal_boundary_on_the_weights_side(activations, words):
    weights = {"parameter_bytes": 2 * MIB, "gradient_bytes": 2 * MIB, "optimizer_state_bytes": 6 * MIB}
    lines = format_summary(summary(activation_peak_bytes=activations, activation_bytes=activations // 2, **weights))
    assert lines.splitlines()[5].startswith(words)


def test_summary_compares_peak_activations_with_the_budget_and_advises_the_setting_the_user_set():
    # the budget bounds the step's peak (1.5 GiB here), not what the forward leaves held (1.0 GiB)
    peak = 3 * GIB // 2
    lines = format_summary(summary(chooser="memory_budget", budget_bytes=GIB // 2, activation_peak_bytes=peak)).splitlines()
    assert lines[2] == ("  peak activations:   1.5 GiB at the step's peak (forward and backward), 3.00x the memory_budget"
                        " of 512.0 MiB, which bounds that peak; 1.0 GiB held for backward at the end of the forward")
    assert lines[5] == ("  Activations at the step's peak (1.5 GiB) are the largest part: a smaller `memory_budget` (or"
                        " `offload=True`) shrinks them.")
    within = format_summary(summary(chooser="memory_budget", budget_bytes=3 * GIB, activation_peak_bytes=peak))
    assert within.splitlines()[2].startswith("  peak activations:   1.5 GiB at the step's peak (forward and backward),"
                                             " 0.50x the memory_budget of 3.0 GiB, which bounds that peak")
    uncounted = format_summary(summary(chooser="memory_budget", budget_bytes=3 * GIB)).splitlines()
    assert uncounted[2] == ("  peak activations:   1.0 GiB held for backward at the end of the forward (the step's peak,"
                            " which the memory_budget of 3.0 GiB bounds, was not counted)")
    plain = format_summary(summary(chooser=None)).splitlines()
    assert plain[2] == "  peak activations:   1.0 GiB held for backward at the end of the forward"
    assert plain[5] == ("  Activations held at the end of the forward (1.0 GiB) are the largest part: checkpointing layers"
                        " (the `GradientCheckpointing` callback) shrinks them.")


def test_two_ranks_from_local_figures_to_the_text():
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of float32
    ranks = [local_summary(parameters=model.parameters(), optimizers=[], gradient_bytes=2**18, activations=(act, 0),
                           peak_host_rss=rss, samples=100, elapsed=2.0)
             for act, rss in ((2**20, GIB), (2**21, GIB // 2))]
    keys = list(ranks[0])
    gathered = torch.stack([torch.tensor(list(rank.values()), dtype=torch.float64) for rank in ranks])
    reduced = {"steps": 5, "world_size": 2, "device": "cpu", **reduce_summary(keys, gathered),
               "chooser": "every_n_layers"}
    assert reduced["activation_bytes"] == 2**21 and reduced["peak_host_rss_bytes"] == GIB
    assert reduced["samples_per_sec"] == 100.0 and reduced["tokens_per_sec"] is None
    assert reduced["peak_allocated_bytes"] is None
    text = format_summary(reduced)
    assert "(5 steps, 2 processes)" in text and "100.0 samples/s\n" in text
    assert text.endswith("Activations held at the end of the forward (2.0 MiB) are the largest part: checkpointing more"
                         " layers (smaller"
                         " `every_n_layers`) or `offload=True` shrinks them.")


# ------------------------------------------------------------------------------------------------
# Batches and device reads
# ------------------------------------------------------------------------------------------------


def test_main_tensor_is_the_first_tensor_depth_first_in_nested_batches():
    ids = torch.zeros(3, 7, dtype=torch.long)
    batch = ("a caption", [{"meta": "x", "input_ids": ids}, torch.ones(3)], torch.zeros(3, 7))
    assert main_tensor(batch) is ids
    assert main_tensor({"empty": [], "inner": {"mask": ids}}) is ids
    assert main_tensor(["text", b"bytes", {"k": 1}]) is None


@pytest.mark.parametrize("batch, tokens", [
    ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4)), 64),
    ({"batch": [{"input_ids": torch.zeros(2, 9, dtype=torch.int32)}], "labels": torch.zeros(2, 9)}, 18),
    (torch.zeros(4, 16), None),  # float features, not token ids
    (torch.zeros(4, 16, dtype=torch.complex64), None),
    (torch.zeros(16, dtype=torch.long), None),  # 1-D: no sequence dimension
    (torch.zeros(2, 3, 4, dtype=torch.long), None),
    ([{"text": "no tensor"}], None),
])
def test_tokens_in_batch(batch, tokens):
    assert tokens_in_batch(batch) == tokens


def test_devices_without_allocator_statistics_have_no_peaks():
    assert device_peak_bytes(torch.device("cpu")) is None
    assert device_peak_bytes(torch.device("meta")) is None
    assert device_total_bytes(torch.device("cpu")) is None


class StandInAllocator:
    """``torch.xpu``'s allocator calls, answering for one device: 5 GiB free of 80, peaks 3 and 4 GiB."""

    def __init__(self) -> None:
        self.resets: list[torch.device] = []

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return 5 * GIB, 80 * GIB

    def max_memory_allocated(self, device: torch.device) -> int:
        return 3 * GIB

    def max_memory_reserved(self, device: torch.device) -> int:
        return 4 * GIB

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.resets.append(device)


def test_an_accelerators_statistics_are_read_from_its_torch_module(monkeypatch):
    allocator = StandInAllocator()
    monkeypatch.setattr(torch, "xpu", allocator, raising=False)
    device = torch.device("xpu", 1)
    assert device_peak_bytes(device) == (3 * GIB, 4 * GIB)
    assert device_total_bytes(device) == 80 * GIB  # the total, not the 5 GiB free
    reset_device_peaks(device)
    assert allocator.resets == [device]


# ------------------------------------------------------------------------------------------------
# The probes
# ------------------------------------------------------------------------------------------------


def two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.nn.Linear(16, 4))


def bytes_saved_by_hooks(model: torch.nn.Module, x: torch.Tensor, exclude_parameters: bool = True) -> int:
    """Bytes of the storages that torch's saved-tensor hooks see saved in a forward, parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters() if exclude_parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).sum()
    return sum(storages.values())


def test_activation_probe_counts_what_torchs_hooks_see_saved():
    model, x = two_layers(), torch.randn(4, 8)
    probe = ActivationProbe()
    probe.start(model.parameters())
    assert probe.active
    loss = model(x).sum()
    counted = probe.stop()
    # the input of the first Linear (4 x 8) and the ReLU's output, which is the second Linear's input (4 x 16)
    assert counted == (4 * 8 * 4 + 4 * 16 * 4, 0) == (bytes_saved_by_hooks(model, x), 0)
    assert not probe.active and probe.stop() is None
    loss.backward()  # the hooks are gone; backward runs as usual
    probe.start(model.parameters())
    probe.start(model.parameters())  # a second start restarts the count
    model(x).sum()
    assert probe.stop() == counted


def test_activation_probe_counts_parameters_when_not_told_they_are_parameters():
    model, x = two_layers(), torch.randn(4, 8)
    probe = ActivationProbe()
    probe.start([])
    model(x).sum()
    # the second Linear's weight, saved for its input's gradient; not the first's (its input needs none), no bias
    weights = 4 * 16 * 4
    assert probe.stop() == (384 + weights, 0) == (bytes_saved_by_hooks(model, x, exclude_parameters=False), 0)


def test_activation_probe_splits_offloaded_bytes():
    model, x = two_layers(), torch.randn(4, 8)
    apply_checkpointing(model[0], layer_cls=torch.nn.Sequential, offload=True)
    probe = ActivationProbe()
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)):
        probe.start(model.parameters())
        loss = model(x).sum()
        counted = probe.stop()
        loss.backward()
    # the checkpointed layer's input goes to "host"; the ReLU output, the next Linear's input, stays
    assert counted == (4 * 16 * 4, 4 * 8 * 4)


def test_flop_probe_share_is_the_recomputed_flops_over_all():
    plain, checkpointed, x = two_layers(), two_layers(), torch.randn(4, 8)
    apply_checkpointing(checkpointed[0], layer_cls=torch.nn.Sequential)
    step = lambda model: model(x).sum().backward()  # noqa: E731
    plain_cost = count_cost(lambda: step(plain))
    checkpointed.zero_grad(set_to_none=True)
    checkpointed_cost = count_cost(lambda: step(checkpointed))
    recomputed = 2 * 4 * 8 * 16 + 4 * 16  # the first Linear's matmul and the ReLU, run again in backward
    assert checkpointed_cost - plain_cost == recomputed

    probe = FlopProbe()
    for _ in range(2):  # two micro-batches of one optimizer step
        checkpointed.zero_grad(set_to_none=True)
        probe.start()
        step(checkpointed)
        probe.stop()
    assert (probe.total, probe.recompute) == (2 * checkpointed_cost, 2 * recomputed)
    assert probe.take() == pytest.approx(recomputed / checkpointed_cost, rel=1e-12)
    assert probe.take() is None and probe.total == probe.recompute == 0

    probe.start()
    step(plain)
    assert probe.take() == 0.0  # take stops a count still running
