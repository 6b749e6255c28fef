"""The LM head and the cross-entropy over chunks of tokens: no ``tokens x vocab`` tensor stays alive.

:func:`lm_loss` computes ``cross_entropy(head(hidden), labels)`` one chunk of tokens at a time, each chunk under
``torch.utils.checkpoint`` (non-reentrant): the forward keeps only the chunk's input (a view of ``hidden``), and
the backward recomputes that chunk's logits, takes their gradient and frees them before the next chunk. The head
is called as a module, so a bias, a frozen or LoRA-wrapped (PEFT) head and FSDP's module hooks all work as in
the unchunked call. Torch's ``F.linear_cross_entropy`` is not used: it takes a bare weight (no LoRA head), and its
chunked path computes the gradients inside the forward, outside the autograd contract.

:func:`chunk_causal_lm_loss` turns it on for a model (Transformers ``*ForCausalLM``, litgpt's ``GPT``, the demo
GPT); :func:`unchunk_causal_lm_loss` turns it off. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> head = torch.nn.Linear(4, 10)
    >>> hidden, labels = torch.randn(2, 6, 4), torch.randint(0, 10, (2, 6))
    >>> ref = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    >>> torch.allclose(lm_loss(hidden, head, labels, chunk_tokens=5), ref)
    True
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK_TOKENS", "LossNotChunkable", "chunk_causal_lm_loss", "chunk_loss_of", "chunk_size",
           "chunked_models", "head_of", "in_lm_loss", "lm_loss", "logits_changed_by", "losses_kept_whole",
           "unchunk_causal_lm_loss"]

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                    ignore_index: int, label_smoothing: float) -> torch.Tensor:
    _in_chunk[0] += 1
    try:
        # fp32 logits for the softmax, as Transformers' loss does: a bf16 head's error stays that of its matmul
        logits = _head_uncached(head, hidden).float()
    finally:
        _in_chunk[0] -= 1
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum")


_in_chunk = [0]  # heads running inside lm_loss's chunks now: a head called otherwise is not chunked


def in_lm_loss() -> bool:
    """Whether a chunk of :func:`lm_loss` is running its head now (for counters that tell a chunked head's calls
    from a head whose caller computes the loss itself)."""
    return _in_chunk[0] > 0


def _head_uncached(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)``; under autocast with its cast-weight cache off. With the cache every chunk would use one bf16
    copy of the weight, whose gradient autograd then sums over the chunks in bf16; without it each chunk's gradient
    goes back through its own cast and the chunks are summed in the weight's fp32."""
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return head(hidden)
    with torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False):
        return head(hidden)


def chunk_size(chunk_tokens: Optional[int]) -> int:
    """Tokens per chunk: ``chunk_tokens``, or :data:`DEFAULT_CHUNK_TOKENS` for ``None``.

    Example::

        >>> chunk_size(None), chunk_size(256)
        (1024, 256)
    """
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise ValueError(f"`chunk_tokens` must be a positive number of tokens, got {chunk_tokens!r}. Pass e.g. 1024,"
                         f" or None for the default ({DEFAULT_CHUNK_TOKENS}).")
    return chunk


