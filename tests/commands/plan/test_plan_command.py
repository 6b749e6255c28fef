"""``lightning-ckpt plan``: the report's numbers add up, the batch-size prediction holds, fake equals real."""

from __future__ import annotations

import dataclasses

import json
import math
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch._subclasses.fake_tensor import FakeTensor

from lightning_ckpt.commands.cli import main as cli_main
from lightning_ckpt.commands.plan import main as plan_main
from lightning_ckpt.commands.plan import measure as plan_measure
from lightning_ckpt.commands.plan import static_memory as plan_static  # where would_not_fit looks up _available_memory
from lightning_ckpt.commands.plan.measure import (
    Built,
    batch_of_length,
    batch_of_size,
    build,
    measure,
    sharding_of,
    static_memory,
    would_not_fit,
)
from lightning_ckpt.commands.plan.predictions import CALLBACK_MODES, PlanSettings, largest_batch
from lightning_ckpt.commands.plan.report import plot
from lightning_ckpt.core.checkpoint.wrapping import apply_checkpointing
from lightning_ckpt.core.measure.profiling import SavedTensorCounter, format_bytes
from lightning_ckpt.core.plan.planner import make_plan
from helpers import counted_peak

TINY = Path(__file__).parents[3] / "configs" / "tiny.yaml"
DEVICE_MEMORY = 8 * 2**20
# Without the chunked LM head and loss (the default 'auto' measures the step twice and adds a row): its figures are
# tested in test_plan_chunked_lengths.py.
# priced by FLOPs, so that a real run's plan is a fake run's (fake tensors are not timed) and the same on every run
ARGS = ["--config", str(TINY), "--memory-budget", "0.5", "--device-memory", "8MiB", "--chunk-loss", "false",
        "--trainer.callbacks.init_args.time_layers=false"]
LAYERS = [f"model.blocks.{i}" for i in range(4)]


def run_plan(args, out_dir, capsys):
    rc = plan_main([*args, "--output-dir", str(out_dir)])
    return rc, capsys.readouterr()


def table(report: str, section: str) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table under ``## section``."""
    body = report.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines() if line.startswith("|")]
    return [r for r in rows[2:]]  # header and rule dropped


