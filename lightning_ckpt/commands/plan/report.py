"""How ``lightning-ckpt plan`` reports: the Markdown report (``plan.md``, :func:`render`).

Every figure as plain data (``plan.json``) and the plot of activations against recompute (``plan.png``) are
:mod:`~lightning_ckpt.commands.plan.plan_files`; what one run found is
:mod:`~lightning_ckpt.commands.plan.result`. Their names are importable from here too, where they were before.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_ckpt.commands.plan.build import PLANNING_TRAINER, Built
from lightning_ckpt.commands.plan.static_memory import HostMemory, StaticMemory
from lightning_ckpt.commands.plan.predictions import SETTINGS, host_memory_short
from lightning_ckpt.core.measure.op_curve import describe
from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import CheckpointPlan, make_option
from lightning_ckpt.core.measure.timing import price_source
# What a run found, plan.json and plan.png have their own modules (issue 43); their names are importable from here
# too, where tests and benchmarks import them.
from lightning_ckpt.commands.plan.result import LengthResult, LongestPlan, PlanResult  # noqa: F401
from lightning_ckpt.commands.plan.plan_files import _plot_lengths, plot, report_data  # noqa: F401


def _b(n: Optional[float]) -> str:
    """A count for the report's tables: rounded, thousands separated; ``n/a`` for a figure that does not apply.

    Example::

        >>> _b(1234567.6), _b(0), _b(None)
        ('1,234,568', '0', 'n/a')
    """
    return "n/a" if n is None else f"{round(n):,}"


_CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def where_measured(built: Built) -> list[str]:
    """Report paragraphs: the precision and attention kernels the step ran with and, when the configured accelerator
    is missing here, what the measurement stands in for and how the target's kernels may differ."""
    name = str(getattr(built.precision, "precision", "32-true"))
    dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float16"
    autocast = (f" (the step under torch.autocast({built.precision.device!r}, {dtype}))"
                if isinstance(built.precision, MixedPrecision) else "")
    kernels = ", ".join(f"`{k}`" for k in sorted(built.attention_kernels)) or "none (no fused attention ran)"
    lines = [f"Precision: {name}{autocast}. Attention kernels: {kernels}.", ""]
    if built.planned_for is None:
        return lines
    lines += [
        f"**Planned for accelerator={built.planned_for!r} on this machine's CPU.** The config asks for"
        f" {built.planned_for!r}, which is not available here, so the trainer was built with"
        f" {', '.join(a.split('.', 1)[1] for a in PLANNING_TRAINER)} for planning, precision kept ({name})."
        " PyTorch without CUDA cannot run autograd on fake CUDA tensors, so the step ran on fake CPU tensors with"
        " CPU kernels' shapes and dtypes; static memory is one device's share (see Static memory).",
        "",
    ]
    if _CPU_FLASH in built.attention_kernels:
        lines += [
            "How the target may differ: CPU flash attention saves query, key, value, output and a float32"
            " log-sum-exp per row, as CUDA's flash and memory-efficient kernels do (plus a few bytes of RNG state;"
            " the memory-efficient kernel pads the log-sum-exp to a multiple of 32 rows). Where the target falls back"
            " to the math kernel (a head size, dtype or mask its fused kernels do not support), attention saves its"
            " batch x heads x seq x seq weights and holds far more than planned. CUDA and CPU autocast cast a few ops"
            " differently; matmuls and linears run in the autocast dtype on both.",
            "",
        ]
    else:
        lines += ["How the target may differ: no fused attention kernel ran here. CPU runs attention with dropout (and"
                  " some masks) as the math implementation, which saves the batch x heads x seq x seq weights; CUDA's"
                  " flash kernel supports dropout and saves only a log-sum-exp per row, so the target may hold less"
                  " than planned. A model that picks its attention implementation by device may differ too.", ""]
    return lines


