"""Which modules to checkpoint: layer-class resolution, block auto-detection, every-n, budgets.

Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    >>> [name for name, _ in select_layers(model, resolve_layer_classes("torch.nn.Linear"), every_n_layers=2)]
    ['0', '2', '4']
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Union

from torch import nn

from lightning_ckpt.core.checkpoint.say_once import say_once

__all__ = ["LayerClass", "LayerClassArg", "class_path", "detect_block_class", "import_class", "is_inside",
           "layer_classes", "parse_memory_budget", "resolve_layer_classes", "select_layers", "validate_every_n_layers"]

log = logging.getLogger(__name__)

LayerClass = Union[str, type[nn.Module]]
LayerClassArg = Union[LayerClass, Sequence[LayerClass], None]

#: The least byte budget :func:`parse_memory_budget` takes from a user: 1 KiB.
MIN_BUDGET_BYTES = 1024
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def validate_every_n_layers(every_n_layers: object) -> int:
    """Return ``every_n_layers`` if it is an int >= 1, else raise a ``TypeError``/``ValueError``."""
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int):
        raise TypeError(
            f"`every_n_layers` must be an int >= 1 (1 = every layer, 4 = layers 0, 4, 8, ...),"
            f" got {every_n_layers!r} of type {type(every_n_layers).__name__}."
        )
    if every_n_layers < 1:
        raise ValueError(
            f"`every_n_layers` must be >= 1 (1 = every layer, 4 = layers 0, 4, 8, ...), got {every_n_layers}."
            " To turn checkpointing off, remove the callback instead."
        )
    return every_n_layers


def import_class(path: str) -> type[nn.Module]:
    """Import ``"package.module.Class"`` and check that it is an ``nn.Module`` subclass."""
    module_name, _, attr = path.rpartition(".")
    hint = "Pass a dotted import path such as 'my_project.model.TransformerBlock', or the class itself."
    if not module_name:
        raise ValueError(f"`layer_cls={path!r}` is not a dotted import path. {hint}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"`layer_cls={path!r}` could not be imported ({err}). {hint}") from err
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise TypeError(f"`layer_cls={path!r}` is {obj!r}, not an `nn.Module` subclass. {hint}")
    return obj


def resolve_layer_classes(layer_cls: LayerClassArg) -> tuple[type[nn.Module], ...] | None:
    """Turn a class, dotted path, or a list of either into a tuple of classes (``None`` stays ``None``)."""
    if layer_cls is None:
        return None
    items = [layer_cls] if isinstance(layer_cls, (str, type)) else layer_cls
    if not isinstance(items, Iterable) or not items:
        raise TypeError(
            f"`layer_cls` must be an `nn.Module` subclass, a dotted import path, a non-empty list of those, or None"
            f" (auto-detect), got {layer_cls!r}."
        )
    classes = []
    for item in items:
        if isinstance(item, str):
            classes.append(import_class(item))
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(
                f"`layer_cls` entries must be `nn.Module` subclasses or dotted import paths, got {item!r}."
            )
    return tuple(dict.fromkeys(classes))


def class_path(cls: type) -> str:
    """The dotted import path of a class, as accepted by :func:`import_class`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def detect_block_class(module: nn.Module) -> type[nn.Module]:
    """Find the repeated block: the one class that fills an ``nn.ModuleList`` or ``nn.Sequential``.

    Containers nested inside an already found block are ignored (an MLP's ``Sequential`` inside a
    transformer block is not a candidate). Raises ``ValueError`` listing the candidates when there is
    no such class or more than one.
    """
    candidates: dict[type[nn.Module], list[str]] = {}
    found_prefixes: list[str] = []
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name.startswith(p + ".") for p in found_prefixes):
            continue
        children = list(container.children())
        kinds = {type(child) for child in children}
        if len(children) >= 2 and len(kinds) == 1:
            cls = kinds.pop()
            if cls in (nn.ModuleList, nn.Sequential):
                continue
            candidates.setdefault(cls, []).append(name or "<root>")
            found_prefixes.append(name)
    if len(candidates) == 1:
        return next(iter(candidates))
    listing = ", ".join(f"{class_path(c)} (in {', '.join(where)})" for c, where in candidates.items())
    if not candidates:
        raise ValueError(
            f"Could not detect the repeated layer of {type(module).__name__}: no `nn.ModuleList`/`nn.Sequential`"
            " holds two or more modules of one class. Pass `layer_cls=` the block class (or its dotted path)."
        )
    raise ValueError(
        f"Found several repeated layer classes in {type(module).__name__}: {listing}."
        " Pass `layer_cls=` the one (or the list) to checkpoint."
    )


