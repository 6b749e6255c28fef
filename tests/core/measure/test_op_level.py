"""Op-level recompute: the planner's per-op choices against every save/recompute choice, tried with torch.

The reference is torch's selective checkpointing written by hand here (a policy that keeps the op outputs at
chosen positions), its bytes counted by this file's own saved-tensor hook and policy (not the package's
counter), its recompute as the extra FLOPs of a training step.
"""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, _VersionWrapper, checkpoint, create_selective_checkpoint_contexts

from lightning_ckpt.core.checkpoint.wrapping import remove_checkpointing
from lightning_ckpt.core.measure.op_curve import OpRecord, op_curve, record_ops
from lightning_ckpt.core.measure.profiling import count_cost
from lightning_ckpt.core.plan.planner import (LayerCost, layer_options, make_plan, measure_step, plan_checkpointing,
                                              solve)

from helpers import counted_peak

class Sandwich(nn.Module):
    """Two expensive matmuls around a wide, cheap middle."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc1(x)
        w = torch.tanh(w) * torch.sigmoid(w)
        return x + torch.tanh(self.fc2(w))


class Pointwise(nn.Module):
    """Element-wise only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x) + torch.tanh(x)


class Tower(nn.Module):
    def __init__(self, width: int = 32, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Sandwich(width) if i % 2 == 0 else Pointwise() for i in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


CLASSES = (Sandwich, Pointwise)


class Held:
    """Bytes held for backward, counted here: what autograd saves (a plain saved-tensor hook) and what the
    hand-written policies below keep (they add the outputs they keep), each storage once, parameters excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self.storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    @property
    def bytes(self) -> int:
        return sum(n for ptr, n in self.storages.items() if ptr not in self.params)

    def __enter__(self) -> Held:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.add(tensor)
            return tensor.detach()

        self._hooks = saved_tensors_hooks(pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def keep_positions(keep: set[int], held: list, creates: list | None = None):
    """A hand-written selective-checkpoint ``context_fn``: keep the outputs of the ops at positions ``keep``
    (reported to ``held[0]`` when set); ``creates`` collects the positions whose outputs are new storages."""

    def context_fn():
        position = [0]

        def policy(ctx, op, *args, **kwargs):
            i = position[0]
            position[0] += 1
            outputs = [t for t in tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if creates is not None and any(t.untyped_storage().data_ptr() not in inputs for t in outputs):
                creates.append(i)
            if i in keep:
                if held[0] is not None:
                    for t in outputs:
                        held[0].add(t)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def sac_cache() -> list[torch.Tensor]:
    """Every tensor torch's selective-checkpoint caches hold now (found through the garbage collector)."""
    gc.collect()
    return [o.val for o in gc.get_objects() if isinstance(o, _VersionWrapper) and isinstance(o.val, torch.Tensor)]


def step_cost(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    cost = count_cost(lambda: model(x).backward())
    model.zero_grad(set_to_none=True)
    return cost


def held_bytes(model: nn.Module, x: torch.Tensor, holder: list) -> int:
    with Held(model) as held:
        holder[0] = held
        model(x)
    holder[0] = None
    return held.bytes


@pytest.fixture(scope="module")
def tower() -> dict:
    """Every save/recompute choice of every layer, tried in the model (that layer alone checkpointed by hand)."""
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(4, 16, 32)
    holder: list = [None]
    base_bytes, base_cost = held_bytes(model, x, holder), step_cost(model, x)
    tables = []
    for block in model.blocks:
        plain_forward = block.forward
        with Held(model) as alone:
            plain_forward(torch.randn(4, 16, 32, requires_grad=True))
        creates: list[int] = []
        block.forward = lambda *a, f=plain_forward, c=creates: checkpoint(
            f, *a, use_reentrant=False, context_fn=keep_positions(set(), [None], c))
        model(x)
        table = [(base_bytes, 0)]  # un-checkpointed
        for r in range(len(creates) + 1):
            for keep in itertools.combinations(creates, r):
                block.forward = lambda *a, f=plain_forward, k=set(keep): checkpoint(
                    f, *a, use_reentrant=False, context_fn=keep_positions(k, holder))
                table.append((held_bytes(model, x, holder), step_cost(model, x) - base_cost))
        del block.forward
        tables.append([(held - base_bytes, cost) for held, cost in table])  # bytes relative to no checkpointing
    return {"model": model, "x": x, "base_bytes": base_bytes, "base_cost": base_cost, "tables": tables,
            "holder": holder}


def optimum(tables: list, base_bytes: int, budget_bytes: float, before: list[int]) -> int:
    """Least recompute over one choice per layer (the layers' bytes and FLOPs add up) within the budget: at the end of
    the forward, and in each layer's backward, where ``before[i]`` is what is alive besides the bytes the layers
    before it hold beyond their un-checkpointed ones (the tables' bytes are relative to those)."""
    front = {0: 0}
    for table, alive in zip(tables, before):
        front = {b0: c0 for b0, c0 in front.items() if alive + b0 <= budget_bytes}
        new: dict[int, int] = {}
        for b0, c0 in front.items():
            for b, c in table:
                new[b0 + b] = min(new.get(b0 + b, c0 + c), c0 + c)
        front = new
    return min(c for b, c in front.items() if base_bytes + b <= budget_bytes)


@pytest.mark.parametrize("budget", [0.5, 0.55, 0.6, 0.7])
def test_tower_plan_against_every_choice_tried_with_torch(tower: dict, budget: float) -> None:
    model, x, base_bytes, holder = tower["model"], tower["x"], tower["base_bytes"], tower["holder"]
    # priced by FLOPs (time_layers=False): the plan is checked against the fewest FLOPs that every choice tried reaches
    three = plan_checkpointing(model, lambda: model(x), budget, layer_cls=CLASSES, modes=("full", "selective"),
                               time_layers=False)
    plan = plan_checkpointing(model, lambda: model(x), budget, layer_cls=CLASSES, time_layers=False)
    # Each choice's bytes were tried with torch; what each layer's backward has alive is the planner's measurement
    # (checked against an independent count in test_peak.py), with the head's saved tensors freed by then.
    head = measure_step(model, lambda: model(x), CLASSES).head_bytes
    nones = [c.none_bytes for c in plan.costs]
    before = [plan.outside_bytes - head + sum(nones[:i]) + c.backward_peak for i, c in enumerate(plan.costs)]
    best = optimum(tower["tables"], base_bytes, plan.budget_bytes, before)
    torch.manual_seed(1)
    reference_grads = torch.autograd.grad(model(x), list(model.parameters()))
    plan.apply(model)
    try:
        # the package's policies report what they keep to the package's counters only: count it here by hand
        before = set(map(id, sac_cache()))
        with Held(model) as held:
            loss = model(x)
        for tensor in sac_cache():
            if id(tensor) not in before:
                held.add(tensor)
        measured_cost = step_cost(model, x) - tower["base_cost"]
        grads = torch.autograd.grad(model(x), list(model.parameters()))
        peak = counted_peak(model, lambda: model(x))
    finally:
        remove_checkpointing(model)
    del loss
    assert peak <= plan.budget_bytes * 1.02 and plan.peak_bytes == pytest.approx(peak, rel=0.05)
    assert held.bytes <= plan.budget_bytes
    assert plan.planned_bytes == pytest.approx(held.bytes, rel=0.05)
    assert plan.recompute_flops == pytest.approx(measured_cost, rel=0.01)
    assert measured_cost <= 1.05 * best
    assert measured_cost <= three.recompute_flops
    if budget == 0.55:  # below "selective everywhere": full/selective/none must fully recompute a Sandwich
        assert three.recompute_flops >= 1.5 * measured_cost
        assert plan.layers["blocks.0"] == "ops"
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, reference_grads))


