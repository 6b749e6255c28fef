"""Lean layers: a decoder layer's norms and gated MLP hold less for backward, with the same gradients bit for bit.

Two exact changes to the token-wise parts of the decoder layers the package knows (those
:mod:`~lightning_ckpt.core.checkpoint.tiling` knows):

- **Norms recompute in backward.** Each norm runs under nested non-reentrant ``torch.utils.checkpoint``: it keeps
  only its input (the residual stream, kept anyway) and recomputes its own output in backward, right before its
  gradient. An RMSNorm under ``bf16-mixed`` otherwise keeps a float32 copy of the whole sequence (``x * rsqrt``) for
  its weight's gradient, two per layer.
- **The gated MLP keeps gate and up only.** ``down(act(gate(x)) * up(x))`` runs its product through
  :class:`GatedProduct`, an autograd Function that saves ``gate`` and ``up``, recomputes ``act(gate)`` in backward
  and writes both input gradients into buffers it made (``act(gate)`` becomes ``up``'s gradient, ``grad * up``
  becomes ``gate``'s), so one ``[tokens, intermediate]`` tensor less is saved and one less is alive in backward.

Both run the very ops autograd runs (``silu_backward``/``gelu_backward`` on ``grad * up``, ``grad * act(gate)``),
so losses and gradients equal the unchanged model's to the bit. At a Llama-3-8B layer's backward peak under
``bf16-mixed`` they take 79.6 bytes per token per hidden unit to 64.6 (``benchmarks/bench_layer_bytes.py``). The
cost is elementwise: a norm's forward again, and ``act(gate)`` again, per layer and step.

As :mod:`~lightning_ckpt.core.checkpoint.tiling` does, a lean module keeps its class, its ``state_dict`` and its
parameters: only its ``forward`` is replaced, by an instance attribute, and :func:`remove_lean` restores it. A tiled
module runs lean inside its tiles. Eval and ``no_grad`` run the module's own forward.

Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> from lightning_ckpt.demos import Transformer
    >>> model = Transformer(16, 8, 1, 8, 2, 0.0)  # its MLP is not gated: only the norms
    >>> apply_lean(model)
    ['blocks.0.ln1', 'blocks.0.ln2', 'ln_f']
    >>> x = torch.randint(0, 16, (2, 8))
    >>> model(x).sum().backward()  # each norm recomputed right before its gradient
    >>> remove_lean(model)
    ['blocks.0.ln1', 'blocks.0.ln2', 'ln_f']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.core.checkpoint.selection import class_path
from lightning_ckpt.core.checkpoint.tiling import TiledForward, token_wise_modules

__all__ = ["GatedProduct", "LeanForward", "apply_lean", "is_lean", "lean_names", "remove_lean"]

_HF_ACT = "transformers.activations"
#: Activation modules by class path, as ``(aten forward, its backward's keyword arguments)``.
_ACTIVATIONS: dict[str, tuple[str, dict[str, str]]] = {
    "torch.nn.modules.activation.SiLU": ("silu", {}),
    f"{_HF_ACT}.SiLUActivation": ("silu", {}),
    f"{_HF_ACT}.GELUTanh": ("gelu", {"approximate": "tanh"}),
    f"{_HF_ACT}.PytorchGELUTanh": ("gelu", {"approximate": "tanh"}),
}
#: Gated MLPs by class path: their (gate, up, down) attributes; the activation is ``act_fn`` (Transformers) or
#: fixed by the class (litgpt).
_HF_MLP = ("gate_proj", "up_proj", "down_proj")
_LITGPT_MLP = ("fc_1", "fc_2", "proj")
_LITGPT_GATED = {"litgpt.model.LLaMAMLP", "litgpt.model.GemmaMLP"}


def _activation(mlp: nn.Module) -> Optional[tuple[str, dict[str, str]]]:
    """``(aten op, backward kwargs)`` of ``mlp``'s activation where it is one this knows, else ``None``."""
    paths = {class_path(cls) for cls in type(mlp).__mro__}
    if "litgpt.model.GemmaMLP" in paths:  # first: it subclasses LLaMAMLP
        return "gelu", {"approximate": mlp.config.gelu_approximate}
    if "litgpt.model.LLaMAMLP" in paths:
        return "silu", {}
    act = getattr(mlp, "act_fn", None)
    if isinstance(act, nn.GELU):
        return "gelu", {"approximate": act.approximate}
    return _ACTIVATIONS.get(class_path(type(act)))


def _projections(mlp: nn.Module) -> Optional[tuple[nn.Module, nn.Module, nn.Module]]:
    """The (gate, up, down) modules of a gated MLP of a family this knows, else ``None``."""
    paths = {class_path(cls) for cls in type(mlp).__mro__}
    if paths & _LITGPT_GATED:
        names = _LITGPT_MLP
    elif any(p.startswith("transformers.models.") for p in paths):
        names = _HF_MLP
    else:
        return None
    mods = tuple(getattr(mlp, name, None) for name in names)
    return mods if all(isinstance(m, nn.Module) for m in mods) else None  # type: ignore[return-value]


