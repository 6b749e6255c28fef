"""plan_checkpointing: measured against brute force, memory-safe while measuring, and an exact solver."""

from __future__ import annotations

import copy
import itertools
import random
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt.core.plan.planner import (
    CheckpointPlan,
    LayerCost,
    cheapest_choices,
    count_cost,
    held_peak,
    make_plan,
    plan_checkpointing,
    predict,
)
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing, checkpointed_names, remove_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import Block, BlockStack, MatmulHeavy, WideElementwise, heterogeneous_blocks
from helpers import counted_peak, least_reachable_bytes

VOCAB, SEQ, BATCH, WIDTH = 32, 16, 4, 32


def uniform_model() -> tuple[BlockStack, tuple[type, ...]]:
    torch.manual_seed(0)
    return BlockStack(VOCAB, WIDTH, [Block(WIDTH, 4, dropout=0.1) for _ in range(6)]), (Block,)


def heterogeneous_model() -> tuple[BlockStack, tuple[type, ...]]:
    torch.manual_seed(0)
    return BlockStack(VOCAB, WIDTH, heterogeneous_blocks(WIDTH, 8, dropout=0.1)), (WideElementwise, MatmulHeavy, Block)


MODELS = {"uniform": uniform_model, "heterogeneous": heterogeneous_model}
IDX = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def loss_of(model: nn.Module) -> torch.Tensor:
    return model(IDX).logsumexp(-1).mean()


def held_bytes(model: nn.Module) -> int:
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        loss_of(model)
    return saved.bytes


def step_cost(model: nn.Module) -> int:
    """FLOPs of forward and backward (gradients start from None every time, so no accumulation is counted)."""
    model.zero_grad(set_to_none=True)
    cost = count_cost(lambda: loss_of(model).backward())
    model.zero_grad(set_to_none=True)
    return cost


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = loss_of(model)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture(scope="module", params=sorted(MODELS))
def brute_force(request: pytest.FixtureRequest) -> dict:
    """Every subset of full checkpointing, measured: the step's activation peak (counted by ``benchmarks/_peak.py``
    over a forward and backward) and extra FLOPs; the held bytes only without checkpointing (the tests compare
    each subset's peak, never its held bytes).

    Recomputation of one layer does not depend on the others, so a subset's extra FLOPs are the sum of
    its layers' extra FLOPs, each measured with only that layer checkpointed.
    """
    model, classes = MODELS[request.param]()
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    base_bytes, base_cost = held_bytes(model), step_cost(model)
    extra = {}
    for name in names:
        apply_checkpointing(model.get_submodule(name), layer_cls=type(model.get_submodule(name)))
        extra[name] = step_cost(model) - base_cost
        remove_checkpointing(model)
    subsets = []
    for mask in itertools.product((False, True), repeat=len(names)):
        chosen = [name for name, on in zip(names, mask) if on]
        for name in chosen:
            apply_checkpointing(model.get_submodule(name), layer_cls=type(model.get_submodule(name)))
        subsets.append((counted_peak(model, lambda: loss_of(model)), sum(extra[name] for name in chosen)))
        remove_checkpointing(model)
    return {"name": request.param, "model": model, "classes": classes, "base_bytes": base_bytes,
            "base_peak": subsets[0][0], "base_cost": base_cost, "subsets": subsets, "reference": loss_and_grads(model)}


