"""What one device holds that checkpointing does not change (commands/plan/static_memory.py), against figures
counted by hand: FSDP2's gathered units, sharded rows, the optimizers' state, the memory there is."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch import nn

from lightning_ckpt.commands.plan import static_memory as sm
from lightning_ckpt.commands.plan.sharding import Sharding

F32 = 4


def linears() -> nn.Sequential:
    """Three Linear blocks of 20, 40 and 18 floats (80, 160, 72 B) in a Sequential, then a LayerNorm of 4 (16 B)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 2)), nn.LayerNorm(2))


def test_fsdp2_gathers_the_roots_and_the_two_largest_blocks_and_holds_the_largest_block_s_gradients():
    # the detected block (Linear): roots 16 B + the two largest blocks 160 + 80; gradients 16 + 160
    assert sm.gathered_bytes(linears()) == (16 + 160 + 80, 16 + 160)
    assert sm.gathered_bytes(linears(), nn.Linear) == (256, 176)
    # the blocks the config names: the LayerNorm alone, the Linears are roots (78 floats)
    assert sm.gathered_bytes(linears(), nn.LayerNorm) == (78 * F32 + 16, 78 * F32 + 16)
    # no block of that class: every parameter is a root
    assert sm.gathered_bytes(linears(), nn.Conv1d) == (82 * F32, 82 * F32)
    # not resharded after forward: every block stays gathered
    assert sm.gathered_bytes(linears(), nn.Linear, reshard_after_forward=False) == (16 + 160 + 80 + 72, 176)


def test_frozen_parameters_are_gathered_but_hold_no_gradient():
    model = linears()
    model[0][1].requires_grad_(False)  # the largest block frozen, as LoRA's base weights are
    assert sm.gathered_bytes(model, nn.Linear) == (256, 16 + 80)
    model[1].requires_grad_(False)
    assert sm.gathered_bytes(model, nn.Linear) == (256, 80)


def test_rows_are_split_over_the_shards_padded_up_and_each_storage_counted_once():
    rows = torch.zeros(10, 4)
    tensors = [None, rows, torch.empty(8, 4, device="meta"), rows[2:], torch.zeros(()), torch.zeros(3, 2)]
    # 10 rows over 4 shards: 3 of 16 B; the view of the same storage, None and the meta tensor not again; a scalar
    # whole (4 B); 3 rows over 4: 1 of 8 B
    total = sm.sharded_bytes(tensors, 4)
    assert total == 3 * 16 + 4 + 8 and type(total) is int
    assert sm.sharded_bytes(tensors, 1) == 160 + 4 + 24


def test_optimizers_are_found_in_whatever_configure_optimizers_returns():
    params = [nn.Parameter(torch.zeros(2))]
    one, two = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.2)
    scheduler = torch.optim.lr_scheduler.StepLR(one, 1)
    assert sm._optimizers(one) == [one]
    assert sm._optimizers({"optimizer": one, "lr_scheduler": scheduler}) == [one]
    assert sm._optimizers(([one, two], [scheduler])) == [one, two]
    assert sm._optimizers([{"optimizer": one}, {"optimizer": two, "lr_scheduler": {"scheduler": scheduler}}]) == [one, two]
    assert sm._optimizers(None) == [] and sm._optimizers("adam") == []


class Momentum(torch.optim.SGD):
    pass


class TwoOptimizers(nn.Module):
    def __init__(self, configured=True):
        super().__init__()
        self.a, self.b, self.configured = nn.Linear(2, 2), nn.Linear(2, 3), configured  # 6 and 9 floats

    def configure_optimizers(self):
        if not self.configured:
            return None
        return ([torch.optim.SGD(self.a.parameters(), lr=0.1, momentum=0.9),
                 Momentum(self.b.parameters(), lr=0.1, momentum=0.9)], [])


def built(module: nn.Module, **given) -> types.SimpleNamespace:
    fields = dict(module=module, sharding=Sharding(), mode=contextlib.nullcontext, layer_cls=None, precision=None,
                  device=torch.device("cpu"))
    return types.SimpleNamespace(**{**fields, **given})


def test_static_memory_counts_the_weights_gradients_and_each_optimizer_s_state_and_names_them():
    static = sm.static_memory(built(TwoOptimizers()))
    # 15 floats of weights and of gradients; one momentum buffer per parameter
    assert (static.weights, static.gradients, static.optimizer_state) == (60, 60, 60)
    assert static.optimizer == "SGD, Momentum" and static.unsharded == 180
    none = sm.static_memory(built(TwoOptimizers(configured=False)))
    assert (none.optimizer, none.optimizer_state) == ("none", 0)


def test_under_cpu_offload_the_shares_go_to_host_memory_and_the_device_holds_the_configured_blocks_gathered():
    model = linears()
    static = sm.StaticMemory(328, 328, 656, "AdamW", Sharding(cpu_offload=True), host_weights=0)
    offloaded = sm._offloaded(static, built(model, layer_cls=nn.LayerNorm), buffers=8)
    # the named block (the LayerNorm, 16 B) and the Linears as roots (312 B) gathered; the shares in host memory
    assert (offloaded.weights, offloaded.gradients, offloaded.optimizer_state) == (8 + 328, 328, 0)
    assert (offloaded.host_weights, offloaded.host_gradients, offloaded.host_optimizer_state) == (320, 328, 656)


def test_this_machine_s_host_memory_is_half_of_what_is_available(monkeypatch):
    monkeypatch.setattr(sm.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=10 << 30))
    assert sm.this_machine_host_memory() == 5 << 30


def test_available_memory_is_the_device_s_free_memory_or_the_host_s_free_pages(monkeypatch):
    monkeypatch.setattr(sm.os, "sysconf", {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}.__getitem__)
    assert sm._available_memory(torch.device("cpu")) == 4_096_000
    asked = []
    monkeypatch.setattr(sm.torch.cuda, "mem_get_info", lambda device: asked.append(device) or (123, 456))
    assert sm._available_memory(torch.device("cuda", 1)) == 123 and asked == [torch.device("cuda", 1)]

    def fails(name):
        raise ValueError(name)

    monkeypatch.setattr(sm.os, "sysconf", fails)
    assert sm._available_memory(torch.device("cpu")) is None


def test_a_model_would_not_fit_when_weights_gradients_and_two_moments_exceed_80_percent_of_what_is_free(monkeypatch):
    model = nn.Linear(2, 2)  # 24 B; with its gradients and two moments 96 B
    asked = []
    for available, too_big in ((120, False), (119, True), (None, False)):
        monkeypatch.setattr(sm, "_available_memory", lambda device, a=available: asked.append(device) or a)
        assert sm.would_not_fit(built(model, device=torch.device("meta"))) is too_big
    assert asked == [torch.device("meta")] * 3
    model.bias.requires_grad_(False)  # 8 B frozen: 24 + 3 x 16
    monkeypatch.setattr(sm, "_available_memory", lambda device: 90)
    assert sm.would_not_fit(built(model)) is False  # 72 <= 72