def layer_classes(module: nn.Module, layer_cls: LayerClassArg) -> tuple[type[nn.Module], ...]:
    """The classes named by ``layer_cls``, or, for ``None``, the repeated block of ``module`` (logged).

    Raises what :func:`resolve_layer_classes` and :func:`detect_block_class` raise.
    """
    classes = resolve_layer_classes(layer_cls)
    if classes is None:
        classes = (detect_block_class(module),)
        say_once(log, f"lightning_ckpt: detected the repeated layer class {class_path(classes[0])}")
    return classes


def select_layers(
    module: nn.Module, classes: tuple[type[nn.Module], ...], every_n_layers: int = 1
) -> list[tuple[str, nn.Module]]:
    """Matched modules in registration order, outermost only, keeping indices 0, n, 2n, ...

    A module inside another matched module is not a separate layer: checkpointing both would recompute twice.
    """
    matched: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, classes) and not any(is_inside(name, outer) for outer, _ in matched):
            matched.append((name, sub))
    return matched[::every_n_layers]


def is_inside(name: str, outer: str) -> bool:
    """Whether the qualified name ``name`` lies inside ``outer`` (``""`` is the root)."""
    return outer == "" or name.startswith(outer + ".")


def parse_memory_budget(budget: object, allow_auto: bool = False, min_bytes: int = MIN_BUDGET_BYTES
                        ) -> float | int | str | None:
    """Parse ``memory_budget``: ``None``, a fraction in (0, 1], bytes as a whole number, or a string like ``"2GiB"``.

    Returns a float for a fraction and an int for bytes. A whole number is bytes whatever type it arrives as: YAML
    and LightningCLI hand ``5555996`` over as the float ``5555996.0``, so a float with no fractional part above 1 is
    bytes too (``1.0`` is the whole activation memory). Units are decimal (``kB``, ``MB``, ``GB``: powers of 1000) or
    binary (``KiB``, ``MiB``, ``GiB``: powers of 1024). Bytes under ``min_bytes`` (1 KiB) are refused: a small whole
    number from a config or a command line is almost always a fraction written without its point (the plain-PyTorch
    planner, whose budgets are typed in Python, passes ``min_bytes=1``). With ``allow_auto`` (the Lightning callback, which
    knows the device), ``"auto"`` is accepted and returned as is: what fits the accelerator's memory.

    Example::

        >>> parse_memory_budget("2GiB"), parse_memory_budget("2GB"), parse_memory_budget(0.25)
        (2147483648, 2000000000, 0.25)
        >>> parse_memory_budget(5555996.0), parse_memory_budget("5555996"), parse_memory_budget("auto", allow_auto=True)
        (5555996, 5555996, 'auto')
    """
    if budget is None:
        return None
    hint = ("Pass None, a fraction of the un-checkpointed activation memory such as 0.25, or bytes such as '2GiB' or"
            " 500_000_000 (KiB, MiB, GiB are powers of 1024; kB, MB, GB powers of 1000).")
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        if allow_auto:
            return "auto"
        raise ValueError(f"`memory_budget='auto'` is only understood by the GradientCheckpointing callback, which knows"
                         f" the accelerator's memory. {hint}")
    if isinstance(budget, bool):
        raise TypeError(f"`memory_budget={budget!r}` is not understood. {hint}")
    if isinstance(budget, float) and budget > 1.0 and budget.is_integer():
        budget = int(budget)
    if isinstance(budget, float):
        if 0.0 < budget <= 1.0:
            return budget
        raise ValueError(f"`memory_budget={budget!r}`: a fraction must be in (0, 1]; bytes are a whole number. {hint}")
    if isinstance(budget, int):
        return _checked_bytes(budget, budget, min_bytes, hint)
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", budget)
        if match and match.group(2).lower() in _BYTE_UNITS:
            return _checked_bytes(budget, int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]), min_bytes,
                                  hint)
        raise ValueError(f"`memory_budget={budget!r}` is not understood. {hint}")
    raise TypeError(f"`memory_budget={budget!r}` is not understood. {hint}")


def _checked_bytes(given: object, value: int, min_bytes: int, hint: str) -> int:
    """``value`` (the bytes ``given`` stands for) if it is at least ``min_bytes``, else a ``ValueError``."""
    if value <= 0:
        raise ValueError(f"`memory_budget={given!r}`: bytes must be positive. {hint}")
    if value < min_bytes:
        raise ValueError(f"`memory_budget={given!r}` means {value} B, under the least byte budget of {min_bytes} B."
                         f" For a fraction of the activation memory pass a float such as 1.0 or 0.5; for bytes pass"
                         f" '1KiB' or more.")
    return value
