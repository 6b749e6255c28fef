"""The result of planning: :class:`CheckpointPlan`, which mode each matched layer gets, what that is predicted to
hold and cost, and how to apply it to a module, save it and print it. Plain PyTorch.

Example::

    >>> plan = CheckpointPlan({"0": "full", "1": "none"}, baseline_bytes=200, planned_bytes=110, budget_bytes=150,
    ...                       recompute_flops=50, outside_bytes=0)
    >>> plan.peak_bytes, CheckpointPlan.from_state_dict(plan.state_dict()) == plan
    (110, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss
from lightning_ckpt.core.checkpoint.compress import Compress
from lightning_ckpt.core.checkpoint.policies import keep_ops_context_fn
from lightning_ckpt.core.checkpoint.tiling import apply_tiling
from lightning_ckpt.core.measure.costs import LayerCost, Offload
from lightning_ckpt.core.measure.op_curve import describe
from lightning_ckpt.core.measure.profiling import format_bytes, format_flops
from lightning_ckpt.core.checkpoint.wrapping import (
    CheckpointOptions,
    apply_checkpointing,
    check_no_nesting,
    remove_checkpointing,
    turn_off_caches,
)

__all__ = ["CheckpointPlan"]

@dataclass
class CheckpointPlan:
    """Which mode each matched layer gets, and what that is predicted to hold and cost.

    ``layers`` maps every matched layer (in order) to ``"none"``, ``"full"``, ``"selective"`` or ``"ops"``; for an
    ``"ops"`` layer, ``kept_ops[name]`` lists the positions of the ops whose outputs it keeps (it recomputes the
    others, see :mod:`lightning_ckpt.core.measure.op_curve`). Bytes are activation bytes held for backward on the device
    (``outside_bytes``: those of everything outside the matched layers, embeddings, head and loss, part of every
    figure). ``recompute_flops`` is the predicted extra FLOPs per step (see
    :class:`~lightning_ckpt.core.measure.profiling.OpCostMode`). Planned for a device profile, ``predicted_step_seconds`` is
    the step's predicted time with the plan and ``baseline_step_seconds`` without checkpointing, on that profile
    (``device`` names it); else both are ``None``.
    ``offloaded`` lists the layers whose held tensors live in host memory (a checkpointed layer's inputs, or all
    an un-checkpointed layer saves); ``host_bytes`` is what they hold there.

    ``compress`` (``None``, ``"bf16"``, ``"fp8"``) is how the checkpointed layers hold their inputs; ``costs``, and
    every figure, count the inputs at that width. ``tile_mlp`` says the layers' token-wise submodules (their MLPs)
    run over tiles of ``tile_tokens`` tokens (``None``: ALST's ``ceil(length / hidden)`` tiles), as
    :func:`~lightning_ckpt.core.checkpoint.tiling.apply_tiling` does; ``costs`` were measured so, and ``recompute_flops``
    includes the tiles' second forward in backward.

    ``planned_bytes`` is what the forward leaves held; ``peak_bytes`` the step's activation peak, which the budget
    bounds: the end of the forward, or a layer's backward, when it recomputes what it did not keep and makes its
    gradients while the layers before it still hold theirs (:func:`~lightning_ckpt.core.plan.solver.held_peak`).
    """

    layers: dict[str, str]
    baseline_bytes: int
    planned_bytes: int
    budget_bytes: int
    recompute_flops: int
    outside_bytes: int
    planned_host_bytes: int = 0
    offload: Offload = False  # what was asked for; ``offloaded`` is what the plan does
    costs: list[LayerCost] = field(default_factory=list)
    kept_ops: dict[str, list[int]] = field(default_factory=dict)
    predicted_step_seconds: Optional[float] = None
    baseline_step_seconds: Optional[float] = None
    device: Optional[str] = None  # the name of the profile the times are predicted on
    offloaded: list[str] = field(default_factory=list)
    peak_bytes: int = 0  # the step's predicted activation peak (0 in a plan saved before it was predicted)
    baseline_peak_bytes: int = 0  # the same without checkpointing: what a fraction budget is a fraction of
    compress: Optional[Compress] = None  # how checkpointed layers hold their inputs (``costs`` count it)
    chunk_tokens: Optional[int] = None  # the LM head and loss run in chunks of this many tokens (None: unchunked)
    tile_mlp: bool = False  # the layers' token-wise submodules run over tiles of tokens
    tile_tokens: Optional[int] = None  # tokens per tile (None: ALST's rule, ceil(length / hidden) tiles)

    def __post_init__(self) -> None:
        self.peak_bytes = self.peak_bytes or self.planned_bytes
        self.baseline_peak_bytes = self.baseline_peak_bytes or self.baseline_bytes
        if self.offload is True and not self.offloaded:  # a plan saved before `offloaded` existed
            self.offloaded = [name for name, mode in self.layers.items() if mode != "none"]

    @property
    def host_bytes(self) -> int:
        """Bytes the plan keeps in host memory (``planned_host_bytes``)."""
        return self.planned_host_bytes

    @property
    def checkpoints_nothing(self) -> bool:
        """Whether applying the plan leaves a module as it is: no layer checkpointed or offloaded, the LM head and
        loss unchunked. No plan is cheaper, so it also holds for every smaller batch."""
        return (not self.offloaded and self.chunk_tokens is None and not self.tile_mlp
                and all(m == "none" for m in self.layers.values()))

    def applies_like(self, other: CheckpointPlan) -> bool:
        """Whether applying ``other`` does to a module what applying this plan does (the same modes, kept ops,
        offload, compression and LM-head chunks), whatever either predicts: switching between them changes nothing.

        Example::

            >>> a = CheckpointPlan({"l0": "full", "l1": "none"}, 100, 60, 80, 10, 0)
            >>> b = CheckpointPlan({"l0": "full", "l1": "none"}, 200, 120, 160, 20, 0)  # another size, same layout
            >>> a.applies_like(b), a.applies_like(CheckpointPlan({"l0": "none", "l1": "full"}, 100, 60, 80, 10, 0))
            (True, False)
        """
        return self._layout() == other._layout()

    def _layout(self) -> tuple[Any, ...]:
        ops = {name: (list(self.kept_ops[name]), self._op_names(name)) for name, mode in self.layers.items() if mode == "ops"}
        checkpointed = any(mode != "none" for mode in self.layers.values())
        return (dict(self.layers), ops, sorted(self.offloaded), self.compress if checkpointed else None,
                self.chunk_tokens, self.tile_mlp, self.tile_tokens if self.tile_mlp else None)

    def apply(self, module: nn.Module, **checkpoint_options: Any) -> list[str]:
        """Checkpoint ``module``'s layers as planned (layers planned ``"none"`` are left or made plain).

        ``checkpoint_options`` (``use_reentrant``, ``preserve_rng_state``, ``checkpoint_kwargs``) go to
        :func:`~lightning_ckpt.core.checkpoint.wrapping.apply_checkpointing`; layer selection, mode, offload and ``compress``
        come from the plan, and so does the LM head and loss in chunks (``chunk_tokens``) and the tiles
        (``tile_mlp``, ``tile_tokens``; ``tile_cls`` names what to tile where the model's MLPs are not known).
        Returns the checkpointed names, in order.
        Everything is checked before anything changes.
        """
        tile_cls = checkpoint_options.pop("tile_cls", None)
        unknown = set(checkpoint_options) - {"use_reentrant", "preserve_rng_state", "checkpoint_kwargs"}
        if unknown:
            raise TypeError(f"`apply` takes use_reentrant, preserve_rng_state, checkpoint_kwargs and tile_cls; got"
                            f" {sorted(unknown)}. Layer selection, mode and offload come from the plan.")
        for name, mode in self.layers.items():
            if mode != "none" or name in self.offloaded:
                CheckpointOptions(offload=name in self.offloaded, **self._mode_options(name, mode, checkpoint_options))
        layers = {}
        for name in self.layers:
            try:
                layers[name] = module.get_submodule(name)
            except AttributeError as err:
                raise ValueError(f"The plan names layer `{name}`, which {type(module).__name__} does not have: apply"
                                 " a plan to the module it was made for (names are relative to it).") from err
        check_no_nesting(module, list(self.layers))
        for name, mode in self.layers.items():
            remove_checkpointing(layers[name])
            if mode != "none" or name in self.offloaded:  # "none", offloaded: kept in host memory, not recomputed
                apply_checkpointing(layers[name], layer_cls=type(layers[name]), offload=name in self.offloaded,
                                    **self._mode_options(name, mode, checkpoint_options))
        names = [name for name, mode in self.layers.items() if mode != "none"]
        turn_off_caches(module, names)
        if self.chunk_tokens is not None:
            chunk_causal_lm_loss(module, self.chunk_tokens)
        if self.tile_mlp:  # after the layers, which were re-wrapped whole
            apply_tiling(module, tile_cls, self.tile_tokens)
        return names

    def _mode_options(self, name: str, mode: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """``apply_checkpointing`` options for one layer: an ``"ops"`` layer is checkpointed with the policy that
        keeps its planned ops (a ``context_fn``, over one the caller may pass)."""
        options = {**options, "compress": self.compress if mode != "none" else None}
        if mode != "ops":
            return {**options, "mode": mode}
        ops = self._op_names(name)
        context_fn = keep_ops_context_fn(self.kept_ops[name], ops)
        return {**options, "mode": "full", "checkpoint_kwargs": {**(options.get("checkpoint_kwargs") or {}),
                                                                  "context_fn": context_fn}}

    def _op_names(self, name: str) -> list[str]:
        """The ops of layer ``name``'s forward, in the order ``kept_ops`` positions count."""
        return [r.op for r in next(c for c in self.costs if c.name == name).ops]

    def state_dict(self) -> dict[str, Any]:
        """Plain data (for a Lightning checkpoint); :meth:`from_state_dict` rebuilds the plan."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CheckpointPlan:
        return cls(**{**state, "costs": [LayerCost(**c) for c in state.get("costs", [])]})

    def __str__(self) -> str:
        head = ("layer", "class", "none", "full", "selective", "FLOPs full", "FLOPs selective", "choice")
        rows = [head]
        for cost in self.costs:
            rows.append((cost.name, cost.cls, format_bytes(cost.none_bytes), format_bytes(cost.device_bytes("full", self.offload is True)),
                         format_bytes(cost.device_bytes("selective", self.offload is True)), format_flops(cost.full_flops),
                         format_flops(cost.selective_flops), self._choice_text(cost.name)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines += [self._ops_line(cost) for cost in self.costs if self.layers.get(cost.name) == "ops"]
        n = sum(mode != "none" for mode in self.layers.values())
        pct = 100 * self.planned_bytes / self.baseline_bytes if self.baseline_bytes else 0.0
        lines += [
            f"outside the layers: {format_bytes(self.outside_bytes)} (in every figure below)",
            f"plan: {n} of {len(self.layers)} layers checkpointed; activations {format_bytes(self.planned_bytes)}"
            f" ({pct:.0f}% of {format_bytes(self.baseline_bytes)} without checkpointing), peak"
            f" {format_bytes(self.peak_bytes)} (budget {format_bytes(self.budget_bytes)},"
            f" {format_bytes(self.baseline_peak_bytes)} without checkpointing); recompute"
            f" {format_flops(self.recompute_flops)} per step"
            + (f"; {format_bytes(self.planned_host_bytes)} offloaded to host ({len(self.offloaded)} layers)"
               if self.offload else "")
            + (f"; inputs held as {self.compress}" if self.compress else "")
            + (f"; LM head and loss in chunks of {self.chunk_tokens} tokens" if self.chunk_tokens else "")
            + ((f"; MLPs in tiles of {self.tile_tokens} tokens" if self.tile_tokens else "; MLPs in tiles")
               if self.tile_mlp else "")
            + (f"; {self.step_time_text()}" if self.predicted_step_seconds is not None else ""),
        ]
        return "\n".join(lines)

    @property
    def step_time_increase(self) -> Optional[float]:
        """Predicted step time with the plan over without checkpointing, less one (``0.12``: 12% slower)."""
        if self.predicted_step_seconds is None or not self.baseline_step_seconds:
            return None
        return self.predicted_step_seconds / self.baseline_step_seconds - 1

    def step_time_text(self) -> str:
        """``'+12% step time (41.0 ms vs 36.6 ms on h100-sxm)'``."""
        plan, base = 1000 * (self.predicted_step_seconds or 0.0), 1000 * (self.baseline_step_seconds or 0.0)
        return (f"+{100 * (self.step_time_increase or 0.0):.0f}% step time ({plan:.1f} ms vs {base:.1f} ms without"
                f" checkpointing on {self.device})")

    def _choice_text(self, name: str) -> str:
        mode = self.layers.get(name, "?")
        return f"{mode} +offload" if self.offload == "auto" and name in self.offloaded else mode

    def _ops_line(self, cost: LayerCost) -> str:
        """What an op-level choice holds, costs, keeps and recomputes."""
        keep = self.kept_ops[cost.name]
        return (f"  {cost.name} (ops): {format_bytes(cost.device_bytes('ops', self.offload is True, keep))},"
                f" {format_flops(cost.flops('ops', keep))}; {describe(cost.ops, keep)}")
