"""`lightning-ckpt compare`: variant configs, the timing statistics, the plot, and real runs of the tiny config."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from matplotlib.container import ErrorbarContainer

from lightning_ckpt.commands.cli import main as cli_main
from lightning_ckpt.commands.compare import DEFAULT_WARMUP
from lightning_ckpt.commands.compare.comparison import Comparison
from lightning_ckpt.commands.compare.report import plot, prediction_text, render_markdown, to_json
from lightning_ckpt.commands.compare.run import PERTURB_ENV, config_seed, read_monitor_csv, schedule, variant_config
from lightning_ckpt.commands.compare.stats import (
    MIN_TIMED_STEPS,
    TimeDifference,
    TimeModel,
    VariantResult,
    first_step_difference,
    measurements,
    measured_baseline,
    predict_variants,
    signed_percent,
    time_difference,
    _resampled_medians,
)
from lightning_ckpt.commands.compare.variants import available_variants, planned_settings
from lightning_ckpt.commands.plan.measure import Measurement, build, measure
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.memory_stats import ACTIVATIONS, GIB, SAMPLES_PER_SEC, STEP_SEC, TOKENS_PER_SEC
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import LayerCost, predict_seconds

TINY = Path(__file__).parents[3] / "configs" / "tiny.yaml"
COLUMNS = ["variant", "layers", "peak device", "host RSS", "activations", "offloaded", "timed steps", "step",
           "step IQR", "samples/s", "memory saved", "time lost", "predicted", "loss diff", "grad diff", "check"]
FIXED = ["none", "every_layer", "selective", "every_2nd", "every_4th", "offload", "every_layer_fp8"]


@pytest.fixture(autouse=True)
def one_thread_workers(monkeypatch):
    """Workers inherit the environment: one intra-op thread each, or the shared 2-core machine thrashes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(PERTURB_ENV, raising=False)


def table(markdown: str) -> dict[str, dict[str, str]]:
    """The rows of the comparison table, by variant."""
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    parsed = [dict(zip(COLUMNS, (cell.strip() for cell in row.strip("|").split("|")))) for row in rows]
    return {row["variant"]: row for row in parsed}


def step_samples(seed: int, scale: float = 1.0, sigma: float = 0.15, rounds: int = 3, per_round: int = 10):
    """Synthetic step times in seconds, ``[rounds][per_round]``, log-normal around ``scale * 10 ms``."""
    rng = np.random.default_rng(seed)
    return (scale * 0.010 * rng.lognormal(0.0, sigma, (rounds, per_round))).tolist()


def comparison(results, steps_per_round=(10, 10, 10), **settings) -> Comparison:
    """The comparison of ``results`` from ``synthetic.yaml``, timed as :func:`step_samples` draws them."""
    return Comparison(list(results), Path("synthetic.yaml"), list(steps_per_round), **settings)


def synthetic(name: str, step_times) -> VariantResult:
    return VariantResult(name=name, activations_gib=1.0 if name == "none" else 0.5, step_times=step_times,
                         samples_per_step=8.0, loss_diff=0.0, grad_diff=0.0)


# ---------------------------------------------------------------------------------------------------- configs


