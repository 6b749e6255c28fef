"""``lightning-ckpt plan --chunk-loss``: the plan's least peak, its longest length and the Settings table count the
LM head and loss in chunks (issue 32), from hand-made measurements with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_ckpt.commands.plan import _across_lengths, _build, _parse, _plan_longest, plan_settings
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.commands.plan.measure import Built, Measurement, Sharding, StaticMemory
from lightning_ckpt.commands.plan.predictions import PlanSettings, setting_choices, setting_rows
from lightning_ckpt.commands.plan.report import PlanResult, render, report_data
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.plan.planner import ChunkedHead, LayerCost

MIB = 2**20
PROFILE = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e9, name="hand-made")


def at_length(length: int, chunked: bool = True) -> Measurement:
    """A step at ``length`` tokens: 4 layers of 8 MiB saved plain and 1 MiB of inputs per 1024 tokens; outside the
    layers 20 MiB per 1024 tokens (the logits and the loss), or 2 MiB per 1024 tokens with the head and loss in chunks
    of 256 tokens, whose backward runs the head's forward again (2**30 FLOPs per 1024 tokens)."""
    scale = length / 1024
    costs = [LayerCost(f"l{i}", "Block", none_bytes=round(8 * MIB * scale), full_bytes=round(MIB * scale),
                       selective_bytes=round(4 * MIB * scale), offloadable_bytes=0, full_flops=round(10**9 * scale),
                       selective_flops=round(10**7 * scale)) for i in range(4)]
    head = ChunkedHead(256, outside_bytes=round(2 * MIB * scale), head_bytes=0, head_peak_bytes=0,
                       flops=round(2**30 * scale)) if chunked else None
    return Measurement(1, costs, round(20 * MIB * scale), length=length, chunked=head)


def result_for(main: Measurement, chunk_loss: bool | None, room: int) -> PlanResult:
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None, chunk_loss=chunk_loss)
    plan, error = plan_settings(built, None).plan(main, 0.5)
    rows = setting_rows(main, setting_choices([c.name for c in main.costs], plan, main.chunked is not None), False,
                        plan_chunked=plan is not None and plan.chunk_tokens is not None)
    static = StaticMemory(0, 0, 0, "AdamW", Sharding())
    return PlanResult("hand-made", built, main, plan, error, 0.5, rows, static, room, [main.batch_size])


def longest_of(chunk_loss: bool | None, room: int, chunked: bool = True) -> PlanResult:
    measured = [at_length(t, chunked) for t in (1024, 2048, 4096)]
    result = result_for(measured[0], chunk_loss, room)
    settings = plan_settings(result.built, None)
    _across_lengths(result, measured, room, settings)
    _plan_longest(result, room, settings, lambda t: at_length(t, chunked), None)
    return result


# ------------------------------------------------------------------------------------------- the least peak


def test_least_peak_counts_the_chunked_head_as_chunk_loss_says():
    """l3's backward sets the floor: outside + 3 x 1 MiB of inputs + its 8 MiB. Chunked, 2 MiB outside: 13 MiB;
    whole, 20 MiB: 31 MiB. ``None`` takes the lesser, ``True`` the chunked one even where it is larger."""
    m = at_length(1024)
    assert [PlanSettings(chunk_loss=c).least_peak(m) for c in (None, True, False)] == [13 * MIB, 13 * MIB, 31 * MIB]
    larger = Measurement(1, m.costs, m.outside_bytes, chunked=ChunkedHead(256, 40 * MIB, 0, 0, 1))
    assert [PlanSettings(chunk_loss=c).least_peak(larger) for c in (None, True, False)] == [31 * MIB, 51 * MIB,
                                                                                            31 * MIB]
    assert PlanSettings(chunk_loss=True).least_peak(at_length(1024, chunked=False)) == 31 * MIB  # nothing to chunk


@pytest.mark.parametrize("chunk_loss", [None, True])
def test_the_planner_meets_the_chunked_least_peak_and_not_a_byte_less(chunk_loss):
    m = at_length(1024)
    settings = PlanSettings(chunk_loss=chunk_loss)
    least = settings.least_peak(m)
    plan, error = settings.plan(m, least)
    assert error is None and plan is not None
    assert plan.chunk_tokens == 256 and plan.peak_bytes == least
    assert settings.plan(m, least - 1)[0] is None


# ------------------------------------------------------------------------------------------- the Settings table


def test_the_settings_table_has_a_chunked_row_and_the_chunked_plan_s_own_row():
    """every_layer_chunked: every_layer's layers with 2 MiB outside instead of 20 (18 MiB less at the end of the
    forward and at the peak), and the head's forward run again. The plan's row is the chunked plan's own line."""
    m = at_length(1024)
    result = result_for(m, True, 100 * MIB)
    rows = {r.name: r for r in result.rows}
    assert list(rows) == ["none", "every_4th", "every_2nd", "every_layer", "selective", "every_layer_chunked",
                          "plan"]
    full, chunked = rows["every_layer"], rows["every_layer_chunked"]
    assert full.peak_bytes == 31 * MIB and chunked.peak_bytes == 13 * MIB
    assert full.activation_bytes - chunked.activation_bytes == 18 * MIB
    assert chunked.recompute_flops - full.recompute_flops == 2**30
    plan, row = result.plan, rows["plan"]
    assert plan is not None and plan.chunk_tokens == 256
    assert (row.activation_bytes, row.peak_bytes, row.recompute_flops) == (plan.planned_bytes, plan.peak_bytes,
                                                                           plan.recompute_flops)
    assert "every_layer_chunked: every layer, full, with the LM head and loss in chunks" in render(result)


