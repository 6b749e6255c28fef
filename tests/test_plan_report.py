"""``lightning-ckpt plan``'s report paragraphs that need no measured model."""

from __future__ import annotations

from lightning_ckpt.commands.plan.measure import Sharding, StaticMemory
from lightning_ckpt.commands.plan.report import sharding_lines


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
