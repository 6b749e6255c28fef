"""Compressed checkpoints (``compress="bf16"`` / ``"fp8"``): what is held, that the forward is untouched, and how
close the gradients stay. Each test fails if compression were skipped (gradients or bytes equal to exact) or applied
to the forward (the loss would change)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_ckpt import GradientCheckpointing, apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.checkpoint.compress import FP8_GROUP, CompressSaved, compressed_bytes
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.core.plan.planner import LayerCost, make_plan
from lightning_ckpt.demos import GPT, Block, CountingDataModule

from helpers import LiveStorages, counted_peak, loss_and_grads, tiny_transformer, tokens

WIDTH, ROWS = 256, 64


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def fp8_by_hand(x: torch.Tensor) -> torch.Tensor:
    """``x`` after an fp8 round trip, written out: one scale per 128 consecutive values, absmax to 448."""
    groups = x.detach().reshape(-1, FP8_GROUP)
    scale = groups.abs().amax(1, keepdim=True) / 448
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


# ------------------------------------------------------------------------------------------------ known answers


@pytest.mark.parametrize("compress", ["bf16", "fp8"])
def test_a_linear_layers_weight_gradient_is_computed_from_the_rounded_input(compress):
    """y = x W^T + b: dL/dW for L = sum(y) is the column sums of the input the backward sees, here the decompressed
    one, computed by hand; the input's own gradient (W's column sums) does not depend on it."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, 8)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with CompressSaved(compress):
        y = checkpoint(layer, x, use_reentrant=False)
    assert torch.equal(y, layer(x))  # the forward ran on the exact input
    y.sum().backward()
    rounded = x.detach().bfloat16().float() if compress == "bf16" else fp8_by_hand(x)
    assert not torch.equal(rounded, x.detach())
    torch.testing.assert_close(layer.weight.grad, rounded.sum(0).expand(8, WIDTH), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(ROWS, WIDTH), rtol=0, atol=0)


def test_what_is_kept_exactly_comes_back_as_the_same_tensor():
    hooks = CompressSaved("bf16")
    param = nn.Parameter(torch.randn(WIDTH, WIDTH))
    kept = {"int": torch.arange(1000), "bool": torch.ones(1000, dtype=torch.bool), "tiny": torch.randn(100),
            "bf16 already": torch.randn(1000).bfloat16(), "parameter": param, "a parameter's view": param.t()}
    for name, tensor in kept.items():
        assert hooks.pack_hook(tensor) is tensor, name
    assert CompressSaved("fp8").pack_hook(torch.randn(1000).bfloat16()) is not None
    packed = CompressSaved("fp8").pack_hook(torch.randn(1000, dtype=torch.float16))
    assert packed.data.dtype == torch.float8_e4m3fn  # fp16 is wider than fp8: compressed


def test_an_fp8_tensor_whose_last_dimension_is_not_a_multiple_of_128_is_padded_and_comes_back_in_shape():
    x = torch.randn(3, 5, 50) * torch.logspace(-3, 3, 50)  # 750 values: 6 groups, the last padded with 18 zeros
    packed = CompressSaved("fp8").pack_hook(x)
    assert packed.data.numel() == 768 and packed.scale.numel() == 6
    back = CompressSaved("fp8").unpack_hook(packed)
    assert back.shape == x.shape and back.dtype == x.dtype
    torch.testing.assert_close(back, fp8_by_hand(torch.nn.functional.pad(x.reshape(-1), (0, 18))).reshape(-1)[:750]
                               .reshape(x.shape), rtol=0, atol=0)


def test_a_channels_last_input_comes_back_channels_last():
    x = torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last)
    back = CompressSaved("bf16").unpack_hook(CompressSaved("bf16").pack_hook(x))
    assert back.stride() == x.stride() and torch.equal(back, x.bfloat16().float())


# ------------------------------------------------------------------------------------------------ bytes, counted


def held_input_bytes(compress, mode="full", use_reentrant=False) -> tuple[int, int]:
    """Storages made in the forward and alive after it, less the output: what the checkpointed block holds for its
    recompute (its input, which nothing else holds), counted without the package's counters; and the input's bytes."""
    torch.manual_seed(0)
    block = Block(WIDTH, 4)
    base = torch.randn(4, 32, WIDTH, requires_grad=True)
    apply_checkpointing(nn.Sequential(block), layer_cls=Block, mode=mode, use_reentrant=use_reentrant,
                        compress=compress)
    with LiveStorages() as live:
        x = base * 1.0  # a fresh storage, the block's input: freed unless something holds it
        x_bytes = x.untyped_storage().nbytes()
        y = block(x)
        del x
        torch.zeros(1)  # one more op: the mode notes the storages that died (the zeros die at once)
        held = live.alive() - y.untyped_storage().nbytes()
    return held, x_bytes


def test_held_bytes_of_a_checkpointed_layers_inputs_are_half_for_bf16_and_about_a_quarter_for_fp8():
    exact, x_bytes = held_input_bytes(None)
    assert exact == x_bytes == 4 * 32 * WIDTH * 4
    bf16, _ = held_input_bytes("bf16")
    fp8, _ = held_input_bytes("fp8")
    assert bf16 / exact == 0.5 and bf16 == compressed_bytes(4 * 32 * WIDTH, "bf16")
    assert fp8 / exact <= 0.27 and fp8 == compressed_bytes(4 * 32 * WIDTH, "fp8")  # 1 B + 4/128 B a value