def num(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_real")
    rc = plan_main([*ARGS, "--output-dir", str(out)])
    return rc, out


@pytest.fixture(scope="module")
def real_report(real_dir):
    rc, out = real_dir
    return rc, (out / "plan.md").read_text()


def test_plan_on_tiny_config_adds_up(real_report, tmp_path, capsys):
    rc, report = real_report
    assert rc == 0
    layers = table(report, "Layers")
    assert [r[0] for r in layers] == [*LAYERS, "(outside the layers)"]
    outside = num(layers[-1][2])
    none, full, sel = ({r[0]: num(r[i]) for r in layers[:-1]} for i in (2, 3, 4))
    flops_full, flops_sel = ({r[0]: num(r[i]) for r in layers[:-1]} for i in (5, 6))
    chosen = {r[0]: r[7] for r in layers[:-1]}
    bytes_of = {"none": none, "full": full, "selective": sel, "ops": {r[0]: num(r[8]) for r in layers[:-1]}}
    flops_of = {"none": dict.fromkeys(LAYERS, 0), "full": flops_full, "selective": flops_sel,
                "ops": {r[0]: num(r[9]) for r in layers[:-1]}}
    for r in layers[:-1]:  # the plan's own columns: the chosen mode's figures
        assert (num(r[8]), num(r[9])) == (bytes_of[r[7]][r[0]], flops_of[r[7]][r[0]]), r
    settings = {r[0]: r for r in table(report, "Settings")}
    expected = {
        "none": ["none"] * 4,
        "every_4th": ["full", "none", "none", "none"],
        "every_2nd": ["full", "none", "full", "none"],
        "every_layer": ["full"] * 4,
        "selective": ["selective"] * 4,
        "plan": [chosen[n] for n in LAYERS],
    }
    assert list(settings) == list(expected)
    for name, modes in expected.items():
        row = settings[name]
        assert num(row[1]) == sum(m != "none" for m in modes)
        assert num(row[2]) == outside + sum(bytes_of[m][n] for n, m in zip(LAYERS, modes)), name
        assert num(row[5]) == sum(flops_of[m][n] for n, m in zip(LAYERS, modes)), name
    baseline = num(settings["none"][2])
    assert num(settings["plan"][2]) <= 0.5 * baseline < num(settings["every_2nd"][2])
    assert num(settings["plan"][5]) < num(settings["every_layer"][5])  # cheaper than the one full setting that fits
    # Static memory: float32 weights of the tiny GPT, gradients alike, AdamW's two moments plus a 4-byte step each.
    params = list(build(TINY, fake=False).module.parameters())
    weights = 4 * sum(p.numel() for p in params)
    [static] = table(report, "Static memory")
    assert [num(c) for c in static[:3]] == [weights, weights, 2 * weights + 4 * len(params)]
    assert static[3] == "AdamW"


def test_plan_json_holds_every_figure_of_the_report(real_dir):
    rc, out = real_dir
    report, data = (out / "plan.md").read_text(), json.loads((out / "plan.json").read_text())
    layers = table(report, "Layers")
    assert [layer["name"] for layer in data["layers"]] == [r[0] for r in layers[:-1]]
    for layer, row in zip(data["layers"], layers):
        assert [layer[k] for k in ("none_bytes", "full_bytes", "selective_bytes", "full_flops", "selective_flops")] == [
            num(c) for c in row[2:7]]
    assert data["outside_bytes"] == num(layers[-1][2])
    assert data["plan"]["layers"] == {r[0]: r[7] for r in layers[:-1]} and data["plan"]["offloaded"] == []
    settings = table(report, "Settings")
    assert [s["name"] for s in data["settings"]] == [r[0] for r in settings]
    assert {"none", "every_layer", "selective", "plan"} <= {s["name"] for s in data["settings"]}
    for setting, row in zip(data["settings"], settings):
        assert setting["checkpointed_layers"] == num(row[1])
        assert setting["activation_bytes"] == num(row[2]) and setting["recompute_flops"] == num(row[5])
        assert round(setting["peak_fixed_bytes"]) == num(row[7])
        assert round(setting["peak_per_sample_bytes"]) == num(row[8])
        assert setting["largest_batch"] == int(row[9])
        assert setting["predicted_step_seconds"] is None  # no time model yet
    plan = next(s for s in data["settings"] if s["name"] == "plan")
    assert (plan["activation_bytes"], plan["recompute_flops"]) == (data["plan"]["activation_bytes"],
                                                                 data["plan"]["recompute_flops"])
    [static] = table(report, "Static memory")
    assert data["static_bytes_per_device"] == sum(num(c) for c in static[:3]) == data["static"]["unsharded_bytes"]
    assert data["device_memory"] == DEVICE_MEMORY and data["batch_sizes"] == [4, 8]


def test_plan_png_draws_every_setting_and_the_front_with_the_plan_marked(real_dir):
    _, out = real_dir
    data = json.loads((out / "plan.json").read_text())
    png = (out / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    fig = plot(data, out / "again.png")
    [ax] = fig.axes
    drawn = {c.get_label(): c for c in ax.collections}
    assert list(drawn) == [s["name"] for s in data["settings"]]
    for setting in data["settings"]:  # no time model yet: recompute FLOPs across, activation bytes up
        assert drawn[setting["name"]].get_offsets().tolist() == [[setting["recompute_flops"], setting["activation_bytes"]]]
    sizes = {name: c.get_sizes()[0] for name, c in drawn.items()}
    assert sizes.pop("plan") > max(sizes.values())  # the chosen plan stands out
    assert "plan (chosen)" in [t.get_text() for t in ax.texts]
    [front] = ax.lines  # no offload: no circles on the plans that offload
    assert front.get_label() == "planner's front over budgets"
    points = [(p["recompute_flops"], p["activation_bytes"]) for p in sorted(data["front"], key=lambda p: p["budget_bytes"])]
    assert front.get_xydata().tolist() == [list(p) for p in points] and len(points) > 3
    # The front is the planner's plans over budgets: the plan for the run's budget is one of its points.
    assert (data["plan"]["recompute_flops"], data["plan"]["activation_bytes"]) in points
    assert ax.get_xlabel() == "recompute per step"


def test_argument_abbreviations_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(TINY), "--device-mem", "80GiB"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --device-mem" in capsys.readouterr().err


def test_sharded_strategy_divides_static_memory_over_the_data_parallel_devices(real_dir, tmp_path, capsys):
    _, out = real_dir
    whole = json.loads((out / "plan.json").read_text())
    rc, _ = run_plan([*ARGS, "--trainer.strategy=fsdp_ckpt", "--trainer.devices=4"], tmp_path, capsys)
    assert rc == 0
    data, report = json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "plan.md").read_text()
    # Each parameter's rows split over 4 devices (padded), its gradient and AdamW moments alike; step counters whole.
    params = list(build(TINY, fake=False).module.parameters())
    share = sum(4 * math.ceil(p.shape[0] / 4) * p[0].numel() for p in params)
    assert [data["static"][k] for k in ("weights_bytes", "gradient_bytes", "optimizer_state_bytes")] == [
        share, share, 2 * share + 4 * len(params)]
    assert data["static_bytes_per_device"] == pytest.approx(whole["static_bytes_per_device"] / 4, rel=0.01)
    assert data["static"]["unsharded_bytes"] == whole["static_bytes_per_device"]
    assert (data["static"]["world"], data["static"]["state_shards"]) == (4, 4)
    [static] = table(report, "Static memory")
    assert sum(num(c) for c in static[:3]) == data["static_bytes_per_device"]
    assert "**One device's share" in report and "strategy 'fsdp_ckpt' shards parameters, gradients and optimizer" \
        " state over 4 devices" in report and "The command launches no process" in report
    # Activations are per device already; the room left for them grows, and with it the largest batch per device.
    room = DEVICE_MEMORY - data["static_bytes_per_device"]
    for sharded, unsharded in zip(data["settings"], whole["settings"]):
        assert sharded["activation_bytes"] == unsharded["activation_bytes"]
        assert sharded["largest_batch"] == largest_batch(sharded["peak_fixed_bytes"], sharded["peak_per_sample_bytes"],
                                                         room)
        assert sharded["largest_batch"] > unsharded["largest_batch"]
    # "static + activations" adds that share, not the unsharded whole, to each setting's activations.
    for setting, row in zip(data["settings"], table(report, "Settings")):
        assert row[6] == format_bytes(data["static_bytes_per_device"] + setting["activation_bytes"]), row
        assert row[6] != format_bytes(data["static"]["unsharded_bytes"] + setting["activation_bytes"]), row


MP = "lightning.pytorch.strategies.ModelParallelStrategy"
FSDP = "lightning.pytorch.strategies.FSDPStrategy"


@pytest.mark.parametrize(("strategy", "devices", "nodes", "weights", "states", "note"), [
    ("auto", 8, 2, 1, 1, ""),
    ("ddp", 8, 2, 1, 1, ""),
    ("fsdp_ckpt", 8, 2, 16, 16, ""),
    ({"class_path": "lightning_ckpt.CheckpointingFSDPStrategy", "init_args": {"tensor_parallel_size": 2}}, 8, 2, 8, 8,
     "tensor parallelism (tensor_parallel_size=2)"),
    ("fsdp", 8, 2, 16, 16, ""),
    ("fsdp_cpu_offload", 8, 2, 16, 16, "`cpu_offload` keeps the shards in host memory"),
    ({"class_path": FSDP, "init_args": {"sharding_strategy": "HYBRID_SHARD"}}, 8, 2, 8, 8, ""),
    ({"class_path": FSDP, "init_args": {"sharding_strategy": "SHARD_GRAD_OP"}}, 8, 2, 1, 16, ""),
    ({"class_path": FSDP, "init_args": {"sharding_strategy": "NO_SHARD"}}, 8, 2, 1, 1, ""),
    # Lightning's "auto": data parallel over the nodes, tensor parallel over each node's devices
    ({"class_path": MP}, 8, 2, 2, 2, "tensor parallelism (tensor_parallel_size=8)"),
    ({"class_path": MP, "init_args": {"data_parallel_size": 4, "tensor_parallel_size": 4}}, 8, 2, 4, 4,
     "tensor parallelism (tensor_parallel_size=4)"),
])
def test_sharding_follows_each_strategy_s_own_rules(strategy, devices, nodes, weights, states, note):
    sharding = sharding_of(strategy, devices, nodes)
    assert (sharding.world, sharding.weights, sharding.states) == (devices * nodes, weights, states)
    assert sharding.note.startswith(note) and bool(sharding.note) == bool(note)


def test_report_printed_is_the_report_written(tmp_path, capsys):
    rc, out = run_plan(["--config", str(TINY), "--memory-budget", "0.5"], tmp_path, capsys)
    assert rc == 0
    written = (tmp_path / "plan.md").read_text()
    assert written in out.out and "## Plan for memory_budget=0.5" in written
    assert "largest batch" not in written  # no --device-memory: one batch size, no fit


def counted_step_peak(batch_size: int, modes: dict[str, str], plan_layers: bool = False) -> int:
    """The activation peak of a real training step (forward and backward) of the tiny config at ``batch_size``,
    counted by ``benchmarks/_peak.py``, its layers checkpointed as :func:`measured_bytes` applies them."""
    built = _checkpointed(modes, plan_layers)
    batch = batch_of_size(built.loader, batch_size)
    return counted_peak(built.module, lambda: plan_measure._loss(built.module.training_step(batch, 0)))


def _checkpointed(modes: dict[str, str], plan_layers: bool) -> Built:
    """The tiny config built for real, its layers checkpointed as ``modes`` say (as the plan for 0.5, made again,
    with ``plan_layers``)."""
    built = build(TINY, fake=False)
    if plan_layers:
        measurement = measure(dataclasses.replace(build(TINY, fake=False), time_layers=False), 8)  # as ARGS: FLOPs
        plan = make_plan(measurement.costs, measurement.outside_bytes, 0.5, modes=CALLBACK_MODES,
                         head_bytes=measurement.head_bytes, head_peak_bytes=measurement.head_peak_bytes)
        assert plan.layers == modes
        plan.apply(built.module)
    for name, mode in modes.items():
        if mode != "none" and not plan_layers:
            layer = built.module.get_submodule(name)
            apply_checkpointing(layer, layer_cls=type(layer), mode=mode)
    return built


def measured_bytes(batch_size: int, modes: dict[str, str], plan_layers: bool = False) -> int:
    """Bytes held for backward by a real training step of the tiny config at ``batch_size``, its layers checkpointed
    as ``modes`` say; with ``plan_layers``, as the plan for memory_budget=0.5, made again here, says (op-level
    layers need its kept ops), checked to be the plan in ``modes``."""
    built = _checkpointed(modes, plan_layers)
    batch = batch_of_size(built.loader, batch_size)
    assert batch[0].shape[0] == batch_size
    with SavedTensorCounter(exclude=built.module.parameters()) as saved:
        loss = built.module.training_step(batch, 0)
    del loss
    return saved.bytes


@pytest.mark.filterwarnings("ignore:You are trying to")
@pytest.mark.parametrize("setting", ["none", "plan"])
def test_largest_batch_prediction_holds_at_that_batch(real_report, setting):
    """The largest batch is the largest whose step's peak (counted by an independent live-storage counter, with the
    activations' gradients) fits with the static memory; the batch after it does not."""
    _, report = real_report
    row = {r[0]: r for r in table(report, "Settings")}[setting]
    fixed, per_sample, batch = num(row[7]), num(row[8]), int(row[9])
    assert batch > 8  # extrapolated beyond both measured batch sizes (4 and 8)
    chosen = {r[0]: r[7] for r in table(report, "Layers")[:-1]} if setting == "plan" else {}
    counted = counted_step_peak(batch, chosen, plan_layers=setting == "plan")
    predicted = fixed + per_sample * batch
    assert abs(predicted - counted) <= 0.05 * counted, (predicted, counted)
    static = sum(num(c) for c in table(report, "Static memory")[0][:3])
    assert static + predicted <= DEVICE_MEMORY < static + fixed + per_sample * (batch + 1)
    assert static + counted <= 1.02 * DEVICE_MEMORY


def test_fake_run_equals_real_run_in_bytes_and_flops(real_report, tmp_path, capsys):
    _, real = real_report
    rc, _ = run_plan([*ARGS, "--fake"], tmp_path, capsys)
    fake = (tmp_path / "plan.md").read_text()
    assert rc == 0
    assert "with fake tensors (FakeTensorMode: no memory allocated)" in fake
    assert fake.replace("with fake tensors (FakeTensorMode: no memory allocated)", "with real tensors") == real


def test_fake_build_allocates_no_parameter_memory_and_is_chosen_when_the_model_would_not_fit(monkeypatch):
    built = build(TINY, fake=True)
    assert all(isinstance(p, FakeTensor) for p in built.module.parameters())
    monkeypatch.setattr(plan_static, "_available_memory", lambda device: 10**12)
    assert not would_not_fit(built)
    monkeypatch.setattr(plan_static, "_available_memory", lambda device: 10**6)  # weights alone are 216 KB; x4 > 0.8 MB
    assert would_not_fit(built)


@pytest.mark.parametrize(("args", "message"), [
    (["--memory-budget", "1.5"], "--memory-budget 1.5: pass a fraction in (0, 1]"),
    (["--memory-budget", "lots"], "--memory-budget lots: pass a fraction in (0, 1]"),
    (["--device-memory", "0.5"], "--device-memory 0.5: pass the device's memory in bytes, such as 80GiB"),
    (["--device", "h200-nvl"], "--device h200-nvl: pass a preset (h100-sxm, h100-pcie, a100-80gb, l4, rtx-4090, gh200, h200)"),
    (["--device-mem", "8MiB"], "unrecognized arguments: --device-mem"),  # no abbreviations: --device is its own flag
])
def test_bad_arguments_exit_2_saying_what_to_pass(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--config", str(TINY), *args])
    assert exit_info.value.code == 2
    assert f"lightning-ckpt plan: error: {message}" in capsys.readouterr().err


def test_missing_config_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(tmp_path / "missing.yaml")])
    assert exit_info.value.code == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err


