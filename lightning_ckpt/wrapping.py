"""How to checkpoint: apply and remove activation checkpointing on a module tree, keeping identity.

A checkpointed layer keeps its class, its ``state_dict`` keys and its parameter names: only its
``forward`` is replaced, by an instance attribute that runs the original forward under
``torch.utils.checkpoint.checkpoint``. Module hooks (FSDP's among them) stay outside the checkpoint,
so they are not run again during recomputation. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    >>> apply_checkpointing(model, layer_cls=nn.Linear, every_n_layers=2)
    ['0', '2']
    >>> remove_checkpointing(model)
    ['0', '2']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.offload import OffloadToHost
from lightning_ckpt.policies import selective_context_fn
from lightning_ckpt.selection import (
    LayerClassArg,
    class_path,
    detect_block_class,
    is_inside,
    layer_classes,
    select_layers,
    validate_every_n_layers,
)

Mode = Literal["full", "selective"]
MODES = ("full", "selective")


@dataclass(frozen=True)
class CheckpointOptions:
    """How each selected layer is checkpointed; validated on construction."""

    offload: bool = False
    mode: Mode = "full"
    use_reentrant: bool = False
    preserve_rng_state: bool = True
    checkpoint_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`mode={self.mode!r}` is not understood. Pass 'full' (recompute the whole layer) or"
                             " 'selective' (keep matmul/attention outputs, recompute the cheap ops).")
        for name in ("offload", "use_reentrant", "preserve_rng_state"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.checkpoint_kwargs is None:
            object.__setattr__(self, "checkpoint_kwargs", {})
        if not isinstance(self.checkpoint_kwargs, Mapping):
            raise TypeError(f"`checkpoint_kwargs` must be a dict of `torch.utils.checkpoint.checkpoint` keyword"
                            f" arguments or None, got {self.checkpoint_kwargs!r}.")
        merged = self.torch_kwargs()
        if merged["use_reentrant"] and "context_fn" in merged:
            raise ValueError("Reentrant checkpointing cannot run a `context_fn`, which `mode='selective'` uses."
                             " Pass `use_reentrant=False` (the default) or `mode='full'`.")

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.checkpoint.checkpoint``: defaults, then ``checkpoint_kwargs`` over them."""
        kwargs: dict[str, Any] = {"use_reentrant": self.use_reentrant, "preserve_rng_state": self.preserve_rng_state}
        if self.mode == "selective":
            kwargs["context_fn"] = selective_context_fn
        kwargs.update(self.checkpoint_kwargs or {})
        return kwargs


class CheckpointedForward:
    """The ``forward`` installed on a checkpointed module; calls the original forward under checkpoint.

    In eval mode or without grad it calls the original forward directly: nothing is saved for backward there.
    """

    def __init__(self, module: nn.Module, options: CheckpointOptions, original: Callable[..., Any] | None) -> None:
        self.module = module
        self.options = options
        # `None` means the class's own forward; anything else was an instance attribute before us.
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.original if self.original is not None else type(module).forward.__get__(module)
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        run, flat = _tensor_kwargs_as_args(forward, args, kwargs)
        torch_kwargs = self.options.torch_kwargs()
        if torch_kwargs["use_reentrant"]:
            run, flat = _with_grad_anchor(run, flat, module)
        with OffloadToHost() if self.options.offload else nullcontext():
            return checkpoint(run, *flat, **torch_kwargs)


