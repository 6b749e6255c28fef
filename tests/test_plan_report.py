"""``lightning-ckpt plan``'s report from hand-made figures, with no measured model: its paragraphs and columns."""

from __future__ import annotations

import math

import torch

from lightning_ckpt.commands.plan.measure import Built, Measurement, Sharding, StaticMemory
from lightning_ckpt.commands.plan.predictions import SettingRow, setting_choices, setting_rows
from lightning_ckpt.commands.plan.report import PlanResult, render, report_data, sharding_lines
from lightning_ckpt.core.device_profile import DeviceProfile
from lightning_ckpt.core.planner import CheckpointPlan, LayerCost, make_plan
from lightning_ckpt.core.profiling import format_bytes


def static(sharding: Sharding, unsharded: int | None = None) -> StaticMemory:
    return StaticMemory(1000, 1000, 2000, "AdamW", sharding, unsharded)


def test_sharding_lines_say_how_many_ways_each_part_is_divided():
    full, blank = sharding_lines(static(Sharding("fsdp_ckpt", 8, 8, 8), unsharded=32 * 1024))
    assert blank == ""
    assert full.startswith("**One device's share (32.0 KiB unsharded):** strategy 'fsdp_ckpt' shards parameters,"
                           " gradients and optimizer state over 8 devices (8 in all: devices x num_nodes)")
    (grad_op, _) = sharding_lines(static(Sharding("FSDPStrategy", 16, 1, 8, note="cpu offload")))
    assert grad_op.startswith("**One device's share:** strategy 'FSDPStrategy' shards gradients and optimizer state"
                              " over 8 devices, parameters over 1 (16 in all")
    assert grad_op.endswith(" Note: cpu offload.")


def test_sharding_lines_for_a_strategy_that_does_not_shard():
    assert sharding_lines(static(Sharding("ddp", 2))) == [
        "Not sharded (strategy 'ddp', 2 devices in all: devices x num_nodes): every device holds all of it.", ""]
    assert sharding_lines(static(Sharding()))[0].startswith("Not sharded (strategy 'auto', 1 device in all")


def settings_table(report: str) -> dict[str, list[str]]:
    """The rows of the report's Settings table by setting name (cells stripped)."""
    body = report.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines() if line.startswith("|")]
    return {r[0]: r for r in rows[2:]}


def test_static_plus_activations_is_one_device_s_share_plus_the_setting_s_activations():
    """Under a sharded strategy the column adds the per-device static memory (not the unsharded whole) to each
    setting's activations; bytes under 1 KiB print whole, so the known answers are exact."""
    sharding = Sharding("fsdp_ckpt", 4, 4, 4)
    static_memory = StaticMemory(100, 100, 208, "AdamW", sharding, unsharded=1600)  # 408 B per device
    costs = [LayerCost(f"l{i}", "Block", 100, 10, 40, 0, 50, 5) for i in range(4)]
    main = Measurement(8, costs, 100)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None)
    rows = [SettingRow("none", 0, 500, 0), SettingRow("every_layer", 4, 140, 200)]
    report = render(PlanResult("hand-made", built, main, None, "none asked", 0.5, rows, static_memory, None, [8]))
    header = next(line for line in report.splitlines() if line.startswith("| setting |"))
    column = [c.strip() for c in header.strip("|").split("|")].index("static + activations")
    got = {name: row[column] for name, row in settings_table(report).items()}
    assert got == {"none": "908 B", "every_layer": "548 B"}  # 408 + 500, 408 + 140 (unsharded: 2.1 KiB, 1.7 KiB)


MIB = 2**20
#: Four layers of 8 MiB saved un-checkpointed, 1 MiB of inputs (all of it movable): above the offload engine's
#: 1 MiB threshold, so the offloaded bytes are whole.
BIG = [LayerCost(f"l{i}", "Block", 8 * MIB, MIB, 4 * MIB, MIB, 10**9, 10**7) for i in range(4)]
#: Offload free: the plan offloads.
FAST_LINK = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e12, host_bandwidth=math.inf, name="fast link")