def test_variant_config_replaces_checkpointing_and_keeps_the_rest(tmp_path):
    base = {
        "seed_everything": True,
        "ckpt_path": "last.ckpt",
        "model": {"class_path": "lightning_ckpt.demos.GPT"},
        "trainer": {"max_steps": 1000, "accumulate_grad_batches": 2, "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
            {"class_path": "lightning_ckpt.GradientCheckpointing",
             "init_args": {"layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 4, "mode": "selective"}},
            {"class_path": "lightning_ckpt.MemoryMonitor", "init_args": {"log_every_n_steps": 50}},
        ]},
    }
    none = variant_config(base, "none", 3, tmp_path / "none" / "round1", seed=7)
    offload = variant_config(base, "offload", 3, tmp_path / "offload" / "round2", seed=7, record_first_step=False)
    selective = variant_config(base, "selective", 3, tmp_path / "selective" / "round1", seed=7)
    paths = [c["class_path"] for c in offload["trainer"]["callbacks"]]
    # the monitor's saved-tensor hooks outside the callback's; no first-step recorder after round 1
    assert paths == ["lightning.pytorch.callbacks.LearningRateMonitor", "lightning_ckpt.callbacks.memory_monitor.MemoryMonitor",
                     "lightning_ckpt.GradientCheckpointing"]
    # each variant says its mode: `every_layer`/`offload` are full checkpointing even when the config is selective
    assert offload["trainer"]["callbacks"][2]["init_args"] == {
        "layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 1, "mode": "full", "offload": True}
    assert selective["trainer"]["callbacks"][2]["init_args"] == {
        "layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 1, "mode": "selective", "offload": False}
    assert selective["trainer"]["callbacks"][-1] == {
        "class_path": "lightning_ckpt.commands.compare.run.FirstStepRecorder",
        "init_args": {"path": str(tmp_path / "selective" / "round1" / "first_step.pt")}}
    assert offload["trainer"]["logger"]["init_args"] == {"save_dir": str(tmp_path / "offload"), "name": "round2",
                                                         "version": ""}  # -> offload/round2/metrics.csv
    assert "lightning_ckpt.GradientCheckpointing" not in [c["class_path"] for c in none["trainer"]["callbacks"]]
    # the monitor logs every step, and counts activations only in the untimed warm-up steps (at least the first)
    assert none["trainer"]["callbacks"][1]["init_args"] == {"log_every_n_steps": 1, "activation_steps": 1}
    for warmup, counted in ((3, 3), (0, 1)):
        config = variant_config(base, "none", 5, tmp_path / "w", seed=7, warmup=warmup)
        assert config["trainer"]["callbacks"][1]["init_args"] == {"log_every_n_steps": 1, "activation_steps": counted}
    for config in (none, offload):
        assert config["seed_everything"] == 7 and "ckpt_path" not in config
        assert config["trainer"]["max_steps"] == 3 and config["trainer"]["accumulate_grad_batches"] == 2
        assert config["model"] == base["model"]
    assert base["trainer"]["callbacks"][1]["init_args"]["every_n_layers"] == 4  # the base is left alone
    with pytest.raises(ValueError, match="every_3rd"):
        variant_config(base, "every_3rd", 3, tmp_path, seed=7)


def test_planned_variant_is_the_configs_budgeted_callback(tmp_path):
    ckpt = {"layer_cls": "lightning_ckpt.demos.Block", "memory_budget": 0.5, "offload": False}
    base = {"trainer": {"callbacks": [{"class_path": "lightning_ckpt.GradientCheckpointing", "init_args": ckpt}]}}
    assert planned_settings(base) == ckpt
    assert available_variants(base) == FIXED + ["planned"]
    planned = variant_config(base, "planned", 4, tmp_path / "planned" / "round1", seed=0)
    assert planned["trainer"]["callbacks"][1] == {"class_path": "lightning_ckpt.GradientCheckpointing",
                                                  "init_args": ckpt}
    # the fixed variants choose their layers themselves: the budget is not passed on
    every_2nd = variant_config(base, "every_2nd", 4, tmp_path / "every_2nd" / "round1", seed=0)
    assert every_2nd["trainer"]["callbacks"][1]["init_args"] == {
        "layer_cls": "lightning_ckpt.demos.Block", "every_n_layers": 2, "mode": "full", "offload": False}

    without = {"trainer": {"callbacks": [{"class_path": "lightning_ckpt.GradientCheckpointing",
                                          "init_args": {"every_n_layers": 2, "memory_budget": None}}]}}
    assert planned_settings(without) is None and available_variants(without) == FIXED
    with pytest.raises(ValueError, match="memory_budget"):
        variant_config(without, "planned", 4, tmp_path, seed=0)


def test_schedule_interleaves_rounds_in_alternating_directions():
    order = schedule(FIXED, 3)
    assert len(order) == 3 * len(FIXED) and order[0] == (0, "none")
    rounds = [[name for r, name in order if r == k] for k in range(3)]
    assert rounds == [FIXED, FIXED[::-1], FIXED]


def test_config_seed_is_the_configs_number_or_the_default():
    assert config_seed({"seed_everything": 7}) == 7
    # `seed_everything: true` lets each process draw its own seed; the variants must share one
    assert config_seed({"seed_everything": True}) == 1234
    assert config_seed({}, default=3) == 3


def test_read_monitor_csv_keeps_the_logged_steps_as_floats(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(f"step,{STEP_SEC},{ACTIVATIONS}\n0,0.5,1.25\n1,,\n2,0.25,\n")
    assert read_monitor_csv(path) == [{"step": 0.0, STEP_SEC: 0.5, ACTIVATIONS: 1.25}, {"step": 2.0, STEP_SEC: 0.25}]
    assert read_monitor_csv(tmp_path / "missing.csv") == []  # a run that logged nothing wrote no file


# ---------------------------------------------------------------------------------------------------- statistics


def test_a_wrong_small_gradient_is_not_hidden_by_a_large_one():
    ref = {"loss": 2.0, "grads": {"big": torch.tensor([1000.0]), "small": torch.tensor([1e-3, -2e-3])}}
    same = {"loss": 2.0, "grads": {k: v.clone() for k, v in ref["grads"].items()}}
    assert first_step_difference(ref, same, rtol=1e-3, atol=1e-6) == (0.0, 0.0, None)

    wrong = {"loss": 2.0, "grads": {"big": torch.tensor([1000.0]), "small": torch.tensor([1e-3, -1e-3])}}
    loss_diff, grad_diff, problem = first_step_difference(ref, wrong, rtol=1e-3, atol=1e-6)
    assert problem == "gradient of small" and grad_diff == pytest.approx(1e-3)

    off_loss = {"loss": 2.1, "grads": same["grads"]}
    assert first_step_difference(ref, off_loss, rtol=1e-3, atol=1e-6)[2] == "loss"
    assert "different parameters" in first_step_difference(ref, {"loss": 2.0, "grads": {"big": ref["grads"]["big"]}},
                                                           rtol=1e-3, atol=1e-6)[2]


def test_time_difference_is_the_ratio_of_pooled_medians_inside_its_interval():
    d = time_difference([[0.010, 0.012], [0.011]], [[0.022], [0.020, 0.024]])
    assert d.ratio == pytest.approx(0.022 / 0.011) and d.timed_steps == 3
    # every resample lies between the slowest base step against the fastest other step and the reverse
    assert 0.020 / 0.012 <= d.low < d.ratio < d.high <= 0.024 / 0.010 and not d.within_noise
    assert time_difference([[0.010, 0.012], [0.011]], [[0.022], [0.020, 0.024]]) == d  # deterministic
    empty = time_difference([], [[0.01]])
    assert math.isnan(empty.ratio) and empty.timed_steps == 0
    assert empty.describe() == "n/a: 0 timed steps, too few to tell"


def test_measurements_take_peaks_over_every_step_and_times_after_warmup():
    def rows(*steps):
        return [{STEP_SEC: s, ACTIVATIONS: a, SAMPLES_PER_SEC: n} for s, a, n in steps]

    done = {"checkpointed_layers": ["a", "b"], "device": "cpu"}
    runs = [(rows((9.0, 3.0, 1.0), (0.1, 1.0, 10.0), (0.3, 1.5, 30.0)), done),
            (rows((8.0, 2.0, 2.0), (0.2, 1.2, 20.0)), done)]
    r = measurements("every_2nd", runs, warmup=1)
    assert r.step_times == [[0.1, 0.3], [0.2]]  # each process's first step is its warm-up
    assert (r.step.median, r.step.q1, r.step.q3, r.step.n) == pytest.approx((0.2, 0.15, 0.25, 3))
    assert r.activations_gib == 3.0 and r.memory_gib == 3.0 and r.timed_memory_gib == 1.5  # warm-up step included
    assert r.samples_per_sec == 20.0 and r.tokens_per_sec is None and r.peak_allocated_gib is None
    assert r.layer_modes == {"a": "full", "b": "full"} and r.kept_ops == {} and r.offload is False
    assert measurements("offload", runs, warmup=1).offload is True
    assert measurements("selective", runs, warmup=1).layer_modes == {"a": "selective", "b": "selective"}

    plan = {"layers": {"a": "selective", "b": "none"}, "kept_ops": {"a": [0, 2]}, "offloaded": ["b"]}
    planned = measurements("planned", [(runs[0][0], {"checkpointed_layers": ["a"], "plan": plan})], warmup=1)
    assert planned.layer_modes == {"a": "selective"} and planned.kept_ops == {"a": [0, 2]}
    assert planned.offload == ["b"]  # the layers the plan offloads, not every checkpointed one


def test_throughput_is_the_samples_of_a_step_over_the_median_step_time():
    # The reported case: batch 8 on a busy machine, an even number of timed steps whose two middle ones are far
    # apart. The median step is their mean time; the median of the logged rates would be the mean of their rates.
    def rows(*times):
        return [{STEP_SEC: t, SAMPLES_PER_SEC: 8 / t, TOKENS_PER_SEC: 8 * 32 / t} for t in times]

    done = {"checkpointed_layers": [], "device": "cpu"}
    r = measurements("none", [(rows(1.0, 0.100, 0.130), done), (rows(2.0, 0.400, 0.420), done)], warmup=1)
    median = (0.130 + 0.400) / 2  # 0.265 s
    by_hand = 8 / median  # 30.19 samples/s, where the median of the rates is (8 / 0.130 + 8 / 0.400) / 2 = 40.77
    assert r.step.median == pytest.approx(median) and r.samples_per_step == pytest.approx(8)
    assert r.samples_per_sec == pytest.approx(by_hand) and r.tokens_per_sec == pytest.approx(32 * by_hand)

    row = table(render_markdown(comparison([r], [2, 2])))["none"]
    assert (row["step"], row["samples/s"]) == ("265", "30.19")
    entry = to_json(comparison([r], [2, 2]))["variants"][0]
    assert entry["step_sec_median"] == pytest.approx(median) and entry["samples_per_step"] == pytest.approx(8)
    assert entry["samples_per_sec"] == pytest.approx(by_hand)
    assert entry["tokens_per_sec"] == pytest.approx(256 / median) and entry["tokens_per_step"] == pytest.approx(256)


def test_a_planted_zero_difference_is_reported_within_noise_never_as_a_gain():
    base, same = step_samples(seed=1), step_samples(seed=2)  # identical distributions
    diff = time_difference(base, same)
    assert diff.low < 1.0 < diff.high and diff.within_noise
    row = table(render_markdown(comparison([synthetic("none", base), synthetic("every_4th", same)])))
    match = re.fullmatch(r"≈0%, within noise ±([\d.]+)%", row["every_4th"]["time lost"])
    assert match, row["every_4th"]["time lost"]
    assert float(match.group(1)) == pytest.approx(100 * max(diff.high - 1, 1 - diff.low), abs=0.5)
    assert 0 < float(match.group(1)) < 20
    assert row["every_4th"]["timed steps"] == "30"

    # A median that came out 3% lower by chance, in noisy timings, is not a gain either.
    lucky = [[0.97 * t for t in r] for r in step_samples(seed=1, sigma=0.3)]
    noisy = time_difference(step_samples(seed=3, sigma=0.3), lucky)
    assert noisy.within_noise and noisy.describe().startswith("≈0%, within noise ±")


def test_a_planted_30_percent_loss_is_reported_with_its_number():
    base, slower = step_samples(seed=1), step_samples(seed=2, scale=1.3)
    diff = time_difference(base, slower)
    assert not diff.within_noise and diff.ratio == pytest.approx(1.3, abs=0.06) and diff.low > 1.15
    text = table(render_markdown(comparison([synthetic("none", base), synthetic("every_layer", slower)])))[
        "every_layer"]["time lost"]
    match = re.fullmatch(r"\+(\d+)% \(\+(\d+)% to \+(\d+)%\)", text)
    assert match, text
    change, low, high = (int(g) for g in match.groups())
    assert 24 <= change <= 36 and change == round(100 * (diff.ratio - 1))
    assert 15 <= low < change < high == round(100 * (diff.high - 1))


def test_rounds_are_paired_so_machine_drift_does_not_hide_a_difference():
    # Every round ran at a different machine speed (x1, x1.5, x2); within a round the variant is 10% slower.
    levels = [1.0, 1.5, 2.0]
    base = [[0.010 * level * (1 + 0.01 * (i % 3)) for i in range(10)] for level in levels]
    slower = [[1.1 * t for t in r] for r in base]
    diff = time_difference(base, slower)
    assert diff.ratio == pytest.approx(1.1, abs=1e-9)
    assert not diff.within_noise and diff.low > 1.05
    # Unpaired (the other side with one round fewer), the drift between rounds swamps it.
    assert time_difference(base, slower[:2]).within_noise


def test_three_steps_give_no_verdict():
    # The reported case: 3 steps, one variant 22% "faster" by chance.
    diff = time_difference([[0.010, 0.011, 0.012]], [[0.008, 0.0085, 0.009]])
    assert diff.timed_steps == 3 < MIN_TIMED_STEPS
    assert diff.describe() == "n/a: 3 timed steps, too few to tell"


def test_unequal_timed_steps_give_no_verdict_when_either_side_has_too_few():
    many, few = step_samples(seed=1), [[0.008, 0.0085, 0.009]]  # 30 timed steps against 3
    for base, other in ((many, few), (few, many)):
        diff = time_difference(base, other)
        assert diff.timed_steps == 3 and not diff.enough_steps
        assert diff.describe() == "n/a: 3 timed steps, too few to tell"
    results = [synthetic("none", many), synthetic("every_layer", few)]
    row = table(render_markdown(comparison(results)))["every_layer"]
    assert row["time lost"] == "n/a: 3 timed steps, too few to tell" and row["timed steps"] == "3"
    assert to_json(comparison(results))["variants"][1]["time_lost"]["enough_steps"] is False


def test_plot_draws_interquartile_error_bars(tmp_path):
    results = [synthetic("none", step_samples(seed=1)), synthetic("every_layer", step_samples(seed=2, scale=1.3))]
    fig = plot(comparison(results), tmp_path / "compare.png")
    png = (tmp_path / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    bars = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2
    for container, result in zip(bars, results):
        (start, end), = [segment[:, 0] for segment in container.lines[2][0].get_segments()]
        assert (start, end) == pytest.approx((1000 * result.step.q1, 1000 * result.step.q3))
        assert end - start > 0
    # memory in the binary unit of the largest figure: activations of 1 and 0.5 GiB
    assert fig.axes[0].get_ylabel() == "activations held for backward (GiB)"
    assert [c.lines[0].get_ydata()[0] for c in bars] == [1.0, 0.5]
    for r, mib in zip(results, (3.5, 0.75)):
        r.activations_gib = mib / 1024
    fig = plot(comparison(results), tmp_path / "compare.png")
    bars = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert fig.axes[0].get_ylabel() == "activations held for backward (MiB)"
    assert [c.lines[0].get_ydata()[0] for c in bars] == [3.5, 0.75]


def test_plot_labels_of_variants_on_one_point_do_not_overlap(tmp_path):
    """every_layer and offload hold the same activations at about the same step time (as on tiny.yaml): their labels
    are placed apart, inside the axes."""
    from matplotlib.text import Text

    same = step_samples(seed=2, scale=1.3)
    results = [synthetic("none", step_samples(seed=1)), synthetic("every_layer", same), synthetic("offload", same),
               synthetic("every_2nd", step_samples(seed=3, scale=1.2))]
    fig = plot(comparison(results), tmp_path / "compare.png")
    [ax] = fig.axes
    renderer = fig.canvas.get_renderer()
    for label in ax.texts:
        label.update_positions(renderer)
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}
    assert list(boxes) == ["none", "every_layer", "offload", "every_2nd"]
    pairs = [(a, b) for i, a in enumerate(boxes) for b in list(boxes)[i + 1:]]
    assert not [(a, b) for a, b in pairs if boxes[a].overlaps(boxes[b])]
    inside = ax.get_window_extent(renderer)
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1
               for b in boxes.values())


def test_memory_is_written_in_the_binary_unit_that_fits_it():
    samples = step_samples(seed=1)
    none, every = synthetic("none", samples), synthetic("every_layer", samples)
    none.activations_gib, none.host_rss_gib = 3.5 / 1024, 1.5  # 3.5 MiB; 1.5 GiB
    every.activations_gib, every.offloaded_gib = 1 / 1024, 0.0002501  # 1 MiB; 0.0002501 x 1024^2 = 262.2 KiB
    rows = table(render_markdown(comparison([none, every])))
    assert [rows["none"][k] for k in ("peak device", "host RSS", "activations", "offloaded")] == [
        "n/a", "1.5 GiB", "3.5 MiB", "0 B"]
    assert (rows["every_layer"]["activations"], rows["every_layer"]["offloaded"]) == ("1.0 MiB", "262.2 KiB")
    assert rows["every_layer"]["memory saved"] == "2.5 MiB (71%)"  # 3.5 - 1 MiB, of 3.5
    assert rows["every_layer"]["host RSS"] == "n/a"  # not measured: NaN
    # compare.json keeps its figures in GiB
    written = to_json(comparison([none, every]))["variants"]
    assert (written[0]["activations_gib"], written[1]["offloaded_gib"]) == (3.5 / 1024, 0.0002501)


def test_render_markdown_shows_memory_saved_a_failed_variant_and_a_warm_up_peak():
    samples = step_samples(seed=1)
    planned = synthetic("planned", samples)
    planned.timed_memory_gib = 0.25  # its measuring first step held 0.5 GiB
    failed = VariantResult(name="every_2nd", error="see every_2nd/round1/worker.log")
    results = [synthetic("none", samples), synthetic("every_layer", samples), failed, planned]
    markdown = render_markdown(comparison(results, warmup=2))
    assert markdown.startswith("# Checkpointing comparison: synthetic.yaml, 30 timed steps per variant\n")
    assert ("Timing: 30 timed steps per variant in 3 round(s) of fresh processes (10/10/10 steps, each after 2"
            " untimed warm-up step(s)), the rounds interleaved and alternately reversed.") in markdown
    assert "95% bootstrap interval" in markdown
    assert "tolerance: |diff| <= 1e-06 + 0.001 x the largest |value|" in markdown
    rows = table(markdown)
    assert rows["every_layer"]["memory saved"] == "512.0 MiB (50%)"  # activations 1.0 -> 0.5 GiB
    assert float(rows["every_layer"]["step"]) == pytest.approx(1000 * np.median(samples), rel=1e-2)
    assert rows["every_2nd"]["check"] == "FAILED: see every_2nd/round1/worker.log"
    assert ("`planned`: the warm-up steps held the most (512.0 MiB, in the table); the timed steps at most 256.0 MiB"
            " (the first step measures for the memory_budget plan).") in markdown
    assert "`every_layer`: the warm-up" not in markdown

    written = to_json(comparison(results, seed=3))
    assert (written["seed"], written["steps"], written["rounds"], written["steps_per_round"]) == (3, 30, 3, [10] * 3)
    assert written["order"][:5] == [(0, "none"), (0, "every_layer"), (0, "every_2nd"), (0, "planned"), (1, "planned")]
    assert written["time_model"] == {"error": ""} and (written["rtol"], written["atol"]) == (1e-3, 1e-6)
    assert written["variants"][2] == {"name": "every_2nd", "description": "every 2nd layer",
                                      "error": "see every_2nd/round1/worker.log"}
    assert written["variants"][1]["time_lost"]["within_noise"] is True  # the same samples


# ---------------------------------------------------------------------------------------------------- predicted


def block_costs(n: int = 4) -> list[LayerCost]:
    """``n`` layers of a 1 GFLOP matmul (kept by selective) then a 1 MB element-wise op; 4 MB of inputs each."""
    ops = (OpRecord("aten.mm.default", 4_000_000, 10**9, 12_000_000, "recompute"),
           OpRecord("aten.gelu.default", 4_000_000, 10**6, 10**6, "recompute"))
    return [LayerCost(f"model.blocks.{i}", "Block", none_bytes=8_000_000, full_bytes=4_000_000,
                      selective_bytes=8_000_000, offloadable_bytes=0, full_flops=10**9 + 10**6, selective_flops=10**6,
                      ops=ops)
            for i in range(n)]


def test_predicted_column_is_the_time_models_ratio_for_the_layers_each_variant_checkpointed():
    costs = block_costs()
    names = [c.name for c in costs]
    profile = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e11, host_bandwidth=1e9, op_overhead=1e-4,
                            policy_overhead=2e-4, name="injected")
    samples = step_samples(seed=1)
    results = [synthetic("none", samples), synthetic("every_layer", samples), synthetic("every_2nd", samples),
               synthetic("selective", samples), synthetic("offload", samples), synthetic("planned", samples)]
    for r, modes in zip(results[1:], ["full", "full", "selective", "full", "ops"]):
        r.layer_modes = dict.fromkeys(names[::2] if r.name == "every_2nd" else names, modes)
    results[4].offload = True
    results[5].kept_ops = {n: [0] for n in names}  # keeps the matmul: recomputes only the element-wise op

    model = TimeModel(Measurement(8, costs, 0), profile, offload_moves=False)
    assert predict_variants(results, model) == []
    # By hand: a step is 3 forwards of 4 x (1 ms matmul + 10 us gelu), and 100 us per op once; every layer
    # recomputes both ops of each layer, at their time and 100 us each.
    step = 3 * 4 * (1e-3 + 1e-5) + 8 * 1e-4
    full = 1 + 4 * (1e-3 + 1e-5 + 2e-4) / step
    assert results[1].predicted_ratio == pytest.approx(full)
    assert results[2].predicted_ratio == pytest.approx(1 + (full - 1) / 2)
    # offload moves nothing in these runs (a CPU run on the CPU's profile): priced as every_layer
    assert results[4].predicted_ratio == pytest.approx(full)
    for r in results[1:]:
        seconds, baseline = predict_seconds(costs, (), r.layer_modes, profile, kept_ops=r.kept_ops)
        assert r.predicted_ratio == pytest.approx(seconds / baseline)
        assert r.predicted_step_seconds == pytest.approx(seconds)
    # selective recomputes only the gelu but pays 200 us per op under its policy, forward and recompute
    assert results[3].predicted_ratio == pytest.approx(1 + 4 * (1e-5 + 1e-4 + 4 * 2e-4) / step)

    rows = table(render_markdown(comparison(results, time_model=model)))
    assert rows["none"]["predicted"] == "-"
    assert rows["every_layer"]["predicted"] == f"+{100 * (full - 1):.0f}%"
    assert rows["selective"]["predicted"] == f"+{100 * (results[3].predicted_ratio - 1):.0f}%"
    written = to_json(comparison(results, time_model=model))
    assert [v["predicted_time_lost"] for v in written["variants"]] == [r.predicted_ratio for r in results]
    assert written["time_model"]["op_overhead"] == 1e-4 and written["time_model"]["policy_overhead"] == 2e-4

    # where offload moves the inputs, both directions over the host link are added, less what hides behind the
    # next layer's forward (copy out) and backward (copy back); the last layer has nothing to hide behind
    moved = TimeModel(Measurement(8, costs, 0), profile, offload_moves=True)
    predict_variants(results, moved)
    seconds, baseline = predict_seconds(costs, (), results[4].layer_modes, profile, offload=True)
    assert results[4].predicted_ratio == pytest.approx(seconds / baseline)
    assert full + 2 * 4e-3 / step < results[4].predicted_ratio < full + 4 * 2 * 4e-3 / step
    # a plan's offload is the layers it offloads, an un-checkpointed one (offload only) included
    results[5].layer_modes, results[5].kept_ops, results[5].offload = {}, {}, [names[1]]
    predict_variants(results, moved)
    seconds, baseline = predict_seconds(costs, (), {}, profile, offload=[names[1]])
    assert results[5].predicted_ratio == pytest.approx(seconds / baseline) and seconds > baseline


def test_on_the_device_measured_the_predicted_step_is_the_baseline_s_measured_step_plus_the_predicted_extra():
    """The optimizer, the loop and the logging are in a step but not in the model: on a profile measured here the
    model's extra goes on top of the baseline's measured step; on a preset, or without a timed baseline, on the
    model's own step."""
    costs = block_costs()
    names = [c.name for c in costs]
    here = DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e11, host_bandwidth=1e9, op_overhead=1e-4,
                         policy_overhead=2e-4, name="measured cpu", layer_times=True)
    results = [synthetic("none", [[0.018, 0.020, 0.022]]), synthetic("every_layer", [[0.03]])]
    results[1].layer_modes = dict.fromkeys(names, "full")
    model = TimeModel(Measurement(8, costs, 0), here, offload_moves=False)
    assert measured_baseline(results, model) == 0.020
    assert predict_variants(results, model) == []
    # by hand: every layer recomputes a 1 ms matmul, a 10 us gelu and 100 us per op for both: 4 x 1.21 ms
    assert results[1].predicted_step_seconds == pytest.approx(0.020 + 4 * 1.21e-3, rel=1e-12)
    assert results[1].predicted_ratio == pytest.approx(1 + 4 * 1.21e-3 / 0.020, rel=1e-12)
    assert results[0].predicted_ratio == pytest.approx(1.0, rel=1e-12)
    text = prediction_text(comparison(results, time_model=model))
    assert "over `none`'s measured step" in text and "no run is timed" not in text

    step = 3 * 4 * (1e-3 + 1e-5) + 8 * 1e-4  # the model's own step, as in the test above
    for model in (TimeModel(Measurement(8, costs, 0), replace(here, layer_times=False), offload_moves=False),
                  TimeModel(Measurement(8, costs, 0), here, offload_moves=False)):
        if model.profile.layer_times:  # a baseline that failed has no step to stand on
            results[0].error = "it crashed"
        assert measured_baseline(results, model) is None
        predict_variants(results, model)
        assert results[1].predicted_step_seconds == pytest.approx(step + 4 * 1.21e-3, rel=1e-12)
        assert "no run is timed" in prediction_text(comparison(results, time_model=model))
    results[0].error, results[0].step_times = None, []  # nor has one that was never timed
    assert measured_baseline(results, TimeModel(Measurement(8, costs, 0), here)) is None
    assert measured_baseline([], TimeModel(Measurement(8, costs, 0), here)) is None


def test_the_predicted_column_s_sentence_whole():
    here = DeviceProfile(2e11, 1e10, 1e10, 4e-6, name="cpu", layer_times=True)
    model = TimeModel(Measurement(8, [], 0), here)
    results = [synthetic("none", [[0.01, 0.02]]), synthetic("every_layer", [[0.03]])]
    assert prediction_text(comparison(results)) == ""
    assert prediction_text(comparison(results, no_time_model="it failed")) == "Predicted: n/a, it failed."
    start = ("Predicted: the slowdown the planner's time model (`predict_seconds`) gives for the layers each variant"
             f" checkpointed, from one measured step of the model (batch 8) priced on {model.describe()}")
    assert prediction_text(comparison(results, time_model=model, unpredicted=["a", "b"])) == (
        start + "; the time each adds, over `none`'s measured step (the optimizer, the loop and the logging are not"
        " in the model). No prediction: a. No prediction: b.")
    preset = TimeModel(Measurement(8, [], 0), replace(here, layer_times=False))
    assert prediction_text(comparison(results, time_model=preset)) == (
        f"Predicted: the slowdown the planner's time model (`predict_seconds`) gives for the layers each variant"
        f" checkpointed, from one measured step of the model (batch 8) priced on {preset.describe()};"
        " no run is timed for it.")

def test_a_variant_whose_layers_were_not_measured_gets_no_prediction():
    samples = step_samples(seed=1)
    results = [synthetic("none", samples), synthetic("every_layer", samples)]
    results[1].layer_modes = {"model.blocks.0": "full", "other.9": "full"}
    model = TimeModel(Measurement(8, block_costs(), 0), DeviceProfile.preset("h100-sxm"))
    problems = predict_variants(results, model)
    assert problems == ["`every_layer` checkpointed other.9, which the measured step does not have"]
    assert results[0].predicted_ratio == 1.0 and results[1].predicted_ratio is None
    text = prediction_text(comparison(results, time_model=model, unpredicted=problems))
    assert text.endswith("No prediction: `every_layer` checkpointed other.9, which the measured step does not have.")
    # a variant that failed, or one with layers not measured, stops nothing: those after are predicted; the first
    # three names not measured are said
    failed, far, after = synthetic("every_2nd", samples), synthetic("selective", samples), synthetic("planned", samples)
    failed.error = "it crashed"
    far.layer_modes = {f"other.{i}": "full" for i in range(5)}
    after.layer_modes = {"model.blocks.0": "full"}
    problems = predict_variants([results[0], failed, far, after], model)
    assert problems == ["`selective` checkpointed other.0, other.1, other.2, which the measured step does not have"]
    assert failed.predicted_ratio is None and far.predicted_ratio is None and after.predicted_ratio > 1
    assert table(render_markdown(comparison(results, time_model=model, unpredicted=problems)))["every_layer"][
        "predicted"] == "n/a"


# ---------------------------------------------------------------------------------------------------- runs


def test_bad_arguments_exit_with_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(TINY), "--variants", "none,every_3rd"])
    assert exit_info.value.code == 2 and "every_3rd" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(TINY), "--variants", "planned"])  # tiny.yaml has no memory_budget
    assert exit_info.value.code == 2 and "needs a memory_budget" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(TINY), "--device", "h300"])  # not a preset
    assert exit_info.value.code == 2 and "--device h300: pass a preset (h100-sxm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(TINY), "--rounds", "0"])
    assert exit_info.value.code == 2 and "--rounds must be >= 1" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--config", str(missing)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2  # argparse's usage error, not a crash (1) or a traceback
    assert err.startswith("usage: lightning-ckpt compare") and f"--config {missing}: no such file" in err