def test_the_chunked_rows_time_counts_the_head_s_forward_again():
    m = at_length(1024)
    plan, _ = PlanSettings(device=PROFILE, chunk_loss=True).plan(m, 1.0)
    assert plan is not None and plan.chunk_tokens == 256
    rows = {r.name: r for r in setting_rows(m, setting_choices([c.name for c in m.costs], plan, True), False,
                                            device=PROFILE, plan_chunked=True, kept_ops=plan.kept_ops)}
    assert rows["every_layer_chunked"].predicted_step_seconds - rows["every_layer"].predicted_step_seconds == (
        pytest.approx(2**30 / 1e12))
    assert rows["plan"].predicted_step_seconds == pytest.approx(plan.predicted_step_seconds)


def test_without_a_chunked_measurement_there_is_no_chunked_row():
    m = at_length(1024, chunked=False)
    assert "every_layer_chunked" not in {r.name for r in result_for(m, None, 100 * MIB).rows}


# ------------------------------------------------------------------------------------------- the longest length


def test_the_plan_s_longest_length_counts_the_chunked_head():
    """Chunked, the least peak is 13 MiB per 1024 tokens: 100 MiB fit floor(100 / 13 x 1024) = 7876 tokens;
    whole, 31 MiB per 1024: floor(100 / 31 x 1024) = 3303, which is every_layer's too."""
    room = 100 * MIB
    result = longest_of(None, room)
    assert [at.least_peak_bytes for at in result.lengths] == [13 * MIB, 26 * MIB, 52 * MIB]
    assert result.largest_length["plan"] == 7876 == math.floor(100 / 13 * 1024)
    assert result.largest_length["every_layer"] == 3303 == math.floor(100 / 31 * 1024)
    assert result.largest_length["every_layer_chunked"] == 7876
    longest = result.longest
    assert longest is not None and longest.plan is not None and longest.plan.chunk_tokens == 256
    assert longest.plan.peak_bytes <= room
    data = report_data(result)
    assert data["largest_length"]["plan"] == 7876 and data["longest_plan"]["plan"]["chunk_tokens"] == 256
    report = render(result)
    assert "**The plan's longest length: 7,876 tokens** at batch size 1 (offload off, exact, chunk_loss 'auto')" in (
        report)
    assert "runs the LM head and loss in chunks of 256 tokens" in report


def test_chunk_loss_false_keeps_the_longest_length_of_the_whole_head():
    result = longest_of(False, 100 * MIB)
    assert result.largest_length["plan"] == 3303
    assert result.longest is not None and result.longest.plan is not None
    assert result.longest.plan.chunk_tokens is None
    assert "(offload off, exact, chunk_loss off)" in render(result)


# ------------------------------------------------------------------------------------------- the command


TINY = Path(__file__).parents[3] / "configs" / "tiny.yaml"


@pytest.mark.parametrize(("option", "expected"), [("true", True), ("false", False), ("auto", None)])
def test_chunk_loss_option_reaches_the_plan_settings(option, expected):
    args = _parse(["--config", str(TINY), "--fake", "--chunk-loss", option])
    built = _build(args)
    assert built.chunk_loss is expected and plan_settings(built, None).chunk_loss is expected


def test_plan_chunk_loss_true_plans_the_tiny_gpt_with_its_head_in_chunks(tmp_path):
    """The demo GPT with a vocabulary of 4096 at batch 8 x 128-512 tokens (more than a chunk of 1024): its logits
    outweigh its layers, so the chunked head's least peak is lower and the plan's longest length longer than without
    it (fake tensors: 699 against 505 tokens when written)."""
    lengths = {}
    for option in ("true", "false"):
        rc = plan_main(["--config", str(TINY), "--fake", "--lengths", "128,256,512", "--device-memory", "200MiB",
                        "--memory-budget", "1.0", "--chunk-loss", option, "--model.init_args.vocab_size=4096",
                        "--data.init_args.vocab_size=4096", "--model.init_args.block_size=4096",
                        "--output-dir", str(tmp_path / option)])
        assert rc == 0
        data = json.loads((tmp_path / option / "plan.json").read_text())
        lengths[option] = data["largest_length"]["plan"]
        chunks = data["longest_plan"]["plan"]["chunk_tokens"]
        assert (chunks is not None) is (option == "true"), data["longest_plan"]
        names = [s["name"] for s in data["settings"]]
        assert ("every_layer_chunked" in names) is (option == "true")  # --chunk-loss false: not measured chunked
    assert lengths["true"] > lengths["false"], lengths


@pytest.mark.parametrize(("option", "expected"), [([], True), (["--chunk-loss", "auto"], None)])
def test_the_config_s_chunk_loss_is_the_default_and_the_option_overrides_it(tmp_path, option, expected):
    config = tmp_path / "chunked.yaml"
    config.write_text(TINY.read_text().replace("        every_n_layers: 2\n",
                                               "        every_n_layers: 2\n        chunk_loss: true\n"))
    built = _build(_parse(["--config", str(config), "--fake", *option]))
    assert built.chunk_loss is expected


def test_without_the_option_or_the_config_s_chunk_loss_the_plan_chooses():
    assert _build(_parse(["--config", str(TINY), "--fake"])).chunk_loss is None