def test_reentrant_checkpointing_holds_the_compressed_input_too():
    exact, _ = held_input_bytes(None, use_reentrant=True)
    assert held_input_bytes("bf16", use_reentrant=True)[0] == exact // 2


def test_selective_mode_compresses_the_inputs_but_not_the_kept_outputs():
    exact, x_bytes = held_input_bytes(None, mode="selective")
    bf16, _ = held_input_bytes("bf16", mode="selective")
    assert exact > x_bytes  # it keeps matmul outputs as well
    assert exact - bf16 == x_bytes // 2  # only the input shrank


def test_a_storage_that_two_layers_save_is_compressed_once():
    a, b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    base = torch.randn(ROWS, WIDTH, requires_grad=True)
    with LiveStorages() as live:
        x = base * 1.0
        with CompressSaved("bf16"):
            ya = checkpoint(a, x, use_reentrant=False)
        with CompressSaved("bf16"):
            yb = checkpoint(b, x, use_reentrant=False)
        del x
        torch.zeros(1)
        held = live.alive() - 2 * ROWS * WIDTH * 4
    assert held == ROWS * WIDTH * 2
    (ya.sum() + yb.sum()).backward()
    torch.testing.assert_close(b.weight.grad, base.detach().bfloat16().float().sum(0).expand(WIDTH, WIDTH))


# ------------------------------------------------------------------------------------------------ a model


def model_loss_and_grads(compress, **options):
    model = tiny_transformer(n_layer=4)  # dropout on: the recompute replays its masks
    if compress != "plain":
        apply_checkpointing(model, compress=compress, **options)
    return loss_and_grads(model, tokens())


@pytest.mark.parametrize(("compress", "least_cosine"), [("bf16", 0.99999), ("fp8", 0.999)])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_forward_is_bit_equal_and_gradients_are_close_but_not_equal(compress, least_cosine, use_reentrant):
    loss, grads = model_loss_and_grads("plain")
    exact_loss, exact = model_loss_and_grads(None, use_reentrant=use_reentrant)
    assert torch.equal(exact_loss, loss) and all(torch.equal(exact[n], grads[n]) for n in grads)
    got_loss, got = model_loss_and_grads(compress, use_reentrant=use_reentrant)
    assert torch.equal(got_loss, loss)
    assert not all(torch.equal(got[n], grads[n]) for n in grads)
    assert min(cosine(got[n], grads[n]) for n in grads) >= least_cosine


def test_offload_moves_the_compressed_bytes_and_gives_the_same_gradients_as_compression_alone():
    _, alone = model_loss_and_grads("fp8")
    stats = {}
    for compress in (None, "fp8"):
        with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
            stats[compress] = model_loss_and_grads(compress, offload=True), engine.stats
    (_, offloaded), with_fp8 = stats["fp8"]
    assert all(torch.equal(offloaded[n], alone[n]) for n in alone)
    # each of the 4 blocks holds one input, 4 x 16 x 32 fp32; compressed, its values and its scales go to host
    assert stats[None][1].offloaded_bytes == 4 * (4 * 16 * 32 * 4) and stats[None][1].to_host_copies == 4
    assert with_fp8.offloaded_bytes == 4 * compressed_bytes(4 * 16 * 32, "fp8") and with_fp8.to_host_copies == 8


def test_removing_checkpointing_removes_the_compression():
    model = tiny_transformer(n_layer=4)
    apply_checkpointing(model, compress="bf16")
    remove_checkpointing(model)
    loss, grads = loss_and_grads(model, tokens())
    _, plain = model_loss_and_grads("plain")
    assert all(torch.equal(grads[n], plain[n]) for n in plain)


# ------------------------------------------------------------------------------------------------ the planner


def costs_of(n=4):
    # each layer: 1000 B un-checkpointed (its backward has 1000 B alive), 400 B of fp32 inputs: 200 B as bf16, 104 as fp8
    return [LayerCost(f"l{i}", "Block", none_bytes=1000, full_bytes=400, selective_bytes=700, offloadable_bytes=0,
                      full_flops=50, selective_flops=5, bf16_bytes=200, fp8_bytes=104) for i in range(n)]


