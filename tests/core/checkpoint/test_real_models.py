"""Models nobody on this project wrote, built from configs (no downloads): Transformers' Llama (with PEFT LoRA)
and litgpt's GPT train exactly as without checkpointing; caches and a model's own checkpointing are handled; fp8
compressed checkpoints stay close to exact ones and their plans hold their budgets."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lightning_ckpt import apply_checkpointing, remove_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, count_flops

from helpers import counted_peak, least_reachable_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
litgpt = pytest.importorskip("litgpt")

# Transformers renames its checkpointing switches; the tests use the names this version has.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

VOCAB, SEQ, BATCH = 128, 32, 2
LAYERS = [f"model.layers.{i}" for i in range(4)]


def llama(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=dropout,
    )
    return transformers.LlamaForCausalLM(config).train()


def lora(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)  # B is random, not zero: every adapter gets a gradient
    return peft.get_peft_model(model, config).train()


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_loss(model: nn.Module, **kwargs) -> torch.Tensor:
    return model(input_ids=ids(), labels=ids(), **kwargs).loss


def loss_and_grads(model: nn.Module, loss_fn=hf_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(result, ref, atol: float) -> None:
    (loss, grads), (ref_loss, ref_grads) = result, ref
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_llama_with_its_default_cache_trains_exactly_and_the_cache_comes_back(use_reentrant, caplog, monkeypatch):
    from lightning_ckpt.core.checkpoint import say_once

    monkeypatch.setattr(say_once, "_said", set())  # said once per process: start this test's process afresh
    ref = loss_and_grads(llama())
    model = llama()
    assert model.config.use_cache is True
    with caplog.at_level(logging.INFO, logger="lightning_ckpt"):
        names = apply_checkpointing(model, use_reentrant=use_reentrant)
        for _ in range(3):  # re-applied, as each new plan does: the cache and the detected class said once a run
            remove_checkpointing(model)
            apply_checkpointing(model, use_reentrant=use_reentrant)
    assert names == LAYERS
    assert model.config.use_cache is False
    assert sum("use_cache" in r.getMessage() for r in caplog.records) == 1
    assert sum("detected the repeated layer class" in r.getMessage() for r in caplog.records) == 1
    assert_same(loss_and_grads(model), ref, atol=1e-6)
    assert remove_checkpointing(model) == LAYERS
    assert model.config.use_cache is True
    assert "_lightning_ckpt_use_cache" not in model.__dict__


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_cache_that_still_reaches_a_checkpointed_layer_is_refused(use_reentrant):
    model = llama()
    apply_checkpointing(model, use_reentrant=use_reentrant)
    with pytest.raises(ValueError, match=r"DynamicCache.*use_cache=False"):
        hf_loss(model, use_cache=True)
    model.eval()  # no checkpointing in eval: the cache is the model's business there
    with torch.no_grad():
        assert model(input_ids=ids(), use_cache=True).past_key_values is not None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_peft_lora_adapters_get_their_exact_gradients_with_less_memory(use_reentrant):
    ref_model = lora(llama())
    ref = loss_and_grads(ref_model)
    model = lora(llama())
    names = apply_checkpointing(model, use_reentrant=use_reentrant)
    assert names == [f"base_model.model.{n}" for n in LAYERS]
    result = loss_and_grads(model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert result[1].keys() == adapters  # frozen base: only adapters get gradients, and every one does
    assert all(result[1][n].abs().sum() > 0 for n in adapters)
    assert_same(result, ref, atol=1e-6)

    def held(m):
        torch.manual_seed(123)
        with SavedTensorCounter(exclude=m.parameters()) as saved:
            hf_loss(m)
        return saved.bytes

    assert held(model) < 0.3 * held(ref_model)


def test_peft_lora_dropout_is_really_random():
    """Dropout on: the bit-equality above needs the RNG replayed, not a dropout that does nothing."""
    model = lora(llama())
    torch.manual_seed(1)
    a = hf_loss(model)
    torch.manual_seed(2)
    assert hf_loss(model) != a


def litgpt_model() -> nn.Module:
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=4, n_embd=64, n_head=4, n_query_groups=2, block_size=SEQ, vocab_size=VOCAB,
                           padded_vocab_size=VOCAB, bias=False)
    return litgpt.GPT(config).train()


def litgpt_loss(model: nn.Module) -> torch.Tensor:
    logits = model(ids())
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids(3).flatten())


def test_litgpt_block_is_detected_and_every_second_trains_bit_equal():
    ref = loss_and_grads(litgpt_model(), litgpt_loss)
    model = litgpt_model()
    assert apply_checkpointing(model, every_n_layers=2) == ["transformer.h.0", "transformer.h.2"]
    assert_same(loss_and_grads(model, litgpt_loss), ref, atol=0)
    plain = litgpt_model()
    flops = [count_flops(lambda m=m: litgpt_loss(m).backward()) for m in (plain, model)]
    assert flops[1] > flops[0]  # it does recompute


def test_a_model_with_its_own_checkpointing_is_recomputed_once(caplog):
    def step(m):
        return count_flops(lambda: hf_loss(m).backward())

    none = step(llama())
    own = llama()
    # Non-reentrant, like ours (older Transformers default to reentrant, which recomputes a little more).
    own.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    once = step(own)
    assert once > none
    with caplog.at_level(logging.INFO, logger="lightning_ckpt"):
        assert apply_checkpointing(own) == []
    assert any("gradient_checkpointing_disable()" in r.getMessage() for r in caplog.records)
    assert step(own) == once
    own.gradient_checkpointing_disable()
    assert apply_checkpointing(own) == LAYERS
    assert step(own) == once  # ours alone costs what theirs did


def test_torch_checkpoint_wrapper_around_a_block_is_left_to_it():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = llama()
    plain = copy.deepcopy(model)
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    names = apply_checkpointing(model, layer_cls="transformers.models.llama.modeling_llama.LlamaDecoderLayer")
    assert names == ["model.layers.0", "model.layers.2", "model.layers.3"]
    ours = copy.deepcopy(plain)
    apply_checkpointing(ours)
    flops = [count_flops(lambda m=m: hf_loss(m).backward()) for m in (model, ours)]
    assert flops[0] == flops[1]  # layer 1 recomputed once, by the wrapper


def test_layers_the_model_leaves_alone_are_checkpointed_by_us():
    """Transformers' `activation_checkpointing_enable(every_n_layers=2)` checkpoints layers 0 and 2; we take 1 and 3,
    and every layer is recomputed exactly once."""
    own = llama()
    if not hasattr(own, "activation_checkpointing_enable"):
        pytest.skip("this Transformers has no every_n_layers of its own")
    own.activation_checkpointing_enable(every_n_layers=2)
    assert apply_checkpointing(own) == ["model.layers.1", "model.layers.3"]
    ours = llama()
    apply_checkpointing(ours)
    flops = [count_flops(lambda m=m: hf_loss(m).backward()) for m in (own, ours)]
    assert flops[0] == flops[1]


def _cnn_case():
    from test_layer_state import ConvBlock, _batches, _cnn

    x, y = _batches(1)[0]
    return _cnn(), lambda m: nn.functional.cross_entropy(m(x), y), ConvBlock


PLAN_CASES = {
    "llama": lambda: (llama(), hf_loss, None),
    "peft lora": lambda: (lora(llama()), hf_loss, None),
    "litgpt": lambda: (litgpt_model(), litgpt_loss, None),
    "batchnorm cnn": _cnn_case,
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_the_planner_on_real_models(case):
    """plan_checkpointing on models nobody here wrote: predictions hold, planning leaves buffers and the model's
    cache setting as they were, and the applied plan turns the cache off like apply_checkpointing."""
    from lightning_ckpt import plan_checkpointing

    model, loss, layer_cls = PLAN_CASES[case]()

    def held() -> int:
        torch.manual_seed(0)
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            loss(model)
        return saved.bytes

    config = getattr(model, "config", None)
    if hasattr(config, "use_cache"):  # what an un-checkpointed step holds as checkpointing will train: cache off
        config.use_cache = False       # (older Transformers save other tensors with the cache on)
        baseline = held()
        config.use_cache = True
    else:
        baseline = held()
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    plan = plan_checkpointing(model, lambda: loss(model), 0.7, layer_cls=layer_cls)
    assert all(torch.equal(buffers[name], buf) for name, buf in model.named_buffers())
    assert getattr(config, "use_cache", None) is not False  # planning turned the cache off only while it ran
    assert plan.baseline_bytes == pytest.approx(baseline, rel=0.05)
    names = plan.apply(model)
    assert names and set(plan.layers.values()) - {"none"}
    measured = held()
    assert plan.planned_bytes == pytest.approx(measured, rel=0.05)
    # the step's activation peak, forward and backward, counted without the package's counters: predicted within
    # 10% (measured: 0.2% over on litgpt, 1.6% on Llama, 2.4% with PEFT, 7% on the CNN, whose first block's input needs no
    # gradient, so its measured backward makes its weights' gradients too)
    torch.manual_seed(0)
    peak = counted_peak(model, lambda: loss(model))
    assert plan.peak_bytes == pytest.approx(peak, rel=0.1)
    assert peak <= plan.budget_bytes * 1.02
    if hasattr(config, "use_cache"):
        assert config.use_cache is False
        remove_checkpointing(model)
        assert config.use_cache is True


def test_offload_copies_of_a_transformers_model_keep_its_gradients():
    """The offload engine's real copy path (fake streams: late, out of order) on Llama with its default cache."""
    from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
    from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine

    ref = loss_and_grads(llama())
    model = llama()
    apply_checkpointing(model, offload=True)
    with use_engine(OffloadEngine(FakeStreams(seed=3), min_bytes=0)) as engine:
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            loss = hf_loss(model)
        # every decoder layer saves the same rotary `position_embeddings` (cos, sin): each storage is copied once
        assert engine.stats.shared >= 2 * (model.config.num_hidden_layers - 1)
        # (the counter counts each storage once; two views of one storage with other shapes, as `position_ids` of
        # `cache_position`, are two copies: 256 bytes here). Without sharing it would move `shared_bytes` more.
        assert saved.offloaded_bytes <= engine.stats.offloaded_bytes <= saved.offloaded_bytes + 1024
        assert engine.stats.shared_bytes > 1024
        del loss
        result = loss_and_grads(model)
    assert engine.stats.to_host_copies >= 4
    assert_same(result, ref, atol=0)


