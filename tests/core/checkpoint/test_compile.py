"""torch.compile and checkpointing: compiled after applying, compiled in configure_model with the callback, and
blocks compiled before applying. Same gradients as eager (dropout off), and the saving holds (bytes held for
backward are counted through the same saved-tensor hooks in compiled graphs)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from helpers import loss_and_grads, tiny_transformer, tokens
from lightning_ckpt import GradientCheckpointing, apply_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter
from lightning_ckpt.demos import Block

pytestmark = pytest.mark.filterwarnings("ignore:.*context_fn is passed to torch.utils.checkpoint.*")


def _eager_reference():
    return loss_and_grads(tiny_transformer(dropout=0.0), tokens())


def _assert_close_to(result, ref) -> None:
    loss, grads = result
    torch.testing.assert_close(loss, ref[0], rtol=0, atol=1e-5)
    grads = {name.replace("_orig_mod.", ""): grad for name, grad in grads.items()}
    assert grads.keys() == ref[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[1][name], rtol=0, atol=1e-5, msg=name)


def _held(model) -> int:
    with SavedTensorCounter(exclude=model.parameters()) as saved:
        model(tokens())
    return saved.bytes


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_after_applying(mode, fullgraph):
    torch._dynamo.reset()
    model = tiny_transformer(dropout=0.0)
    apply_checkpointing(model, layer_cls=Block, mode=mode)
    compiled = torch.compile(model, fullgraph=fullgraph)
    _assert_close_to(loss_and_grads(compiled, tokens()), _eager_reference())
    none = _held(torch.compile(tiny_transformer(dropout=0.0), fullgraph=fullgraph))
    held = _held(compiled)
    if mode == "full":
        assert held < 0.35 * none
    else:  # selective keeps the matmul outputs: more than full, still less than none
        assert held < none
        full = tiny_transformer(dropout=0.0)
        apply_checkpointing(full, layer_cls=Block)
        assert held > _held(torch.compile(full, fullgraph=fullgraph))


def test_blocks_compiled_before_applying():
    torch._dynamo.reset()
    model = tiny_transformer(dropout=0.0)
    none = _held(model)
    for block in model.blocks:
        block.compile()
    apply_checkpointing(model, layer_cls=Block)
    _assert_close_to(loss_and_grads(model, tokens()), _eager_reference())
    assert _held(model) < 0.35 * none


class CompiledInConfigureModel(LightningModule):
    """Builds and compiles its model in ``configure_model``, and counts the bytes each step holds for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.held: list[int] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = torch.compile(tiny_transformer(dropout=0.0))

    def training_step(self, batch, batch_idx):
        with SavedTensorCounter(exclude=self.parameters()) as saved:
            loss = self.model(tokens()).logsumexp(-1).mean()
        self.held.append(saved.bytes)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return [0, 1]


def test_compile_in_configure_model_with_the_callback(tmp_path):
    def fit(callbacks):
        torch._dynamo.reset()
        module = CompiledInConfigureModel()
        Trainer(max_steps=2, callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path).fit(module)
        return module

    plain = fit([])
    callback = GradientCheckpointing(layer_cls=Block)
    checkpointed = fit([callback])
    assert callback.checkpointed_layers == [f"model._orig_mod.blocks.{i}" for i in range(6)]
    for p, q in zip(checkpointed.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    assert checkpointed.held[-1] < 0.35 * plain.held[-1]


def test_compiled_layer_state_is_updated_once():
    """Under compile the graph applies BatchNorm's and the counter's updates once: buffers end as in eager."""
    from test_layer_state import ConvBlock, _assert_same_state, _cnn, _train

    torch._dynamo.reset()
    ref = _train(_cnn())
    model = _cnn()
    apply_checkpointing(model, layer_cls=ConvBlock)
    _train(torch.compile(model))
    assert int(model.blocks[0].bn.num_batches_tracked) == 3 and int(model.blocks[0].calls) == 3
    _assert_same_state(model, ref, atol=1e-5)