def metrics_rows(path: Path) -> int:
    with open(path, newline="") as f:
        return sum(1 for row in csv.DictReader(f) if row.get("time/step_sec"))


def test_default_times_at_least_20_steps_after_warmup_in_rounds(tmp_path):
    out = tmp_path / "out"
    assert cli_main(["compare", "--config", str(TINY), "--variants", "none", "--output-dir", str(out)]) == 0
    written = json.loads((out / "compare.json").read_text())
    none = written["variants"][0]
    assert written["steps"] >= 20 and none["timed_steps"] >= 20 and written["rounds"] >= 2
    assert table((out / "compare.md").read_text())["none"]["timed steps"] == str(none["timed_steps"])
    # each round is its own process, which ran its warm-up steps and then its share of the timed ones
    logged = [metrics_rows(out / "none" / f"round{k + 1}" / "metrics.csv") for k in range(written["rounds"])]
    assert [n - DEFAULT_WARMUP for n in logged] == written["steps_per_round"] == [len(r) for r in none["step_times"]]
    assert sum(written["steps_per_round"]) == none["timed_steps"]
    assert none["step_sec_q1"] <= none["step_sec_median"] <= none["step_sec_q3"]


def test_compare_tiny_config_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(TINY), "--steps", "3", "--rounds", "1", "--warmup", "1",
                     "--device", "h100-sxm", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    for i, name in enumerate(FIXED, 1):
        assert f"[{i}/7] round 1/1 {name}" in printed  # progress, one line per process

    markdown = (out / "compare.md").read_text()
    assert markdown in printed
    rows = table(markdown)
    assert list(rows) == FIXED
    assert [rows[n]["layers"] for n in rows] == ["0", "4", "4", "2", "1", "4", "4"]  # tiny.yaml: 4 blocks
    written = json.loads((out / "compare.json").read_text())
    activations = {v["name"]: v["activations_gib"] for v in written["variants"]}
    assert activations["none"] > activations["every_4th"] > activations["every_2nd"] > activations["every_layer"] > 0
    assert activations["none"] > activations["selective"] > activations["every_layer"]
    # fp8 inputs: the same layers hold about a quarter of their fp32 bytes (the rest of the step is unchanged)
    assert activations["every_layer_fp8"] < activations["every_layer"]
    for name in FIXED[1:]:
        row = rows[name]
        assert row["timed steps"] == "3" and float(row["loss diff"]) <= 1e-6  # every forward is exact
        if name == "every_layer_fp8":  # its backward starts from fp8 inputs: close, not equal
            assert row["check"] == "ok (cosine ≥ 0.99)" and float(row["grad diff"]) > 1e-6
        else:
            assert row["check"] == "ok" and float(row["grad diff"]) <= 1e-6
        assert row["memory saved"].endswith("%)")
        assert row["time lost"] == "n/a: 3 timed steps, too few to tell"  # 3 steps are not a result
        assert float(row["step"]) > 0 and float(row["samples/s"]) > 0
    assert rows["none"]["check"] == "baseline" and rows["none"]["peak device"] == "n/a"  # CPU run
    # memory in the table and the progress lines in binary units, from the JSON's GiB (KiB and MiB here)
    for name in FIXED:
        assert rows[name]["activations"] == format_bytes(activations[name] * GIB)
        assert re.fullmatch(r"\d+\.\d [KM]iB", rows[name]["activations"])
    assert f"2 layers checkpointed, activations {format_bytes(activations['every_2nd'] * GIB)}, median" in printed
    # memory saved is that of the step's activation peak (what a budget bounds), not of what the forward leaves held
    peaks = {v["name"]: v["activation_peak_gib"] for v in written["variants"]}
    saved = peaks["none"] - peaks["every_layer"]
    percent = 100 * saved / peaks["none"]
    assert rows["every_layer"]["memory saved"] == f"{format_bytes(saved * GIB)} ({percent:.0f}%)"
    assert percent < 100 * (activations["none"] - activations["every_layer"]) / activations["none"]

    assert [v["name"] for v in written["variants"]] == FIXED
    assert all(v["timed_steps"] == 3 for v in written["variants"])
    # the predicted column: the time model on the preset, for the layers each variant checkpointed
    measured = measure(build(TINY, fake=False))
    assert written["time_model"]["device"] == "h100-sxm" and written["time_model"]["offload_moves"] is True
    h100 = DeviceProfile.preset("h100-sxm")
    names = [c.name for c in measured.costs]
    expected = {"none": {}, "every_layer": dict.fromkeys(names, "full"), "selective": dict.fromkeys(names, "selective"),
                "every_2nd": {n: "full" for n in names[::2]}, "every_4th": {names[0]: "full"},
                "offload": dict.fromkeys(names, "full"), "every_layer_fp8": dict.fromkeys(names, "full")}
    for v in written["variants"]:
        assert v["layer_modes"] == expected[v["name"]]
        seconds, baseline = predict_seconds(measured.costs, measured.outside_ops, expected[v["name"]], h100,
                                            offload=v["name"] == "offload",
                                            compress="fp8" if v["name"] == "every_layer_fp8" else None)
        assert v["predicted_time_lost"] == pytest.approx(seconds / baseline, rel=1e-6)
        if v["name"] != "none":
            assert rows[v["name"]]["predicted"] == f"+{100 * (seconds / baseline - 1):.{1 if seconds / baseline < 1.0995 else 0}f}%"
    # the tiny config's layer inputs are under the engine's 1 MiB threshold: offload moves nothing, priced so
    assert 0 < max(s for c in measured.costs for s in c.input_sizes) < 1 << 20
    assert written["variants"][5]["predicted_time_lost"] == written["variants"][1]["predicted_time_lost"]
    # the fp8 passes read and write each input once each way, at the device's memory bandwidth: a little dearer
    assert written["variants"][6]["predicted_time_lost"] > written["variants"][1]["predicted_time_lost"]
    assert metrics_rows(out / "every_2nd" / "round1" / "metrics.csv") == 4  # 1 warm-up + 3 timed
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not (out / "every_2nd" / "round1" / "first_step.pt").exists()


