"""Tiles of tokens: a layer's token-wise submodules (its MLP, its norms) run over tiles of the sequence.

ALST's TiledMLP (Arctic Long Sequence Training). A token-wise submodule computes each token from that token alone, so
it can run over tiles of tokens along the sequence dimension (``dim=-2`` of a ``[batch, seq, hidden]`` input), each
tile under non-reentrant ``torch.utils.checkpoint``: the forward keeps only each tile's input (a view of the whole
input), and the backward recomputes one tile at a time, takes its gradients and frees its intermediates before the
next. Only one tile's intermediates (``[tile, intermediate]`` for an MLP) are alive at a time, in forward and in
backward; the weight gradients add up over the tiles through autograd, as for any module called several times.

As :mod:`~lightning_ckpt.core.checkpoint.wrapping` does for checkpointed layers, a tiled module keeps its class, its
``state_dict`` keys and its parameters: only its ``forward`` is replaced, by an instance attribute, and
:func:`remove_tiling` restores it exactly. Its module hooks (FSDP's, PEFT's) run once around the whole call, outside
the tiles. Tiles run only in training with grad enabled; in eval or under ``no_grad`` the module runs whole.

Only submodules known to be token-wise are tiled (a module that mixes tokens, such as attention, would compute
something else over tiles): the MLP and the norms of the decoder layers of Transformers' Llama, Mistral, Qwen2, Qwen3,
Phi3, Gemma, Gemma2 and Gemma3, of litgpt's ``Block`` and of the demo GPT's ``Block``, and those models' final norm
(:data:`KNOWN_LAYERS`); any other class only when the user names it (``tile_cls``). The norms matter as much as the
MLP at long lengths: an RMSNorm under bf16 keeps float32 copies of the whole sequence for its backward.

**Dropout** inside a tiled module: each tile draws its own mask from the same RNG stream, one tile after another, and
each tile's recompute replays its own RNG state (``preserve_rng_state=True``), so the recompute is exact and a tiled
run is reproducible from its seed; but the masks are not those an untiled call would draw (the stream is consumed per
tile), so a tiled run with dropout is not bitwise the untiled one. It is the same distribution of masks.

Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch import nn
    >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    >>> model = nn.ModuleDict({"mlp": mlp})
    >>> apply_tiling(model, tile_cls=nn.Sequential, tile_tokens=4)
    ['mlp']
    >>> x = torch.randn(2, 10, 8, requires_grad=True)
    >>> out = mlp(x)  # three tiles of 4, 4 and 2 tokens, each under checkpoint
    >>> remove_tiling(model), torch.allclose(out, mlp(x))
    (['mlp'], True)
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.core.checkpoint.say_once import say_once
from lightning_ckpt.core.checkpoint.selection import LayerClassArg, class_path, is_inside, resolve_layer_classes

__all__ = ["KNOWN_LAYERS", "TiledForward", "apply_tiling", "check_tiling", "is_tiled", "remove_tiling", "restore_tiles",
           "tile_classes", "tile_size", "tiled_names", "tiles_of", "token_wise_modules", "validate_tile_tokens"]

log = logging.getLogger(__name__)

_NORMS_MLP = ("input_layernorm", "post_attention_layernorm", "mlp")  # Llama's layout: norm, attention, norm, MLP
# Gemma2's: a norm on each side of the attention and of the MLP
_NORMS_MLP_NORM = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp",
                   "post_feedforward_layernorm")
_HF = "transformers.models"
#: Transformers' decoder families whose layers the package knows, as (module, class prefix): ``modeling_llama`` and
#: ``LlamaDecoderLayer``, ``LlamaMLP``, ``LlamaRMSNorm``, ``LlamaAttention``, ...
TRANSFORMERS_FAMILIES = [("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                         ("phi3", "Phi3"), ("gemma", "Gemma"), ("gemma2", "Gemma2"), ("gemma3", "Gemma3")]

#: The modules whose token-wise children are known, by class path: the attributes (dotted paths) of those children.
#: In a decoder layer, the MLP and the norms on both sides of the attention and of the MLP (every part of the layer
#: but the attention, its projections and the residual adds); in a model, its final norm before the LM head. A child
#: is tiled only when it is also of a known token-wise class (a litgpt ``Block`` whose ``mlp`` is a mixture of
#: experts, or whose ``norm_2`` is ``Identity``, keeps it whole).
KNOWN_LAYERS: dict[str, tuple[str, ...]] = {
    **{f"{_HF}.{m}.modeling_{m}.{c}DecoderLayer": _NORMS_MLP_NORM if m in ("gemma2", "gemma3") else _NORMS_MLP
       for m, c in TRANSFORMERS_FAMILIES},
    **{f"{_HF}.{m}.modeling_{m}.{c}{'TextModel' if m == 'gemma3' else 'Model'}": ("norm",)
       for m, c in TRANSFORMERS_FAMILIES},
    "litgpt.model.Block": ("norm_1", "post_attention_norm", "norm_2", "mlp", "post_mlp_norm"),
    "litgpt.model.GPT": ("transformer.ln_f",),
    "lightning_ckpt.demos.Block": ("ln1", "ln2", "mlp"),
    "lightning_ckpt.demos.Transformer": ("ln_f",),
}

#: Classes that compute each token from that token alone (over the last dimension).
_TOKEN_WISE = {
    *(f"{_HF}.{m}.modeling_{m}.{c}{k}" for m, c in TRANSFORMERS_FAMILIES for k in ("MLP", "RMSNorm")),
    "litgpt.model.GptNeoxMLP", "litgpt.model.LLaMAMLP", "litgpt.model.GemmaMLP", "litgpt.model.RMSNorm",
}
#: Leaf modules that act on each token alone; an ``nn.Sequential`` of them (the demo GPT's MLP) is token-wise.
_TOKEN_WISE_LEAVES = (nn.Linear, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)


def _class_paths(module: nn.Module) -> set[str]:
    """The class paths of ``module``'s class and its bases (a subclass, such as FSDP2's, is recognised too)."""
    return {class_path(cls) for cls in type(module).__mro__}


def _is_token_wise(module: nn.Module) -> bool:
    """Whether ``module`` is of a class known to compute each token (along the last dimension) alone."""
    if _class_paths(module) & _TOKEN_WISE:
        return getattr(module, "dim", -1) == -1  # litgpt's RMSNorm may normalise over another dimension
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return len(module.normalized_shape) == 1
    if type(module) is nn.Sequential:
        return len(module) > 0 and all(isinstance(m, _TOKEN_WISE_LEAVES) or _is_token_wise(m) for m in module)
    return False


def _child(module: nn.Module, path: str) -> Optional[nn.Module]:
    """The submodule at the dotted ``path`` of ``module``, or ``None`` where there is none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _known_children(layer: nn.Module) -> Optional[tuple[str, ...]]:
    for path in (class_path(cls) for cls in type(layer).__mro__):
        if path in KNOWN_LAYERS:
            return KNOWN_LAYERS[path]
    return None


