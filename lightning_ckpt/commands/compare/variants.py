"""The variants ``compare`` runs: what each one sets on ``GradientCheckpointing``, in which order, and which of
them a config can run (``planned`` needs its own ``memory_budget``). Plain data and config reading.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

#: Variant name -> ``GradientCheckpointing`` settings (``None``: no checkpointing), in the order they run.
VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "every_layer": {"every_n_layers": 1, "mode": "full", "offload": False},
    "selective": {"every_n_layers": 1, "mode": "selective", "offload": False},
    "every_2nd": {"every_n_layers": 2, "mode": "full", "offload": False},
    "every_4th": {"every_n_layers": 4, "mode": "full", "offload": False},
    "offload": {"every_n_layers": 1, "mode": "full", "offload": True},
    "every_layer_fp8": {"every_n_layers": 1, "mode": "full", "offload": False, "compress": "fp8"},
}
#: The config's own ``GradientCheckpointing``, run as written, when it has a ``memory_budget``.
PLANNED = "planned"
DESCRIPTIONS = {
    "none": "no checkpointing",
    "every_layer": "every layer",
    "selective": "every layer, selective",
    "every_2nd": "every 2nd layer",
    "every_4th": "every 4th layer",
    "offload": "every layer, inputs offloaded to host",
    "every_layer_fp8": "every layer, inputs held as fp8",
    PLANNED: "the config's memory_budget plan",
}
BASELINE = "none"

#: The least cosine similarity a compressed variant's step-1 gradients must keep to the baseline's, per parameter:
#: its forward is exact (the loss is checked as tightly as any variant's), its backward starts from rounded inputs.
#: Set under the least single-parameter cosines bench_compress.py measured (fp8: 0.9984 on a Llama's k_proj; bf16:
#: 0.999994), with room for other models: a wrong gradient (a bug) is far below either.
MIN_COSINE = {"bf16": 0.9999, "fp8": 0.99}


def compress_of(settings: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The ``compress`` setting of a variant's (or a config's) ``GradientCheckpointing`` settings, if any.

    Example::

        >>> compress_of(VARIANTS["every_layer_fp8"]), compress_of(VARIANTS["none"])
        ('fp8', None)
    """
    return (settings or {}).get("compress")


def is_callback(entry: Any, name: str) -> bool:
    """Whether a ``trainer.callbacks`` entry of a LightningCLI config is the class ``name`` (by its class_path)."""
    path = entry.get("class_path", "") if isinstance(entry, Mapping) else entry if isinstance(entry, str) else ""
    return path == name or path.endswith("." + name)


def checkpointing_args(base: Mapping[str, Any]) -> dict[str, Any]:
    """The ``init_args`` of the config's ``GradientCheckpointing`` entry (``{}`` when it has none)."""
    callbacks = (base.get("trainer") or {}).get("callbacks") or []
    callbacks = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks)
    for entry in callbacks:
        if is_callback(entry, "GradientCheckpointing"):
            return dict(entry.get("init_args") or {}) if isinstance(entry, Mapping) else {}
    return {}


def planned_settings(base: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The settings of the ``planned`` variant: the config's ``GradientCheckpointing`` as written, when it has a
    ``memory_budget``; ``None`` otherwise (then there is no ``planned`` variant).

    Example::

        >>> cb = {"class_path": "lightning_ckpt.GradientCheckpointing", "init_args": {"memory_budget": 0.3}}
        >>> planned_settings({"trainer": {"callbacks": [cb]}})
        {'memory_budget': 0.3}
        >>> planned_settings({"trainer": {"callbacks": []}}) is None
        True
    """
    args = checkpointing_args(base)
    return args if args.get("memory_budget") is not None else None


def available_variants(base: Mapping[str, Any]) -> list[str]:
    """Every variant this config can run, in order: :data:`VARIANTS`, then ``planned`` if it has a budget.

    Example::

        >>> available_variants({})
        ['none', 'every_layer', 'selective', 'every_2nd', 'every_4th', 'offload', 'every_layer_fp8']
    """
    return list(VARIANTS) + ([PLANNED] if planned_settings(base) is not None else [])
