"""apply_checkpointing / remove_checkpointing on plain PyTorch modules: exactness, memory, FLOPs, identity."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from helpers import BATCH, SEQ, WIDTH, loss_and_grads, saved_bytes, tiny_transformer, tokens
from lightning_ckpt import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names, is_checkpointed
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, count_flops
from lightning_ckpt.demos import Block


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("every_n", [1, 2, 3])
def test_loss_and_grads_equal_with_dropout(every_n, use_reentrant):
    idx = tokens()
    ref_loss, ref_grads = loss_and_grads(tiny_transformer(), idx)
    model = tiny_transformer()
    names = apply_checkpointing(model, layer_cls=Block, every_n_layers=every_n, use_reentrant=use_reentrant)
    assert names == [f"blocks.{i}" for i in range(0, 6, every_n)]
    loss, grads = loss_and_grads(model, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)


def test_dropout_actually_random_so_the_equality_test_means_something():
    idx = tokens()
    a, _ = loss_and_grads(tiny_transformer(), idx, rng_seed=1)
    b, _ = loss_and_grads(tiny_transformer(), idx, rng_seed=2)
    assert a != b


def _bytes_inside_blocks(model) -> list[int]:
    """Per block: bytes that the block saves for backward when it is not checkpointed."""
    counter = SavedTensorCounter(exclude=model.parameters())
    marks: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda *_: marks.append(counter.bytes)) for b in model.blocks]
    hooks += [b.register_forward_hook(lambda *_: marks.append(counter.bytes)) for b in model.blocks]
    with counter:
        model(tokens())
    for h in hooks:
        h.remove()
    return [end - start for start, end in zip(marks[::2], marks[1::2])]


def test_saved_bytes_full_is_inputs_plus_outside_and_every_2nd_is_halfway():
    none = saved_bytes(tiny_transformer(), tokens())
    inside = _bytes_inside_blocks(tiny_transformer())
    input_bytes = BATCH * SEQ * WIDTH * 4  # each block's input, float32
    full_model = tiny_transformer()
    apply_checkpointing(full_model, layer_cls=Block)
    full = saved_bytes(full_model, tokens())
    expected_full = none - sum(inside) + len(inside) * input_bytes
    assert full == pytest.approx(expected_full, rel=0.02)
    assert full < none / 3
    half_model = tiny_transformer()
    apply_checkpointing(half_model, layer_cls=Block, every_n_layers=2)
    assert saved_bytes(half_model, tokens()) == pytest.approx((none + full) / 2, rel=0.02)


def test_eval_and_no_grad_skip_checkpointing(monkeypatch):
    import lightning_ckpt.core.checkpoint.wrapping as wrapping

    calls = []
    checkpoint = wrapping.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(wrapping, "checkpoint", counting_checkpoint)
    ref, model = tiny_transformer(), tiny_transformer()
    apply_checkpointing(model, layer_cls=Block)
    ref.eval(), model.eval()
    assert saved_bytes(model, tokens()) == saved_bytes(ref, tokens())
    assert len(calls) == 0
    model.train()
    with torch.no_grad():
        model(tokens())
    assert len(calls) == 0
    model(tokens())  # and the counter sees checkpoint when it runs: once per block
    assert len(calls) == len(model.blocks) == 6


def _train_flops(model) -> int:
    return count_flops(lambda: model(tokens()).sum().backward())


@pytest.mark.parametrize("every_n", [1, 2])
@pytest.mark.parametrize("variant", ["reentrant", "non_reentrant_no_early_stop", "non_reentrant"])
def test_recompute_is_one_extra_forward_of_checkpointed_layers(every_n, variant):
    ref = tiny_transformer(dropout=0.0)
    x = torch.randn(BATCH, SEQ, WIDTH)
    block_forward = count_flops(lambda: ref.blocks[0](x))
    model = tiny_transformer(dropout=0.0)
    names = apply_checkpointing(model, layer_cls=Block, every_n_layers=every_n, use_reentrant=variant == "reentrant")
    with set_checkpoint_early_stop(variant != "non_reentrant_no_early_stop"):
        extra = _train_flops(model) - _train_flops(ref)
    if variant == "non_reentrant":
        # Non-reentrant recompute stops once the last saved tensor is rebuilt: the block's final
        # matmul (whose output nothing saves) is not run again.
        block_forward -= count_flops(lambda: ref.blocks[0].mlp[2](torch.randn(BATCH, SEQ, 4 * WIDTH)))
    assert extra == len(names) * block_forward > 0
    again = apply_checkpointing(model, layer_cls=Block, every_n_layers=every_n, use_reentrant=variant == "reentrant")
    assert again == names
    with set_checkpoint_early_stop(variant != "non_reentrant_no_early_stop"):
        assert _train_flops(model) - _train_flops(ref) == extra


def test_selective_mode_recomputes_less_and_keeps_gradients():
    idx = tokens()
    ref = tiny_transformer()
    ref_loss, ref_grads = loss_and_grads(ref, idx)
    full, selective = tiny_transformer(), tiny_transformer()
    apply_checkpointing(full, layer_cls=Block)
    apply_checkpointing(selective, layer_cls=Block, mode="selective")
    loss, grads = loss_and_grads(selective, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    # Every matmul output is kept, so no matmul runs again (FLOPs count matmul/attention/conv work) ...
    assert _train_flops(ref) == _train_flops(selective) < _train_flops(full)
    # ... and it holds more than full checkpointing, less than none: exactly the matmul and attention outputs.
    kept = _bytes_of_compute_heavy_outputs(ref, idx)
    assert saved_bytes(selective, idx) == saved_bytes(full, idx) + kept
    assert saved_bytes(ref, idx) > saved_bytes(selective, idx) > saved_bytes(full, idx)


def _bytes_of_compute_heavy_outputs(model, idx) -> int:
    """Independent count: bytes of the outputs of compute-heavy ops run inside the blocks (no checkpointing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lightning_ckpt.core.checkpoint.policies import COMPUTE_HEAVY_OPS

    class Outputs(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in COMPUTE_HEAVY_OPS:
                Outputs.total += sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    for block in model.blocks:
        with Outputs():
            block(torch.randn(idx.shape[0], idx.shape[1], WIDTH))
    return Outputs.total


def test_identity_hooks_outside_and_exact_removal():
    model = tiny_transformer()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append("pre"))
    model.blocks[0].register_forward_hook(lambda *_: calls.append("post"))
    apply_checkpointing(model, layer_cls=Block)
    assert type(model.blocks[0]) is Block and isinstance(model.blocks[0], Block)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    model(tokens()).sum().backward()
    assert calls == ["pre", "post"]  # not run again in the recompute
    assert remove_checkpointing(model) == [f"blocks.{i}" for i in range(6)]
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert checkpointed_names(model) == []


def test_an_instance_forward_is_restored_exactly():
    layer = nn.Linear(4, 4)
    custom = lambda x: torch.zeros(2, 4)  # noqa: E731
    layer.forward = custom
    apply_checkpointing(nn.Sequential(layer, nn.Linear(4, 4)), layer_cls=nn.Linear)
    assert layer(torch.randn(2, 4)).eq(0).all()  # the instance forward ran, under checkpoint
    remove_checkpointing(layer)
    assert layer.forward is custom


def test_wrapped_model_deepcopies_and_pickles():
    model = tiny_transformer()
    apply_checkpointing(model, layer_cls=Block, every_n_layers=2)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert checkpointed_names(clone) == ["blocks.0", "blocks.2", "blocks.4"]
        assert clone.blocks[0].forward.module is clone.blocks[0]
        loss, _ = loss_and_grads(clone, tokens())
        torch.testing.assert_close(loss, loss_and_grads(model, tokens())[0], rtol=0, atol=0)


def test_nested_selection_is_refused_before_any_change():
    model = tiny_transformer()
    apply_checkpointing(model, layer_cls=Block, every_n_layers=2)
    with pytest.raises(ValueError, match="nested"):
        apply_checkpointing(model, layer_cls=nn.LayerNorm)
    assert checkpointed_names(model) == ["blocks.0", "blocks.2", "blocks.4"]


def _frozen_embeddings_model():
    model = tiny_transformer()
    model.tok_emb.requires_grad_(False)
    model.pos_emb.requires_grad_(False)
    return model


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_frozen_inputs_still_get_layer_gradients(use_reentrant):
    idx = tokens()
    _, ref_grads = loss_and_grads(_frozen_embeddings_model(), idx)
    model = _frozen_embeddings_model()
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    apply_checkpointing(model, layer_cls=Block, use_reentrant=use_reentrant)
    _, grads = loss_and_grads(model, idx)
    assert grads.keys() == ref_grads.keys() and any(k.startswith("blocks.0.") for k in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    remove_checkpointing(model)
    assert hooks_before == [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                            for m in model.modules()]


class MultiIO(nn.Module):
    """Takes several tensors and keyword arguments, returns a tuple with non-tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y, *, scale: float = 1.0, bias: torch.Tensor | None = None):
        out = self.drop(self.lin(x)) * scale + y
        if bias is not None:
            out = out + bias
        return out, out.sum(-1), {"note": "kept"}, 3


class MultiIONet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MultiIO() for _ in range(3))

    def forward(self, x):
        bias = torch.ones(8, requires_grad=True)
        extra = x
        for layer in self.layers:
            x, s, meta, n = layer(x, extra, scale=0.5, bias=bias * 0.1)
            assert meta == {"note": "kept"} and n == 3
        return x.sum() + s.sum()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_kwargs_several_tensors_and_non_tensor_outputs(use_reentrant):
    torch.manual_seed(0)
    ref = MultiIONet()
    model = copy.deepcopy(ref)
    assert apply_checkpointing(model, use_reentrant=use_reentrant) == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for net in (ref, model):
        torch.manual_seed(5)
        x.grad = None
        net(x).backward()
        results.append((x.grad.clone(), {n: p.grad.clone() for n, p in net.named_parameters()}))
    # Reentrant backward runs a nested backward per layer, so the gradient of `x` (used by every layer)
    # is summed in another order: equal up to float rounding. Non-reentrant is bit-exact.
    tol = dict(rtol=1e-6, atol=1e-6) if use_reentrant else dict(rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, **tol, msg=name)


def test_tensor_kwargs_are_saved_like_positional_inputs():
    model = MultiIONet()
    apply_checkpointing(model)
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(torch.randn(4, 8, requires_grad=True))
    # Each layer's input x (the first layer's is also the shared `extra`, counted once) and its own `bias`
    # kwarg (a new `bias * 0.1` per call): exactly these, so a tensor kwarg kept out of checkpoint's inputs
    # (in a closure, invisible to saved-tensor hooks and offload) fails, as does anything else kept.
    x_bytes, bias_bytes = 4 * 8 * 4, 8 * 4
    assert saved.bytes == 3 * x_bytes + 3 * bias_bytes == 480


def test_offload_on_cpu_is_a_noop_that_says_so_and_keeps_gradients(monkeypatch):
    import lightning_ckpt.core.checkpoint.wrapping as wrapping

    idx = tokens()
    _, ref_grads = loss_and_grads(tiny_transformer(), idx)
    model = tiny_transformer()
    monkeypatch.setattr(wrapping, "_warned_offload_on_cpu", False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # a CPU-only machine
    with pytest.warns(UserWarning, match="no effect") as record:
        apply_checkpointing(model, layer_cls=Block, offload=True)
        _, grads = loss_and_grads(model, idx)
        loss_and_grads(model, idx)
    assert sum("no effect" in str(w.message) for w in record) == 1
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(idx)
    plain_ckpt = tiny_transformer()
    apply_checkpointing(plain_ckpt, layer_cls=Block)
    assert saved.offloaded_bytes == 0
    assert saved.bytes == saved_bytes(plain_ckpt, idx) > 0


def test_is_checkpointed_marks_only_selected_layers():
    model = tiny_transformer()
    apply_checkpointing(model, every_n_layers=3)
    assert [i for i, b in enumerate(model.blocks) if is_checkpointed(b)] == [0, 3]
    assert not is_checkpointed(model)


class SelfCheckpointingMlp(nn.Module):
    """An MLP that runs itself under torch's checkpoint when its ``gradient_checkpointing`` flag is on, as
    Transformers' modules do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gradient_checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Residual(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp: nn.Module = SelfCheckpointingMlp(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("inner", ["checkpoint_wrapper", "own_flag"])
def test_a_layer_with_a_checkpoint_inside_is_left_to_it(inner):
    """Layer 1's MLP already runs under a checkpoint (torch's CheckpointWrapper, or its own flag): checkpointing
    layer 1 around it would recompute the MLP twice, so layer 1 is left to it and every op is recomputed once."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    plain = nn.Sequential(*[Residual() for _ in range(3)])
    model = copy.deepcopy(plain)
    if inner == "checkpoint_wrapper":
        model[1].mlp = checkpoint_wrapper(model[1].mlp)
    else:
        model[1].mlp.gradient_checkpointing = True
    x = torch.randn(8, 16)

    def step(m: nn.Module) -> None:
        m(x).square().sum().backward()

    assert apply_checkpointing(model, layer_cls=Residual) == ["0", "2"]
    with torch.no_grad():  # forward FLOPs: what a recompute costs
        block, mlp = count_flops(lambda: plain[0](x)), count_flops(lambda: plain[1].mlp(x))
    assert block > 0 and mlp > 0
    with set_checkpoint_early_stop(False):  # each recompute runs its whole forward, whoever checkpoints
        assert count_flops(lambda: step(model)) == count_flops(lambda: step(plain)) + 2 * block + mlp
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