class GatedProduct(torch.autograd.Function):
    """``act(gate) * up``, saving only ``gate`` and ``up``; backward recomputes ``act(gate)`` and writes the input
    gradients into buffers it made, running the ops autograd would (so the gradients are the same bits).

    Example::

        >>> gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
        >>> out = GatedProduct.apply(gate, up, "silu", {})
        >>> torch.equal(out, torch.nn.functional.silu(gate) * up)
        True
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, act: str, kwargs: dict[str, str]) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.kwargs = act, kwargs
        return getattr(torch.ops.aten, act)(gate, **kwargs) * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        gate, up = ctx.saved_tensors
        # As MulBackward0 then SiluBackward0/GeluBackward0 compute them, one [tokens, intermediate] buffer fewer:
        grad_gate = grad * up
        backward = getattr(torch.ops.aten, f"{ctx.act}_backward").grad_input
        grad_gate = backward(grad_gate, gate, **ctx.kwargs, grad_input=grad_gate)  # in place: elementwise
        grad_up = getattr(torch.ops.aten, ctx.act)(gate, **ctx.kwargs).mul_(grad)
        return grad_gate, grad_up, None, None


class LeanForward:
    """The ``forward`` installed on a lean module: a norm under nested checkpoint, or a gated MLP through
    :class:`GatedProduct`. In eval mode or without grad it calls the module's own forward."""

    def __init__(self, module: nn.Module, original: Optional[Callable[..., Any]]) -> None:
        self.module = module
        self.original = original  # None: the class's own forward; else an instance attribute from before us
        self.gated = _activation(module)  # None for a norm

    def _own(self) -> Callable[..., Any]:
        return self.original if self.original is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._own()
        if not (self.module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if self.gated is None:
            # a norm draws no random numbers: no RNG state to stash
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        (x,) = (*args, *kwargs.values())  # an MLP takes the hidden states alone
        gate_proj, up_proj, down_proj = _projections(self.module)  # type: ignore[misc]
        gate, up = gate_proj(x), up_proj(x)
        if gate.dtype != up.dtype or gate.shape != up.shape:  # broadcast or promoted: as the class computes it
            return down_proj(getattr(torch.ops.aten, self.gated[0])(gate, **self.gated[1]) * up)
        return down_proj(GatedProduct.apply(gate, up, *self.gated))


def _lean_forward(module: nn.Module) -> Optional[LeanForward]:
    forward = module.__dict__.get("forward")
    if isinstance(forward, TiledForward):
        forward = forward.original
    return forward if isinstance(forward, LeanForward) else None


def is_lean(module: nn.Module) -> bool:
    """Whether ``module`` itself runs lean (inside its tiles too)."""
    return _lean_forward(module) is not None


def lean_names(module: nn.Module) -> list[str]:
    """Qualified names of the lean submodules of ``module``, in registration order.

    Example::

        >>> lean_names(nn.Linear(2, 2))
        []
    """
    return [name for name, sub in module.named_modules() if is_lean(sub)]


def _leanable(sub: nn.Module) -> bool:
    """A norm, or a gated MLP whose projections and activation this knows and whose forward is its class's own."""
    if is_lean(sub):
        return True
    if _projections(sub) is None:
        return isinstance(sub, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(sub).__name__
    current = sub.__dict__.get("forward")
    own = current is None or (isinstance(current, TiledForward) and current.original is None)
    return own and _activation(sub) is not None


def apply_lean(module: nn.Module) -> list[str]:
    """Make the norms and gated MLPs of the decoder layers ``module`` knows lean, in place (idempotent); return their
    qualified names. A module this cannot make lean exactly (an MLP with another activation or a forward replaced by
    someone else) is left as it is; a model with nothing to make lean is refused before anything changes.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> apply_lean(Transformer(16, 8, 1, 8, 2, 0.0))
        ['blocks.0.ln1', 'blocks.0.ln2', 'ln_f']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`apply_lean` takes an `nn.Module`, got {type(module).__name__}.")
    names = [name for name in token_wise_modules(module) if _leanable(module.get_submodule(name))]
    if not names:
        raise ValueError(f"lean_layers=True found no norm or gated MLP it knows in {type(module).__name__} (it knows"
                         " the decoder layers of Transformers' Llama, Mistral, Qwen2/3, Gemma/2/3 and litgpt's Block)."
                         " Pass lean_layers=False.")
    for name in names:
        sub = module.get_submodule(name)
        if is_lean(sub):
            continue
        tiled = sub.__dict__.get("forward")
        if isinstance(tiled, TiledForward):
            tiled.original = LeanForward(sub, tiled.original)
        else:
            sub.forward = LeanForward(sub, tiled)
    return names


def remove_lean(module: nn.Module) -> list[str]:
    """Undo :func:`apply_lean` on ``module`` and all its submodules (tiles stay); return the names restored.

    Example::

        >>> remove_lean(nn.Linear(2, 2))
        []
    """
    names = []
    for name, sub in module.named_modules():
        lean = _lean_forward(sub)
        if lean is None:
            continue
        tiled = sub.__dict__.get("forward")
        if isinstance(tiled, TiledForward):
            tiled.original = lean.original
        else:
            del sub.forward
            if lean.original is not None:
                sub.forward = lean.original
        names.append(name)
    return names
