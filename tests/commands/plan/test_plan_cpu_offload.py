"""``lightning-ckpt plan``: the target's host memory (``--host-memory``) and ``fsdp_ckpt``'s CPU offload in static
memory (issue 39, parts 3 and 4). Known answers computed by hand: parameter counts x 4 bytes (float32) or x 2
(gathered in bfloat16 under ``bf16-mixed``), rows padded over the shards as ``fully_shard`` pads them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_ckpt.commands.plan import _across_lengths, _plan_longest, host_memory_of, plan_settings
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.commands.plan.measure import (
    CPU_OFFLOAD_NOTE,
    Built,
    HostMemory,
    Measurement,
    Sharding,
    StaticMemory,
    gathered_bytes,
    sharding_of,
    static_memory,
)
from lightning_ckpt.commands.plan.predictions import PlanSettings, setting_choices, setting_rows
from lightning_ckpt.commands.plan.report import PlanResult, render, report_data
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import LayerCost

MIB = 2**20
GIB = 2**30
TINY = Path(__file__).parents[3] / "configs" / "tiny.yaml"
FAST_LINK = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e12, host_bandwidth=math.inf, name="fast link")
CKPT = "lightning_ckpt.CheckpointingFSDPStrategy"


# ------------------------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize(("strategy", "devices", "offload", "reshard", "shards"), [
    ("fsdp_ckpt_cpu_offload", 1, True, True, 1),
    ("fsdp_ckpt_cpu_offload", 8, True, True, 8),
    ({"class_path": CKPT, "init_args": {"cpu_offload": True, "reshard_after_forward": False}}, 2, True, False, 2),
    ({"class_path": CKPT, "init_args": {"cpu_offload": False}}, 2, False, True, 2),
    ("fsdp_ckpt", 4, False, True, 4),
    ("fsdp_cpu_offload", 4, False, True, 4),  # Lightning's FSDP1: not counted, its note says so
])
def test_cpu_offload_is_read_from_the_configured_strategy(strategy, devices, offload, reshard, shards):
    sharding = sharding_of(strategy, devices, num_nodes=1)
    assert (sharding.cpu_offload, sharding.reshard_after_forward) == (offload, reshard)
    assert (sharding.weights, sharding.states) == (shards, shards)
    assert (sharding.note == CPU_OFFLOAD_NOTE) is offload


# ------------------------------------------------------------------------------------------------ static memory


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 6), nn.Linear(6, 4)  # 24 + 6 + 24 + 4 = 58 floats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


class Net(nn.Module):
    """Roots of 85 floats (embedding 10 x 4, head 10 x 4 without bias, a frozen 5) around 3 blocks of 58, a buffer
    of 7 floats; AdamW over the trainable ones (14 tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.head = nn.Linear(4, 10, bias=False)
        self.norm = nn.Module()
        self.norm.scale = nn.Parameter(torch.ones(5), requires_grad=False)
        self.register_buffer("counts", torch.zeros(7))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _static(sharding: Sharding, precision=None) -> StaticMemory:
    built = Built(Net(), [], torch.device("cpu"), Mlp, False, None, None, sharding=sharding)
    if precision is not None:
        built.precision = precision
    return static_memory(built)


def test_one_device_with_cpu_offload_holds_the_gathered_units_and_the_host_holds_the_states():
    static = _static(Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, cpu_offload=True))
    # Host: every parameter (85 + 3 x 58 = 259 floats), the gradients of the trainable 254, AdamW's two moments of
    # them and a 4-byte step per trainable tensor (14).
    assert (static.host_weights, static.host_gradients, static.host_optimizer_state) == (
        259 * 4, 254 * 4, 2 * 254 * 4 + 14 * 4) == (1036, 1016, 2088)
    assert static.host_total == 4140
    # Device: the buffer (28 B), the roots gathered (85 floats) and two blocks (one computing, one prefetched); the
    # gradients of the trainable roots (80) and of one block (58), until reduce-scattered; no optimizer state.
    assert (static.weights, static.gradients, static.optimizer_state) == (28 + (85 + 2 * 58) * 4, (80 + 58) * 4, 0)
    assert static.total == 832 + 552 == 1384
    # The whole, undivided: the same as without offload.
    assert static.unsharded == 1036 + 28 + 1016 + 2088
    plain = _static(Sharding("fsdp_ckpt", 1, 1, 1))
    assert (plain.weights, plain.gradients, plain.optimizer_state, plain.host_total) == (1064, 1016, 2088, 0)
    assert plain.unsharded == static.unsharded


def test_sharded_with_cpu_offload_the_host_holds_each_device_s_padded_share():
    """Over 2 devices each parameter's rows are split, padded: embedding and head 5 of 10 rows (20 floats each), a
    block's up 3 of 6 rows (12 + 3 of bias), down 2 of 4 (12 + 2), the frozen 3 of 5: 130 floats, 127 trainable.
    The device gathers the whole units, as on one device."""
    static = _static(Sharding("fsdp_ckpt_cpu_offload", 2, 2, 2, cpu_offload=True))
    assert (static.host_weights, static.host_gradients, static.host_optimizer_state) == (
        130 * 4, 127 * 4, 2 * 127 * 4 + 14 * 4)
    assert (static.weights, static.gradients, static.optimizer_state) == (832, 552, 0)