def sharding_lines(static: StaticMemory) -> list[str]:
    """Report paragraph: whether, and how, the figures above are one device's share of sharded static memory."""
    s = static.sharding
    if s.states == 1 and s.weights == 1:
        holds = ("every device's host memory holds all of it (CPU offload)" if s.cpu_offload else
                 "every device holds all of it")
        text = (f"Not sharded (strategy {s.strategy!r}, {s.world} device{'s' * (s.world > 1)} in all: devices x"
                f" num_nodes): {holds}." + (f" Note: {s.note}." if s.note else ""))
        return [text, ""]
    unsharded = "" if static.unsharded is None else f" ({format_bytes(static.unsharded)} unsharded)"
    what = (f"parameters, gradients and optimizer state over {s.states} devices" if s.weights == s.states else
            f"gradients and optimizer state over {s.states} devices, parameters over {s.weights}")
    return [f"**One device's share{unsharded}:** strategy {s.strategy!r} shards {what}"
            f" ({s.world} in all: devices x num_nodes), rows padded as `fully_shard` pads them; buffers and 0-d"
            " optimizer state (step counters) are whole on every device. The command launches no process: it plans"
            " one device's share, and the largest batch is per device." + (f" Note: {s.note}." if s.note else ""), ""]


def host_memory_lines(static: StaticMemory, host: Optional[HostMemory], offload: object = False) -> list[str]:
    """Report paragraph: the host memory planned with, whose it is (``--host-memory`` or this machine's) and, under
    CPU offload, what the parameters, gradients and optimizer state take of it and leave for offloaded activations.

    Example::

        >>> from lightning_ckpt.commands.plan.sharding import Sharding
        >>> static = StaticMemory(0, 0, 0, "AdamW", Sharding(cpu_offload=True), host_weights=3 * 2**30)
        >>> print(host_memory_lines(static, HostMemory(8 * 2**30, given=True, static=3 * 2**30))[0])
        ... # doctest: +NORMALIZE_WHITESPACE
        Host memory planned with: 8.0 GiB per device (given: --host-memory). CPU offload keeps 3.0 GiB of it (this
        device's share of the parameters, gradients and optimizer state), leaving 5.0 GiB for offloaded activations.
    """
    if host is None:
        return []
    if not offload and not static.sharding.cpu_offload and not host.given:  # this machine's figure would change nothing
        return ["Host memory planned with: nothing is planned there (offload is off, no CPU offload); --host-memory sets the"
                " target's (default: half of this machine's available memory).", ""]
    source = ("given: --host-memory" if host.given else
              "this machine's: half of its available memory; pass --host-memory with the target's")
    text = f"Host memory planned with: {format_bytes(host.total)} per device ({source})."
    if static.sharding.cpu_offload:
        text += (f" CPU offload keeps {format_bytes(static.host_total)} of it (this device's share of the parameters,"
                 " gradients and optimizer state)")
        text += (f", leaving {format_bytes(host.for_offload)} for offloaded activations." if host.fits else
                 f": **more than the host memory, so the run does not fit it**; pass the target's --host-memory, or"
                 " shard over more devices.")
    else:
        text += (" Offloaded activations may take all of it." if offload else
                 " Nothing is planned there (offload is off).")
    return [text, ""]


def _host_hint(host: Optional[HostMemory]) -> str:
    """What to do when no plan fits the host memory: the figure planned with, and whose it was."""
    if host is None:
        return ""
    whose = "given by --host-memory" if host.given else "this machine's; pass --host-memory with the target's"
    return f" (host memory for offloaded activations: {format_bytes(host.for_offload)}, {whose})"


def render(result: PlanResult) -> str:
    """The report, as Markdown: what was measured, the layers, the plan, the settings, static memory and (with
    ``--lengths``) the plan across lengths.

    Example::

        report = render(PlanResult("tiny.yaml", built, measured, plan, None, 0.5, rows, static_memory(built)))
        report.splitlines()[0]  # '# Checkpointing plan: tiny.yaml'
    """
    lines = [*_intro_lines(result), *_layer_lines(result), *_plan_lines(result), *_settings_lines(result),
             *_static_lines(result), *_length_lines(result)]
    return "\n".join(lines) + "\n"


