"""``lightning-ckpt plan``'s report from hand-made figures, with no measured model: its paragraphs and columns."""

from __future__ import annotations

import torch

from lightning_ckpt.commands.plan.measure import Built, Measurement, Sharding, StaticMemory
from lightning_ckpt.commands.plan.predictions import SettingRow
from lightning_ckpt.commands.plan.report import PlanResult, render, sharding_lines
from lightning_ckpt.core.planner import LayerCost


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