# ------------------------------------------------------------------ what may be kept, and keeping it is correct


class Tricky(nn.Module):
    """In-place ops, dropout and attention (random ops), a view, an op after the last save."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.fc(x).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        h = y.transpose(1, 2).reshape(b, t, c)
        h = torch.relu_(h * 2)  # in place
        h = nn.functional.dropout(h, 0.3, training=self.training)
        return x + self.out(torch.tanh(h))


def test_in_place_and_random_ops_are_grouped() -> None:
    torch.manual_seed(0)
    records = record_ops(Tricky(8), torch.randn(2, 4, 8, requires_grad=True))
    kinds = {}
    for r in records:
        kinds.setdefault(r.op.split(".")[1], set()).add(r.kind)
    assert kinds["relu_"] == {"recompute"} and kinds["mul"] >= {"recompute"}  # relu_ and the tensor it writes
    assert kinds["view"] <= {"recompute", "after"} and kinds["permute"] == {"recompute"}  # views
    random_kinds = {r.kind for r in records if torch.Tag.nondeterministic_seeded in _op(r).tags}
    assert len(random_kinds) == 1  # all together, whatever it is
    assert records[-1].kind == "after"  # the residual add: nothing after it saves for backward


def _op(record: OpRecord):
    namespace, name, overload = record.op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def test_every_curve_point_trains_like_no_checkpointing() -> None:
    """Keeping any allowed set of op outputs (every point of the curve) gives the same loss and gradients."""
    from lightning_ckpt.core.checkpoint.policies import keep_ops_context_fn

    torch.manual_seed(0)
    layer, x = Tricky(8), torch.randn(2, 4, 8, requires_grad=True)
    records = record_ops(layer, x)
    names = [r.op for r in records]
    torch.manual_seed(5)
    ref = layer(x).square().sum()
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()])
    points = op_curve(records)
    assert len(points) >= 3
    for point in points:
        torch.manual_seed(5)
        out = checkpoint(layer, x, use_reentrant=False, context_fn=keep_ops_context_fn(point.keep, names)).square().sum()
        grads = torch.autograd.grad(out, [x, *layer.parameters()])
        assert torch.equal(out, ref)
        assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, ref_grads)), point.keep


def test_a_policy_whose_ops_differ_recomputes_everything() -> None:
    """Recorded names that do not match the forward (another branch taken): nothing kept from there on."""
    from lightning_ckpt.core.checkpoint.policies import keep_ops_context_fn
    from lightning_ckpt.core.measure.profiling import SavedTensorCounter

    torch.manual_seed(0)
    layer, x = Sandwich(8), torch.randn(2, 4, 8, requires_grad=True)
    records = record_ops(layer, x)
    keep = tuple(i for i, r in enumerate(records) if r.kind == "free")
    names = [r.op for r in records]

    def held(names: list[str]) -> int:
        with SavedTensorCounter(exclude=layer.parameters()) as saved:
            checkpoint(layer, x, use_reentrant=False, context_fn=keep_ops_context_fn(keep, names))
        return saved.bytes

    first_free = keep[0]
    wrong = names[:first_free] + ["aten.nothing.default"] + names[first_free + 1:]
    assert held(names) == 32 * 2 * 4 + sum(records[i].bytes for i in keep)  # x, and every kept output
    assert held(wrong) == 32 * 2 * 4  # x only: full checkpointing


# ------------------------------------------------------------------------------- real layers, with dropout


def test_plan_with_op_level_layers_trains_like_no_checkpointing() -> None:
    from lightning_ckpt.core.measure.profiling import SavedTensorCounter
    from lightning_ckpt.demos import Block, BlockStack

    torch.manual_seed(0)
    model = BlockStack(32, 32, [Block(32, 4, dropout=0.1) for _ in range(4)])
    idx = torch.randint(0, 32, (4, 16))
    loss_of = lambda: model(idx).logsumexp(-1).mean()  # noqa: E731
    torch.manual_seed(3)
    ref_loss = loss_of()
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    seen = set()
    for budget in (0.35, 0.45, 0.6):
        plan = plan_checkpointing(model, loss_of, budget, layer_cls=Block, time_layers=False)  # "ops" by FLOPs
        seen |= set(plan.layers.values())
        plan.apply(model)
        try:
            with SavedTensorCounter(exclude=model.parameters()) as saved:
                loss_of()
            torch.manual_seed(3)
            loss = loss_of()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            peak = counted_peak(model, loss_of)
        finally:
            remove_checkpointing(model)
        assert saved.bytes <= plan.budget_bytes and peak <= plan.budget_bytes * 1.02
        assert plan.planned_bytes == pytest.approx(saved.bytes, rel=0.05)
        assert torch.equal(loss, ref_loss)
        assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads))
    assert "ops" in seen


def test_selective_bytes_from_the_records_match_a_selective_run() -> None:
    from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
    from lightning_ckpt.core.measure.profiling import SavedTensorCounter
    from lightning_ckpt.core.plan.planner import measure_layer_costs, predict
    from lightning_ckpt.demos import BlockStack, heterogeneous_blocks

    torch.manual_seed(0)
    model = BlockStack(32, 32, heterogeneous_blocks(32, 6))
    idx = torch.randint(0, 32, (4, 16))
    classes = tuple({type(b) for b in model.blocks})
    costs, outside = measure_layer_costs(model, lambda: model(idx).sum(), classes)
    apply_checkpointing(model, layer_cls=classes, mode="selective")
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(idx).sum()
    remove_checkpointing(model)
    assert predict(costs, outside, dict.fromkeys([c.name for c in costs], "selective"))[0] == saved.bytes


# ----------------------------------------------------------------------------------------------- solver


def random_layer(rng: random.Random, name: str, items: int) -> LayerCost:
    ops = tuple(OpRecord("aten.mul.Tensor", rng.randint(1, 400), rng.randint(1, 1000), 0) for _ in range(items))
    full_bytes = rng.randint(10, 100)
    full_flops = sum(r.flops for r in ops) + rng.randint(0, 500)
    none = full_bytes + rng.randint(100, sum(r.bytes for r in ops) + 200)
    return LayerCost(name, "Block", none_bytes=none, full_bytes=full_bytes, selective_bytes=none, offloadable_bytes=0,
                     full_flops=full_flops, selective_flops=0, ops=ops)


@pytest.mark.parametrize("seed", range(4))
def test_solver_matches_every_combination_of_kept_ops(seed: int) -> None:
    rng = random.Random(seed)
    costs = [random_layer(rng, f"l{i}", 6) for i in range(3)]
    baseline = sum(c.none_bytes for c in costs)
    per_layer = []
    for c in costs:  # none, or checkpointed keeping any subset of its ops
        subsets = [(c.none_bytes, 0)]
        for r in range(7):
            for keep in itertools.combinations(range(6), r):
                subsets.append((c.device_bytes("ops", keep=keep), c.flops("ops", keep)))
        per_layer.append(subsets)
    for fraction in (0.3, 0.5, 0.8):
        need = baseline - int(fraction * baseline)
        best = min(sum(f for _, f in combo) for combo in itertools.product(*per_layer)
                   if baseline - sum(b for b, _ in combo) >= need)
        chosen = solve([layer_options(c, ("full", "ops")) for c in costs], need)
        assert baseline - sum(o.device_bytes for o in chosen) >= need
        assert sum(o.flops for o in chosen) <= best * 1.001


def test_solver_500_layers_with_curves_is_deterministic() -> None:
    rng = random.Random(0)
    costs = [random_layer(rng, f"l{i}", 20) for i in range(500)]
    plans = [make_plan(costs, outside_bytes=10_000, memory_budget=0.3) for _ in range(2)]
    assert plans[0].layers == plans[1].layers and plans[0].kept_ops == plans[1].kept_ops
    assert plans[0].planned_bytes <= plans[0].budget_bytes
    three = make_plan(costs, outside_bytes=10_000, memory_budget=0.3, modes=("full",))
    assert plans[0].recompute_flops < three.recompute_flops


def test_a_forward_longer_than_its_records_recomputes_the_extra_ops() -> None:
    """Recorded names that stop early (the forward runs more ops): the ops past the end are recomputed, even at
    positions the choice keeps, and nothing raises."""
    from lightning_ckpt.core.checkpoint.policies import keep_ops_context_fn
    from lightning_ckpt.core.measure.profiling import SavedTensorCounter

    torch.manual_seed(0)
    layer, x = Sandwich(8), torch.randn(2, 4, 8, requires_grad=True)
    records = record_ops(layer, x)
    names = [r.op for r in records]
    # view, t, addmm (1 KiB, 4096 FLOPs), view, tanh (1 KiB, 256), sigmoid, mul, view, t, addmm, view, tanh, add
    assert [names[i] for i in (2, 4, 9)] == ["aten.addmm.default", "aten.tanh.default", "aten.addmm.default"]
    keep = (2, 4, 5, 6, 9, 11)  # every op that may be kept
    assert {i for i, r in enumerate(records) if r.kind == "free"} == set(keep)
    short = names[:5]  # up to the first tanh: keeps only positions 2 and 4

    def run() -> torch.Tensor:
        return checkpoint(layer, x, use_reentrant=False, context_fn=keep_ops_context_fn(keep, short))

    with SavedTensorCounter(exclude=layer.parameters()) as saved:
        run()
    assert saved.bytes == 256 + 1024 + 1024  # x, the first addmm, the first tanh
    def cost(forward) -> int:  # of a training step, from no gradients (accumulating into them is counted)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return count_cost(lambda: forward().sum().backward())

    recompute = cost(run) - cost(lambda: layer(x))
    full = sum(r.flops for r in records if r.kind != "after")
    assert full == 9024
    assert recompute == full - 4096 - 256  # everything but the two kept ops


def test_random_ops_are_kept_all_together_or_not_at_all() -> None:
    """Two random ops (dropout's in-place ``bernoulli_``): never offered one by one, whatever their bytes."""
    records = (
        OpRecord("aten.addmm.default", 100, 50, 0),
        OpRecord("aten.bernoulli_.float", 10, 30, 0, "random"),  # cheap to keep, worth keeping alone
        OpRecord("aten.bernoulli_.float", 1000, 1, 0, "random"),  # dear to keep, worth little
        OpRecord("aten.mul.Tensor", 0, 7, 0, "recompute"),
        OpRecord("aten.add.Tensor", 40, 5, 0, "after"),
    )
    points = op_curve(records)
    assert [(p.keep, p.bytes, p.flops) for p in points] == [
        ((), 0, 88), ((0,), 100, 38), ((0, 1, 2), 1110, 7)]  # the pair alone (1010 B, saves 31) is dominated
    assert all((1 in p.keep) == (2 in p.keep) for p in points)


def test_torch_asks_a_selective_checkpoint_policy_in_the_forward_only() -> None:
    """What keep_ops_context_fn's one position counter relies on: the policy is asked once per op in the forward,
    with ``is_recompute=False`` and the op's output, and never during the recompute (which replays the cache by
    order). A torch that asks during the recompute again would shift the counter: this test would say so."""
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append((ctx.is_recompute, str(op), ctx.op_output is not None))
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    mlp = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(2, 8, requires_grad=True)
    y = checkpoint(mlp, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))
    forward = list(calls)
    y.sum().backward()
    assert [op.split(".")[1] for _, op, _ in forward] == ["t", "addmm", "tanh", "t", "addmm"]
    assert all(not recompute and has_output for recompute, _, has_output in forward)
    assert calls == forward  # the recompute asked nothing