def _intro_lines(result: PlanResult) -> list[str]:
    """The title and what was measured, how."""
    built, main = result.built, result.main
    how = ("fake tensors (FakeTensorMode: no memory allocated)" if built.fake_mode is not None else "real tensors")
    return [
        f"# Checkpointing plan: {result.title}",
        "",
        f"One training step of {type(built.module).__name__} at batch size {main.batch_size}, measured on"
        f" {built.device} with {how}, every matched layer fully checkpointed"
        + (", each layer's MLP over tiles of tokens (tile_mlp)" if built.tile_mlp else "")
        + (", its norms and gated MLP lean (lean_layers)" if built.lean_layers else "")
        + ". Bytes are activations held for"
        " backward; FLOPs are recomputed in backward per step (matmul and attention as torch's FlopCounterMode"
        " counts them, one per output element for other ops). Every figure below is predicted from this one"
        " measurement; no setting was run."
        + (" Offload is on: checkpointed layers' inputs count as host memory." if built.offload is True else "")
        + (" Offload is 'auto': the plan chooses per layer what lives in host memory (`+offload` in the Layers"
           " table's plan column)." if built.offload == "auto" else "")
        + (f" Compress is {built.compress!r}: every setting's checkpointed layers hold their inputs as {built.compress}"
           " (the full and selective columns count them so; the forward is exact, gradients close, not equal)."
           if built.compress else ""),
        "",
        *where_measured(built),
    ]