def test_compare_flags_a_planted_wrong_gradient_and_exits_non_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(PERTURB_ENV, "every_layer")  # test hook: this variant corrupts one gradient element
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(TINY), "--steps", "1", "--rounds", "1", "--warmup", "0",
                     "--variants", "every_layer", "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "beyond tolerance" in captured.err
    rows = table((out / "compare.md").read_text())
    assert list(rows) == ["none", "every_layer"]
    assert rows["every_layer"]["check"] == "**MISMATCH: gradient of model.tok_emb.weight**"
    assert float(rows["every_layer"]["grad diff"]) > 1e-3
    assert float(rows["every_layer"]["loss diff"]) == 0  # the forward is right; only the gradient is wrong


def test_compare_planned_variant_fits_the_budget(tmp_path, capsys):
    from lightning_ckpt import GradientCheckpointing

    try:
        GradientCheckpointing(memory_budget=0.5)
    except NotImplementedError:
        pytest.skip("GradientCheckpointing(memory_budget=...) is not implemented yet")
    config = yaml.safe_load(TINY.read_text())
    config["trainer"]["callbacks"] = [{"class_path": "lightning_ckpt.GradientCheckpointing",
                                       "init_args": {"layer_cls": "lightning_ckpt.demos.Block", "memory_budget": 0.5}}]
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    code = cli_main(["compare", "--config", str(path), "--steps", "2", "--rounds", "1", "--warmup", "1",
                     "--variants", "every_layer,planned", "--output-dir", str(out)])
    capsys.readouterr()
    assert code == 0
    rows = table((out / "compare.md").read_text())
    assert list(rows) == ["none", "every_layer", "planned"]
    assert rows["planned"]["check"] == "ok"  # step 1 (measured, fully checkpointed) has the gradients of none
    written = json.loads((out / "compare.json").read_text())
    activations = {v["name"]: v["activations_gib"] for v in written["variants"]}
    planned = written["variants"][2]
    # the plan holds from step 2: the timed steps' activation peak (after 1 warm-up step) is within the budget, a
    # fraction of the peak without checkpointing
    peaks = {v["name"]: v["activation_peak_gib"] for v in written["variants"]}
    assert peaks["every_layer"] <= planned["timed_memory_gib"] <= 0.5 * peaks["none"]
    assert planned["timed_memory_gib"] <= planned["activation_peak_gib"]
    assert rows["planned"]["activations"] == format_bytes(planned["activations_gib"] * GIB)
    assert 1 <= int(rows["planned"]["layers"]) <= 4
    # predicted on this CPU, measured (the default): the plan's own layers; any recompute costs time
    assert written["time_model"]["device"] == "measured cpu" and written["time_model"]["offload_moves"] is False
    assert set(planned["layer_modes"]) <= set(written["time_model"]["layers"]) and planned["layer_modes"]
    assert planned["predicted_time_lost"] > 1 and written["variants"][1]["predicted_time_lost"] > 1
    assert rows["planned"]["predicted"].startswith("+")