@pytest.mark.parametrize("budget", [0.35, 0.5, 0.7])
def test_plan_against_brute_force(brute_force: dict, budget: float) -> None:
    model, base_bytes = brute_force["model"], brute_force["base_bytes"]
    plan = plan_checkpointing(model, lambda: loss_of(model), budget, layer_cls=brute_force["classes"], modes=("full",),
                              time_layers=False)  # FLOPs: checked against brute force
    assert plan.baseline_bytes == pytest.approx(base_bytes, rel=0.05)
    assert checkpointed_names(model) == []  # planning applies nothing

    applied = plan.apply(model)
    try:
        measured, extra = held_bytes(model), step_cost(model) - brute_force["base_cost"]
        peak = counted_peak(model, lambda: loss_of(model))
        loss, grads = loss_and_grads(model)
    finally:
        remove_checkpointing(model)
    assert applied == [name for name, mode in plan.layers.items() if mode == "full"]
    # The budget is a fraction of the step's activation peak without checkpointing, and bounds the plan's peak.
    assert plan.baseline_peak_bytes == pytest.approx(brute_force["base_peak"], rel=0.02)
    assert peak <= budget * brute_force["base_peak"] * 1.02
    assert plan.peak_bytes == pytest.approx(peak, rel=0.05)
    assert plan.planned_bytes == pytest.approx(measured, rel=0.05)
    assert plan.recompute_flops == pytest.approx(extra, rel=0.01)
    optimum = min(cost for step_peak, cost in brute_force["subsets"] if step_peak <= budget * brute_force["base_peak"])
    assert extra <= 1.05 * optimum
    ref_loss, ref_grads = brute_force["reference"]
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads))


def test_heterogeneous_plan_is_not_the_first_k_layers(brute_force: dict) -> None:
    """Bytes per recomputed FLOP decide, not the first k layers: the early element-wise blocks go first."""
    if brute_force["name"] != "heterogeneous":
        pytest.skip("only the heterogeneous model has layers that differ")
    model = brute_force["model"]
    plan = plan_checkpointing(model, lambda: loss_of(model), 0.6, layer_cls=brute_force["classes"], modes=("full",),
                              time_layers=False)  # FLOPs: checked against brute force
    chosen = [name for name, mode in plan.layers.items() if mode == "full"]
    # Position counts as well: the last layers' backward comes first, while all others still hold their choice, so
    # what the first layers free lowers the peak most. The wide blocks among them go first.
    assert {"blocks.0", "blocks.3"} <= set(chosen)
    assert chosen != [f"blocks.{i}" for i in range(len(chosen))]


@pytest.mark.parametrize("budget", [0.35, 0.5, 0.7])
def test_selective_never_costs_more_than_full_only(brute_force: dict, budget: float) -> None:
    model, classes = brute_force["model"], brute_force["classes"]
    full_only = plan_checkpointing(model, lambda: loss_of(model), budget, layer_cls=classes, modes=("full",),
                                   time_layers=False)  # FLOPs: checked against brute force
    both = plan_checkpointing(model, lambda: loss_of(model), budget, layer_cls=classes,
                              time_layers=False)  # FLOPs: checked against brute force
    assert both.recompute_flops <= full_only.recompute_flops
    both.apply(model)
    try:
        measured, extra = held_bytes(model), step_cost(model) - brute_force["base_cost"]
    finally:
        remove_checkpointing(model)
    assert measured <= budget * brute_force["base_bytes"] * 1.02
    assert both.planned_bytes == pytest.approx(measured, rel=0.05)
    assert extra <= full_only.recompute_flops * 1.01


class AliveBytes(SavedTensorCounter):
    """Bytes saved for backward that are alive at once (each storage once), and the peak of that.

    Sees what inner saved-tensor hooks hide through their reports (``report_held``); a saved tensor stops
    counting when its last Python reference (the autograd graph's) goes.
    """

    def __init__(self, exclude) -> None:
        super().__init__(exclude=exclude)
        self.refs: dict[tuple, int] = {}
        self.alive = self.peak = 0

    def _track(self, tensor: torch.Tensor) -> None:
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if key in self._excluded:
            return
        if self.refs.get(key, 0) == 0:
            self.alive += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.alive)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(tensor, self._release, key, tensor.untyped_storage().nbytes())

    def _release(self, key: tuple, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.alive -= nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        held = tensor.detach()  # returning a saved output itself would make a cycle with its grad_fn
        self._track(held)
        return held

    def _held(self, tensor: torch.Tensor, kind) -> None:
        self._track(tensor)


def largest_layer_bytes(model: BlockStack) -> int:
    """Bytes one block holds un-checkpointed, the largest over blocks, each run alone on its real input."""
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in model.blocks]
    with torch.no_grad():
        loss_of(model)
    for hook in hooks:
        hook.remove()
    largest = 0
    for block, x in zip(model.blocks, inputs):
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            block(x.requires_grad_())
        largest = max(largest, saved.bytes)
    return largest