def _layer_lines(result: PlanResult) -> list[str]:
    """The Layers table (each layer's bytes and FLOPs by mode, and the plan's choice) and the op-level choices."""
    built, main, plan = result.built, result.main, result.plan
    lines = [
        "## Layers",
        "",
        "| layer | class | none (B) | full (B) | selective (B) | recompute full (FLOP) | recompute selective (FLOP)"
        " | plan | plan (B) | recompute plan (FLOP) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    planned_costs = {c.name: c for c in plan.costs} if plan else {}
    for c in main.costs:
        mode, keep = (plan.layers[c.name], plan.kept_ops.get(c.name, ())) if plan else ("-", ())
        planned = "- | -"
        if plan:
            option = make_option(planned_costs[c.name], mode, keep, c.name in plan.offloaded)  # type: ignore[arg-type]
            planned = f"{_b(option.device_bytes)} | {_b(option.flops)}"
            mode += " +offload" if plan.offload == "auto" and c.name in plan.offloaded else ""
        lines.append(f"| {c.name} | {c.cls} | {_b(c.none_bytes)} | {_b(c.device_bytes('full', built.offload is True))}"
                     f" | {_b(c.device_bytes('selective', built.offload is True))} | {_b(c.full_flops)}"
                     f" | {_b(c.selective_flops)} | {mode} | {planned} |")
    lines += [f"| (outside the layers) | | {_b(main.outside_bytes)} | {_b(main.outside_bytes)} | {_b(main.outside_bytes)}"
              " | 0 | 0 | | | |", ""]
    if plan is not None and plan.kept_ops:
        lines += ["Op-level choices (`ops`): which op outputs each layer keeps and which ops it recomputes:", "",
                  *[f"- {name}: {describe(c.ops, plan.kept_ops[name])}" for c in main.costs
                    for name in [c.name] if name in plan.kept_ops],
                  ""]
    return lines


def _plan_lines(result: PlanResult) -> list[str]:
    """The plan for the budget in one paragraph, or why there is none."""
    plan = result.plan
    lines = [f"## Plan for memory_budget={result.budget!r}", ""]
    if plan is None:
        hint = _host_hint(result.host_memory) if host_memory_short(result.plan_error) else ""
        return [*lines, f"No plan: {result.plan_error}{hint}"]
    n = sum(m != "none" for m in plan.layers.values())
    checkpointed = ", ".join(f"{k}: {v}" for k, v in plan.layers.items() if v != "none")
    lines.append(f"{n} of {len(plan.layers)} layers checkpointed"
                 f" ({checkpointed or ('none' if plan.offloaded else 'none needed')})"
                 f"{_offload_text(plan, result.built.offload)}:"
                 f" activations {format_bytes(plan.planned_bytes)} ({100 * plan.planned_bytes / plan.baseline_bytes:.0f}%"
                 f" of {format_bytes(plan.baseline_bytes)} without checkpointing), peak {format_bytes(plan.peak_bytes)}"
                 f" (budget {format_bytes(plan.budget_bytes)}, {format_bytes(plan.baseline_peak_bytes)} without"
                 " checkpointing);"
                 f" recompute {_b(plan.recompute_flops)} FLOP per step"
                 + (f"; {plan.step_time_text()}." if plan.predicted_step_seconds is not None else "."))
    lines += ["", f"Choices priced by {price_source(result.main.costs, result.profile)}."]
    return lines


def _offload_text(plan: CheckpointPlan, offload: object) -> str:
    """The plan line's offload clause: which layers the plan offloads and the bytes they keep in host memory, which
    the device figures after it (activations, peak) leave out; nothing when the run does not plan with offload.

    Example::

        >>> plan = CheckpointPlan({"a": "full", "b": "none"}, 100, 50, 60, 9, 10, planned_host_bytes=3 * 2**20,
        ...                       offload="auto", offloaded=["a"])
        >>> _offload_text(plan, "auto")
        ', 1 offloaded to host memory (a): 3.0 MiB (3,145,728 B) in host memory, not in the device figures that follow'
        >>> _offload_text(CheckpointPlan({"a": "full"}, 100, 50, 60, 9, 10), "auto"), _offload_text(plan, False)
        (", none offloaded (offload 'auto'): 0 B in host memory", '')
    """
    if not offload:
        return ""
    if not plan.offloaded:
        return f", none offloaded (offload {offload!r}): 0 B in host memory"
    return (f", {len(plan.offloaded)} offloaded to host memory ({', '.join(plan.offloaded)}):"
            f" {format_bytes(plan.host_bytes)} ({_b(plan.host_bytes)} B) in host memory, not in the device figures"
            " that follow")


def _settings_lines(result: PlanResult) -> list[str]:
    """The Settings table (with the fit over the batch, the largest batch and step times when measured) and what
    its columns mean."""
    rows, plan, device_memory, batch_sizes = result.rows, result.plan, result.device_memory, result.batch_sizes
    memory_head = f" | largest batch in {format_bytes(device_memory)}" if device_memory is not None else ""
    timed = rows[0].predicted_step_seconds is not None
    time_head = f" | predicted step time on {plan.device if plan else 'the device'} | vs none" if timed else ""
    fit_head = " | peak fixed (B) | peak per sample (B)" if len(batch_sizes) > 1 else ""
    offload = bool(result.built.offload)  # True or "auto": a column of the bytes each setting keeps on the host
    none_bytes = rows[0].activation_bytes
    lines = [
        "",
        "## Settings",
        "",
        f"| setting | checkpointed layers | activations (B) | activations | of none | recompute (FLOP)"
        f" | static + activations{fit_head}{memory_head}{time_head} | peak (B) |" + " host memory (B) |" * offload,
        "|---|---:|---:|---:|---:|---:|---:|---:"
        + "|---:" * ((len(batch_sizes) > 1) * 2 + (device_memory is not None) + 2 * timed + offload) + "|",
    ]
    for r in rows:
        fit = f" | {_b(r.peak_fixed_bytes)} | {_b(r.peak_per_sample_bytes)}" if len(batch_sizes) > 1 else ""
        fits = (f" | {'unbounded' if r.largest_batch is None else r.largest_batch}" if device_memory is not None else "")
        step = (f" | {1000 * r.predicted_step_seconds:.2f} ms"
                f" | +{100 * (r.predicted_step_seconds / rows[0].predicted_step_seconds - 1):.0f}%"
                if r.predicted_step_seconds is not None and rows[0].predicted_step_seconds else "")
        lines.append(f"| {r.name} | {r.layers} | {_b(r.activation_bytes)} | {format_bytes(r.activation_bytes)}"
                     f" | {100 * r.activation_bytes / none_bytes:.0f}% | {_b(r.recompute_flops)}"
                     f" | {format_bytes(result.static.total + r.activation_bytes)}{fit}{fits}{step} | {_b(r.peak_bytes)} |"
                     + f" {_b(r.host_bytes)} |" * offload)
    lines += ["", "Settings: " + "; ".join(f"{k}: {v}" for k, v in SETTINGS.items() if k in {r.name for r in rows}) + ".",
              "Activations: held for backward at the end of the forward; peak: the most alive at once over the step,"
              " forward and backward (each layer's recompute and gradients while the layers before it hold theirs),"
              " which is what a memory budget bounds."]
    if offload:
        lines.append("Host memory: what offloaded layers keep in host memory"
                     + (" (with offload 'auto' only the plan offloads)" if result.built.offload == "auto" else "")
                     + "; activations, peak and static + activations are device memory and leave it out.")
    if len(batch_sizes) > 1:
        lines.append(f"The step was measured at batch sizes {batch_sizes[0]} and {batch_sizes[1]} and each setting's"
                     " peak fitted as peak fixed + peak per sample x batch.")
    if device_memory is not None:
        lines.append(f"Largest batch: static memory (weights, gradients, optimizer state) plus the step's fitted peak"
                     f" within {format_bytes(device_memory)} ({_b(device_memory)} B); allocator slack needs some"
                     " headroom on top.")
    return lines


def _static_lines(result: PlanResult) -> list[str]:
    """The Static memory table, how it is sharded, and how much of the total activations are."""
    static, none_bytes = result.static, result.rows[0].activation_bytes
    state = "unknown" if static.optimizer_state is None else _b(static.optimizer_state)
    device_row = (f"| {_b(static.weights)} | {_b(static.gradients)} | {state} | {static.optimizer}"
                  f" | {format_bytes(static.total)} |")
    if static.sharding.cpu_offload:
        host_state = "unknown" if static.host_optimizer_state is None else _b(static.host_optimizer_state)
        table = ["| where | weights and buffers (B) | gradients (B) | optimizer state (B) | optimizer | total |",
                 "|---|---:|---:|---:|---|---:|",
                 f"| device (buffers; gathered units) {device_row}",
                 f"| host (CPU offload) | {_b(static.host_weights)} | {_b(static.host_gradients)} | {host_state}"
                 f" | {static.optimizer} | {format_bytes(static.host_total)} |"]
    else:
        table = ["| weights and buffers (B) | gradients (B) | optimizer state (B) | optimizer | total |",
                 "|---:|---:|---:|---|---:|", device_row]
    return [
        "",
        "## Static memory (checkpointing does not change it)",
        "",
        *table,
        "",
        *sharding_lines(static),
        *host_memory_lines(static, result.host_memory, result.built.offload),
        f"Optimizer state counted after one optimizer step. Without checkpointing, activations are"
        f" {100 * none_bytes / (none_bytes + static.total):.0f}% of static memory plus activations"
        + (": checkpointing cannot save much here; shard the weights and optimizer state (FSDP) or train fewer"
           " parameters (PEFT)." if none_bytes < static.total else "."),
    ]


def _length_lines(result: PlanResult) -> list[str]:
    """With ``--lengths``: the plan for the budget at each length, each setting's peak at each length and (with
    ``--device-memory``) the largest length each setting fits; nothing otherwise."""
    if not result.lengths:
        return []
    timed = result.profile is not None
    lines = [
        "",
        "## Plan across lengths",
        "",
        f"The step measured again at each length, at batch size {result.lengths[0].batch_size}: the batch's token ids"
        " and every tensor of their length (labels, masks) cut or tiled along dim 1. The plan is made for"
        f" memory_budget={result.budget!r} at each length.",
        "",
        "| length | shape (batch x length) | tokens | layers checkpointed | plan peak (B) | plan peak"
        " | recompute (FLOP)" + (f" | predicted step time on {result.profile.name}" if result.profile else "") + " |",
        "|---:|---|---:|---|---:|---:|---:" + "|---:" * timed + "|",
    ]
    for at in result.lengths:
        shape = f"{at.batch_size} x {at.length}"
        if at.plan is None:
            lines.append(f"| {at.length} | {shape} | {_b(at.batch_size * at.length)} | no plan | - | - | -"
                         + " | -" * timed + " |")
            continue
        modes = [m for m in at.plan.layers.values() if m != "none"]
        kinds = ", ".join(f"{modes.count(m)} {m}" for m in dict.fromkeys(modes))
        step = f" | {1000 * at.plan.predicted_step_seconds:.2f} ms" if at.plan.predicted_step_seconds is not None else ""
        lines.append(f"| {at.length} | {shape} | {_b(at.batch_size * at.length)} | {len(modes)} of {len(at.plan.layers)}"
                     + (f" ({kinds})" if kinds else "") + f" | {_b(at.plan.peak_bytes)} | {format_bytes(at.plan.peak_bytes)}"
                     f" | {_b(at.plan.recompute_flops)}{step} |")
    missing = [f"No plan at {at.batch_size} x {at.length}: {at.plan_error}"
               + (_host_hint(result.host_memory) if host_memory_short(at.plan_error) else "")
               for at in result.lengths if at.plan is None]
    lines += ["", *missing] if missing else []  # a blank line first: a text line right after a table joins it
    lines += ["", *_length_peak_lines(result)]
    return lines


def _length_peak_lines(result: PlanResult) -> list[str]:
    """Each standard setting's peak at each length and, with ``--device-memory``, the largest length it fits."""
    names = [r.name for r in result.rows if r.name in SETTINGS and r.name != "plan"]
    peaks = {at.length: {r.name: r.peak_bytes for r in at.rows} for at in result.lengths}
    batch = result.main.batch_size
    fits = result.device_memory is not None and result.length_fit is not None
    memory_head = (f" | largest batch at {batch} x {result.main.length} | largest length at batch {batch}"
                   if fits else "")
    lines = [
        "| setting | " + " | ".join(f"peak (B) at {at.batch_size} x {at.length}" for at in result.lengths)
        + memory_head + " |",
        "|---|" + "---:|" * (len(result.lengths) + 2 * fits),
    ]
    for row in (r for r in result.rows if r.name in names):
        largest = ""
        if fits:
            length = result.largest_length.get(row.name)
            largest = (f" | {'unbounded' if row.largest_batch is None else row.largest_batch}"
                       f" | {'unbounded' if length is None else length}")
        lines.append(f"| {row.name} | " + " | ".join(_b(peaks[at.length][row.name]) for at in result.lengths)
                     + largest + " |")
    if fits:
        length = result.largest_length.get("plan")
        lines.append("| plan (least peak) | " + " | ".join(_b(at.least_peak_bytes) for at in result.lengths)
                     + f" | - | {'unbounded' if length is None else length} |")
    if result.length_fit == "quadratic":
        how = (f"fitted over the {len(result.lengths)} lengths as a quadratic, c0 + c1 x T + c2 x T^2 (attention's"
               " T^2 terms)")
    elif result.length_fit == "linear":
        how = "fitted over the 2 lengths as a line, c0 + c1 x T (pass 3 or more lengths for attention's T^2 terms)"
    else:
        how = "not fitted (pass 2 or more lengths)"
    lines += ["", f"Peak: the step's activation peak at each length; {how}."]
    if fits:
        lines.append(f"Largest length: static memory plus the setting's fitted peak within"
                     f" {format_bytes(result.device_memory)} at batch size {batch}; largest batch (from the Settings"
                     " table): static memory plus the step's peak at the measured length. plan (least peak): the"
                     " least peak a plan reaches with the plan's own settings"
                     f" ({_settings_text(result.built, result.main.chunked is not None)}), fitted the same way.")
        lines += _longest_lines(result)
    return lines


def _settings_text(built: Built, chunkable: bool = False) -> str:
    """The plan's own settings in words: offload, compression and, for a model whose LM head and loss can run in
    chunks (``chunkable``), ``chunk_loss``.

    Example::

        >>> built = Built(None, [], None, None, "auto", 0.5, None, compress="fp8")
        >>> _settings_text(built), _settings_text(Built(None, [], None, None, False, 0.5, None, chunk_loss=True), True)
        ("offload 'auto', compress 'fp8'", 'offload off, exact, chunk_loss on')
    """
    offload = "off" if built.offload is False else "on" if built.offload is True else repr(built.offload)
    chunks = "'auto'" if built.chunk_loss is None else "on" if built.chunk_loss else "off"
    return (f"offload {offload}, " + (f"compress {built.compress!r}" if built.compress else "exact")
            + (f", chunk_loss {chunks}" if chunkable else ""))


def _longest_lines(result: PlanResult) -> list[str]:
    """The plan's longest length in one paragraph: where it was measured again, the plan there and its time."""
    longest, memory = result.longest, result.device_memory
    if longest is None:
        return []
    room = memory - result.static.total  # type: ignore[operator]  # with device memory only
    shape = f"{longest.batch_size} x {longest.length}"
    head = (f"**The plan's longest length: {longest.length:,} tokens** at batch size {longest.batch_size}"
            f" ({_settings_text(result.built, result.main.chunked is not None)})")
    capped = (f" (the fit gave {longest.fitted:,}; the model's {longest.capped[0]} is {longest.capped[1]:,})"
              if longest.capped else "")
    fell_short = (f" (the fit gave {longest.fitted:,}; {_shortened_text(longest.shortened, result.host_memory)}"
                  if longest.length < longest.fitted and not longest.capped else "")
    if longest.plan is None:
        said = "host_memory" in longest.shortened and not longest.capped  # the fell_short text names the figure
        hint = _host_hint(result.host_memory) if host_memory_short(longest.plan_error) and not said else ""
        return ["", f"{head}: no plan at {shape}, measured again there{capped}{fell_short}: {longest.plan_error}{hint}"]
    plan = longest.plan
    n = sum(m != "none" for m in plan.layers.values())
    chunks = f", runs the LM head and loss in chunks of {plan.chunk_tokens:,} tokens" if plan.chunk_tokens else ""
    per_token = longest.seconds_per_token()
    time = ("" if per_token is None else
            f"; predicted step time {1000 * plan.predicted_step_seconds:.2f} ms on {plan.device},"  # type: ignore[operator]
            f" {1e6 * per_token:.3f} us per token")
    return ["", f"{head}{capped}{fell_short}. The step measured again at {shape}: the plan for"
                f" {format_bytes(room)} (device memory less static memory) checkpoints {n} of {len(plan.layers)}"
                f" layers{f', offloads {len(plan.offloaded)}' if plan.offloaded else ''}"
                f"{chunks}; peak"
                f" {format_bytes(plan.peak_bytes)} ({_b(plan.peak_bytes)} B), host memory"
                f" {format_bytes(plan.planned_host_bytes)}, least reachable {format_bytes(longest.least_peak_bytes)}"
                f"{time}."]


def _shortened_text(reasons: list[str], host: Optional[HostMemory]) -> str:
    """Why the plan's longest length is shorter than the fit gave, in words, each reason once, in order, ending the
    parenthesis the caller opened.

    Example::

        >>> _shortened_text(["overshot", "overshot"], None)
        'its least peak there overshot, so shorter lengths were measured)'
        >>> print(_shortened_text(["host_memory"], HostMemory(2**30, given=False)))  # doctest: +NORMALIZE_WHITESPACE
        no plan there fit the host memory for offloaded activations (1.0 GiB, this machine's; pass --host-memory with
        the target's), so shorter lengths were measured)
    """
    words = {"overshot": "its least peak there overshot",
             "host_memory": "no plan there fit the host memory for offloaded activations"
                            + (_host_hint(host).replace(" (host memory for offloaded activations: ", " (")),
             "no_plan": "the planner found no plan within the room there"}
    said = [words.get(reason, reason) for reason in dict.fromkeys(reasons)]
    return ("; then ".join(said) + ", so shorter lengths were measured)") if said else "shorter lengths were measured)"