def tile_size(length: int, width: int, tile_tokens: Optional[int] = None) -> int:
    """Tokens per tile along a sequence of ``length`` tokens of ``width`` features: ``tile_tokens``, or by ALST's rule
    ``ceil(length / width)`` tiles of equal size (about ``width`` tokens each) when ``None``.

    Example::

        >>> tile_size(10_000, 4096), tile_size(10_000, 4096, tile_tokens=1024), tile_size(100, 4096)
        (3334, 1024, 100)
    """
    if tile_tokens is not None:
        return validate_tile_tokens(tile_tokens)
    if length <= 0:
        return 1
    tiles = math.ceil(length / max(1, width))
    return math.ceil(length / tiles)


def validate_tile_tokens(tile_tokens: object) -> int:
    """``tile_tokens`` if it is an int >= 1, else a ``TypeError``/``ValueError`` that says what to pass.

    Example::

        >>> validate_tile_tokens(512)
        512
    """
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"`tile_tokens` is the tokens per tile along the sequence: pass an int >= 1 (e.g. 4096), or"
                         f" None for ALST's rule (ceil(length / hidden) tiles), got {tile_tokens!r}.")
    return tile_tokens


class TiledForward:
    """The ``forward`` installed on a tiled module: the original forward over tiles of ``tile_tokens`` tokens along
    ``dim=-2`` of its one tensor argument, each tile under non-reentrant checkpoint, the outputs concatenated.

    In eval mode or without grad it calls the original forward on the whole input: nothing is held for backward.
    """

    def __init__(self, module: nn.Module, original: Optional[Callable[..., Any]], tile_tokens: Optional[int]) -> None:
        self.module = module
        # `None` means the class's own forward; anything else was an instance attribute before us.
        self.original = original
        self.tile_tokens = tile_tokens  # None: ALST's rule, per call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.original if self.original is not None else type(module).forward.__get__(module)
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2 or args[0].shape[-2] == 0:
            return forward(*args, **kwargs)  # nothing to tile along (checked at apply for the classes it knows)
        x, rest = args[0], args[1:]
        others = [type(v).__name__ for v in (*rest, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if others:
            raise TypeError(f"lightning_ckpt: the tiled {type(module).__name__} was called with more than one tensor"
                            f" ({1 + len(others)}); tiling splits only its first argument along the sequence. Tile a"
                            " module that takes the hidden states alone (pass tile_cls= its class), or tile_mlp=False.")
        tile = tile_size(x.shape[-2], x.shape[-1], self.tile_tokens)
        outs = []
        for piece in x.split(tile, dim=-2):
            out = checkpoint(forward, piece, *rest, use_reentrant=False, preserve_rng_state=True, **kwargs)
            if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[-2] != piece.shape[-2]:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise TypeError(f"lightning_ckpt: the tiled {type(module).__name__} returned {shape} for a tile of"
                                f" {tuple(piece.shape)}: a tiled module must return one tensor with a row per token"
                                " (dim -2). Pass tile_mlp=False, or tile_cls= a token-wise class.")
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module`` itself runs over tiles of tokens."""
    return isinstance(module.__dict__.get("forward"), TiledForward)


def tiled_names(module: nn.Module) -> list[str]:
    """Qualified names (relative to ``module``) of its tiled submodules, in registration order.

    Example::

        >>> tiled_names(nn.Linear(2, 2))
        []
    """
    return [name for name, sub in module.named_modules() if is_tiled(sub)]


def tile_classes(tile_cls: LayerClassArg) -> Optional[tuple[type[nn.Module], ...]]:
    """``tile_cls`` as classes (``None`` stays ``None``); resolved as ``layer_cls`` is, its errors naming ``tile_cls``.

    Example::

        >>> tile_classes("torch.nn.Linear")
        (<class 'torch.nn.modules.linear.Linear'>,)
    """
    try:
        return resolve_layer_classes(tile_cls)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("`layer_cls", "`tile_cls")) from None


def _takes_one_tensor(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` can be called with the hidden states alone (one required positional argument)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return True
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_one = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    return len(required) <= 1 and takes_one


def token_wise_modules(module: nn.Module, tile_cls: LayerClassArg = None) -> list[str]:
    """The qualified names of the submodules of ``module`` that :func:`apply_tiling` tiles, in registration order.

    With ``tile_cls`` (a class, a dotted import path, or a list of either): every instance of those classes. Without:
    in each decoder layer and model it knows (:data:`KNOWN_LAYERS`), the MLP and the norms, those of a known
    token-wise class.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> token_wise_modules(Transformer(16, 8, 2, 8, 2, 0.0))
        ['blocks.0.ln1', 'blocks.0.ln2', 'blocks.0.mlp', 'blocks.1.ln1', 'blocks.1.ln2', 'blocks.1.mlp', 'ln_f']
    """
    classes = tile_classes(tile_cls)
    if classes is not None:
        return [name for name, sub in module.named_modules() if isinstance(sub, classes)]
    names = []
    for name, layer in module.named_modules():
        children = _known_children(layer)
        for attr in children or ():
            child = _child(layer, attr)
            if isinstance(child, nn.Module) and _is_token_wise(child):
                names.append(f"{name}.{attr}" if name else attr)
            elif isinstance(child, nn.Module) and attr == "mlp":
                say_once(log, f"lightning_ckpt: the `mlp` of {type(layer).__name__} is a {type(child).__name__}, not a"
                              " class known to be token-wise: it is not tiled (pass tile_cls= its class to tile it).")
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return sorted(dict.fromkeys(names), key=order.__getitem__)


def apply_tiling(module: nn.Module, tile_cls: LayerClassArg = None, tile_tokens: Optional[int] = None) -> list[str]:
    """Run the token-wise submodules of ``module`` (see :func:`token_wise_modules`) over tiles of tokens, in place;
    return their qualified names.

    Args:
        module: any ``nn.Module``.
        tile_cls: the classes to tile, instead of the MLPs (and norms) of the decoder layers this module knows: a
            class, a dotted import path, or a list of either. Name only classes that compute each token alone (an
            MLP, a norm over the last dimension) and take the hidden states as their one tensor argument.
        tile_tokens: tokens per tile along the sequence (``dim=-2``); ``None`` takes ALST's rule per call,
            ``ceil(length / hidden)`` tiles (:func:`tile_size`). With a batch of ``B`` sequences, a tile holds
            ``B x tile_tokens`` tokens.

    Applying again changes only ``tile_tokens``. Everything is checked before anything changes: a model with nothing
    this knows to tile is refused, and so is a ``tile_cls`` that takes more than one tensor or that nests in another.

    Example::

        >>> from lightning_ckpt.demos import Transformer
        >>> model = Transformer(16, 8, 1, 8, 2, 0.0)
        >>> apply_tiling(model, tile_tokens=4)
        ['blocks.0.ln1', 'blocks.0.ln2', 'blocks.0.mlp', 'ln_f']
        >>> remove_tiling(model)
        ['blocks.0.ln1', 'blocks.0.ln2', 'blocks.0.mlp', 'ln_f']
    """
    names = check_tiling(module, tile_cls, tile_tokens)
    for name in names:
        sub = module.get_submodule(name)
        if is_tiled(sub):
            sub.forward.tile_tokens = tile_tokens
        else:
            sub.forward = TiledForward(sub, sub.__dict__.get("forward"), tile_tokens)
    return names


def check_tiling(module: nn.Module, tile_cls: LayerClassArg = None, tile_tokens: Optional[int] = None) -> list[str]:
    """The names :func:`apply_tiling` would tile in ``module``, changing nothing; raises what it would refuse.

    Example::

        >>> check_tiling(nn.Sequential(nn.Linear(2, 2)), tile_cls="torch.nn.Linear")
        ['0']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`apply_tiling` takes an `nn.Module`, got {type(module).__name__}.")
    if tile_tokens is not None:
        validate_tile_tokens(tile_tokens)
    names = token_wise_modules(module, tile_cls)
    if not names:
        raise ValueError(_nothing_to_tile(module, tile_cls))
    subs = {name: module.get_submodule(name) for name in names}
    for name, sub in subs.items():
        if not _takes_one_tensor(type(sub)):
            raise TypeError(f"`{name}` ({class_path(type(sub))}) takes more than one tensor argument: tiling splits one"
                            " input, the hidden states, along the sequence. Pass tile_cls= a class called with the"
                            " hidden states alone (the MLP), or tile_mlp=False.")
    for name in names:
        for other in sorted({*names, *tiled_names(module)} - {name}):  # sorted: the same message every run
            inner, outer = (name, other) if is_inside(name, other) else (other, name)
            if is_inside(inner, outer):
                raise ValueError(f"`{inner}` would be tiled inside `{outer}`, which is tiled too: each tile would run"
                                 " the inner tiles again. Pass a tile_cls that matches one of them, or call"
                                 " `remove_tiling` first.")
    return names


def _nothing_to_tile(module: nn.Module, tile_cls: LayerClassArg) -> str:
    if tile_cls is not None:
        return f"`tile_cls={tile_cls!r}` matches no submodule of {type(module).__name__}: pass the class of its MLP."
    return (f"tile_mlp=True found no MLP it knows to be token-wise in {type(module).__name__} (it knows the decoder"
            " layers of Transformers' Llama, Mistral, Qwen2/3, Phi3, Gemma/2/3, litgpt's Block and the demo GPT's"
            " Block). Pass tile_cls= the class of your layers' MLP (a class or its dotted import path), whose forward"
            " computes each token alone; or tile_mlp=False.")


def remove_tiling(module: nn.Module) -> list[str]:
    """Undo :func:`apply_tiling` on ``module`` and all its submodules; return the names restored.

    Example::

        >>> remove_tiling(nn.Linear(2, 2))
        []
    """
    names = []
    for name, sub in module.named_modules():
        if is_tiled(sub):
            original = sub.forward.original
            del sub.forward
            if original is not None:
                sub.forward = original
            names.append(name)
    return names


def tiles_of(module: nn.Module) -> dict[str, Optional[int]]:
    """The tiled submodules of ``module`` with their tokens per tile, for :func:`restore_tiles` after something that
    re-wraps layers whole (as measuring does).

    Example::

        >>> model = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(2, 2))})
        >>> _ = apply_tiling(model, tile_cls=nn.Sequential, tile_tokens=4)
        >>> tiles_of(model)
        {'mlp': 4}
    """
    return {name: sub.forward.tile_tokens for name, sub in module.named_modules() if is_tiled(sub)}


def restore_tiles(module: nn.Module, tiles: dict[str, Optional[int]]) -> None:
    """Tile again each submodule of ``tiles`` (from :func:`tiles_of`) that is not tiled now."""
    for name, tile_tokens in tiles.items():
        sub = module.get_submodule(name)
        if not is_tiled(sub):
            sub.forward = TiledForward(sub, sub.__dict__.get("forward"), tile_tokens)