def test_resampled_medians_take_each_round_at_its_own_size():
    # Round 0 has one step (0.0), round 1 two (1.0 each): the table pads round 0 to two columns. A resample of
    # rounds (0, 1) draws 1 + 2 steps, [0, 1, 1], median 1; one that drew a second step from round 0 would see
    # [0, 0, 1, 1], median 0.5.
    picks = np.array([[0, 1], [1, 0], [0, 0], [1, 1]])
    medians = _resampled_medians([[0.0], [1.0, 1.0]], picks, np.random.default_rng(0))
    assert medians.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_the_95_percent_interval_leaves_out_2_5_percent_of_the_resampled_ratios_on_each_side():
    rng = np.random.default_rng(1)
    base = [list(1.0 + 0.1 * rng.standard_normal(15)) for _ in range(4)]
    other = [list(1.1 + 0.1 * rng.standard_normal(15)) for _ in range(4)]
    d = time_difference(base, other, seed=0)
    # The same resamples as time_difference draws (seed 0; as many rounds both sides, so the same round picks).
    draws = np.random.default_rng(0)
    picks = draws.integers(0, 4, (2000, 4))
    ratios = _resampled_medians(other, picks, draws) / _resampled_medians(base, picks, draws)
    below, above = float(np.mean(ratios < d.low)), float(np.mean(ratios > d.high))
    assert d.low < d.ratio < d.high
    assert 0.02 <= below <= 0.025 and 0.02 <= above <= 0.025, (below, above)


def test_a_compressed_variants_gradient_close_in_direction_or_within_atol_passes():
    ref = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -2.0]), "z": torch.zeros(2)}}
    # w: 0.01 off (beyond atol) but cosine 0.99999 to the reference; z: 1e-8 off, within atol, cosine 0.
    near = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -2.01]), "z": torch.tensor([1e-8, 0.0])}}
    assert first_step_difference(ref, near, 1e-3, 1e-6, min_cosine=0.999)[2] is None
    far = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, -1.0]), "z": torch.zeros(2)}}  # cosine 0.949
    assert first_step_difference(ref, far, 1e-3, 1e-6, min_cosine=0.999)[2] == "gradient of w (cosine below 0.999)"


def test_percentages_that_round_to_10_drop_their_decimal():
    # One decimal under 10%, none from 10% on: 9.96% rounds to 10, so it is written "10", never "10.0".
    assert [signed_percent(f) for f in (0.0994, -0.0996, 0.1, 0.234)] == ["+9.9%", "-10%", "+10%", "+23%"]
    assert TimeDifference(0.80, 0.75, 0.9004, 30).describe() == "-20% (-25% to -10%), faster"