def test_bf16_mixed_gathers_in_bfloat16_and_reshard_false_keeps_every_block_gathered():
    bf16 = _static(Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, cpu_offload=True), MixedPrecision("bf16-mixed", "cpu"))
    assert (bf16.weights, bf16.gradients) == (28 + (85 + 2 * 58) * 2, (80 + 58) * 2)
    assert bf16.host_weights == 1036  # the shards stay float32
    kept = _static(Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, cpu_offload=True, reshard_after_forward=False))
    assert kept.weights == 28 + (85 + 3 * 58) * 4  # every block gathered from its forward to its backward
    assert kept.gradients == (80 + 58) * 4  # gradients still one block at a time
    assert gathered_bytes(Net(), Mlp) == ((85 + 2 * 58) * 4, (80 + 58) * 4)


def test_host_memory_is_what_cpu_offload_leaves_for_offloaded_activations():
    static = _static(Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, cpu_offload=True))
    host = host_memory_of(10_000, static)
    assert (host.total, host.given, host.static, host.for_offload, host.fits) == (10_000, True, 4140, 5860, True)
    assert host_memory_of(4000, static).for_offload == 0 and not host_memory_of(4000, static).fits
    default = host_memory_of(None, static)
    assert not default.given and default.total > 0  # this machine's: half of its available memory


# ------------------------------------------------------------------------------------------------ the command


def run(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    rc = plan_main(["--config", str(TINY), "--fake", "--chunk-loss", "false", "--output-dir", str(tmp_path), *args])
    return rc, json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "plan.md").read_text()


def test_plan_with_fsdp_ckpt_cpu_offload_counts_the_tiny_gpt_by_hand(tmp_path, capsys):
    """tiny.yaml's GPT: blocks of 12,704 floats (LayerNorms 2 x 64, qkv 32 x 96 + 96, proj 32 x 32 + 32, MLP
    32 x 128 + 128 and 128 x 32 + 32), roots of 3,168 (embeddings 2 x 32 x 32, final LayerNorm 64, head
    32 x 32 + 32); no buffer. One device, float32."""
    rc, data, report = run(tmp_path, "--trainer.strategy=fsdp_ckpt_cpu_offload", "--host-memory", "1GiB")
    assert rc == 0
    static = data["static"]
    assert static["cpu_offload"] is True and static["note"] == CPU_OFFLOAD_NOTE
    assert static["weights_bytes"] == (3168 + 2 * 12704) * 4 == 114_304
    assert static["gradient_bytes"] == (3168 + 12704) * 4 == 63_488
    assert static["optimizer_state_bytes"] == 0
    assert data["static_bytes_per_device"] == 114_304 + 63_488
    params = 3168 + 4 * 12704  # 53,984 floats; AdamW: two moments and a step for each of 54 tensors
    assert (static["host_weights_bytes"], static["host_gradient_bytes"], static["host_optimizer_state_bytes"]) == (
        params * 4, params * 4, 2 * params * 4 + 54 * 4)
    assert static["host_bytes"] == static["unsharded_bytes"] == 4 * params * 4 + 54 * 4
    assert data["host_memory"] == {"bytes": GIB, "given": True, "static_bytes": static["host_bytes"],
                                   "for_offload_bytes": GIB - static["host_bytes"]}
    assert "| device (buffers; gathered units) | 114,304 | 63,488 | 0 | AdamW |" in report
    assert f"| host (CPU offload) | {params * 4:,} | {params * 4:,} | {2 * params * 4 + 216:,} | AdamW |" in report
    assert "Host memory planned with: 1.0 GiB per device (given: --host-memory). CPU offload keeps" in report
    assert "every device's host memory holds all of it (CPU offload)" in report
    capsys.readouterr()


def test_host_memory_defaults_to_this_machine_s_and_the_report_says_so(tmp_path, capsys):
    rc, data, report = run(tmp_path, "--trainer.strategy=fsdp_ckpt_cpu_offload")
    assert rc == 0 and data["host_memory"]["given"] is False and data["host_memory"]["bytes"] > 0
    assert "per device (this machine's: half of its available memory; pass --host-memory with the target's)" in report
    capsys.readouterr()


@pytest.mark.parametrize("bad", ["lots", "-5", "0.5GiB/s"])
def test_a_host_memory_that_is_not_bytes_exits_2_saying_what_to_pass(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(TINY), "--host-memory", bad])
    assert exit_info.value.code == 2
    assert f"--host-memory {bad}: pass the target's host memory per device in bytes, such as 256GiB" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ offload and host


def layers(scale: float = 1.0) -> list[LayerCost]:
    """Four layers of 8 MiB saved un-checkpointed and 1 MiB of inputs (x ``scale``)."""
    return [LayerCost(f"l{i}", "Block", none_bytes=round(8 * MIB * scale), full_bytes=round(MIB * scale),
                      selective_bytes=round(4 * MIB * scale), offloadable_bytes=0, full_flops=round(10**9 * scale),
                      selective_flops=round(10**7 * scale)) for i in range(4)]


