"""A small GPT-style LightningModule and a data module that makes its own data, for examples and tests.

Like ``lightning.pytorch.demos``: nothing to download, and the loss visibly falls within a couple of
minutes on a CPU. Each sequence counts up from a random token with a random stride (mod the
vocabulary), so the next token is predictable from the context.

Example::

    from lightning.pytorch import Trainer
    from lightning_ckpt import GradientCheckpointing
    from lightning_ckpt.demos import GPT, CountingDataModule

    trainer = Trainer(max_steps=200, callbacks=[GradientCheckpointing(every_n_layers=2)])
    trainer.fit(GPT(), CountingDataModule())
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.core.checkpoint.chunked_loss import chunk_loss_of, lm_loss


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """A pre-norm transformer block: the layer that gets checkpointed."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks in an ``nn.ModuleList``, a language-model head.

    Called with ``targets`` it returns the mean cross-entropy instead of the logits: through
    :func:`lightning_ckpt.lm_loss` in chunks when ``chunk_loss`` turned it on (nothing of ``tokens x vocab``
    kept for backward), else from the full logits.
    """

    chunks_own_loss = True  # chunk_loss=True reaches this loss through chunk_loss_of(self), no wrapper

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        if targets is None:
            return self.head(hidden)
        chunk = chunk_loss_of(self)
        if chunk is not None:
            return lm_loss(hidden, self.head, targets, chunk_tokens=chunk)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())



class WideElementwise(nn.Module):
    """Element-wise only, on a 4x wider tensor: many bytes held for backward, few FLOPs to recompute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat(1, 1, 4)
        h = torch.tanh(h) * torch.sigmoid(h * 1.5)
        h = torch.exp(-h * h) * h
        return x + h.view(*x.shape[:-1], 4, x.shape[-1]).mean(-2)


class MatmulHeavy(nn.Module):
    """Four square matmuls: few bytes held for backward, many FLOPs to recompute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for fc in self.fcs:
            h = F.relu(fc(h))
        return x + h


class BlockStack(nn.Module):
    """Embeddings, a list of blocks of any kinds, a head: the bytes outside the blocks (logits) count too.

    Example::

        >>> model = BlockStack(16, 8, heterogeneous_blocks(8, 3))
        >>> [type(b).__name__ for b in model.blocks]
        ['WideElementwise', 'MatmulHeavy', 'Block']
    """

    def __init__(self, vocab_size: int, width: int, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def heterogeneous_blocks(width: int, n_layers: int, dropout: float = 0.0,
                         elementwise: type[nn.Module] = WideElementwise) -> list[nn.Module]:
    """Wide element-wise, matmul-heavy and attention blocks, interleaved: each holds a different number of bytes
    per recomputed FLOP, which is what a memory-budget plan has to weigh."""
    kinds = [elementwise, lambda: MatmulHeavy(width), lambda: Block(width, 4, dropout)]
    return [kinds[i % 3]() for i in range(n_layers)]


class GPT(pl.LightningModule):
    """A GPT-style language model on ``(tokens, targets)`` batches of shape ``[batch, seq]``.

    Args:
        build_in_configure_model: build the network in ``configure_model`` instead of ``__init__``
            (how large models are built under FSDP).
    """

    def __init__(
        self,
        vocab_size: int = 64,
        block_size: int = 64,
        n_layer: int = 4,
        n_embd: int = 64,
        n_head: int = 4,
        dropout: float = 0.1,
        lr: float = 3e-3,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[Transformer] = None
        if not build_in_configure_model:
            self.model = self._build()

    def _build(self) -> Transformer:
        h = self.hparams
        return Transformer(h.vocab_size, h.block_size, h.n_layer, h.n_embd, h.n_head, h.dropout)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(idx, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self(idx, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def counting_sequences(num: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``num`` sequences of ``length`` tokens, each ``start + stride * i (mod vocab_size)``, stride in 1..3."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num, 1), generator=gen)
    stride = torch.randint(1, 4, (num, 1), generator=gen)
    return (start + stride * torch.arange(length)) % vocab_size


class CountingDataModule(pl.LightningDataModule):
    """Batches of ``(tokens, next tokens)``, both ``[batch_size, block_size]``, made in memory."""

    def __init__(self, vocab_size: int = 64, block_size: int = 64, batch_size: int = 16, num_samples: int = 4096,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        seqs = counting_sequences(h.num_samples, h.block_size + 1, h.vocab_size, h.seed)
        return DataLoader(TensorDataset(seqs[:, :-1], seqs[:, 1:]), batch_size=h.batch_size, shuffle=True)