def _channels_last_cnn_case():
    model, loss_fn, layer_cls = _cnn_case()
    return model.to(memory_format=torch.channels_last), loss_fn, layer_cls


OFFLOAD_CASES = {**PLAN_CASES, "batchnorm cnn, channels-last": _channels_last_cnn_case}


@pytest.mark.parametrize("case", sorted(OFFLOAD_CASES))
def test_offload_on_real_models_trains_as_checkpointing_without_it(case):
    """Every saved input through the offload engine (fake streams: late, out-of-order copies): two steps give the
    loss, gradients and buffers (BatchNorm statistics) of checkpointing without offload, bit for bit."""
    from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
    from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine

    runs = []
    for offloaded in (False, True):
        model, loss_fn, layer_cls = OFFLOAD_CASES[case]()
        apply_checkpointing(model, layer_cls=layer_cls, offload=offloaded)
        with use_engine(OffloadEngine(FakeStreams(seed=5, complete_probability=0.2), min_bytes=0)) as engine:
            results = [loss_and_grads(model, loss_fn) for _ in range(2)]
        runs.append((results, {n: b.clone() for n, b in model.named_buffers()}, engine.stats))
    (want, want_buffers, _), (got, got_buffers, stats) = runs
    assert stats.to_host_copies > 0 and stats.to_device_copies > 0
    for result, ref in zip(got, want):
        assert_same(result, ref, atol=0)
    assert got_buffers.keys() == want_buffers.keys()
    for name, buffer in want_buffers.items():
        assert torch.equal(got_buffers[name], buffer), name