def test_unreachable_budget_exits_1_with_the_minimum(tmp_path, capsys):
    rc, out = run_plan(["--config", str(TINY), "--memory-budget", "0.01", "--fake"], tmp_path, capsys)
    assert rc == 1
    report = (tmp_path / "plan.md").read_text()
    minimum = re.search(r"pass a budget of at least (0\.\d+) \(or (\d+) bytes\)", report)
    every_layer = {r[0]: r for r in table(report, "Settings")}["every_layer"]
    assert int(minimum.group(2)) == num(every_layer[-1])  # the least reachable: every layer full, its peak
    assert "cannot be met" in out.err


# ------------------------------------------------------------------------------ planning for hardware you do not have

CPU_FLASH = "`aten._scaled_dot_product_flash_attention_for_cpu`"


def gpt_args(vocab: int, seq: int, layers: int, embd: int, heads: int, batch: int) -> list[str]:
    """LightningCLI overrides that turn tiny.yaml's GPT (dropout off) and data into these sizes."""
    return [f"--model.init_args.vocab_size={vocab}", f"--model.init_args.block_size={seq}",
            f"--model.init_args.n_layer={layers}", f"--model.init_args.n_embd={embd}", f"--model.init_args.n_head={heads}",
            "--model.init_args.dropout=0.0", f"--data.init_args.vocab_size={vocab}", f"--data.init_args.block_size={seq}",
            f"--data.init_args.batch_size={batch}", f"--data.init_args.num_samples={2 * batch}"]


