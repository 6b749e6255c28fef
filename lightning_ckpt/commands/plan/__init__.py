"""``lightning-ckpt plan``: what fits, before a run starts.

The command: its arguments and :func:`main`. How it measures is :mod:`~lightning_ckpt.commands.plan.measure`,
what it predicts from the measurements :mod:`~lightning_ckpt.commands.plan.predictions`, and how it reports
:mod:`~lightning_ckpt.commands.plan.report`.

One training step of a LightningCLI config's model and data is measured with every matched layer fully
checkpointed (:func:`~lightning_ckpt.core.plan.planner.measure_layer_costs`): each layer's activation bytes
un-checkpointed, fully and selectively checkpointed, and its recompute FLOPs. From those numbers alone (no
further runs) it predicts the activations and extra FLOPs of the standard settings (none, every 4th, every
2nd, every layer, selective everywhere) and of the plan for ``--memory-budget``, and adds the static memory
(weights, gradients and the configured optimizer's state, counted after one optimizer step).

With ``--device-memory`` the step is measured at two batch sizes, each setting's activations and step peak are
fitted as ``fixed + per_sample * batch``, and the largest batch size each setting fits is printed (static memory
plus the step's peak, forward and backward).

With ``--lengths 512,2048,8192`` the step is measured again at each sequence length, at the loader's batch size:
the batch's token ids (its first 2-D integer tensor, batch x length) and every tensor with their length in dim 1
(labels, masks) are cut or tiled along dim 1. A length beyond what the model takes (its ``block_size`` or
``max_position_embeddings``) is a usage error. The report adds the plan for the budget at each length (its layers,
peak, recompute FLOPs and, with ``--device``, step time) and each setting's peak at each length, every row naming
the shape measured (batch x length). With ``--device-memory`` and 2 or more lengths, each setting's peak is fitted
over the length (a quadratic through 3 or more lengths, for attention's ``T^2`` terms; a line through 2) and the
largest length it fits is printed beside the largest batch (static memory plus the fitted peak). So is the plan's
own longest length: the least peak its settings (:func:`~lightning_ckpt.commands.plan.planning.plan_settings`: offload, compression, the chunked LM head and
loss) reach at each length, fitted alike; the step is measured again at that length and the plan made there for the
device memory less static memory, with its predicted step time.

With ``--fake``, or by default when the static memory would not fit this machine, the model is built and
the step run under ``torch._subclasses.FakeTensorMode``: shapes, dtypes and bytes without any storage, as
torch's own AutoSAC estimator measures. A 7B-parameter config can be planned on a laptop. When the config's
accelerator is not available here (a ``cuda`` config on a laptop), ``--fake`` is implied and the trainer is built
with ``accelerator="cpu", devices=1`` for planning, the precision kept (``bf16-mixed`` runs under CPU autocast
to bfloat16): PyTorch built without CUDA cannot run autograd on fake CUDA tensors, so the step runs CPU kernels'
shape and dtype rules, and the report says which attention kernel ran and how the target's may differ.

The datamodule is built with real tensors (data is cheap, and its values steer the branches a step takes, see
:mod:`lightning_ckpt.core.measure.fake_values`); weights are not initialised under fake tensors (Transformers'
``no_init_weights``), and modules may be moved (PEFT's adapters). A model that fake tensors still cannot build (its own
code reads a value of its weights) is measured with real tensors instead, its size first checked on the meta device, and stdout says why; with
``--fake`` or without the config's accelerator it is an error that says where to run instead.

Static memory is one device's share. The command launches no process: the trainer is built for one device
without a strategy, and the configured ``trainer.strategy``, ``devices`` and ``num_nodes`` only say how static
memory is divided (:func:`~lightning_ckpt.commands.plan.sharding.sharding_of`). Under the package's ``fsdp_ckpt``,
Lightning's ``FSDPStrategy`` (by its ``sharding_strategy``) or ``ModelParallelStrategy`` (a name, or a
``class_path`` with ``init_args``), each device holds its share of the parameters, gradients and optimizer state
over the data-parallel devices (devices x num_nodes for ``fsdp_ckpt`` and full sharding), rows padded as
``fully_shard`` pads them; buffers and 0-d state whole. The largest batch is then per device.

Under ``fsdp_ckpt``'s CPU offload (``--trainer.strategy=fsdp_ckpt_cpu_offload``, or ``cpu_offload: true`` in its
``init_args``) that share is in host memory, and the device holds the buffers and what FSDP2 gathers there
(:func:`~lightning_ckpt.commands.plan.static_memory.gathered_bytes`): the root units' parameters (kept from their forward to
the end of the backward) and two blocks' (one computing, the next prefetched), in the dtype they are gathered in
(bfloat16 under ``bf16-mixed``), and the gradients of the roots and of one block; no optimizer state. One device
(``--trainer.devices=1``) can then be planned as ALST's one-GPU runs are.

``--host-memory 256GiB`` is the target's host memory per device (default: half of this machine's available memory,
which the report then says): what offloaded activations may take, less what CPU offload keeps there. Where no plan
fits it (the planner's "needs more than `host_memory=...`"), the report says so, and at the plan's longest length
that it, not an overshoot of the device, made the length shorter.

LightningCLI arguments after the options override the config, as for ``lightning-ckpt fit``.

Example::

    lightning-ckpt plan --config configs/tiny.yaml --memory-budget 0.5 --device-memory 80GiB
    lightning-ckpt plan --config configs/tiny.yaml --trainer.accelerator=cuda --trainer.precision=bf16-mixed \
        --model.init_args.n_embd=4096 --model.init_args.n_layer=32 --device-memory 80GiB
    lightning-ckpt plan --config configs/tiny.yaml --trainer.strategy=fsdp_ckpt_cpu_offload --trainer.devices=1 \
        --offload true --device-memory 80GiB --host-memory 256GiB

With ``--device`` (a preset such as ``h100-sxm``, or ``auto``: the accelerator the step runs on, measured) the
plan minimises the predicted step time on that device, and every setting gets its predicted step time
(:func:`~lightning_ckpt.core.plan.planner.predict_seconds`). ``--offload auto|true|false`` (default: the config's
``GradientCheckpointing`` offload) plans with offload; ``auto`` (which needs ``--device``) lets the plan choose per
layer what lives in host memory, shown in the per-layer table (``+offload``) and in ``plan.json``'s ``offloaded``.
``--compress bf16|fp8|none`` (default: the config's ``GradientCheckpointing`` compress) counts every setting's
checkpointed layers with their inputs held compressed (:meth:`~lightning_ckpt.core.measure.costs.LayerCost.compressed`).
``--tile-mlp true|false`` (default: the config's ``GradientCheckpointing`` tile_mlp) measures every step with each
layer's MLP and norms (and the final norm) over tiles of tokens (:func:`~lightning_ckpt.core.checkpoint.tiling.apply_tiling`), so
every setting and the plan's longest length are with tiles; ``plan.json``'s ``tile_mlp`` says so. The tiles' second
forward is not in the settings' recompute FLOPs.
``--lean-layers true|false`` (default: the config's ``GradientCheckpointing`` lean_layers) measures every step with
each layer's norms recomputed in backward and its gated MLP keeping gate and up only
(:func:`~lightning_ckpt.core.checkpoint.lean.apply_lean`: the same gradients, less held); ``plan.json``'s
``lean_layers`` says so.
``--chunk-loss auto|true|false`` (default: the config's ``GradientCheckpointing`` chunk_loss, else ``auto``): for a
model whose loss :func:`~lightning_ckpt.core.checkpoint.chunked_loss.chunk_causal_lm_loss` can chunk (Transformers
``*ForCausalLM``, litgpt's ``GPT``, the demo GPT), the step is measured a second time with the LM head and loss in
chunks of tokens (:func:`~lightning_ckpt.core.plan.planner.measure_chunked_head`); the plan then runs them chunked
(``true``), never (``false``) or where that is cheaper or the only way to the budget (``auto``), and the Settings
table gets ``every_layer_chunked`` (every layer full, the head and loss chunked).

It prints a Markdown report and writes it to ``plan.md`` in ``--output-dir`` (default
``lightning_ckpt_plan/<config name>``), with every figure in ``plan.json`` and a plot in ``plan.png``.
Exit status: 0, 1 when the budget cannot be met (the report says what can), 2 for a usage error.

``plan.json`` (bytes and FLOPs as integers, ``null`` where a figure does not apply):

- ``config``, ``model``: the config file's name and the LightningModule's class; ``fake``: measured under
  FakeTensorMode; ``planned_for``: the configured accelerator when it is missing here, else ``null``.
- ``batch_size``: the measured batch; ``batch_sizes``: both measured with ``--device-memory``.
- ``memory_budget``: as given (a fraction or bytes); ``device_memory``: ``--device-memory`` in bytes;
  ``device``: the ``--device`` profile's name, or ``null``; ``priced_by``: what the plan's choices were priced by, in
  words: the times each layer took in the measuring step here (real tensors, no ``--device`` or ``--device auto``),
  a preset's datasheet rates, or recompute FLOPs (fake tensors); ``offload``: what was planned with, ``true``, ``false``
  or ``"auto"``; ``host_memory``: ``{bytes, given, static_bytes, for_offload_bytes}``, the host memory per device
  planned with (``--host-memory``, ``given: true``, or this machine's), what CPU offload keeps of it and what is left
  for offloaded activations (the planner's ``host_memory``).
- ``outside_bytes``: activations held outside the matched layers (embeddings, head, loss), part of every setting.
- ``static_bytes_per_device``: weights, gradients and optimizer state one device holds.
- ``static``: ``weights_bytes`` (parameters and buffers), ``gradient_bytes``, ``optimizer_state_bytes``
  (``null`` when ``configure_optimizers`` could not run), ``optimizer``, ``unsharded_bytes`` (the three summed,
  undivided), ``strategy``, ``world`` (devices x num_nodes), ``weight_shards`` and ``state_shards`` (how many ways
  parameters, and gradients and optimizer state, are divided), ``note`` (what is not modelled, how CPU offload is
  counted); ``cpu_offload`` (``fsdp_ckpt``'s: the device figures are then the buffers and what FSDP2 gathers),
  ``host_weights_bytes``, ``host_gradient_bytes``, ``host_optimizer_state_bytes`` and ``host_bytes`` (their sum):
  this device's share in host memory under CPU offload, 0 without.
- ``layers``: per matched layer ``{name, class, none_bytes, full_bytes, selective_bytes, full_flops,
  selective_flops}``: bytes held not checkpointed, fully and selectively checkpointed; FLOPs recomputed.
- ``settings``: per setting ``{name, description, checkpointed_layers, activation_bytes, peak_bytes, host_bytes,
  recompute_flops, predicted_step_seconds, fixed_bytes, per_sample_bytes, peak_fixed_bytes, peak_per_sample_bytes,
  largest_batch}`` (``activation_bytes``: held
  on the device at the end of the forward; ``peak_bytes``: the step's activation peak on the device, forward and
  backward, which a budget bounds; ``host_bytes``: held in host memory by offloaded layers, in neither), names
  ``none``, ``every_4th``,
  ``every_2nd``, ``every_layer``, ``selective``, ``every_layer_chunked`` (when the step was measured with the LM head
  and loss in chunks too) and ``plan`` (when the budget can be met).
  ``predicted_step_seconds``: on the ``--device`` profile, ``null`` without one. ``fixed_bytes`` and ``per_sample_bytes``: the fit
  ``activations = fixed + per_sample x batch``, ``peak_fixed_bytes`` and ``peak_per_sample_bytes`` the same for the
  peak, and ``largest_batch`` the largest batch per device whose peak fits in ``device_memory`` with the static
  memory, all ``null`` without ``--device-memory`` (``largest_batch`` also when the peak does not grow with the
  batch). Every setting's figures count the costs as the planner plans them (with ``--device``, every layer's
  inputs can move to host memory), so the ``plan`` row is the plan's own line.
- ``plan``: ``{layers, offloaded, compress, chunk_tokens, kept_ops, budget_bytes, activation_bytes, peak_bytes,
  host_bytes, recompute_flops, predicted_step_seconds, baseline_step_seconds}``: each layer's mode, the layers whose held tensors go to host
  memory, the op outputs an ``ops`` layer keeps, the tokens a chunk of the LM head and loss (``null``: whole), the
  budget in bytes and the plan's predictions; ``null`` with
  ``plan_error`` saying why when the budget cannot be met.
- ``front``: the planner's plans for budgets from the least setting up to no checkpointing, planned with the same
  offload as the plan, each ``{budget_bytes, activation_bytes, peak_bytes, host_bytes, recompute_flops,
  predicted_step_seconds}`` (what ``plan.png`` draws as a line).
- With ``--lengths`` only: ``lengths``, per length ``{length, batch_size, tokens, plan, plan_error, settings}``
  (``plan`` as above or ``null`` with ``plan_error``; ``least_peak_bytes``: the least peak the plan's settings
  reach; ``settings`` each ``{name, peak_bytes, activation_bytes, recompute_flops, predicted_step_seconds}``);
  ``length_fit``: ``"quadratic"``, ``"linear"`` or ``null`` (one length); ``largest_length``: setting -> the
  largest length that fits ``device_memory`` at ``batch_size``, and ``"plan"``: the longest the plan itself fits
  (``null`` when unbounded; the whole entry ``null`` without ``--device-memory``); ``longest_plan``: ``{fitted_length,
  length, batch_size, least_peak_bytes, plan, plan_error, predicted_seconds_per_token, shortened}``, the plan made at
  its longest length (``null`` without ``--device-memory`` or with one length); ``shortened``: why each shorter length
  was measured, ``"overshot"`` (the least peak was over the room), ``"host_memory"`` (no plan fit the host memory)
  or ``"no_plan"``. ``plan.png`` then has a second panel:
  each setting's peak against the length, the plan's least peak, the room the device leaves and the plan at its
  longest length.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from lightning_ckpt.commands.arguments import (
    add_config_argument,
    add_device_argument,
    check_config_argument,
    check_device_argument,
    parse_budget_arg,
    parse_bytes_arg,
)
# Aliased: bound here as `build`, `static_memory` and `measure`, the functions would hide the submodules
# `lightning_ckpt.commands.plan.build`, `.static_memory` and `.measure`.
from lightning_ckpt.commands.plan.build import Built, accelerator_available, configured_accelerator
from lightning_ckpt.commands.plan.build import build as build_from
from lightning_ckpt.commands.plan.measure import Measurement, check_length, device_profile, loader_batch_size
from lightning_ckpt.commands.plan.measure import measure as measure_at
from lightning_ckpt.commands.plan.plan_files import plot, report_data
from lightning_ckpt.commands.plan.planning import _across_lengths, _plan_longest, _rows, host_memory_of, plan_settings
from lightning_ckpt.commands.plan.predictions import planner_front
from lightning_ckpt.commands.plan.report import render
from lightning_ckpt.commands.plan.result import PlanResult
from lightning_ckpt.commands.plan.static_memory import static_memory as static_memory_of
from lightning_ckpt.commands.plan.static_memory import would_not_fit
from lightning_ckpt.core.checkpoint.lean import apply_lean
from lightning_ckpt.core.checkpoint.tiling import apply_tiling
from lightning_ckpt.core.measure.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.core.measure.longest import length_limit

__all__ = ["main"]

DEFAULT_BUDGET = 0.5
#: Arguments after the options that go to LightningCLI (config overrides).
_CLI_PREFIXES = ("--trainer.", "--model", "--data", "--seed_everything", "--optimizer", "--lr_scheduler")


# ------------------------------------------------------------------------------------------------ arguments


def _lengths(text: str) -> tuple[int, ...]:
    """``--lengths`` text as sorted distinct lengths.

    Example::

        >>> _lengths("2048,512, 8192,512")
        (512, 2048, 8192)
    """
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass sequence lengths of 1 or more, comma-separated, such as"
                                         " 512,2048,8192")
    return tuple(lengths)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        # No abbreviations: an option added later (such as a `--device`) must not be read as `--device-memory`.
        prog="lightning-ckpt plan", allow_abbrev=False,
        description="Measure one training step of a LightningCLI config and show what each checkpointing setting"
                    " holds and recomputes, the cheapest plan for a memory budget, and (with --device-memory) the"
                    " largest batch size each setting fits.")
    add_config_argument(parser)
    parser.add_argument("--memory-budget", default=None,
                        help="a fraction of the activation peak without checkpointing (0.5) or bytes (2GiB); default:"
                             f" the config's GradientCheckpointing memory_budget, else {DEFAULT_BUDGET}")
    parser.add_argument("--device-memory", default=None,
                        help="memory of the target device (80GiB): also print the largest batch size each setting fits")
    add_device_argument(parser, "plan for the least predicted step time on this device",
                        "default: the fewest recompute FLOPs, no step times")
    parser.add_argument("--offload", choices=("auto", "true", "false"), default=None,
                        help="plan with offload: 'true' (every checkpointed layer's inputs in host memory), 'false', or"
                             " 'auto' (the plan chooses per layer; needs --device); default: the config's"
                             " GradientCheckpointing offload")
    parser.add_argument("--host-memory", default=None,
                        help="host memory per device on the target (256GiB), for what offload keeps there: the"
                             " offloaded activations and, under fsdp_ckpt's cpu_offload, the parameters, gradients and"
                             " optimizer state; default: half of this machine's available memory")
    parser.add_argument("--compress", choices=("bf16", "fp8", "none"), default=None,
                        help="plan with the checkpointed layers' inputs held as bf16 or fp8 (see the guide 'Compressed"
                             " checkpoints'), or 'none' (exact); default: the config's GradientCheckpointing compress")
    parser.add_argument("--chunk-loss", choices=("auto", "true", "false"), default=None,
                        help="plan with the LM head and loss in chunks of tokens (see the guide 'Long sequences'):"
                             " 'true', 'false', or 'auto' (the plan chooses them where it is cheaper or only reaches"
                             " the budget with them); default: the config's GradientCheckpointing chunk_loss, else"
                             " 'auto'")
    parser.add_argument("--tile-mlp", choices=("true", "false"), default=None,
                        help="measure with each layer's MLP and norms (and the final norm) over tiles of tokens, so one"
                             " layer's backward holds one tile's MLP intermediates (see the guide 'Long sequences');"
                             " default: the config's GradientCheckpointing tile_mlp")
    parser.add_argument("--lean-layers", choices=("true", "false"), default=None,
                        help="measure with each layer's norms recomputed in backward and its gated MLP keeping gate"
                             " and up only (the same gradients; see the guide 'Long sequences'); default: the config's"
                             " GradientCheckpointing lean_layers")
    parser.add_argument("--lengths", type=_lengths, default=(),
                        help="sequence lengths to plan at too (512,2048,8192): the step measured at each, the batch's"
                             " token ids and every tensor of their length cut or tiled; with --device-memory also the"
                             " largest length each setting fits")
    parser.add_argument("--fake", action="store_true",
                        help="measure under FakeTensorMode: no memory allocated (default when the model would not fit"
                             " this machine)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write plan.md and plan.json (default: lightning_ckpt_plan/<config name>)")
    args, extra = parser.parse_known_args(list(argv))
    bad = [a for a in extra if a.startswith("-") and not a.startswith(_CLI_PREFIXES)]
    if bad or (extra and not extra[0].startswith("-")):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra[:1])} (LightningCLI overrides start with"
                     " --trainer., --model., --data., such as --model.init_args.n_layer=32)")
    args.cli_args = extra
    check_config_argument(parser, args.config, "plan")
    if args.memory_budget is not None:
        try:
            args.memory_budget = parse_budget_arg(args.memory_budget)
        except (TypeError, ValueError):
            parser.error(f"--memory-budget {args.memory_budget}: pass a fraction in (0, 1] of the activations without"
                         " checkpointing, such as 0.3, or bytes, such as 2GiB or 500000000")
    check_device_argument(parser, args.device)
    if args.device_memory is not None:
        try:
            args.device_memory = parse_bytes_arg(args.device_memory)
        except (TypeError, ValueError):
            parser.error(f"--device-memory {args.device_memory}: pass the device's memory in bytes, such as 80GiB,"
                         " 40e9 or 16000000000")
    if args.host_memory is not None:
        try:
            args.host_memory = parse_bytes_arg(args.host_memory)
        except (TypeError, ValueError):
            parser.error(f"--host-memory {args.host_memory}: pass the target's host memory per device in bytes, such"
                         " as 256GiB, 2.5e11 or 250000000000")
    return args


# ------------------------------------------------------------------------------------------------ driver


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-ckpt plan --config X.yaml [--memory-budget 0.3] [--device-memory 80GiB] [--host-memory 256GiB]
    [--lengths 512,2048] [--fake]``; the exit status."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        built = _build(args)
    except ValueError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    if built.offload == "auto" and args.device is None:
        print("plan: offload 'auto' prices offload against recompute in time on a device: pass --device NAME (a preset"
              f" such as {PRESET_NAMES[0]}) or --device auto, or --offload true/false.", file=sys.stderr)
        return 2
    try:
        for length in args.lengths:
            check_length(built, length)
        profile = device_profile(args.device, built)
    except ValueError as err:
        print(f"plan: {str(err).removeprefix('plan: ')}", file=sys.stderr)
        return 2
    measured = _run(args, built)
    result = _compute(args, built, measured, profile, lambda length: _measure(built, measured.main.batch_size, length))
    _write(result, (args.output_dir or Path("lightning_ckpt_plan") / args.config.stem).resolve())
    if result.plan is None:
        print(f"plan: memory_budget={result.budget!r} cannot be met; see 'No plan' above.", file=sys.stderr)
        return 1
    return 0


def _build(args: argparse.Namespace) -> Built:
    """The config built for measuring: under fake tensors when asked, when the configured accelerator is missing
    here or when the static memory would not fit this machine (each said on stdout); ``--offload`` applied.

    A model that cannot be built under fake tensors (PEFT's adapters swap weights, which fake tensors refuse; a
    ViT's ``trunc_normal_`` init reads a value) is measured for real when that is allowed, its size checked on the
    meta device first, and stdout says why. Raises ``ValueError`` when only fake tensors would do."""
    fake = args.fake
    target = configured_accelerator(args.config, args.cli_args)
    if not accelerator_available(target):
        if not fake:
            print(f"plan: the config's accelerator {target!r} is not available here; planning for it with fake tensors"
                  " on the CPU (no memory allocated).", flush=True)
        fake = True
    try:
        built = build_from(args.config, fake=True, cli_args=args.cli_args)
    except Exception as err:  # whatever the model's own code raises under fake tensors
        built = _build_without_fake(args, fake, err)
    else:
        if not fake and would_not_fit(built):
            print(f"plan: the weights, gradients and optimizer state would not fit this machine's {built.device}"
                  " memory; measuring with fake tensors (no memory allocated).", flush=True)
            fake = True
        if not fake:
            built = build_from(args.config, fake=False, cli_args=args.cli_args, seed_banner=False)
    if args.offload is not None:
        built.offload = {"true": True, "false": False, "auto": "auto"}[args.offload]
    if args.compress is not None:
        built.compress = None if args.compress == "none" else args.compress
    if args.chunk_loss is not None:
        built.chunk_loss = {"true": True, "false": False, "auto": None}[args.chunk_loss]
    if args.tile_mlp is not None:
        built.tile_mlp = args.tile_mlp == "true"
    if args.lean_layers is not None:
        built.lean_layers = args.lean_layers == "true"
    if built.lean_layers:  # every step measured lean, as the run would take it
        apply_lean(built.module)
    if built.tile_mlp:  # every step measured with the tiles, as the run would take it
        apply_tiling(built.module, built.tile_cls, built.tile_tokens)
    return built


def _build_without_fake(args: argparse.Namespace, fake: bool, err: Exception) -> Built:
    """The config built for real after ``err`` stopped its build under fake tensors, if the accelerator is here, no
    ``--fake`` was asked and the model fits (checked on the meta device)."""
    while (err.__cause__ or err.__context__) is not None:  # jsonargparse wraps the model's own error
        err = err.__cause__ or err.__context__
    why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if fake:
        raise ValueError(f"the model cannot be built under fake tensors ({why}), which --fake or a missing"
                         " accelerator needs; run plan without --fake on a machine that has the config's accelerator")
    sized = build_from(args.config, fake=False, meta=True, cli_args=args.cli_args, seed_banner=False)
    if would_not_fit(sized):
        raise ValueError(f"the model cannot be built under fake tensors ({why}) and its weights, gradients and"
                         " optimizer state would not fit this machine's memory; run plan on a machine with more memory")
    print(f"plan: the model cannot be built under fake tensors ({why}); measuring with real tensors (its size"
          " checked on the meta device first).", flush=True)
    return build_from(args.config, fake=False, cli_args=args.cli_args, seed_banner=False)


@dataclass
class _Measured:
    """The steps measured: at the loader's batch, at a second batch size (``--device-memory``) and at each of
    ``--lengths``."""

    main: Measurement
    other: Optional[Measurement] = None
    at_lengths: list[Measurement] = field(default_factory=list)


def _run(args: argparse.Namespace, built: Built) -> _Measured:
    """Measure the step at the loader's batch size, at half of it with ``--device-memory``, and at each length; with
    ``compress`` every setting's checkpointed layers hold their inputs compressed (:meth:`LayerCost.compressed`)."""
    size = loader_batch_size(built.loader)
    measured = _Measured(_measure(built, size))
    if args.device_memory is not None:
        measured.other = _measure(built, size // 2 if size >= 2 else 2)
    measured.at_lengths = [_measure(built, size, length) for length in args.lengths]
    return measured


def _measure(built: Built, batch_size: int, length: Optional[int] = None) -> Measurement:
    """One step measured at ``batch_size`` (x ``length``), its layers' inputs held as ``built.compress`` says."""
    m = measure_at(built, batch_size, length)
    return replace(m, costs=[c.compressed(built.compress) for c in m.costs])


def _compute(args: argparse.Namespace, built: Built, measured: _Measured, profile: Optional[DeviceProfile],
             measure_length: Optional[Callable[[int], Measurement]] = None) -> PlanResult:
    """The plan for the budget, every setting's predictions, the planner's front and, with ``--lengths``, the same
    at each length with the largest length each setting, and the plan's settings, fit (``measure_length`` measures
    the step again at the plan's longest length, for the plan there)."""
    config_budget = built.memory_budget if built.memory_budget not in (None, "auto") else None
    budget = args.memory_budget if args.memory_budget is not None else config_budget or DEFAULT_BUDGET
    main_m, other = measured.main, measured.other
    static = static_memory_of(built)  # its optimizer step changes the weights: after every measurement but the longest
    host = host_memory_of(getattr(args, "host_memory", None), static)
    settings = plan_settings(built, profile, host)
    plan, plan_error = settings.plan(main_m, budget)
    room = None if args.device_memory is None else args.device_memory - static.total
    rows = _rows(main_m, plan, built.offload, profile, other, room)
    front = planner_front(main_m, built.offload, min(r.peak_bytes for r in rows),
                          include=[plan.budget_bytes] if plan is not None else [], device=profile,
                          host_memory=settings.host_memory, modes=settings.modes)
    batch_sizes = sorted([main_m.batch_size] + ([other.batch_size] if other else []))
    result = PlanResult(args.config.name, built, main_m, plan, plan_error, budget, rows, static, args.device_memory,
                        batch_sizes, front, profile, host_memory=host)
    if measured.at_lengths:
        _across_lengths(result, measured.at_lengths, room, settings)
        if room is not None and len(measured.at_lengths) >= 2 and measure_length is not None:
            _plan_longest(result, room, settings, measure_length, length_limit(built.module))
    return result


def _write(result: PlanResult, out_dir: Path) -> None:
    """Print the report and write it to ``plan.md``, with ``plan.json`` and ``plan.png``, in ``out_dir``."""
    report = render(result)
    data = report_data(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.md").write_text(report)
    (out_dir / "plan.json").write_text(json.dumps(data, indent=1) + "\n")
    drawn = plot(data, out_dir / "plan.png") is not None
    print(report)
    print(f"plan: wrote {out_dir / 'plan.md'}, plan.json" + (" and plan.png" if drawn else ""), flush=True)