def lm_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor, *,
            ignore_index: int = -100, label_smoothing: float = 0.0,
            num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
            chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``cross_entropy(head(hidden), labels)`` over chunks of ``chunk_tokens`` tokens, each checkpointed.

    Args:
        hidden: ``[..., hidden_size]``, the last hidden states (after the final norm).
        head: the LM head, usually an ``nn.Module`` (``nn.Linear``, with or without bias, LoRA-wrapped or not).
        labels: ``[...]`` class indices matching ``hidden``'s leading dimensions (already shifted for causal LMs).
        ignore_index: labels with this value count for nothing, neither in the sum nor in the mean.
        label_smoothing: as in ``F.cross_entropy``.
        num_items_in_batch: divide the summed loss by this instead of by the number of counted labels
            (Transformers' normalisation under gradient accumulation).
        chunk_tokens: tokens per chunk; ``None`` takes :data:`DEFAULT_CHUNK_TOKENS`.

    Example::

        >>> head, hidden = torch.nn.Linear(3, 5, bias=False), torch.randn(3, 3)
        >>> labels = torch.tensor([1, -100, 4])  # two labels count
        >>> mean = lm_loss(hidden, head, labels, chunk_tokens=1)
        >>> torch.allclose(lm_loss(hidden, head, labels, num_items_in_batch=8), mean * 2 / 8)
        True
    """
    chunk = chunk_size(chunk_tokens)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_hidden.device)
    if flat_labels.numel() != flat_hidden.shape[0]:
        raise ValueError(f"`lm_loss` got {flat_hidden.shape[0]} hidden states and {flat_labels.numel()} labels. Pass one"
                         " label per hidden state: labels [batch, seq] for hidden [batch, seq, width], shifted as for"
                         " the loss (hidden[:, :-1] with labels[:, 1:]).")
    total = None
    for h, y in zip(flat_hidden.split(chunk), flat_labels.split(chunk)):
        part = checkpoint(_chunk_loss_sum, h, y, head, ignore_index, label_smoothing, use_reentrant=False)
        total = part if total is None else total + part
    if total is None:  # no tokens at all: the mean of nothing, as cross_entropy gives
        total = flat_hidden.sum().float() * 0.0
    if num_items_in_batch is None:
        return total / (flat_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


_CHUNK_ATTR = "_lightning_ckpt_chunk_tokens"  # on a model whose loss runs chunked: the tokens per chunk


def chunk_loss_of(model: nn.Module) -> Optional[int]:
    """The tokens per chunk ``model``'s loss runs with, or ``None`` when it runs unchunked.

    Example::

        >>> chunk_loss_of(torch.nn.Linear(2, 2)) is None
        True
    """
    return model.__dict__.get(_CHUNK_ATTR)


class LossNotChunkable(RuntimeError):
    """A chunked loss found that the model changes its logits between the head and the loss (see
    :func:`logits_changed_by` for the ones known before running); ``model`` is its class name."""

    def __init__(self, model: str) -> None:
        super().__init__(f"lightning_ckpt: chunk_loss cannot chunk {model}'s loss: its forward changes the logits"
                         " between the head and the loss (soft-capping or scaling). Pass chunk_loss=False for this"
                         " model: its loss then stays whole.")
        self.model = model


#: Config fields by which a model changes its logits between the LM head and the loss (Transformers' Gemma 2/3
#: ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
#: ``lm_head_multiplier``; litgpt's ``final_logit_softcapping``), each with the value that changes nothing.
_LOGIT_CHANGES = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                  "lm_head_multiplier": 1.0}


def logits_changed_by(model: nn.Module) -> Optional[str]:
    """What in ``model``'s config changes its logits between the LM head and the loss (``"final_logit_softcapping=
    30.0"``), or ``None``: such a loss cannot be chunked (chunks take the head's output as the logits).

    Example::

        >>> class Config:
        ...     final_logit_softcapping = 30.0
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = Config()
        >>> logits_changed_by(model), logits_changed_by(torch.nn.Linear(2, 2))
        ('final_logit_softcapping=30.0', None)
    """
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    for cfg in filter(None, [config, text() if callable(text) else None]):
        for name, same in _LOGIT_CHANGES.items():
            value = getattr(cfg, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (same, 0):
                return f"{name}={value!r}"
    return None


class _HeadSwap:
    """Makes ``head`` return its input (the hidden states) until :meth:`restore`: the model's own forward then
    hands the hidden states to where its logits would go, and nothing of ``tokens x vocab`` is made."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.returned: Optional[torch.Tensor] = None
        self._had_forward = "forward" in head.__dict__
        self._forward = head.__dict__.get("forward")
        head.forward = self._identity

    def _identity(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.returned = hidden
        return hidden

    def hidden_from(self, value: Any, model: nn.Module) -> torch.Tensor:
        """The hidden states, checked to be exactly what the head returned: a model that changes its logits
        between head and loss (soft-capping, scaling) cannot be chunked this way."""
        if self.returned is None or value is not self.returned:
            raise LossNotChunkable(type(model).__name__)
        return value

    def restore(self) -> None:
        if self.head.__dict__.get("forward") == self._identity:
            del self.head.forward
            if self._had_forward:
                self.head.forward = self._forward


@contextmanager
def _swapped(head: nn.Module) -> Iterator[_HeadSwap]:
    swap = _HeadSwap(head)
    try:
        yield swap
    finally:
        swap.restore()


class _HFCausalLMForward:
    """A Transformers ``*ForCausalLM``'s forward with ``labels``: its ``lm_head`` passes the hidden states
    through and its ``loss_function`` becomes :func:`lm_loss` on the real head; ``logits`` comes back ``None``.
    Without ``labels`` it is the model's own forward."""

    def __init__(self, model: nn.Module, original: Optional[Callable[..., Any]]) -> None:
        self.model = model
        self.original = original
        self._signature = inspect.signature(type(model).forward)

    def _own_forward(self) -> Callable[..., Any]:
        return self.original if self.original is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._own_forward()
        bound = self._signature.bind_partial(self.model, *args, **kwargs).arguments
        chunk = chunk_loss_of(self.model)
        if bound.get("labels") is None or chunk is None:
            return forward(*args, **kwargs)
        model = self.model
        had_loss = "_loss_function" in model.__dict__
        own_loss = model.__dict__.get("_loss_function")
        with _swapped(model.lm_head) as swap:

            def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                              num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                              shift_labels: Optional[torch.Tensor] = None, **_: Any) -> torch.Tensor:
                hidden = swap.hidden_from(logits, model)
                swap.restore()
                if shift_labels is None:  # tokens < n predict n, as Transformers' ForCausalLMLoss
                    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
                return lm_loss(hidden, model.lm_head, shift_labels, ignore_index=ignore_index,
                               num_items_in_batch=num_items_in_batch, chunk_tokens=chunk)

            model.loss_function = loss_function
            try:
                out = forward(*args, **kwargs)
            finally:
                del model._loss_function
                if had_loss:
                    model._loss_function = own_loss
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...), the "logits" being the hidden states
            return (out[0], None, *out[2:])
        out["logits"] = None
        return out