def gpt_params(vocab: int, seq: int, layers: int, embd: int) -> tuple[int, int]:
    """``(parameters, parameter tensors)`` of the demo GPT: per block two LayerNorms and four Linears (12 d^2 + 13 d,
    12 tensors); token and position embeddings, the final LayerNorm and the head."""
    d = embd
    return layers * (12 * d * d + 13 * d) + vocab * d + seq * d + 2 * d + d * vocab + vocab, 12 * layers + 6


def block_bytes(n: int, d: int, lse: int, bf16: bool) -> int:
    """Bytes one demo Block (dropout off, CPU flash attention) holds for backward, ``n`` = batch x seq tokens.

    float32: the inputs of both LayerNorms and their mean and rstd, the inputs of the four Linears, q/k/v (one
    qkv storage), attention's output (the proj input is a view of it) and float32 log-sum-exp, GELU's input.
    bf16-mixed: the LayerNorms stay float32 (residual stream); everything a matmul touches is bfloat16, plus the
    bfloat16 copies of the four weight matrices (12 d^2) that autocast makes and the Linears save.
    """
    stats = 2 * 2 * 4 * n + 4 * lse  # two LayerNorms' mean and rstd; the log-sum-exp per head and row
    if not bf16:
        return 4 * 16 * n * d + stats
    return 4 * 2 * n * d + 2 * 14 * n * d + 2 * 12 * d * d + stats


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_7b_cuda_bf16_config_plans_on_this_cpu_exactly_without_allocating(tmp_path, capsys):
    import psutil

    vocab, seq, layers, embd, heads, batch = 32000, 2048, 32, 4096, 32, 4
    args = ["--config", str(TINY), "--trainer.accelerator=cuda", "--trainer.precision=bf16-mixed",
            *gpt_args(vocab, seq, layers, embd, heads, batch), "--device-memory", "80GiB", "--memory-budget", "0.3"]
    rss = psutil.Process().memory_info().rss
    rc, out = run_plan(args, tmp_path, capsys)  # no --fake: the missing accelerator implies it
    grown = psutil.Process().memory_info().rss - rss
    report = (tmp_path / "plan.md").read_text()
    assert rc == 0
    assert "accelerator 'cuda' is not available here; planning for it with fake tensors" in out.out
    assert "**Planned for accelerator='cuda' on this machine's CPU.**" in report
    assert "accelerator=cpu, devices=1, num_nodes=1, strategy=auto for planning, precision kept (bf16-mixed)" in report
    assert f"Precision: bf16-mixed (the step under torch.autocast('cpu', torch.bfloat16)). Attention kernels: {CPU_FLASH}." in report
    assert "CPU flash attention saves query, key, value, output and a float32 log-sum-exp" in report

    params, tensors = gpt_params(vocab, seq, layers, embd)
    assert 6.5e9 < params < 7e9
    weights = 4 * params  # bf16-mixed keeps float32 weights; AdamW: two float32 moments and a 4-byte step per tensor
    [static] = table(report, "Static memory")
    assert [num(c) for c in static[:3]] == [weights, weights, 2 * weights + 4 * tensors]
    assert grown < weights / 50, f"RSS grew {grown:,} B: something real was allocated"  # 26.9 GB of weights

    n = batch * seq
    for row in table(report, "Layers")[:-1]:
        assert num(row[2]) == block_bytes(n, embd, batch * heads * seq, bf16=True), row[0]
        assert num(row[3]) == 4 * n * embd  # a checkpointed block keeps its float32 input (the residual stream)
    # 107 GB of static memory: no batch fits an unsharded 80 GiB device, and the report says what to do instead.
    assert weights + weights + 2 * weights > 80 * 2**30
    assert {r[9] for r in table(report, "Settings")} == {"0"}
    assert "shard the weights and optimizer state (FSDP)" in report


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bf16_mixed_holds_bfloat16_activations_and_float32_weights(tmp_path, capsys):
    vocab, seq, layers, embd, heads, batch = 32, 32, 4, 32, 2, 8
    reports = {}
    for precision in ("32-true", "bf16-mixed"):
        args = ["--config", str(TINY), "--trainer.accelerator=gpu", f"--trainer.precision={precision}", "--fake",
                *gpt_args(vocab, seq, layers, embd, heads, batch)]
        rc, _ = run_plan(args, tmp_path / precision, capsys)
        assert rc == 0
        reports[precision] = (tmp_path / precision / "plan.md").read_text()
        assert "**Planned for accelerator='gpu' on this machine's CPU.**" in reports[precision]
    n, lse = batch * seq, batch * heads * seq
    fp32, bf16 = (table(reports[p], "Layers") for p in ("32-true", "bf16-mixed"))
    for row32, row16 in zip(fp32[:-1], bf16[:-1]):
        assert num(row32[2]) == block_bytes(n, embd, lse, bf16=False)
        assert num(row16[2]) == block_bytes(n, embd, lse, bf16=True)
        assert num(row32[3]) == num(row16[3]) == 4 * n * embd  # the same float32 layer input
        # The same matmul FLOPs; recomputing under autocast adds its casts (one op per element): the four
        # weights and biases (12 d^2 + 9 d) and the two LayerNorm outputs that feed Linears (2 n d).
        assert num(row16[5]) == num(row32[5]) + 12 * embd * embd + 9 * embd + 2 * n * embd
    assert num(bf16[-1][2]) < num(fp32[-1][2])  # head input and logits in bfloat16 (the loss stays float32)
    assert table(reports["bf16-mixed"], "Static memory") == table(reports["32-true"], "Static memory")
    assert "torch.autocast" not in reports["32-true"] and "Precision: 32-true." in reports["32-true"]


