"""A Hugging Face causal LM (fully fine-tuned, or with LoRA adapters through PEFT) and a ViT image classifier as
LightningModules, and their data made in memory.

The most common real case for checkpointing: fine-tune a Transformers model with PEFT, base weights
frozen. The model is a tiny Llama built from a ``LlamaConfig`` (nothing is downloaded) in
``configure_model``, as large models are under FSDP. ``transformers`` and ``peft`` come with the
``test`` extra; ``import lightning_ckpt`` does not import this module or them.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing
    from lightning_ckpt.demos.hf import LoraCausalLM, TokenDataModule

    trainer = Trainer(max_steps=30, callbacks=[GradientCheckpointing()])  # detects LlamaDecoderLayer
    trainer.fit(LoraCausalLM(), TokenDataModule())
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import peft
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.demos import counting_sequences


class CausalLM(pl.LightningModule):
    """A ``LlamaForCausalLM`` built from a config in ``configure_model``, every weight trained (full fine-tuning).

    Batches are token ids ``[batch, seq]``; the loss is the causal LM loss (``labels=input_ids``). ``num_kv_heads``
    below ``num_heads`` is grouped-query attention (Llama-3's 8 of 32); ``max_position_embeddings`` bounds the length.

    Example::

        >>> module = CausalLM(num_layers=2)
        >>> module.configure_model()
        >>> [name for name, _ in module.named_children()], len(module.model.model.layers)
        (['model'], 2)
    """

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int = 128,
        num_kv_heads: Optional[int] = None,
        max_position_embeddings: int = 256,
        lr: float = 3e-2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    def _llama(self) -> transformers.PreTrainedModel:
        h = self.hparams
        config = transformers.LlamaConfig(
            vocab_size=h.vocab_size,
            hidden_size=h.hidden_size,
            num_hidden_layers=h.num_layers,
            num_attention_heads=h.num_heads,
            num_key_value_heads=h.num_kv_heads or h.num_heads,
            intermediate_size=h.intermediate_size,
            max_position_embeddings=h.max_position_embeddings,
            initializer_range=0.1,
        )
        return transformers.AutoModelForCausalLM.from_config(config)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._llama()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


class LoraCausalLM(CausalLM):
    """:class:`CausalLM` wrapped by ``peft.get_peft_model`` with LoRA adapters: only the LoRA weights train.
    ``self.model`` is the ``PeftModel``, so the decoder layers are ``model.base_model.model.model.layers.<i>`` from the
    LightningModule.

    Example::

        >>> module = LoraCausalLM(num_layers=2)
        >>> module.configure_model()
        >>> sum(p.requires_grad for p in module.parameters())  # lora_A and lora_B of q_proj and v_proj, 2 layers
        8
    """

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int = 128,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: Optional[list[str]] = None,
        lr: float = 3e-2,
        num_kv_heads: Optional[int] = None,
        max_position_embeddings: int = 256,
    ) -> None:
        super().__init__(vocab_size, hidden_size, num_layers, num_heads, intermediate_size, num_kv_heads,
                         max_position_embeddings, lr)
        if target_modules is None:
            target_modules = ["q_proj", "v_proj"]
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        lora = peft.LoraConfig(r=h.lora_r, lora_alpha=h.lora_alpha, lora_dropout=h.lora_dropout,
                               target_modules=list(h.target_modules), task_type="CAUSAL_LM")
        self.model = peft.get_peft_model(self._llama(), lora)


class TokenDataModule(pl.LightningDataModule):
    """Batches of token ids ``[batch_size, seq_len]``: counting sequences (see ``demos.counting_sequences``)."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 64, batch_size: int = 8, num_samples: int = 1024,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(counting_sequences(h.num_samples, h.seq_len, h.vocab_size, h.seed), batch_size=h.batch_size,
                          shuffle=True)


class ViTClassifier(pl.LightningModule):
    """A ``ViTForImageClassification`` built from a ``ViTConfig`` in ``__init__`` (its ``trunc_normal_`` init reads
    values: ``lightning-ckpt plan --fake`` builds it without weight init).

    Batches are ``(pixel_values [batch, channels, size, size], labels [batch])``; the encoder layers are
    ``model.vit.encoder.layer.<i>`` from the LightningModule.

    Example::

        >>> module = ViTClassifier(num_layers=2)
        >>> module(torch.zeros(3, 3, 32, 32)).shape
        torch.Size([3, 10])
    """

    def __init__(self, image_size: int = 32, patch_size: int = 8, hidden_size: int = 64, num_layers: int = 4,
                 num_heads: int = 4, intermediate_size: int = 128, num_labels: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = transformers.ViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=hidden_size,
                                        num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                        intermediate_size=intermediate_size, num_labels=num_labels)
        self.model = transformers.ViTForImageClassification(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        pixel_values, labels = batch
        loss = self.model(pixel_values=pixel_values, labels=labels).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class ImageDataModule(pl.LightningDataModule):
    """Batches of ``(images, labels)``: random images whose label is the brightest of ``num_labels`` horizontal
    bands, so a classifier has something to learn."""

    def __init__(self, image_size: int = 32, num_labels: int = 10, batch_size: int = 8, num_samples: int = 256,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        generator = torch.Generator().manual_seed(h.seed)
        images = torch.rand(h.num_samples, 3, h.image_size, h.image_size, generator=generator)
        bands = torch.stack([band.mean(dim=(1, 2, 3)) for band in images.chunk(h.num_labels, dim=2)], dim=1)
        return DataLoader(TensorDataset(images, bands.argmax(dim=1)), batch_size=h.batch_size, shuffle=True,
                          generator=generator)