# Known, and within the 5% below: Llama's layers all take the same rotary cos/sin and position storages; the measured
# step counts them once, the layers' input bytes once each, so the bytes outside the layers come out short by the
# repeats (19,200 B here), which an offloaded layer no longer makes up: 3.2% of this plan's bytes (5.2% of the plan
# this budget made when it bounded only the end of the forward, which an xfail marked).
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_an_offload_auto_plan_on_real_models_trains_exactly_and_moves_what_it_planned(case):
    """offload="auto" on models nobody here wrote, on a profile where offload and recompute both win somewhere:
    the applied plan (offload-only and recomputed layers mixed) gives the plain model's loss and gradients bit for
    bit through the fake engine, moves no more than the plan's host bytes per step, and holds its device bytes."""
    from lightning_ckpt import DeviceProfile
    from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
    from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
    from lightning_ckpt.core.plan.planner import kept_on_device, make_plan, measure_step

    reference, reference_loss, _ = PLAN_CASES[case]()  # the same model, plain: its buffers see one forward too
    want = loss_and_grads(reference, reference_loss)
    model, loss_fn, layer_cls = PLAN_CASES[case]()
    profile = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e9, host_bandwidth=1e9, name="mixed")
    measured = measure_step(model, lambda: loss_fn(model), layer_cls)
    plan = make_plan(measured.costs, measured.outside_bytes, 0.5, offload="auto", device=profile,
                     outside_ops=measured.outside_ops, host_memory=1 << 40, min_bytes=1)  # these tensors are small
    plan.apply(model)
    offloaded = [o for c in plan.costs for o in [c.movable_bytes(plan.layers[c.name], 1)] if c.name in plan.offloaded]
    assert plan.offloaded and plan.host_bytes == sum(offloaded) > 0
    with use_engine(OffloadEngine(FakeStreams(seed=4, complete_probability=0.3), min_bytes=1)) as engine:
        got = loss_and_grads(model, loss_fn)
        with SavedTensorCounter(exclude=model.parameters()) as saved:  # after: it moves BatchNorm's statistics
            torch.manual_seed(0)
            loss_fn(model)
    assert_same(got, want, atol=0)
    # shared storages (a rotary cache every layer takes) are copied once, and the plan counts them once, on the
    # device, outside the layers: the engine moves at most what was planned and those (and on Llama 256 B more a
    # forward: `position_ids` and `cache_position`, two views of one storage with other shapes, are two copies)
    assert 0 < engine.stats.offloaded_bytes <= 2 * (plan.host_bytes + measured.shared_bytes + 256)  # two forwards
    newest = next(c.movable_bytes(plan.layers[c.name], 1) for c in reversed(plan.costs) if c.name in plan.offloaded)
    assert saved.bytes + newest == pytest.approx(plan.planned_bytes, rel=0.05)
    assert kept_on_device([]) == 0