def test_missing_accelerator_without_fake_is_refused_by_build_with_what_to_pass():
    with pytest.raises(ValueError, match=r"accelerator='cuda', which this machine does not have; plan for it with --fake"):
        build(TINY, fake=False, cli_args=["--trainer.accelerator", "cuda"])


def test_arguments_that_are_not_lightningcli_overrides_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(TINY), "--fakes"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --fakes (LightningCLI overrides start with --trainer." in capsys.readouterr().err


def test_device_prices_every_setting_and_plan_json_holds_the_report(real_report, tmp_path, capsys):
    """--device: a predicted step time per setting (none is the baseline), the plan minimises it; plan.json
    holds the report's figures under its documented keys."""
    from lightning_ckpt import DeviceProfile
    from lightning_ckpt.core.plan.planner import predict_seconds

    rc, _ = run_plan([*ARGS, "--device", "l4"], tmp_path, capsys)
    assert rc == 0
    report = (tmp_path / "plan.md").read_text()
    data = json.loads((tmp_path / "plan.json").read_text())
    settings = {r[0]: r for r in table(report, "Settings")}
    by_name = {s["name"]: s for s in data["settings"]}
    assert list(by_name) == list(settings) == ["none", "every_4th", "every_2nd", "every_layer", "selective", "plan"]
    for name, row in settings.items():
        assert num(row[2]) == by_name[name]["activation_bytes"] and num(row[5]) == by_name[name]["recompute_flops"]
        assert row[10] == f"{1000 * by_name[name]['predicted_step_seconds']:.2f} ms"
        assert int(row[9]) == by_name[name]["largest_batch"]
    seconds = {name: s["predicted_step_seconds"] for name, s in by_name.items()}
    assert seconds["none"] == data["plan"]["baseline_step_seconds"]
    assert seconds["plan"] == pytest.approx(data["plan"]["predicted_step_seconds"])
    assert seconds["none"] < seconds["every_2nd"] < seconds["every_layer"]
    assert data["device"] == "l4" and data["plan"]["activation_bytes"] <= data["plan"]["budget_bytes"]
    assert data["static_bytes_per_device"] == sum(num(c) for c in table(report, "Static memory")[0][:3])
    # the plan's predicted time is the least among the settings that fit the budget
    fits = [name for name, s in by_name.items() if s["activation_bytes"] <= data["plan"]["budget_bytes"]]
    assert seconds["plan"] <= min(seconds[name] for name in fits) * (1 + 1e-9)
    assert f"+{100 * (seconds['plan'] / seconds['none'] - 1):.0f}% step time" in report
    # and the same figure from the plain-PyTorch function, from the measured costs
    measurement = measure(build(TINY, fake=False), 8)
    plan_seconds, base = predict_seconds(measurement.costs, measurement.outside_ops, data["plan"]["layers"],
                                         DeviceProfile.preset("l4"), kept_ops=data["plan"]["kept_ops"])
    assert (plan_seconds, base) == pytest.approx((seconds["plan"], seconds["none"]))


def test_offload_auto_needs_a_device_and_plans_per_layer(tmp_path, capsys):
    """--offload auto: refused without --device; with one, plan.json's plan row is priced with the layers the plan
    offloads (the same bytes and time as the plan), and the plan is never predicted slower than without offload."""
    rc, out = run_plan(["--config", str(TINY), "--offload", "auto"], tmp_path / "refused", capsys)
    assert rc == 2 and "pass --device NAME" in out.err and not (tmp_path / "refused" / "plan.json").exists()
    figures = {}
    for offload in ("auto", "false"):
        rc, _ = run_plan(["--config", str(TINY), "--memory-budget", "0.4", "--device", "gh200", "--offload", offload],
                         tmp_path / offload, capsys)
        assert rc == 0
        figures[offload] = json.loads((tmp_path / offload / "plan.json").read_text())
    data = figures["auto"]
    row = next(s for s in data["settings"] if s["name"] == "plan")
    assert set(data["plan"]["offloaded"]) <= set(data["plan"]["layers"])
    assert row["activation_bytes"] == data["plan"]["activation_bytes"] <= data["plan"]["budget_bytes"]
    assert row["host_bytes"] == data["plan"]["host_bytes"] and data["offload"] == "auto"
    assert row["predicted_step_seconds"] == pytest.approx(data["plan"]["predicted_step_seconds"])
    assert data["plan"]["predicted_step_seconds"] <= figures["false"]["plan"]["predicted_step_seconds"]
    assert figures["false"]["plan"]["offloaded"] == [] and figures["false"]["plan"]["host_bytes"] == 0
    assert figures["false"]["offload"] is False and {s["host_bytes"] for s in figures["false"]["settings"]} == {0}


class _Frozen(LightningModule):
    """A Linear(3, 5) (20 float32 parameters, 5 rows each), a frozen 6-float parameter and a 7-float buffer;
    AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 5)
        self.frozen = torch.nn.Parameter(torch.ones(6), requires_grad=False)
        self.register_buffer("counts", torch.zeros(7))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_shard_grad_op_keeps_weights_whole_and_splits_gradients_and_optimizer_state():
    """FSDP's SHARD_GRAD_OP over 4 devices: each device holds every weight, and a quarter (rows padded) of the
    gradients and of AdamW's moments. Known answers, counted by hand."""
    sharding = sharding_of({"class_path": FSDP, "init_args": {"sharding_strategy": "SHARD_GRAD_OP"}}, 4, 1)
    assert (sharding.world, sharding.weights, sharding.states) == (4, 1, 4)
    built = Built(_Frozen(), [], torch.device("cpu"), None, False, None, None, sharding=sharding)
    static = static_memory(built)
    # Weights whole: weight 5 x 3 and bias 5 (80 B), the frozen 6 (24 B), the buffer 7 (28 B).
    assert static.weights == 80 + 24 + 28 == 132
    # Gradients of the trainable two only, 2 of 5 rows each (ceil(5 / 4)): 2 x 3 x 4 + 2 x 4.
    assert static.gradients == 24 + 8 == 32
    # AdamW: exp_avg and exp_avg_sq split like the gradients; each parameter's 0-d float32 step whole.
    assert static.optimizer_state == 2 * 32 + 2 * 4 == 72
    assert static.total == 132 + 32 + 72
    # Unsharded: 104 B of parameters, 28 of buffer, 80 of gradients, 2 x 80 + 8 of optimizer state.
    assert static.unsharded == 104 + 28 + 80 + 168 == 380
    assert static.optimizer == "AdamW" and static.sharding == sharding
    assert all(p.grad is None for p in built.module.parameters())  # the zero gradients are dropped again


def test_the_config_s_seed_banner_is_printed_once(tmp_path, capfd, caplog):
    """tiny.yaml's seed_everything: 0 is applied at each build (fake, then real); Lightning's line shows once."""
    with caplog.at_level("INFO", logger="lightning.fabric.utilities.seed"):
        rc = plan_main(["--config", str(TINY), "--output-dir", str(tmp_path)])
    out = capfd.readouterr()
    assert rc == 0
    printed = (out.out + out.err + caplog.text).count("Seed set to 0")
    assert printed == 1, f"printed {printed} times"


# ------------------------------------------------------------------------------------------------ --lengths

LENGTHS = (8, 16, 32)


@pytest.fixture(scope="module")
def lengths_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_lengths")
    rc = plan_main([*ARGS, "--fake", "--lengths", ",".join(map(str, LENGTHS)), "--output-dir", str(out)])
    return rc, out


def test_lengths_plan_each_length_as_a_separate_measurement_does(lengths_dir):
    """At each length, the plan's peak and every setting's peak are what make_plan and predict_peak give on a step
    measured here at that length (the batch's token ids and labels cut or tiled to it)."""
    from lightning_ckpt.core.plan.planner import predict_peak

    rc, out = lengths_dir
    assert rc == 0
    report, data = (out / "plan.md").read_text(), json.loads((out / "plan.json").read_text())
    rows = table(report, "Plan across lengths")
    assert [(r[0], r[1], r[2]) for r in rows[:3]] == [("8", "8 x 8", "64"), ("16", "8 x 16", "128"), ("32", "8 x 32", "256")]
    by_setting = {r[0]: r for r in rows[5:]}  # the second table (after its header and rule): peaks by length
    modes = {"none": {}, "every_4th": {LAYERS[0]: "full"}, "every_2nd": {LAYERS[0]: "full", LAYERS[2]: "full"},
             "every_layer": dict.fromkeys(LAYERS, "full"), "selective": dict.fromkeys(LAYERS, "selective")}
    assert list(by_setting) == [*modes, "plan (least peak)"]
    built = build(TINY, fake=True)
    for i, length in enumerate(LENGTHS):
        m = measure(built, 8, length)
        plan = make_plan(m.costs, m.outside_bytes, 0.5, modes=CALLBACK_MODES, head_bytes=m.head_bytes,
                         head_peak_bytes=m.head_peak_bytes)
        assert num(rows[i][4]) == pytest.approx(plan.peak_bytes, rel=0.05), length
        assert num(rows[i][6]) == pytest.approx(plan.recompute_flops, rel=0.05), length
        assert rows[i][3].startswith(f"{sum(v != 'none' for v in plan.layers.values())} of 4")
        entry = data["lengths"][i]
        assert (entry["length"], entry["batch_size"], entry["tokens"]) == (length, 8, 8 * length)
        assert entry["plan"]["layers"] == plan.layers and entry["plan_error"] is None
        peaks = {s["name"]: s["peak_bytes"] for s in entry["settings"]}
        for name, layers in modes.items():
            known = predict_peak(m.costs, m.outside_bytes, layers, False, head_bytes=m.head_bytes,
                                 head_peak_bytes=m.head_peak_bytes)
            assert peaks[name] == pytest.approx(known, rel=0.05), (length, name)
            assert num(by_setting[name][1 + i]) == pytest.approx(known, rel=0.05), (length, name)
        # the least peak the plan's own settings (here: exact, no offload) reach: every layer full
        assert entry["least_peak_bytes"] == PlanSettings().least_peak(m) == num(by_setting["plan (least peak)"][1 + i])
        assert entry["least_peak_bytes"] <= peaks["every_layer"]
    # Attention's T^2: the peak without checkpointing more than doubles from 16 to 32 tokens.
    assert data["lengths"][2]["settings"][0]["peak_bytes"] > 2 * data["lengths"][1]["settings"][0]["peak_bytes"]
    # 32 is the loader's own length: the tiled-and-cut path gives the plain measurement's peaks.
    assert {s["name"]: s["peak_bytes"] for s in data["lengths"][2]["settings"]} == {
        s["name"]: s["peak_bytes"] for s in data["settings"]}


def test_lengths_largest_length_fits_a_quadratic_through_the_measured_peaks(lengths_dir):
    """With --device-memory: the largest length per setting, static memory plus the quadratic through the three
    measured peaks within device memory, found here by scanning lengths."""
    import numpy as np

    _, out = lengths_dir
    report, data = (out / "plan.md").read_text(), json.loads((out / "plan.json").read_text())
    assert data["length_fit"] == "quadratic" and "as a quadratic, c0 + c1 x T + c2 x T^2" in report
    room = DEVICE_MEMORY - data["static_bytes_per_device"]
    shown = {r[0]: r for r in table(report, "Plan across lengths")[5:]}
    assert list(data["largest_length"]) == ["none", "every_4th", "every_2nd", "every_layer", "selective", "plan"]
    for name, largest in data["largest_length"].items():
        if name == "plan":
            continue
        peaks = [next(s["peak_bytes"] for s in at["settings"] if s["name"] == name) for at in data["lengths"]]
        c2, c1, c0 = np.polyfit(LENGTHS, peaks, 2)
        known = max(t for t in range(1, 100_000) if c0 + c1 * t + c2 * t * t <= room)
        assert largest == known, name
        assert shown[name][-1] == str(known)
        assert shown[name][-2] == str(next(s["largest_batch"] for s in data["settings"] if s["name"] == name))
    assert data["largest_length"]["none"] < data["largest_length"]["every_layer"]
    # The plan's: the same fit through its settings' least peaks. Beyond the tiny GPT's block_size (32), so the plan
    # was made at 32 and the fitted length stays.
    c2, c1, c0 = np.polyfit(LENGTHS, [at["least_peak_bytes"] for at in data["lengths"]], 2)
    known = max(t for t in range(1, 100_000) if c0 + c1 * t + c2 * t * t <= room)
    assert data["largest_length"]["plan"] == known > 32 and shown["plan (least peak)"][-1] == str(known)
    assert data["longest_plan"]["length"] == 32 and data["longest_plan"]["fitted_length"] == known
    assert data["longest_plan"]["plan"]["budget_bytes"] == room
    assert f"(the fit gave {known:,}; the model's block_size is 32)" in report


def test_lengths_png_draws_a_line_per_setting_over_the_lengths(lengths_dir):
    _, out = lengths_dir
    data = json.loads((out / "plan.json").read_text())
    fig = plot(data, out / "again.png")
    _, ax = fig.axes
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines) == ["none", "every_4th", "every_2nd", "every_layer", "selective", "plan",
                           "plan's settings: least peak", "device memory less static", "plan at its longest, 32"]
    assert list(lines["device memory less static"].get_ydata()) == [DEVICE_MEMORY - data["static_bytes_per_device"]] * 2
    assert lines["none"].get_xdata().tolist() == list(LENGTHS)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8 x 8", "8 x 16", "8 x 32"]