def test_the_plan_offloads_within_the_host_memory_it_is_given():
    """offload=True on a fast link, budget 12 MiB: the least peak (3 MiB outside l3's 8 and its 1 MiB of inputs
    brought back) needs l0-l2's inputs in host memory, 3 MiB. 3 MiB of host memory is enough; 2 MiB is not, and the
    planner says so in the words the report recognises."""
    measured = Measurement(1, layers(), 3 * MIB)
    plan, error = PlanSettings(offload=True, device=FAST_LINK, host_memory=3 * MIB).plan(measured, 12 * MIB)
    assert plan is not None and plan.planned_host_bytes <= 3 * MIB and error is None
    plan, error = PlanSettings(offload=True, device=FAST_LINK, host_memory=2 * MIB).plan(measured, 12 * MIB)
    assert plan is None and "needs more than `host_memory=2097152`" in error


def longest(host: HostMemory, room: int = 100 * MIB) -> PlanResult:
    """The plan's longest length over 1024-4096 tokens with offload on, as ``test_plan_lengths`` makes it."""
    def at_length(length: int) -> Measurement:
        return Measurement(1, layers(length / 1024), round(3 * MIB * length / 1024), length=length)

    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, True, 0.5, None)
    settings = plan_settings(built, FAST_LINK, host)
    main = at_length(1024)
    plan, error = settings.plan(main, 0.5)
    rows = setting_rows(main, setting_choices([c.name for c in main.costs], plan), True, device=FAST_LINK,
                        kept_ops=plan.kept_ops if plan else {}, plan_offloaded=plan.offloaded if plan else ())
    result = PlanResult("hand-made", built, main, plan, error, 0.5, rows, StaticMemory(0, 0, 0, "AdamW"), room, [1],
                        profile=FAST_LINK, host_memory=host)
    _across_lengths(result, [at_length(t) for t in (1024, 2048, 4096)], room, settings)
    _plan_longest(result, room, settings, at_length, None)
    return result


def test_when_no_plan_fits_the_host_memory_the_report_names_it_not_an_overshoot():
    """With offload, 100 MiB of room fit floor(100 / 12 x 1024) = 8533 tokens, where l0-l2's inputs take
    3 x 8533 / 1024 MiB = 25 MiB of host memory. Given 1 GiB, the plan is made there; given 4 MiB, no plan fits the
    host memory at any length tried, and the report says that, not that the least peak overshot the room."""
    ample = longest(HostMemory(GIB, given=True))
    assert ample.longest.plan is not None and ample.longest.length == 8533 and ample.longest.shortened == []
    assert ample.longest.plan.planned_host_bytes <= GIB

    short = longest(HostMemory(4 * MIB, given=True))
    assert short.longest.fitted == 8533 and short.longest.plan is None
    assert short.longest.least_peak_bytes <= 100 * MIB  # the device would hold it
    assert set(short.longest.shortened) == {"host_memory"} and len(short.longest.shortened) == 6
    report = render(short)
    assert "overshot" not in report
    assert ("(the fit gave 8,533; no plan there fit the host memory for offloaded activations (4.0 MiB, given by"
            " --host-memory), so shorter lengths were measured)") in report
    assert report_data(short)["longest_plan"]["shortened"] == ["host_memory"] * 6
    # A length of --lengths where the same holds says what to raise too (the planner's words are its own argument's).
    assert ("No plan at 1 x 2048: `memory_budget=0.5` (35.0 MiB of activations) needs more than `host_memory=4194304`"
            in report)
    assert "(host memory for offloaded activations: 4.0 MiB, given by --host-memory)" in report


class NetWithoutOptimizer(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        raise RuntimeError("needs the Trainer")


def test_with_an_optimizer_that_cannot_be_built_the_offloaded_shares_are_still_counted_and_the_state_is_unknown():
    sharding = Sharding("fsdp_ckpt_cpu_offload", 1, 1, 1, cpu_offload=True)
    built = Built(NetWithoutOptimizer(), [], torch.device("cpu"), Mlp, False, None, None, sharding=sharding)
    static = static_memory(built)
    assert static.optimizer_state is None and "configure_optimizers or its step failed (needs the Trainer)" in (
        static.optimizer)
    # as with an optimizer (above), less its state: every parameter and gradient in host memory, the device holding
    # the buffer, the gathered roots and two blocks, and the gradients of the roots and one block
    assert (static.host_weights, static.host_gradients) == (259 * 4, 254 * 4)
    assert (static.weights, static.gradients) == (28 + (85 + 2 * 58) * 4, (80 + 58) * 4)


def test_only_a_cpu_offload_that_is_understood_and_on_counts_as_asked():
    from lightning_ckpt.commands.plan.sharding import _cpu_offload_asked

    assert [_cpu_offload_asked(v) for v in (True, False, None, "nonsense", 3)] == [True, False, False, False, False]