def offload_result(offload: object) -> PlanResult:
    """A plan made with ``offload`` for half the peak of :data:`BIG` on :data:`FAST_LINK`, with every setting."""
    main = Measurement(8, BIG, MIB)
    plan = make_plan(BIG, MIB, 0.5, offload=offload, device=FAST_LINK, host_memory=1 << 40)
    rows = setting_rows(main, setting_choices([c.name for c in BIG], plan), offload, kept_ops=plan.kept_ops,
                        device=FAST_LINK, plan_offloaded=plan.offloaded)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, offload, 0.5, None)
    return PlanResult("hand-made", built, main, plan, None, 0.5, rows, static(Sharding()), None, [8], profile=FAST_LINK)


def offload_report(offload: object) -> tuple[CheckpointPlan, str]:
    result = offload_result(offload)
    assert result.plan is not None
    return result.plan, render(result)


def plan_line(report: str) -> str:
    return report.split("## Plan for memory_budget=0.5\n\n", 1)[1].split("\n", 1)[0]


def test_the_plan_line_names_what_is_offloaded_and_the_host_bytes():
    """An offloading plan's line says which layers live in host memory and how many bytes, as format_bytes writes
    them and exactly, before the device figures (which leave those bytes out)."""
    plan, report = offload_report("auto")
    assert plan.offloaded and plan.host_bytes > 0
    line = plan_line(report)
    names = ", ".join(plan.offloaded)
    assert f"{len(plan.offloaded)} offloaded to host memory ({names}): {format_bytes(plan.host_bytes)}" in line
    assert f"({plan.host_bytes:,} B) in host memory, not in the device figures that follow: activations" in line


def test_the_plan_line_says_so_when_offload_was_asked_and_nothing_is_offloaded():
    _, report = offload_report(False)
    assert "offload" not in plan_line(report)
    plan = make_plan(BIG, MIB, 0.5)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, "auto", 0.5, None)
    rows = setting_rows(Measurement(8, BIG, MIB), setting_choices([c.name for c in BIG], plan), "auto")
    report = render(PlanResult("hand-made", built, Measurement(8, BIG, MIB), plan, None, 0.5, rows, static(Sharding())))
    assert ", none offloaded (offload 'auto'): 0 B in host memory:" in plan_line(report)


def test_the_settings_table_gives_host_bytes_in_their_own_column():
    """With offload the Settings table has a host memory column: the plan row's is the plan's host bytes, which
    its activations and peak do not count; the standard settings offload nothing under 'auto'."""
    plan, report = offload_report("auto")
    header = next(line for line in report.splitlines() if line.startswith("| setting |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[-1] == "host memory (B)"
    rows = settings_table(report)
    assert rows["plan"][-1] == f"{plan.host_bytes:,}" and rows["plan"][2] == f"{plan.planned_bytes:,}"
    assert {name: row[-1] for name, row in rows.items() if name != "plan"} == dict.fromkeys(
        ["none", "every_4th", "every_2nd", "every_layer", "selective"], "0")
    assert ("Host memory: what offloaded layers keep in host memory (with offload 'auto' only the plan offloads);"
            " activations, peak and static + activations are device memory and leave it out.") in report
    data = report_data(offload_result("auto"))  # plan.json: the same figures
    assert data["offload"] == "auto"
    assert {s["name"]: s["host_bytes"] for s in data["settings"]} == {name: int(row[-1].replace(",", ""))
                                                                     for name, row in rows.items()}
    # offload=True: every checkpointed layer's inputs go to the host, 1 MiB each
    _, report = offload_report(True)
    assert {name: row[-1] for name, row in settings_table(report).items()}["every_2nd"] == f"{2 * MIB:,}"
    assert "(with offload 'auto'" not in report
    # without offload: no such column
    _, report = offload_report(False)
    assert "host memory" not in report.split("## Settings", 1)[1]
