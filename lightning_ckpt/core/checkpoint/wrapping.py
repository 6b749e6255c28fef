"""How to checkpoint: apply and remove activation checkpointing on a module tree, keeping identity.

A checkpointed layer keeps its class, its ``state_dict`` keys and its parameter names: only its
``forward`` is replaced, by an instance attribute that runs the original forward under
``torch.utils.checkpoint.checkpoint``. Module hooks (FSDP's among them) stay outside the checkpoint,
so they are not run again during recomputation. Plain PyTorch; nothing here imports Lightning.

About 520 lines: :func:`apply_checkpointing` and :func:`remove_checkpointing` with the checks they share (caches,
tiles, nesting, offload) and the forward they install (:class:`CheckpointedForward`).

Example::

    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    >>> apply_checkpointing(model, layer_cls=nn.Linear, every_n_layers=2)
    ['0', '2']
    >>> remove_checkpointing(model)
    ['0', '2']
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss, unchunk_causal_lm_loss
from lightning_ckpt.core.checkpoint.compress import (Compress, CompressSaved, check_compress, layer_compress,
                                                     validate_compress)
from lightning_ckpt.core.checkpoint.layer_state import CallState, LayerState
from lightning_ckpt.core.checkpoint.offload import OffloadToHost, engine_for
from lightning_ckpt.core.checkpoint.policies import selective_context_fn
from lightning_ckpt.core.checkpoint.say_once import say_once
from lightning_ckpt.core.checkpoint.selection import (
    LayerClassArg,
    class_path,
    detect_block_class,
    is_inside,
    layer_classes,
    select_layers,
    validate_every_n_layers,
)
from lightning_ckpt.core.checkpoint.tiling import apply_tiling, check_tiling, remove_tiling, tiled_names

__all__ = ["MODES", "CheckpointOptions", "CheckpointedForward", "Mode", "apply_checkpointing", "check_no_nesting",
           "checkpointed_elsewhere", "checkpointed_names", "in_recompute", "is_checkpointed", "remove_checkpointing",
           "restore_caches", "turn_off_caches"]

log = logging.getLogger(__name__)

Mode = Literal["full", "selective", "none"]
MODES = ("full", "selective")  # the modes that recompute; "none" (offload only) is not checkpointing


@dataclass(frozen=True)
class CheckpointOptions:
    """How each selected layer is checkpointed; validated on construction."""

    offload: bool = False
    mode: Mode = "full"
    use_reentrant: bool = False
    preserve_rng_state: bool = True
    checkpoint_kwargs: Mapping[str, Any] = field(default_factory=dict)
    compress: Optional[Compress] = None

    def __post_init__(self) -> None:
        validate_compress(self.compress)
        if self.compress is not None and self.mode == "none":
            raise ValueError(f"`compress={self.compress!r}` holds a checkpointed layer's inputs compressed until its"
                             " recompute, but `mode='none'` recomputes nothing (it offloads every tensor the layer"
                             " saves, exactly). Pass mode='full' or 'selective' to compress, or compress=None.")
        if self.mode not in (*MODES, "none"):
            raise ValueError(f"`mode={self.mode!r}` is not understood. Pass 'full' (recompute the whole layer),"
                             " 'selective' (keep matmul/attention outputs, recompute the cheap ops) or, with"
                             " offload=True, 'none' (recompute nothing, keep what the layer saves in host memory).")
        if self.mode == "none" and self.offload is not True:
            raise ValueError("`mode='none'` recomputes nothing: it only moves what the layer saves for backward to host"
                             " memory, so it needs `offload=True`. Pass offload=True, or mode='full' or 'selective'"
                             " to recompute.")
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

    def saved_inputs_hooks(self) -> AbstractContextManager[Any]:
        """The saved-tensor hooks put around the checkpoint call: where and how the layer's inputs are held."""
        if self.compress is not None:
            return CompressSaved(self.compress, offload_to_host=self.offload)
        return OffloadToHost() if self.offload else nullcontext()

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
    Buffers the forward changes are put back around the recompute (see :mod:`lightning_ckpt.core.checkpoint.layer_state`).
    """

    def __init__(self, module: nn.Module, options: CheckpointOptions, original: Callable[..., Any] | None) -> None:
        self.module = module
        self.options = options
        # `None` means the class's own forward; anything else was an instance attribute before us.
        self.original = original
        self.state = LayerState(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.original if self.original is not None else type(module).forward.__get__(module)
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if self.options.mode == "none":  # nothing recomputed: every tensor the layer saves goes to host memory
            if torch.compiler.is_compiling():  # as for checkpointed layers, offload is for eager layers
                return forward(*args, **kwargs)
            with OffloadToHost():
                return forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs), is_leaf=lambda node: not _is_container(node))
        run, flat = _tensors_as_args(forward, leaves, spec)
        torch_kwargs = self.options.torch_kwargs()
        if torch_kwargs["use_reentrant"]:
            run, flat = _with_grad_anchor(run, flat, module)
        if torch.compiler.is_compiling():
            # A compiled graph functionalises buffer updates: its recompute does not apply them a second time.
            return checkpoint(run, *flat, **torch_kwargs)
        _refuse_caches(module, leaves)
        call = self.state.begin()
        with self.options.saved_inputs_hooks():
            out = checkpoint(_recomputing(run, call if call.needs_replay else None), *flat, **torch_kwargs)
        self.state.end(call)
        return out


def _recomputing(run: Callable[..., Any], call: CallState | None) -> Callable[..., Any]:
    """``run`` for checkpoint: the first call is the forward, every later call a recompute, marked for
    :func:`in_recompute` and run under ``call``'s replayed state (when given)."""
    calls = 0

    def recomputing_run(*flat: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return run(*flat)
        with _marked_recompute(), call.replayed() if call is not None else nullcontext():
            return run(*flat)

    return recomputing_run


_recompute_state = threading.local()


def in_recompute() -> bool:
    """Whether this thread is inside a checkpointed layer's recompute (torch's checkpoint re-running the layer's
    forward in backward), for counters that tell recomputed work apart (``MemoryMonitor``'s FLOP share)."""
    return getattr(_recompute_state, "depth", 0) > 0


@contextmanager
def _marked_recompute() -> Iterator[None]:
    _recompute_state.depth = getattr(_recompute_state, "depth", 0) + 1
    try:
        yield
    finally:  # also when checkpoint stops the recompute early (it raises inside `run`)
        _recompute_state.depth -= 1


def _is_container(node: Any) -> bool:
    return type(node) in (tuple, list, dict)


def _tensors_as_args(
    forward: Callable[..., Any], leaves: list[Any], spec: TreeSpec
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Pass every tensor among the flattened ``(args, kwargs)`` positionally (also those inside plain tuples, lists
    and dicts, such as Transformers' ``position_embeddings``), so that checkpoint saves and offloads them like the
    others."""
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    # Without the tensors: checkpoint keeps `run` until backward, and a reference here would keep each input alive
    # on the device whatever offload or compression does with the copy checkpoint saves.
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def run(*tensors: Any) -> Any:
        filled = list(template)
        for i, tensor in zip(positions, tensors):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return forward(*call_args, **call_kwargs)

    return run, tuple(leaves[i] for i in positions)


def _is_cache(value: Any) -> bool:
    """A key/value cache object (Transformers' ``Cache``), recognised by duck typing."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "update", None)) and callable(
        getattr(value, "get_seq_length", None))


def _refuse_caches(module: nn.Module, leaves: list[Any]) -> None:
    """A cache that reaches a checkpointed layer would show its recompute what the forward appended to it."""
    caches = [type(leaf).__name__ for leaf in leaves if _is_cache(leaf)]
    if caches:
        raise ValueError(
            f"A key/value cache ({caches[0]}) reaches the checkpointed layer {type(module).__name__} in training: its"
            " recompute would see the keys and values that the forward already added. Checkpointing turned the"
            " model's `config.use_cache` off; do not pass `use_cache=True` or `past_key_values` to the model in"
            " training (pass `use_cache=False`)."
        )


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
    compress: Compress | None = None,
    chunk_loss: bool = False,
    tile_mlp: bool = False,
    tile_tokens: int | None = None,
    tile_cls: LayerClassArg = None,
) -> list[str]:
    """Checkpoint the selected layers of ``module`` in place and return their qualified names.

    Args:
        module: any ``nn.Module``.
        layer_cls: a class, a dotted import path, or a list of either; ``None`` detects the repeated block.
        every_n_layers: checkpoint matched layers 0, n, 2n, ... in registration order.
        offload: keep the checkpointed layers' saved inputs in host memory.
        mode: ``"full"`` or ``"selective"`` (keep matmul/attention outputs, recompute the rest); with
            ``offload=True`` also ``"none"``: nothing is recomputed, every tensor the layer saves for backward
            lives in host memory instead (activation offloading without checkpointing).
        use_reentrant: torch's reentrant implementation; non-reentrant (the default) is recommended.
        preserve_rng_state: replay the RNG in recompute so dropout masks match.
        checkpoint_kwargs: extra ``torch.utils.checkpoint.checkpoint`` arguments, merged over the above.
        compress: ``None`` (exact), ``"bf16"`` or ``"fp8"``: hold the checkpointed layers' inputs compressed until
            their recompute (the forward runs on the exact inputs; the backward starts from the decompressed copy,
            so gradients are close, not equal). See :mod:`~lightning_ckpt.core.checkpoint.compress`.
        chunk_loss: also compute the LM head and the cross-entropy in chunks of tokens (nothing of
            ``tokens x vocab`` kept) for the models :func:`~lightning_ckpt.core.checkpoint.chunked_loss.chunk_causal_lm_loss`
            knows (Transformers ``*ForCausalLM`` with ``labels``, litgpt ``GPT`` with ``targets=``, the demo GPT);
            ``False`` leaves a chunking applied before as it is. Other models keep their loss, said once.
        tile_mlp: also run each decoder layer's MLP and norms (and the final norm) over tiles of tokens, each tile under
            checkpoint, so that only one tile's intermediates are alive at a time (ALST's TiledMLP, see
            :mod:`~lightning_ckpt.core.checkpoint.tiling`): in every layer it knows, checkpointed or not (in a checkpointed
            layer the tiles run inside its recompute). ``False`` leaves a tiling applied before as it is.
        tile_tokens: with ``tile_mlp``: tokens per tile along the sequence; ``None``: ``ceil(length / hidden)`` tiles.
        tile_cls: with ``tile_mlp``: the class(es) to tile instead of the MLPs it knows (a class, a dotted import
            path, or a list of either), for a model of your own; name only modules that compute each token alone.

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
    if not isinstance(chunk_loss, bool):
        raise TypeError(f"`chunk_loss` is True or False, got {chunk_loss!r}. Pass True to compute the LM head and"
                        " the loss in chunks of tokens, or False.")
    options = CheckpointOptions(offload, mode, use_reentrant, preserve_rng_state, checkpoint_kwargs or {}, compress)
    tiled = _tiles_asked(module, tile_mlp, tile_tokens, tile_cls)
    every_n_layers = validate_every_n_layers(every_n_layers)
    classes = layer_classes(module, layer_cls)
    selected = select_layers(module, classes, every_n_layers)
    if not selected:
        raise ValueError(_no_match_message(module, classes))
    check_compress(compress, {p.device for _, layer in selected for p in layer.parameters()})
    selected = _without_layers_checkpointed_elsewhere(module, selected)
    check_no_nesting(module, [name for name, _ in selected])
    _check_tiles_inside(module, [name for name, _ in selected], tiled)
    exact = [name for name, layer in selected if layer_compress(layer, compress) != compress]
    for name, layer in selected:
        layer_options = replace(options, compress=None) if name in exact else options
        if is_checkpointed(layer):
            layer.forward.options = layer_options
        else:
            original = layer.__dict__.get("forward")
            layer.forward = CheckpointedForward(layer, layer_options, original)
    for cls in sorted({type(layer).__name__ for name, layer in selected if name in exact}):
        say_once(log, f"lightning_ckpt: compress={compress!r} keeps the inputs of {cls} layers exact: they hold BatchNorm,"
                  " whose recompute would normalise the rounded inputs by their own batch statistics (compress='bf16'"
                  " holds them at half width).")
    if options.offload:
        _warn_if_offload_does_nothing([layer for _, layer in selected])
    names = [name for name, _ in selected]
    turn_off_caches(module, names)
    if chunk_loss and not chunk_causal_lm_loss(module):
        say_once(log, f"lightning_ckpt: chunk_loss=True found no loss it can chunk in {type(module).__name__} (it knows"
                      " Transformers *ForCausalLM, litgpt GPT and the demo GPT); its loss runs as before. A"
                      " training_step of your own can call lightning_ckpt.lm_loss.")
    if tile_mlp:
        apply_tiling(module, tile_cls, tile_tokens)
    return names


def _tiles_asked(module: nn.Module, tile_mlp: bool, tile_tokens: int | None, tile_cls: LayerClassArg) -> list[str]:
    """The names :func:`apply_checkpointing` is asked to tile (none with ``tile_mlp=False``); refuses a bad option."""
    if not isinstance(tile_mlp, bool):
        raise TypeError(f"`tile_mlp` is True or False, got {tile_mlp!r}. Pass True to run each layer's MLP over tiles"
                        " of tokens, or False.")
    if not tile_mlp:
        if tile_tokens is not None or tile_cls is not None:
            raise ValueError(f"`tile_tokens={tile_tokens!r}` and `tile_cls={tile_cls!r}` say how `tile_mlp=True` tiles,"
                             " but tile_mlp is False. Pass tile_mlp=True with them, or leave both None.")
        return []
    return check_tiling(module, tile_cls, tile_tokens)


def _check_tiles_inside(module: nn.Module, names: Sequence[str], tiled: Sequence[str]) -> None:
    """Refuse a checkpointed layer that is, or lies inside, a tiled module: each tile's checkpoint would recompute
    it again (tiles inside a checkpointed layer are what tiling is for)."""
    for name in names:
        for tile in {*tiled, *tiled_names(module)}:
            if name == tile or is_inside(name, tile):
                raise ValueError(f"`{name}` would be checkpointed {'as' if name == tile else 'inside'} the tiled"
                                 f" `{tile}`, whose tiles already run under checkpoint: it would be recomputed twice."
                                 " Pass a layer_cls around the MLP (the decoder layer), or tile_mlp=False.")


_warned_offload_on_cpu = False


def _warn_if_offload_does_nothing(layers: Sequence[nn.Module]) -> None:
    """Say once per process that ``offload=True`` does nothing for ``layers``: their parameters are on the CPU of a
    machine without an accelerator, so what they save for backward is in host memory already (unless
    :func:`~lightning_ckpt.core.checkpoint.offload.use_engine` put a fake device in charge). Said here, at setup, and attributed
    to the caller of :func:`apply_checkpointing`, rather than at the first saved tensor, inside torch's checkpoint.

    With an accelerator present nothing is said: a model still on the CPU may be moved after setup (Lightning's
    strategies move it after the callbacks' ``setup``).
    """
    global _warned_offload_on_cpu
    devices = {p.device.type for layer in layers for p in layer.parameters()}
    if (_warned_offload_on_cpu or devices != {"cpu"} or torch.accelerator.is_available()
            or engine_for("cpu") is not None):
        return
    _warned_offload_on_cpu = True
    warnings.warn(
        "lightning_ckpt: `offload=True` has no effect here: the saved layer inputs are already in host (CPU)"
        " memory. Offload moves them off an accelerator.",
        stacklevel=3,  # this function, apply_checkpointing, its caller
    )


def remove_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing` on ``module`` and all its submodules (its chunked loss and tiles too); return
    the names of the layers restored."""
    names = []
    for name, sub in module.named_modules():
        if is_checkpointed(sub):
            original = sub.forward.original
            del sub.forward
            if original is not None:
                sub.forward = original
            names.append(name)
    restore_caches([sub for sub in module.modules() if _CACHE_FLAG in sub.__dict__])
    unchunk_causal_lm_loss(module)
    remove_tiling(module)
    return names


_CACHE_FLAG = "_lightning_ckpt_use_cache"  # on a model whose `config.use_cache` we turned off: the value to restore


def turn_off_caches(module: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """Turn off the cache of every model (a ``config.use_cache`` found by duck typing, as in Transformers) that
    holds one of the checkpointed layers ``names``: a cache filled in forward would be seen again by the recompute.
    Returns the models changed, for :func:`restore_caches`; :func:`remove_checkpointing` restores them too."""
    changed = []
    for owner_name, owner in module.named_modules():
        config = getattr(owner, "config", None)
        if getattr(config, "use_cache", None) is True and any(is_inside(name, owner_name) for name in names):
            owner.__dict__[_CACHE_FLAG] = True
            config.use_cache = False
            changed.append(owner)
            if _first_time(config):  # one line per config: its layers share it, and are not the model it names
                log.info(f"lightning_ckpt: turned off `config.use_cache` of {type(owner).__name__} while its layers"
                         " are checkpointed (the recompute must not see a cache that forward filled); removing"
                         " checkpointing turns it back on.")
    return changed


_configs_said: dict[int, Any] = {}  # id -> a weak reference to the config said for (the config, if it takes none)


def _first_time(config: Any) -> bool:
    """Whether ``config``'s cache is turned off for the first time (a Transformers model's layers hold the model's
    config: checkpointing one alone, as measuring does, must not say it again naming the layer). By identity:
    Transformers' configs compare equal by value and hash by nothing."""
    held = _configs_said.get(id(config))
    if held is not None and (held() if isinstance(held, weakref.ref) else held) is config:
        return False
    try:
        _configs_said[id(config)] = weakref.ref(config)
    except TypeError:
        _configs_said[id(config)] = config
    return True


def restore_caches(owners: Sequence[nn.Module]) -> None:
    """Turn the caches that :func:`turn_off_caches` turned off on ``owners`` back on."""
    for owner in owners:
        if _CACHE_FLAG in owner.__dict__:
            owner.config.use_cache = owner.__dict__.pop(_CACHE_FLAG)


def checkpointed_elsewhere(module: nn.Module, name: str) -> str | None:
    """Why the submodule ``name`` of ``module`` already runs under someone else's checkpoint, or ``None``.

    Recognised: torch's ``CheckpointWrapper`` on, around or inside the layer, and Transformers' own gradient
    checkpointing, a ``gradient_checkpointing = True`` flag (set by ``gradient_checkpointing_enable()``): on the
    layer or inside it, or, for a layer without a flag of its own, on a module around it that runs its layers
    under checkpoint.

    Example::

        >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        >>> model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.Linear(2, 2))
        >>> checkpointed_elsewhere(model, "0"), checkpointed_elsewhere(model, "1")
        ("torch's CheckpointWrapper `0`", None)
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    layer_has_flag = hasattr(module.get_submodule(name), "gradient_checkpointing")
    for other, sub in module.named_modules():
        around = other != name and is_inside(name, other)
        if not (other == name or around or is_inside(other, name)):
            continue
        if isinstance(sub, CheckpointWrapper):
            return f"torch's CheckpointWrapper `{other or '<root>'}`"
        if getattr(sub, "gradient_checkpointing", False) is True and not (around and layer_has_flag):
            return (f"the model's own gradient checkpointing (`{other or '<root>'}.gradient_checkpointing`; turn it"
                    " off with `gradient_checkpointing_disable()`, `activation_checkpointing_disable()` in recent"
                    " Transformers, to use this package's options)")
    return None


def _without_layers_checkpointed_elsewhere(
    module: nn.Module, selected: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Leave layers that already run under a checkpoint to it (log which): nested checkpoints recompute twice."""
    reasons = {name: checkpointed_elsewhere(module, name) for name, _ in selected}
    left = [name for name, reason in reasons.items() if reason is not None]
    if left:
        log.info("lightning_ckpt: %d layers (%s) are left to %s; checkpointing them again would recompute them twice.",
                 len(left), ", ".join(left[:4]) + (", ..." if len(left) > 4 else ""), reasons[left[0]])
    return [(name, layer) for name, layer in selected if reasons[name] is None]


def check_no_nesting(module: nn.Module, names: Sequence[str]) -> None:
    """Refuse to checkpoint ``names`` inside or around a layer of ``module`` that already is: nested checkpoints
    recompute twice. The same layers again are fine (applying is idempotent)."""
    for wrapped in checkpointed_names(module):
        for name in names:
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