#: The models whose layers fp8 compresses: the BatchNorm CNN's layers keep their inputs exact under fp8.
FP8_CASES = sorted(set(PLAN_CASES) - {"batchnorm cnn"})


def _exact_and_fp8_runs(case: str) -> dict:
    """Two steps of the case with every matched layer checkpointed, exact and under fp8: per compress, the
    (loss, gradients) of each step, the buffers after them and the bytes held for backward by the first forward."""
    runs = {}
    for compress in (None, "fp8"):
        model, loss_fn, layer_cls = PLAN_CASES[case]()
        apply_checkpointing(model, layer_cls=layer_cls, compress=compress)
        torch.manual_seed(0)
        with SavedTensorCounter(exclude=model.parameters()) as saved:
            loss_fn(model)
        results = [loss_and_grads(model, loss_fn) for _ in range(2)]
        runs[compress] = (results, {n: b.clone() for n, b in model.named_buffers()}, saved.bytes)
    return runs


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_inputs_on_real_models_keep_the_forward_and_buffers_and_bring_gradients_close(case):
    """compress='fp8' on models nobody here wrote, every matched layer checkpointed, against exact checkpointing:
    the loss bit-equal and buffers equal after two steps, the gradients close but not equal, and less held for
    backward. Close: the cosine of all of them >= 0.999, the issue's target for transformers."""
    runs = _exact_and_fp8_runs(case)
    (exact, exact_buffers, exact_held), (fp8, fp8_buffers, fp8_held) = runs[None], runs["fp8"]
    for (loss, grads), (exact_loss, exact_grads) in zip(fp8, exact):
        assert torch.equal(loss, exact_loss)
        got, want = (torch.cat([g[n].flatten() for n in sorted(exact_grads)]).double() for g in (grads, exact_grads))
        assert not torch.equal(got, want)
        assert float(nn.functional.cosine_similarity(got, want, dim=0)) >= 0.999
    assert all(torch.equal(fp8_buffers[n], b) for n, b in exact_buffers.items())
    assert fp8_held < exact_held