def test_planning_holds_at_most_full_checkpointing_plus_one_layer(brute_force: dict) -> None:
    model, classes = brute_force["model"], brute_force["classes"]
    apply_checkpointing(model, layer_cls=classes)
    full = held_bytes(model)
    remove_checkpointing(model)
    largest = largest_layer_bytes(model)

    with AliveBytes(exclude=model.parameters()) as tracker:
        plan = plan_checkpointing(model, lambda: loss_of(model), 0.5, layer_cls=classes)
    assert tracker.alive == 0  # everything measured was released
    assert tracker.peak >= full  # the tracker saw the step
    assert tracker.peak <= (full + largest) * 1.05
    assert tracker.peak < 0.6 * brute_force["base_bytes"]  # never an un-checkpointed forward of the whole model
    assert plan.baseline_bytes == pytest.approx(brute_force["base_bytes"], rel=0.05)


def test_impossible_budget_says_what_would_help_and_changes_nothing() -> None:
    model, classes = uniform_model()
    apply_checkpointing(model, layer_cls=Block, every_n_layers=3)
    forwards = [b.__dict__.get("forward") for b in model.blocks]
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    with pytest.raises(ValueError) as err:
        plan_checkpointing(model, lambda: loss_of(model), 0.05, layer_cls=classes)
    text = str(err.value)
    assert "memory_budget=0.05" in text and "least reachable" in text
    assert "offload=True" in text and "smaller batch" in text and "Nothing was applied" in text
    minimum = float(text.split("pass a budget of at least ")[1].split(" ")[0])
    assert 0.05 < minimum < 0.5
    with pytest.raises(ValueError, match="least reachable"):
        plan_checkpointing(model, lambda: loss_of(model), "1KiB", layer_cls=classes)
    assert [b.__dict__.get("forward") for b in model.blocks] == forwards
    assert checkpointed_names(model) == ["blocks.0", "blocks.3"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_the_minimum_reachable_is_reachable() -> None:
    model, classes = uniform_model()
    with pytest.raises(ValueError) as err:
        plan_checkpointing(model, lambda: loss_of(model), 0.05, layer_cls=classes)
    minimum = least_reachable_bytes(str(err.value))
    plan = plan_checkpointing(model, lambda: loss_of(model), minimum, layer_cls=classes)
    plan.apply(model)
    assert counted_peak(model, lambda: loss_of(model)) == pytest.approx(minimum, rel=0.02)
    assert plan.peak_bytes <= minimum


def test_budget_already_met_checkpoints_nothing() -> None:
    model, classes = uniform_model()
    plan = plan_checkpointing(model, lambda: loss_of(model), 1.0, layer_cls=classes)
    assert set(plan.layers.values()) == {"none"} and plan.recompute_flops == 0
    assert plan.planned_bytes == plan.baseline_bytes
    assert plan.apply(model) == [] and checkpointed_names(model) == []


def test_a_chunked_plan_s_baseline_is_the_step_without_checkpointing_and_without_chunks() -> None:
    from lightning_ckpt.core.plan.planner import ChunkedHead

    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                       full_flops=50, selective_flops=5) for i in range(4)]
    # unchunked, the logits hold 1,000 B outside the layers: a 700 B budget only the chunked head (300 B) reaches
    chunked = ChunkedHead(chunk_tokens=256, outside_bytes=300, head_bytes=100, head_peak_bytes=50, flops=20)
    plan = make_plan(costs, outside_bytes=1000, memory_budget=700, head_bytes=600, head_peak_bytes=800,
                     chunked=chunked, chunk_loss=None)
    assert plan.chunk_tokens == 256
    # by hand: 1,000 B outside + 4 x 100 B in the layers, as the run holds without the package; not 300 + 400
    assert plan.baseline_bytes == 1400
    assert plan.outside_bytes == 300 and plan.planned_bytes < 700 < plan.baseline_bytes


class BNBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


def test_planning_leaves_batchnorm_buffers_and_rng_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[BNBlock(8) for _ in range(4)], nn.Dropout(0.2))
    x = torch.randn(4, 3, 8, 8)
    model(x)  # buffers away from their initial values
    before = copy.deepcopy(dict(model.named_buffers()))
    rng = torch.get_rng_state()
    plan = plan_checkpointing(model, lambda: model(x).square().mean(), 0.7, layer_cls=BNBlock)
    after = dict(model.named_buffers())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert int(after["1.bn.num_batches_tracked"]) == 1
    assert torch.equal(torch.get_rng_state(), rng)
    assert sum(mode != "none" for mode in plan.layers.values()) >= 1


def test_planning_restores_existing_checkpointing() -> None:
    model, classes = uniform_model()
    apply_checkpointing(model, layer_cls=Block, every_n_layers=2, mode="selective")
    forwards = [b.__dict__.get("forward") for b in model.blocks]
    plan = plan_checkpointing(model, lambda: loss_of(model), 0.5, layer_cls=classes)
    assert [b.__dict__.get("forward") for b in model.blocks] == forwards
    assert all(f.options.mode == "selective" for f in forwards if f is not None)
    plan.apply(model)
    assert checkpointed_names(model) == [n for n, mode in plan.layers.items() if mode != "none"]
    options = [model.get_submodule(n).forward.options for n in checkpointed_names(model)]
    # an op-level layer is checkpointed in full with a policy (context_fn) that keeps its planned ops
    assert [o.mode if "context_fn" not in o.checkpoint_kwargs else "ops" for o in options] == [
        mode for mode in plan.layers.values() if mode != "none"]
    assert all(o.mode == "full" for o, mode in zip(options, plan.layers.values()) if mode == "ops")


def test_bad_input_is_refused_before_anything_runs() -> None:
    model, classes = uniform_model()
    calls = []

    def step():
        calls.append(1)
        return loss_of(model)

    with pytest.raises(ValueError, match="fraction must be in"):
        plan_checkpointing(model, step, 1.5, layer_cls=classes)
    with pytest.raises(ValueError, match="modes="):
        plan_checkpointing(model, step, 0.5, layer_cls=classes, modes=("fast",))
    with pytest.raises(ValueError, match="module.train()"):
        plan_checkpointing(model.eval(), step, 0.5, layer_cls=classes)
    assert calls == []


# ---------------------------------------------------------------------------------------------- solver


