"""The Hugging Face + PEFT example (lightning_ckpt.demos.hf): a LoRA fine-tune of a Transformers causal LM."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.core.checkpoint.selection import detect_block_class

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_ckpt.demos.hf import LoraCausalLM, TokenDataModule  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

LAYERS = [f"model.base_model.model.model.layers.{i}" for i in range(4)]


def fit(module: LoraCausalLM, steps: int, checkpointing: bool, seed: int = 0) -> tuple[Trainer, list[float]]:
    """Train ``steps`` steps on CPU, with or without the callback; return the trainer and each step's loss."""
    seed_everything(seed)
    losses: list[float] = []
    module.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(float(outputs["loss"]))
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[GradientCheckpointing()] if checkpointing else [])
    trainer.fit(module, TokenDataModule())
    return trainer, losses


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def params(module: LoraCausalLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_decoder_layers_are_detected_and_recomputed():
    module = LoraCausalLM()
    module.configure_model()
    assert detect_block_class(module) is LlamaDecoderLayer
    calls = []
    attn = module.model.base_model.model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda mod, args: calls.append(1))

    trainer, _ = fit(module, steps=2, checkpointing=True)

    [callback] = [c for c in trainer.callbacks if isinstance(c, GradientCheckpointing)]
    assert callback.checkpointed_layers == LAYERS
    # The layer's inside runs twice per step: the forward and its recompute in backward.
    assert len(calls) == 4
    # Undone at teardown: a fresh training step runs it once.
    module.train()
    calls.clear()
    module.model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.sum().backward()
    assert len(calls) == 1


def test_configure_model_builds_once():
    module = LoraCausalLM()
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model


def test_only_lora_weights_train():
    module = LoraCausalLM(lora_dropout=0.0)
    module.configure_model()  # built here so the weights can be read before fit; fit does not rebuild
    before = params(module)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == {n for n in before if is_lora(n)}
    assert len(trainable) == 4 * 2 * 2  # 4 layers x (q_proj, v_proj) x (lora_A, lora_B)

    fit(module, steps=3, checkpointing=True)

    after = params(module)
    frozen = [n for n in before if not is_lora(n)]
    assert len(frozen) > 0
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert all(not torch.equal(before[n], after[n]) for n in trainable)


def test_lora_weights_match_training_without_checkpointing():
    torch.manual_seed(0)
    with_ckpt = LoraCausalLM(lora_dropout=0.0)
    with_ckpt.configure_model()
    without = LoraCausalLM(lora_dropout=0.0)
    without.configure_model()
    without.load_state_dict(with_ckpt.state_dict())

    _, losses_ckpt = fit(with_ckpt, steps=5, checkpointing=True)
    _, losses_plain = fit(without, steps=5, checkpointing=False)

    assert losses_ckpt == pytest.approx(losses_plain, abs=1e-6)
    a, b = params(with_ckpt), params(without)
    lora = [n for n in a if is_lora(n)]
    assert len(lora) == 16
    assert max((a[n] - b[n]).abs().max().item() for n in lora) <= 1e-6
    # ...and they did move away from their start, so the comparison means something.
    assert max(a[n].abs().max().item() for n in lora if ".lora_B." in n) > 1e-3


def test_loss_falls_with_checkpointing():
    _, losses = fit(LoraCausalLM(), steps=30, checkpointing=True)
    assert len(losses) == 30
    assert losses[-1] < 0.8 * losses[0]


def test_no_cache_reaches_a_checkpointed_layer():
    """``use_cache`` is off while layers are checkpointed: no ``DynamicCache`` is filled again by the recompute."""
    module = LoraCausalLM(num_layers=2)
    module.configure_model()
    assert module.model.config.use_cache is True
    caches = []
    layer = module.model.base_model.model.model.layers[0]
    layer.register_forward_pre_hook(lambda mod, args, kwargs: caches.append(kwargs.get("cache")), with_kwargs=True)

    fit(module, steps=2, checkpointing=True)

    assert caches == [None, None]
    assert module.model.config.use_cache is True  # restored when checkpointing is removed


def test_auto_detection_on_hf_peft_and_litgpt():
    """What the README says to pass as ``layer_cls``, and what detection finds, for each library."""
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    assert detect_block_class(hf) is LlamaDecoderLayer
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert detect_block_class(lora) is LlamaDecoderLayer

    litgpt = pytest.importorskip("litgpt")
    gpt = litgpt.GPT(litgpt.Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, padded_vocab_size=32, block_size=16))
    assert detect_block_class(gpt) is litgpt.model.Block


def test_import_lightning_ckpt_does_not_import_peft_or_the_example():
    code = ("import sys, lightning_ckpt, lightning_ckpt.commands.cli, lightning_ckpt.demos;"
            "print(sorted(m for m in ('peft', 'litgpt', 'lightning_ckpt.demos.hf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_setting_reaches_the_llama_config_and_the_lora_config():
    from lightning_ckpt.demos.hf import CausalLM

    shape = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, num_kv_heads=2,
                 max_position_embeddings=128)
    module = LoraCausalLM(**shape, lora_r=4, lora_alpha=8, lora_dropout=0.25, target_modules=["k_proj", "o_proj"],
                          lr=0.5)
    module.configure_model()
    config = module.model.base_model.model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.intermediate_size, config.num_key_value_heads, config.max_position_embeddings,
            config.initializer_range) == (40, 32, 2, 4, 48, 2, 128, 0.1)
    lora = module.model.peft_config["default"]
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (4, 8, 0.25, {"k_proj", "o_proj"})
    # by hand: k_proj maps 32 to 2 heads x 8 = 16, o_proj 32 to 32; A is [r, in], B [out, r]
    shapes = {n.split("layers.")[1]: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}
    assert shapes == {f"{i}.self_attn.{proj}.lora_{ab}.default.weight": shape_
                      for i in range(2) for proj, out in (("k_proj", 16), ("o_proj", 32))
                      for ab, shape_ in (("A", (4, 32)), ("B", (out, 4)))}
    optimizer = module.configure_optimizers()
    assert optimizer.defaults["lr"] == 0.5 and sum(len(g["params"]) for g in optimizer.param_groups) == 8
    full = CausalLM(**shape)
    full.configure_model()
    assert full.model.config.num_key_value_heads == 2 and full.model.config.max_position_embeddings == 128
    assert sum(len(g["params"]) for g in full.configure_optimizers().param_groups) == len(list(full.parameters()))
    assert LoraCausalLM().hparams.target_modules == ["q_proj", "v_proj"]
