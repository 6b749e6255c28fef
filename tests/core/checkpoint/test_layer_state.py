"""Layer state: buffers a layer's forward changes end as without checkpointing, in every mode, and the
recompute sees the state the forward saw."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import GradientCheckpointing, apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
from lightning_ckpt.core.measure.profiling import count_flops


class ConvBlock(nn.Module):
    """Conv, BatchNorm, ReLU, then a scale that depends on a counter buffer the forward increments in place,
    and an average buffer the forward replaces (out-of-place update, as some models write it)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean_out", torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))) * (1.0 + 0.1 * self.calls)
        if self.training:
            self.calls += 1
            self.mean_out = 0.9 * self.mean_out + 0.1 * y.detach().mean((0, 2, 3))
        return x + y


class CNN(nn.Module):
    def __init__(self, channels: int = 4, n_blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(n_blocks)])
        self.head = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _cnn(seed: int = 0) -> CNN:
    torch.manual_seed(seed)
    return CNN()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, steps: int = 3) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for x, y in _batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _assert_same_state(model: nn.Module, ref: nn.Module, atol: float) -> None:
    buffers, ref_buffers = dict(model.named_buffers()), dict(ref.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, buf in buffers.items():
        exact = 0 if not buf.is_floating_point() else atol
        torch.testing.assert_close(buf, ref_buffers[name], rtol=0, atol=exact, msg=name)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


VARIANTS = {
    "full": dict(),
    "selective": dict(mode="selective"),
    "reentrant": dict(use_reentrant=True),
    "every_2nd": dict(every_n_layers=2),
    "offload": dict(offload=True),
}


@pytest.mark.filterwarnings("ignore:.*offload=True. has no effect.*")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_buffers_and_weights_end_as_without_checkpointing(variant):
    ref = _train(_cnn())
    model = _cnn()
    apply_checkpointing(model, layer_cls=ConvBlock, **VARIANTS[variant])
    _train(model)
    assert int(model.blocks[0].bn.num_batches_tracked) == 3 and int(model.blocks[0].calls) == 3
    _assert_same_state(model, ref, atol=1e-6)


def test_buffers_end_as_without_checkpointing_through_real_offload_copies():
    """Offload's copy path (host-to-host on the fake-stream engine, copies late and out of order) and layer state."""
    ref = _train(_cnn())
    model = _cnn()
    apply_checkpointing(model, layer_cls=ConvBlock, offload=True)
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
        _train(model)
    assert engine.stats.to_host_copies >= 3 * 4
    _assert_same_state(model, ref, atol=1e-6)


def test_without_the_restore_the_state_would_differ():
    """The equality above means something: a second forward in the step changes the state."""
    ref = _train(_cnn())
    model = _cnn()

    def step_with_extra_forward(block):
        original = block.forward

        def forward(x):
            original(x)
            return original(x)

        block.forward = forward

    for block in model.blocks:
        step_with_extra_forward(block)
    _train(model)
    assert int(model.blocks[0].bn.num_batches_tracked) == 6
    assert not torch.equal(model.blocks[0].bn.running_mean, ref.blocks[0].bn.running_mean)


def test_recompute_sees_the_state_the_forward_saw():
    """The counter scales the output: a recompute after the increment would give other gradients."""
    torch.manual_seed(0)
    ref, model = _cnn(), _cnn()
    x, y = _batches(1)[0]
    apply_checkpointing(model, layer_cls=ConvBlock)
    for m in (ref, model):
        m.blocks[0].calls.fill_(4)
        nn.functional.cross_entropy(m(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_buffer_identity_is_kept():
    """Optimizers, DDP and FSDP hold buffers by reference: after training the same tensor objects are in place
    for buffers updated in place, and the replaced one is the tensor the forward assigned."""
    model = _cnn()
    apply_checkpointing(model, layer_cls=ConvBlock)
    bn = model.blocks[1].bn
    running_mean, counter = bn.running_mean, model.blocks[1].calls
    _train(model, steps=2)
    assert bn.running_mean is running_mean and model.blocks[1].calls is counter


class MaskedBlock(nn.Module):
    """A block with a large constant buffer (a causal mask) and a small changing one."""

    def __init__(self, size: int = 256) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        self.register_buffer("mask", torch.tril(torch.ones(size, size)))
        self.bn = nn.BatchNorm1d(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x) @ self.mask)


class _CopiedBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes written by clone/copy ops while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_):
            self.bytes += out.numel() * out.element_size()
        return out


def test_a_constant_buffer_is_not_copied_per_step():
    model = nn.Sequential(MaskedBlock(), MaskedBlock())
    apply_checkpointing(model, layer_cls=MaskedBlock)
    x = torch.randn(8, 256)
    model(x).sum().backward()  # the first step learns which buffers change
    with _CopiedBytes() as copied:
        model(x).sum().backward()
    mask_bytes = model[0].mask.numel() * model[0].mask.element_size()
    assert 0 < copied.bytes < mask_bytes // 16  # only the BatchNorm statistics are copied
    assert {name for _, name in model[0].forward.state.changing} == {"running_mean", "running_var",
                                                                       "num_batches_tracked"}


def test_state_survives_two_calls_of_one_layer_per_step():
    """A layer called twice in a step (shared weights) ends as without checkpointing."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = ConvBlock(4)

        def forward(self, x):
            return self.block(self.block(x))

    ref, model = Twice(), Twice()
    model.load_state_dict(ref.state_dict())
    apply_checkpointing(model, layer_cls=ConvBlock)
    x = torch.randn(2, 4, 6, 6)
    for m in (ref, model):
        m(x).sum().backward()
    _assert_same_state(model, ref, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


class CNNModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _cnn()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        xs, ys = zip(*_batches(3))
        return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_trainer_fit_ends_with_the_same_buffers_and_weights(mode, tmp_path):
    def fit(callbacks):
        module = CNNModule()
        Trainer(max_steps=3, callbacks=callbacks, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path).fit(module)
        return module.model

    ref = fit([])
    callback = GradientCheckpointing(layer_cls=ConvBlock, mode=mode)
    model = fit([callback])
    assert callback.checkpointed_layers == [f"model.blocks.{i}" for i in range(4)]
    assert int(model.blocks[3].bn.num_batches_tracked) == 3
    _assert_same_state(model, ref, atol=1e-6)


def test_checkpointing_still_recomputes_with_state():
    """The state machinery does not turn checkpointing into a plain forward: recompute FLOPs are there."""
    x, y = _batches(1)[0]
    plain, model = _cnn(), _cnn()
    apply_checkpointing(model, layer_cls=ConvBlock)
    flops = [count_flops(lambda m=m: nn.functional.cross_entropy(m(x), y).backward()) for m in (plain, model)]
    assert flops[1] > flops[0]
    remove_checkpointing(model)
    assert count_flops(lambda: nn.functional.cross_entropy(model(x), y).backward()) == flops[0]


class WarmupScale(nn.Module):
    """Leaves its ``scale`` buffer alone on its first training call (a warm-up), then doubles it on every later one,
    before using it: by replacing the tensor (an out-of-place update) or, with ``in_place=True``, with ``mul_`` on the
    same tensor (only its version counter shows the change). The output is scaled by it: a recompute that started
    from the doubled value would double it again and give gradients twice as large."""

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.calls > 0:
                if self.in_place:
                    self.scale.mul_(2)
                else:
                    self.scale = self.scale * 2
            self.calls += 1
        return self.linear(x) * self.scale


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "in_place"])
def test_a_buffer_first_changed_on_a_later_call_warns_once_and_is_restored_from_then_on(in_place):
    torch.manual_seed(0)
    model = nn.Sequential(WarmupScale(in_place), WarmupScale(in_place))
    apply_checkpointing(model, layer_cls=WarmupScale)
    x = torch.randn(4, 8)

    def step(m: nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        m(x).square().sum().backward()

    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        step(model)  # learns: only `calls` changes
    assert [str(w.message) for w in first] == []
    with pytest.warns(UserWarning, match=r"WarmupScale changed buffers \(scale\) that its first training call left"
                                         r" alone.*restored around every recompute") as second:
        step(model)
    assert len([w for w in second if "changed buffers" in str(w.message)]) == 2  # once per layer
    # That step's recompute ran before the change was known, and may have doubled `scale` once more (as the warning
    # says); from here on it is restored: two more steps double it exactly twice.
    warned_scale = float(model[0].scale)

    # From the third call on, the layer is recomputed with `scale` as its forward saw it: a plain model started
    # from the same state trains the same, to the bit, and ends with the same buffers.
    plain = nn.Sequential(WarmupScale(in_place), WarmupScale(in_place))
    plain.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        for _ in range(2):
            step(model)
            step(plain)
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
            _assert_same_state(model, plain, atol=0)
    assert float(model[0].scale) == 4 * warned_scale and int(model[0].calls) == 4
    assert [str(w.message) for w in later] == []  # warned once, then restored silently