class _LitGPTForward:
    """litgpt ``GPT``'s forward with a ``targets=`` keyword: then the loss (mean over targets that are not
    ``-100``, as litgpt's ``chunked_cross_entropy``) of the hidden states after ``ln_f`` through
    :func:`lm_loss`. Without ``targets`` it is the model's own forward and returns logits."""

    def __init__(self, model: nn.Module, original: Optional[Callable[..., Any]]) -> None:
        self.model = model
        self.original = original

    def __call__(self, *args: Any, targets: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        forward = self.original if self.original is not None else type(self.model).forward.__get__(self.model)
        chunk = chunk_loss_of(self.model)
        if targets is None:
            return forward(*args, **kwargs)
        if chunk is None:
            logits = forward(*args, **kwargs)
            return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)
        with _swapped(self.model.lm_head) as swap:
            hidden = swap.hidden_from(forward(*args, **kwargs), self.model)
        return lm_loss(hidden, self.model.lm_head, targets, chunk_tokens=chunk)


def _kind(module: nn.Module) -> Optional[str]:
    cls = type(module)
    if cls.__name__.endswith("ForCausalLM") and hasattr(module, "lm_head") and hasattr(cls, "loss_function"):
        return "transformers"
    if cls.__module__.startswith("litgpt") and cls.__name__ == "GPT" and hasattr(module, "lm_head"):
        return "litgpt"
    if getattr(cls, "chunks_own_loss", False):  # the demo GPT reads chunk_loss_of itself
        return "own"
    return None


def head_of(model: nn.Module) -> nn.Module:
    """The LM head of a model :func:`chunked_models` lists: ``lm_head``, or the demo GPT's ``head``.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> head_of(Transformer(16, 8, 1, 8, 2, 0.0))
        Linear(in_features=8, out_features=16, bias=True)
    """
    return model.lm_head if hasattr(model, "lm_head") else model.head


def chunked_models(module: nn.Module) -> list[str]:
    """The qualified names of the models inside ``module`` whose loss :func:`chunk_causal_lm_loss` can chunk: of a
    kind it knows, their logits not changed between the head and the loss by their config (:func:`logits_changed_by`).

    Example::

        >>> chunked_models(torch.nn.Linear(2, 2))
        []
    """
    return [name for name, sub in module.named_modules() if _kind(sub) is not None and logits_changed_by(sub) is None]


def losses_kept_whole(module: nn.Module) -> list[str]:
    """Why each model inside ``module`` of a kind :func:`chunk_causal_lm_loss` knows keeps its loss whole where
    chunks are chosen (``chunk_loss=None``): its config changes the logits before the loss (:func:`logits_changed_by`).

    Example::

        >>> losses_kept_whole(torch.nn.Linear(2, 2))
        []
    """
    found = [(sub, logits_changed_by(sub)) for _, sub in module.named_modules() if _kind(sub) is not None]
    return [f"{type(sub).__name__}'s loss stays whole: its {why} changes the logits between the LM head and the loss,"
            " which a head run in chunks cannot reproduce" for sub, why in found if why is not None]


def chunk_causal_lm_loss(module: nn.Module, chunk_tokens: Optional[int] = None) -> list[str]:
    """Run the loss of every supported model inside ``module`` through :func:`lm_loss`; return their names.

    Transformers ``*ForCausalLM`` (PEFT-wrapped too): called with ``labels``. litgpt ``GPT``: called with
    ``targets=``, it returns the loss. The demo GPT: its ``training_step``. Other models are left as they are.
    Applying again only changes the chunk size.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> model = Transformer(16, 8, 1, 8, 2, 0.0)
        >>> chunk_causal_lm_loss(model, chunk_tokens=4), chunk_loss_of(model)
        ([''], 4)
        >>> unchunk_causal_lm_loss(model), chunk_loss_of(model)
        ([''], None)
    """
    chunk = chunk_size(chunk_tokens)
    names = []
    for name, sub in module.named_modules():
        kind = _kind(sub)
        if kind is None:
            continue
        if kind != "own" and not isinstance(sub.__dict__.get("forward"), (_HFCausalLMForward, _LitGPTForward)):
            wrapper = _HFCausalLMForward if kind == "transformers" else _LitGPTForward
            sub.forward = wrapper(sub, sub.__dict__.get("forward"))
        sub.__dict__[_CHUNK_ATTR] = chunk
        names.append(name)
    return names


def unchunk_causal_lm_loss(module: nn.Module) -> list[str]:
    """Undo :func:`chunk_causal_lm_loss` on ``module`` and its submodules; return the names restored."""
    names = []
    for name, sub in module.named_modules():
        if _CHUNK_ATTR not in sub.__dict__:
            continue
        del sub.__dict__[_CHUNK_ATTR]
        forward = sub.__dict__.get("forward")
        if isinstance(forward, (_HFCausalLMForward, _LitGPTForward)):
            del sub.forward
            if forward.original is not None:
                sub.forward = forward.original
        names.append(name)
    return names