def random_costs(n: int, seed: int) -> list[LayerCost]:
    rng = random.Random(seed)
    costs = []
    for i in range(n):
        none = rng.randint(1_000, 100_000)
        full = rng.randint(10, none // 10)
        selective = rng.randint(full, none)
        flops = rng.randint(1_000, 1_000_000)
        costs.append(LayerCost(f"l{i}", "Block", none_bytes=none, full_bytes=full, selective_bytes=selective,
                               offloadable_bytes=0, full_flops=flops, selective_flops=rng.randint(0, flops)))
    return costs


@pytest.mark.parametrize("seed", range(5))
def test_solver_finds_the_exhaustive_optimum(seed: int) -> None:
    costs = random_costs(7, seed)
    baseline = sum(c.none_bytes for c in costs)
    need = baseline // 2
    chosen = cheapest_choices(costs, need)
    freed = lambda ch: sum(c.none_bytes - c.device_bytes(m) for c, m in zip(costs, ch))  # noqa: E731
    flops = lambda ch: sum(c.flops(m) for c, m in zip(costs, ch))  # noqa: E731
    optimum = min(flops(ch) for ch in itertools.product(("none", "full", "selective"), repeat=7) if freed(ch) >= need)
    assert freed(chosen) >= need
    assert flops(chosen) <= optimum * 1.001


def test_solver_500_layers_is_deterministic_and_near_optimal() -> None:
    costs = random_costs(500, 0)
    plans = [make_plan(costs, outside_bytes=1_000_000, memory_budget=0.3, modes=("full",)) for _ in range(2)]
    assert plans[0].layers == plans[1].layers
    assert plans[0].planned_bytes <= plans[0].peak_bytes <= plans[0].budget_bytes
    # The last layer's backward comes first, while every other layer still holds its choice, so it can stay plain.
    assert plans[0].layers[costs[-1].name] == "none"
    # Layer i's backward has all it saves alive (these costs record no backward: their un-checkpointed bytes) while
    # the layers before it hold theirs, so those must free `need_i`. For each i, the fractional (LP) optimum over
    # the layers before it, greedy by freed bytes per FLOP, is a lower bound on the optimum; here one such bound
    # binds and the whole-layer solution is at most one layer's FLOPs above it. The solver rounds freed bytes down
    # to quanta of 1/128000 of the shortfall here, so it may pay a little more than that (0.2%).
    allowed = plans[0].budget_bytes - 1_000_000

    def fractional_optimum(layers: list[LayerCost], need: int) -> float:
        items = sorted((c.full_flops / (c.none_bytes - c.full_bytes), c.none_bytes - c.full_bytes) for c in layers)
        bound, left = 0.0, need
        for ratio, freed in items:
            take = min(freed, left)
            bound, left = bound + ratio * take, left - take
        return bound

    bound = max(fractional_optimum(costs[:i], sum(c.none_bytes for c in costs[:i + 1]) - allowed)
                for i in range(len(costs)))
    assert bound <= plans[0].recompute_flops <= 1.002 * (bound + max(c.full_flops for c in costs))
    with_selective = make_plan(costs, outside_bytes=1_000_000, memory_budget=0.3)
    assert with_selective.recompute_flops <= plans[0].recompute_flops


def test_offload_counts_checkpointed_inputs_as_host_bytes() -> None:
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=20, selective_bytes=50, offloadable_bytes=20,
                       full_flops=10, selective_flops=2)
             for i in range(4)]
    # Without offload the least peak is l3's backward: 100 B outside, 3 x 20 B of inputs, l3's own 100 B; with it,
    # the inputs are in host memory but the newest offloaded one before l3 comes back for its backward: 20 B.
    with pytest.raises(ValueError, match=r"(?s)least reachable is 260 B .*\n  - or offload=True, which reaches 220 B"):
        make_plan(costs, outside_bytes=100, memory_budget=250)
    plan = make_plan(costs, outside_bytes=100, memory_budget=250, offload=True)
    # device bytes: full 0, selective 30 (its kept outputs). l3's backward has 100 + 100 + 20 B alive besides what
    # l0-l2 keep on the device, so they may keep 30 B: two full and one selective; l3 itself can stay plain.
    assert plan.layers["l3"] == "none"
    assert sorted(mode for name, mode in plan.layers.items() if name != "l3") == ["full", "full", "selective"]
    assert plan.peak_bytes == 100 + 30 + 100 + 20 and plan.planned_host_bytes == 60 and plan.recompute_flops == 22
    # The engine keeps the newest offloaded layer's inputs (l2's 20 B) on the device at the end of forward too.
    assert plan.planned_bytes == 100 + 30 + 100 + 20
    assert plan.offloaded == ["l0", "l1", "l2"] and plan.host_bytes == 60