def test_without_lengths_plan_json_has_no_length_entries(real_dir):
    _, out = real_dir
    data = json.loads((out / "plan.json").read_text())
    assert not {"lengths", "length_fit", "largest_length"} & set(data)
    assert "## Plan across lengths" not in (out / "plan.md").read_text()


def test_a_length_beyond_the_model_s_block_size_exits_2_naming_it(tmp_path, capsys):
    rc, out = run_plan(["--config", str(TINY), "--fake", "--lengths", "16,64"], tmp_path, capsys)
    assert rc == 2
    assert "plan: --lengths: the model cannot take a length of 64 tokens: its block_size is 32" in out.err
    assert not (tmp_path / "plan.json").exists()


def test_bad_lengths_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(TINY), "--lengths", "512,lots"])
    assert exit_info.value.code == 2
    assert "--lengths: '512,lots': pass sequence lengths of 1 or more" in capsys.readouterr().err


def test_batch_of_length_cuts_and_tiles_every_tensor_of_the_token_length():
    ids = torch.arange(6).view(2, 3)
    batch = {"input_ids": ids, "labels": ids + 10, "mask": torch.ones(2, 3, dtype=torch.bool),
             "embeds": torch.zeros(2, 3, 4), "other": torch.zeros(2, 5), "ids_per_sample": torch.arange(2), "name": "x"}
    longer = batch_of_length(batch, 7)
    assert {k: tuple(v.shape) for k, v in longer.items() if k != "name"} == {
        "input_ids": (2, 7), "labels": (2, 7), "mask": (2, 7), "embeds": (2, 7, 4), "other": (2, 5),
        "ids_per_sample": (2,)}
    assert longer["input_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 3, 4, 5, 3]]
    assert longer["labels"][1].tolist() == [13, 14, 15, 13, 14, 15, 13] and longer["name"] == "x"
    shorter = batch_of_length((ids.float(), ids, ids + 10), 2)  # the token ids: the first 2-D integer tensor
    assert [tuple(t.shape) for t in shorter] == [(2, 2), (2, 2), (2, 2)]
    assert shorter[2].tolist() == [[10, 11], [13, 14]]
    with pytest.raises(ValueError, match="needs token ids in the batch"):
        batch_of_length((torch.zeros(2, 3),), 4)


def test_lengths_a_budget_in_bytes_met_at_one_length_and_not_at_another(tmp_path, capsys):
    """600,000 B: met at 8 x 8 (no checkpointing peaks at 661,064 B there), not at 8 x 32 (every layer full peaks at
    1,054,976 B); plan.json has the plan at one and null with the planner's reason at the other."""
    rc, out = run_plan(["--config", str(TINY), "--fake", "--lengths", "8,32", "--memory-budget", "600000"], tmp_path,
                       capsys)
    assert rc == 1  # the loader's own length, 32, cannot be met either
    data, report = json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "plan.md").read_text()
    short, long = data["lengths"]
    assert short["plan"]["peak_bytes"] <= 600_000 < next(s["peak_bytes"] for s in short["settings"] if s["name"] == "none")
    assert short["plan_error"] is None and [s["name"] for s in short["settings"]][-1] == "plan"
    assert long["plan"] is None and "the least reachable is" in long["plan_error"]
    assert "plan" not in [s["name"] for s in long["settings"]]
    assert data["length_fit"] == "linear" and data["largest_length"] is None  # no --device-memory
    assert "| 32 | 8 x 32 | 256 | no plan | - | - | - |\n\nNo plan at 8 x 32: `memory_budget=600000`" in report
    assert "fitted over the 2 lengths as a line" in report