def test_a_curve_leaves_out_a_choice_that_saves_no_more_for_more_bytes() -> None:
    records = (
        OpRecord("aten.tanh.default", 100, 50, 0),
        OpRecord("aten.sigmoid.default", 200, 50, 0),  # saves as much as the tanh, for twice the bytes
        OpRecord("aten.mul.Tensor", 0, 9, 0, "recompute"),
    )
    assert [(p.keep, p.bytes, p.flops) for p in op_curve(records)] == [
        ((), 0, 109), ((0,), 100, 59), ((0, 1), 300, 9)]


def test_a_long_curve_is_thinned_to_the_most_saving_point_of_each_slice() -> None:
    """Ten ops of 1, 2, 4, ... 512 bytes, each saving as many FLOPs: every byte count 0..1023 is on the exact
    front (1024 points); thinned to 512, the 510 slices between the ends are about 2 bytes wide."""
    records = tuple(OpRecord("aten.mul.Tensor", 2**i, 2**i, 0) for i in range(10))
    points = op_curve(records)
    assert len(points) == 512
    assert (points[0].bytes, points[-1].bytes) == (0, 1023)
    assert all(p.flops == 1023 - p.bytes for p in points)  # each point reachable as it stands
    # slice 0 holds 1 and 2 bytes, slice 1 holds 3 and 4: the most saving of each
    assert [p.bytes for p in points[1:3]] == [2, 4]


class TwoDropouts(nn.Module):
    """``native_dropout`` (a random op that creates its output) and dropout's in-place ``bernoulli_`` (which must
    be recomputed): they replay one RNG stream, so the first must be recomputed too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.native_dropout(self.fc(x), 0.3, True)[0]
        b = nn.functional.dropout(a * 2, 0.3)
        return x + self.out(torch.tanh(b))


def test_a_random_op_is_recomputed_when_another_must_be() -> None:
    from lightning_ckpt.core.checkpoint.policies import keep_ops_context_fn

    torch.manual_seed(0)
    layer, x = TwoDropouts(8), torch.randn(2, 4, 8, requires_grad=True)
    records = record_ops(layer, x)
    kinds = {r.op: r.kind for r in records if r.op.split(".")[1] in ("native_dropout", "bernoulli_")}
    assert kinds == {"aten.native_dropout.default": "recompute", "aten.bernoulli_.float": "recompute"}
    torch.manual_seed(5)
    ref_grads = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])
    for point in op_curve(records):
        torch.manual_seed(5)
        out = checkpoint(layer, x, use_reentrant=False,
                         context_fn=keep_ops_context_fn(point.keep, [r.op for r in records]))
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, ref_grads)), point.keep