def test_a_budget_below_full_checkpointing_is_reachable_with_compression_and_the_error_says_which_width():
    """The last layer's backward sets the floor: the three before it hold their inputs while it has its 1000 B alive,
    plus its compressed copy. Exact: 3 x 400 + 1000 = 2200 B; bf16: 3 x 200 + 1200 = 1800 B; fp8: 3 x 104 + 1104 =
    1416 B."""
    costs = costs_of()
    assert make_plan(costs, 0, 2200).peak_bytes == 2200
    with pytest.raises(ValueError, match=r"(?s)least reachable is 2\.1 KiB.*\n  - or compress='bf16' .* which reaches 1\.8 KiB\."):
        make_plan(costs, 0, 2000)
    plan = make_plan(costs, 0, 1800, compress="bf16")
    assert plan.compress == "bf16" and plan.peak_bytes == 1800
    assert plan.layers == {"l0": "full", "l1": "full", "l2": "full", "l3": "none"}  # the last one need not hold less
    with pytest.raises(ValueError, match=r"\n  - or compress='fp8' .* which reaches 1\.4 KiB\."):
        make_plan(costs, 0, 1500, compress="bf16")
    assert make_plan(costs, 0, 1416, compress="fp8").peak_bytes == 1416
    with pytest.raises(ValueError, match=r"\n  - \(compress='fp8', .* would reach 1\.4 KiB: not enough either"):
        make_plan(costs, 0, 1400)


def test_a_compressed_plan_applies_the_compression_and_its_predicted_peak_matches_the_count():
    from lightning_ckpt.core.plan.planner import plan_checkpointing

    model = tiny_transformer(n_layer=4, dropout=0.0)
    idx = tokens()

    def step():
        return model(idx).logsumexp(-1).mean()

    with pytest.raises(ValueError, match="or compress="):
        plan_checkpointing(model, step, 0.32)  # exact, the floor is 32.8% of the peak without checkpointing
    plan = plan_checkpointing(model, step, 0.32, compress="fp8")
    names = plan.apply(model)
    assert names and {model.get_submodule(n).forward.options.compress for n in names} == {"fp8"}
    counted = counted_peak(model, step)
    assert counted <= plan.budget_bytes
    assert abs(plan.peak_bytes / counted - 1) < 0.05, (plan.peak_bytes, counted)


# ------------------------------------------------------------------------------------------------ refusals


def test_fp8_on_a_device_without_float8_is_refused_before_anything_changes(monkeypatch):
    model = tiny_transformer(n_layer=2)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("mps"))
    with pytest.raises(ValueError, match="compress='bf16'"):
        apply_checkpointing(model, compress="fp8")
    assert checkpointed_names(model) == []


# ------------------------------------------------------------------------------------------------ under Lightning


class Recorder(Callback):
    """Each step's loss, and the first step's gradients."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def trained(compress) -> tuple[Recorder, GradientCheckpointing]:
    seed_everything(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=4, n_embd=128, n_head=4, dropout=0.1)
    callback, recorder = GradientCheckpointing(compress=compress), Recorder()
    trainer = Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=[callback, recorder], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, CountingDataModule(vocab_size=32, block_size=16, batch_size=4, num_samples=64))
    return recorder, callback


def test_the_callback_trains_with_the_same_first_loss_and_close_gradients_and_saves_the_option():
    exact, _ = trained(None)
    got, callback = trained("fp8")
    assert torch.equal(got.losses[0], exact.losses[0])  # the forward of the first step: untouched
    assert not all(torch.equal(got.grads[n], exact.grads[n]) for n in exact.grads)  # its backward saw fp8 inputs
    assert min(cosine(got.grads[n], exact.grads[n]) for n in exact.grads) >= 0.999
    assert callback.compress == "fp8" and callback.state_dict()["settings"]["compress"] == "fp8"
    assert callback.checkpointed_layers == [f"model.blocks.{i}" for i in range(4)]


def test_an_all_zero_fp8_group_comes_back_exactly_zero_next_to_a_scaled_one():
    from lightning_ckpt.core.checkpoint.compress import compress_tensor, decompress_tensor

    torch.manual_seed(0)
    x = torch.cat([torch.zeros(128), torch.randn(128)]).view(2, 128)
    data, scale = compress_tensor(x, "fp8")
    y = decompress_tensor(data, scale, x.shape, x.stride(), x.dtype)
    assert torch.equal(y[0], torch.zeros(128)), y[0, :4]
    assert scale[0].item() == 1.0  # its absmax / 448 is 0, and 0 / 0 would be NaN
    torch.testing.assert_close(y[1], fp8_by_hand(x[1:]).view(128), rtol=0, atol=0)


def test_fp8_bytes_count_the_padding_of_the_last_group_and_one_scale_per_group():
    # 750 values: 6 groups of 128 (768 bytes, the last one padded with 18 zeros) and 6 float32 scales
    assert compressed_bytes(750, "fp8") == 6 * 128 + 6 * 4 == 792
    assert compressed_bytes(768, "fp8") == 792 and compressed_bytes(769, "fp8") == 7 * 132
    assert compressed_bytes(750, "bf16") == 1_500


def test_offloaded_fp8_copies_are_prefetched_before_their_unpack():
    """Four blocks, each offloading its input's fp8 values and scales (8 copies). The last block's values are fetched
    by their own unpack, which brings its group's scales along (1 prefetched); each block's unpack starts the copies
    of the block before it, which the engine links through the saved tensor they are copies of: the other 3 blocks'
    6 copies are prefetched too, 7 in all (without that link only each block's scales are: 4)."""
    with use_engine(OffloadEngine(FakeStreams(), min_bytes=0)) as engine:
        model_loss_and_grads("fp8", offload=True)
    assert engine.stats.to_host_copies == 8
    assert engine.stats.prefetched == 7