def test_compress_counts_every_settings_layer_inputs_compressed_and_the_plan_applies_it(real_dir, tmp_path, capsys):
    """--compress fp8: each layer's full-checkpointing bytes are its inputs as fp8 (a byte a value and a 4-byte scale
    per 128: 0.258 of their fp32 bytes here), every setting that checkpoints holds that much less, the plan records
    the width it was solved for; the un-checkpointed figures are unchanged."""
    _, exact_dir = real_dir
    exact = json.loads((exact_dir / "plan.json").read_text())
    rc, out = run_plan([*ARGS, "--compress", "fp8"], tmp_path, capsys)
    assert rc == 0 and "Compress is 'fp8'" in out.out
    got = json.loads((tmp_path / "plan.json").read_text())
    assert got["plan"]["compress"] == "fp8" and exact["plan"]["compress"] is None
    for mine, theirs in zip(got["layers"], exact["layers"]):
        assert mine["none_bytes"] == theirs["none_bytes"]
        values = theirs["full_bytes"] // 4  # the block input, float32
        groups = -(-values // 128)  # the last one padded to 128 values
        assert mine["full_bytes"] == 128 * groups + 4 * groups
    saved = sum(t["full_bytes"] - m["full_bytes"] for m, t in zip(got["layers"], exact["layers"]))
    settings = {s["name"]: s for s in got["settings"]}
    exact_settings = {s["name"]: s for s in exact["settings"]}
    assert settings["every_layer"]["activation_bytes"] == exact_settings["every_layer"]["activation_bytes"] - saved
    assert settings["none"]["activation_bytes"] == exact_settings["none"]["activation_bytes"]


def test_compress_fp8_counts_the_padded_last_group_of_an_input_that_is_not_a_multiple_of_128(tmp_path, capsys):
    """tiny.yaml at batch 3, length 31, width 20: each block's input holds 3 x 31 x 20 = 1,860 fp32 values, as fp8
    15 groups of 128 (the last padded with 60 zeros) and 15 scales: 15 x 128 + 15 x 4 = 1,980 B (not 1,860 + 60)."""
    config = TINY.read_text().replace("block_size: 32", "block_size: 31").replace("n_embd: 32", "n_embd: 20")
    config = config.replace("batch_size: 8", "batch_size: 3")
    (tmp_path / "odd.yaml").write_text(config)
    rc, out = run_plan(["--config", str(tmp_path / "odd.yaml"), "--compress", "fp8", "--fake"], tmp_path, capsys)
    assert rc == 0, out.err
    layers = json.loads((tmp_path / "plan.json").read_text())["layers"]
    assert [(layer["name"], layer["full_bytes"]) for layer in layers] == [(name, 1_980) for name in LAYERS]


def test_lengths_peaks_are_exactly_those_predicted_from_a_measurement_at_each_length(lengths_dir):
    """The measurement under --fake is deterministic, so each setting's peak at each length is predict_peak's on a
    step measured here, to the byte (the head's backward peak included: it moves them by 0.16% only)."""
    from lightning_ckpt.core.plan.planner import predict_peak

    _, out = lengths_dir
    data = json.loads((out / "plan.json").read_text())
    modes = {"none": {}, "every_4th": {LAYERS[0]: "full"}, "every_2nd": {LAYERS[0]: "full", LAYERS[2]: "full"},
             "every_layer": dict.fromkeys(LAYERS, "full"), "selective": dict.fromkeys(LAYERS, "selective")}
    built = build(TINY, fake=True)
    for entry in data["lengths"]:
        m = measure(built, 8, entry["length"])
        known = {name: predict_peak(m.costs, m.outside_bytes, layers, False, head_bytes=m.head_bytes,
                                    head_peak_bytes=m.head_peak_bytes) for name, layers in modes.items()}
        plan = make_plan(m.costs, m.outside_bytes, 0.5, modes=CALLBACK_MODES, head_bytes=m.head_bytes,
                         head_peak_bytes=m.head_peak_bytes)
        assert {s["name"]: s["peak_bytes"] for s in entry["settings"]} == {**known, "plan": plan.peak_bytes}


def test_lengths_are_measured_compressed_with_compress(tmp_path, capsys):
    """--lengths 8,32 --compress fp8: 32 is the loader's own length, so its row is the main table's, fp8 inputs
    included. Every layer full peaks in the last block's backward: fp8 takes 32,768 - 8,448 B off each of the three
    blocks held before it and adds the last one's 8,448 B copy to its backward, 64,512 B less than exact inputs'
    1,054,976 B: 990,464 B; and 8 B more: each block's measured backward peak is 921,608 B since the re-run makes its
    outputs' gradients inside its backward (921,600 B before; the 8 B not traced further)."""
    rc, out = run_plan([*ARGS, "--fake", "--lengths", "8,32", "--compress", "fp8"], tmp_path, capsys)
    assert rc == 0, out.err
    data = json.loads((tmp_path / "plan.json").read_text())
    peaks = {s["name"]: s["peak_bytes"] for s in data["lengths"][1]["settings"]}
    assert peaks["every_layer"] == 990_472 == 1_054_976 - 3 * (32_768 - 8_448) + 8_448 + 8
    assert peaks == {s["name"]: s["peak_bytes"] for s in data["settings"]}
    assert [at["plan"]["compress"] for at in data["lengths"]] == ["fp8", "fp8"]