def _tensor_kwargs_as_args(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Pass tensor keyword arguments positionally, so checkpoint saves (and offloads) them like the others."""
    tensor_names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    others = {k: v for k, v in kwargs.items() if k not in tensor_names}
    n_args = len(args)

    def run(*flat: Any) -> Any:
        return forward(*flat[:n_args], **others, **dict(zip(tensor_names, flat[n_args:])))

    return run, (*args, *(kwargs[k] for k in tensor_names))


def _with_grad_anchor(
    run: Callable[..., Any], flat: tuple[Any, ...], module: nn.Module
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Reentrant checkpoint only backpropagates when an input requires grad; frozen inputs (frozen
    embeddings, PEFT) would silently drop the layer's parameter gradients. An empty tensor that
    requires grad makes the output require grad without any hook on the user's model."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if any(t.requires_grad for t in tensors) or not any(p.requires_grad for p in module.parameters()):
        return run, flat
    anchor = torch.empty(0, requires_grad=True, device=tensors[0].device if tensors else None)

    def anchored(_anchor: torch.Tensor, *rest: Any) -> Any:
        return run(*rest)

    return anchored, (anchor, *flat)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` itself runs under checkpoint."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def checkpointed_names(module: nn.Module) -> list[str]:
    """Qualified names (relative to ``module``) of its checkpointed submodules, in registration order."""
    return [name for name, sub in module.named_modules() if is_checkpointed(sub)]


def apply_checkpointing(
    module: nn.Module,
    layer_cls: LayerClassArg = None,
    every_n_layers: int = 1,
    offload: bool = False,
    mode: Mode = "full",
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    checkpoint_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """Checkpoint the selected layers of ``module`` in place and return their qualified names.

    Args:
        module: any ``nn.Module``.
        layer_cls: a class, a dotted import path, or a list of either; ``None`` detects the repeated block.
        every_n_layers: checkpoint matched layers 0, n, 2n, ... in registration order.
        offload: keep the checkpointed layers' saved inputs in host memory.
        mode: ``"full"`` or ``"selective"`` (keep matmul/attention outputs, recompute the rest).
        use_reentrant: torch's reentrant implementation; non-reentrant (the default) is recommended.
        preserve_rng_state: replay the RNG in recompute so dropout masks match.
        checkpoint_kwargs: extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the above.

    Applying again with the same selection changes nothing (a layer is never checkpointed twice);
    options given again replace the old ones. Everything is validated before anything changes.

    Example::

        >>> from torch import nn
        >>> blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        >>> apply_checkpointing(nn.ModuleDict({"layers": blocks}))
        ['layers.0', 'layers.1', 'layers.2']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`apply_checkpointing` takes an `nn.Module`, got {type(module).__name__}.")
    options = CheckpointOptions(offload, mode, use_reentrant, preserve_rng_state, checkpoint_kwargs or {})
    every_n_layers = validate_every_n_layers(every_n_layers)
    classes = layer_classes(module, layer_cls)
    selected = select_layers(module, classes, every_n_layers)
    if not selected:
        raise ValueError(_no_match_message(module, classes))
    _check_no_nesting(module, [name for name, _ in selected])
    for _, layer in selected:
        if is_checkpointed(layer):
            layer.forward.options = options
        else:
            original = layer.__dict__.get("forward")
            layer.forward = CheckpointedForward(layer, options, original)
    return [name for name, _ in selected]


def remove_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing` on ``module`` and all its submodules; return the names restored."""
    names = []
    for name, sub in module.named_modules():
        if is_checkpointed(sub):
            original = sub.forward.original
            del sub.forward
            if original is not None:
                sub.forward = original
            names.append(name)
    return names


def _check_no_nesting(module: nn.Module, selected: list[str]) -> None:
    for wrapped in checkpointed_names(module):
        for name in selected:
            if name != wrapped and (is_inside(name, wrapped) or is_inside(wrapped, name)):
                raise ValueError(
                    f"`{name}` would be checkpointed inside or around `{wrapped}`, which already is: nested"
                    " checkpoints recompute twice. Call `remove_checkpointing` first, or select the same layers."
                )


def _no_match_message(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> str:
    wanted = ", ".join(class_path(c) for c in classes)
    try:
        hint = f" The repeated block looks like {class_path(detect_block_class(module))}."
    except ValueError as err:
        hint = f" {err}"
    return f"No submodule of {type(module).__name__} is an instance of {wanted}.{hint}"