def test_the_newest_offloaded_layers_inputs_are_what_stays_on_the_device() -> None:
    """Both layers checkpointed and offloaded: the engine keeps the newest (last) one's inputs, 300 B, on the device
    for backward, not the oldest one's 100 B."""
    costs = [LayerCost("l0", "Block", none_bytes=1000, full_bytes=100, selective_bytes=1000, offloadable_bytes=100,
                       full_flops=10, selective_flops=0),
             LayerCost("l1", "Block", none_bytes=1000, full_bytes=300, selective_bytes=1000, offloadable_bytes=300,
                       full_flops=10, selective_flops=0)]
    assert predict(costs, 0, {"l0": "full", "l1": "full"}, offload=True, min_bytes=0) == (300, 20)
    # In the peak: the end of the forward holds l1's 300 B; l1's backward brings l0's 100 B back.
    assert held_peak([0, 0], [0, 0], host=[100, 300]) == 300
    assert held_peak([0, 0], [250, 250], host=[100, 300]) == 350


def test_plan_round_trips_and_prints_its_table() -> None:
    model, classes = uniform_model()
    plan = plan_checkpointing(model, lambda: loss_of(model), 0.5, layer_cls=classes)
    again = CheckpointPlan.from_state_dict(copy.deepcopy(plan.state_dict()))
    assert again == plan
    text = str(plan)
    rows = [line for line in text.splitlines() if line.startswith("blocks.")]
    assert len(rows) == 6 and all(" Block " in row for row in rows)
    assert [row.split()[-1] for row in rows] == list(plan.layers.values())
    ops_lines = [line for line in text.splitlines() if " (ops): " in line]
    assert [line.split()[0] for line in ops_lines] == [n for n, mode in plan.layers.items() if mode == "ops"]
    assert all("keeps " in line and "; recomputes " in line for line in ops_lines)
    assert f"{sum(m != 'none' for m in plan.layers.values())} of 6 layers checkpointed" in text


@pytest.mark.parametrize("outer_first", [True, False], ids=["outer-entered-first", "outer-entered-last"])
def test_measuring_reruns_are_hidden_from_an_outer_counter(outer_first: bool) -> None:
    """A MemoryMonitor-style counter around the measured step counts what the step holds, not the re-runs."""
    from lightning_ckpt.core.plan.planner import LayerCostRecorder

    model, classes = heterogeneous_model()
    layers = [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
    for _, block in layers:
        apply_checkpointing(block, layer_cls=type(block))
    with SavedTensorCounter(exclude=model.parameters()) as alone:
        loss_of(model)
    recorder = LayerCostRecorder(model, layers, selective=True)
    outer = SavedTensorCounter(exclude=model.parameters())
    first, second = (outer, recorder) if outer_first else (recorder, outer)
    with first, second:
        loss_of(model)
    costs = recorder.costs()
    # The re-runs did run and saw far more than the step holds: each layer un-checkpointed, and selectively.
    assert sum(c.none_bytes for c in costs) + sum(c.selective_bytes for c in costs) > 2 * alone.bytes
    assert outer.bytes == alone.bytes == recorder.held_bytes


def test_among_equally_cheap_plans_the_earliest_layers_are_checkpointed():
    """Four identical layers, room for two un-checkpointed: every choice of two costs the same, and the plan takes
    layers 0 and 1, as ``every_n_layers`` starts from the first (a stable choice from run to run)."""
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=100, offloadable_bytes=0,
                       full_flops=50, selective_flops=0) for i in range(4)]
    plan = make_plan(costs, outside_bytes=0, memory_budget=220, modes=("full",))
    assert plan.layers == {"l0": "full", "l1": "full", "l2": "none", "l3": "none"}
    assert plan.planned_bytes == 10 + 10 + 100 + 100 and plan.recompute_flops == 2 * 50