def test_fp8_keeps_the_inputs_of_batchnorm_layers_exact_and_says_so_once(caplog, monkeypatch):
    """A layer with BatchNorm re-normalises its rounded inputs in the recompute (the issue measured a step-1 gradient
    cosine of 0.964 on a ResNet-style CNN): under fp8 its inputs are kept exact, so the CNN trains bit-equal to exact
    checkpointing and holds as much, and the log says so once however often the layers are wrapped."""
    from lightning_ckpt import plan_checkpointing
    from lightning_ckpt.core.checkpoint import say_once

    monkeypatch.setattr(say_once, "_said", set())  # said once per process: start this test's process afresh
    with caplog.at_level(logging.INFO, logger="lightning_ckpt"):
        runs = _exact_and_fp8_runs("batchnorm cnn")
        model, _, layer_cls = PLAN_CASES["batchnorm cnn"]()
        apply_checkpointing(model, layer_cls=layer_cls, compress="fp8")  # wrapped again: nothing more said
    (exact, exact_buffers, exact_held), (fp8, fp8_buffers, fp8_held) = runs[None], runs["fp8"]
    for (loss, grads), (exact_loss, exact_grads) in zip(fp8, exact):
        assert torch.equal(loss, exact_loss)
        assert all(torch.equal(grads[n], g) for n, g in exact_grads.items())
    assert all(torch.equal(fp8_buffers[n], b) for n, b in exact_buffers.items())
    assert fp8_held == exact_held
    said = [r.getMessage() for r in caplog.records if "keeps the inputs of ConvBlock layers exact" in r.getMessage()]
    assert len(said) == 1 and "compress='bf16'" in said[0]
    model, loss_fn, layer_cls = PLAN_CASES["batchnorm cnn"]()  # the planner prices those inputs exact too
    with pytest.raises(ValueError, match="least reachable is") as info:
        plan_checkpointing(model, lambda: loss_fn(model), 0.01, layer_cls=layer_cls)
    least = least_reachable_bytes(str(info.value))  # what exact inputs reach at best
    assert plan_checkpointing(model, lambda: loss_fn(model), least, layer_cls=layer_cls, compress="fp8").peak_bytes == least
    with pytest.raises(ValueError, match=f"(?s)least reachable is .*at least {least} bytes"):
        plan_checkpointing(model, lambda: loss_fn(model), least - 1, layer_cls=layer_cls, compress="fp8")




@pytest.mark.parametrize("case", FP8_CASES)
def test_an_fp8_plan_on_real_models_predicts_its_peak_and_holds_its_budget(case):
    """plan_checkpointing(..., compress='fp8') at a budget below what exact full checkpointing reaches: the applied
    plan's activation peak, counted without the package's counters, is within the budget, and the prediction is at
    or above it by at most 15% (it counts each layer's compressed copy in its backward whatever the choice; on the
    BatchNorm CNN, whose small layers make that copy a larger share, 12% over)."""
    from lightning_ckpt import plan_checkpointing

    model, loss_fn, layer_cls = PLAN_CASES[case]()
    exact_floor = plan_checkpointing(model, lambda: loss_fn(model), 1.0, layer_cls=layer_cls)
    with pytest.raises(ValueError, match="least reachable is") as info:
        plan_checkpointing(model, lambda: loss_fn(model), 0.01, layer_cls=layer_cls)
    least = least_reachable_bytes(str(info.value))  # what exact inputs reach at best
    plan = plan_checkpointing(model, lambda: loss_fn(model), least - 1, layer_cls=layer_cls, compress="fp8")
    assert plan.compress == "fp8" and exact_floor.compress is None
    plan.apply(model)
    torch.manual_seed(0)
    peak = counted_peak(model, lambda: loss_fn(model))
    assert peak <= plan.peak_bytes <= 1.15 * peak, (plan.peak_bytes, peak)
    assert peak <= plan.budget_bytes
