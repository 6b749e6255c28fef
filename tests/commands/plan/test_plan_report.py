"""``lightning-ckpt plan``'s report from hand-made figures, with no measured model: its paragraphs and columns."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lightning_ckpt.commands.plan.measure import Built, Measurement, Sharding, StaticMemory
from lightning_ckpt.commands.plan.predictions import SettingRow, setting_choices, setting_rows
from lightning_ckpt.commands.plan.report import PlanResult, plot, render, report_data, sharding_lines
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.core.measure.profiling import format_bytes
from lightning_ckpt.core.plan.planner import CheckpointPlan, LayerCost, make_plan


def static(sharding: Sharding, unsharded: int | None = None) -> StaticMemory:
    return StaticMemory(1000, 1000, 2000, "AdamW", sharding, unsharded)


def test_sharding_lines_say_how_many_ways_each_part_is_divided():
    full, blank = sharding_lines(static(Sharding("fsdp_ckpt", 8, 8, 8), unsharded=32 * 1024))
    assert blank == ""
    assert full.startswith("**One device's share (32.0 KiB unsharded):** strategy 'fsdp_ckpt' shards parameters,"
                           " gradients and optimizer state over 8 devices (8 in all: devices x num_nodes)")
    (grad_op, _) = sharding_lines(static(Sharding("FSDPStrategy", 16, 1, 8, note="cpu offload")))
    assert grad_op.startswith("**One device's share:** strategy 'FSDPStrategy' shards gradients and optimizer state"
                              " over 8 devices, parameters over 1 (16 in all")
    assert grad_op.endswith(" Note: cpu offload.")


def test_sharding_lines_for_a_strategy_that_does_not_shard():
    assert sharding_lines(static(Sharding("ddp", 2))) == [
        "Not sharded (strategy 'ddp', 2 devices in all: devices x num_nodes): every device holds all of it.", ""]
    assert sharding_lines(static(Sharding()))[0].startswith("Not sharded (strategy 'auto', 1 device in all")


def settings_table(report: str) -> dict[str, list[str]]:
    """The rows of the report's Settings table by setting name (cells stripped)."""
    body = report.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines() if line.startswith("|")]
    return {r[0]: r for r in rows[2:]}


def test_static_plus_activations_is_one_device_s_share_plus_the_setting_s_activations():
    """Under a sharded strategy the column adds the per-device static memory (not the unsharded whole) to each
    setting's activations; bytes under 1 KiB print whole, so the known answers are exact."""
    sharding = Sharding("fsdp_ckpt", 4, 4, 4)
    static_memory = StaticMemory(100, 100, 208, "AdamW", sharding, unsharded=1600)  # 408 B per device
    costs = [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                       full_flops=50, selective_flops=5) for i in range(4)]
    main = Measurement(8, costs, 100)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None)
    rows = [SettingRow("none", 0, 500, 0), SettingRow("every_layer", 4, 140, 200)]
    report = render(PlanResult("hand-made", built, main, None, "none asked", 0.5, rows, static_memory, None, [8]))
    header = next(line for line in report.splitlines() if line.startswith("| setting |"))
    column = [c.strip() for c in header.strip("|").split("|")].index("static + activations")
    got = {name: row[column] for name, row in settings_table(report).items()}
    assert got == {"none": "908 B", "every_layer": "548 B"}  # 408 + 500, 408 + 140 (unsharded: 2.1 KiB, 1.7 KiB)


MIB = 2**20
#: Four layers of 8 MiB saved un-checkpointed, 1 MiB of inputs (all of it movable): above the offload engine's
#: 1 MiB threshold, so the offloaded bytes are whole.
BIG = [LayerCost(f"l{i}", "Block", none_bytes=8 * MIB, full_bytes=MIB, selective_bytes=4 * MIB, offloadable_bytes=MIB,
                 full_flops=10**9, selective_flops=10**7) for i in range(4)]
#: Offload free: the plan offloads.
FAST_LINK = DeviceProfile(matmul_flops=1e9, memory_bandwidth=1e12, host_bandwidth=math.inf, name="fast link")


def offload_result(offload: object) -> PlanResult:
    """A plan made with ``offload`` for half the peak of :data:`BIG` on :data:`FAST_LINK`, with every setting."""
    main = Measurement(8, BIG, MIB)
    plan = make_plan(BIG, MIB, 0.5, offload=offload, device=FAST_LINK, host_memory=1 << 40)
    rows = setting_rows(main, setting_choices([c.name for c in BIG], plan), offload, kept_ops=plan.kept_ops,
                        device=FAST_LINK, plan_offloaded=plan.offloaded)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, offload, 0.5, None)
    return PlanResult("hand-made", built, main, plan, None, 0.5, rows, static(Sharding()), None, [8], profile=FAST_LINK)


def offload_report(offload: object) -> tuple[CheckpointPlan, str]:
    result = offload_result(offload)
    assert result.plan is not None
    return result.plan, render(result)


def plan_line(report: str) -> str:
    return report.split("## Plan for memory_budget=0.5\n\n", 1)[1].split("\n", 1)[0]


def test_the_plan_line_names_what_is_offloaded_and_the_host_bytes():
    """An offloading plan's line says which layers live in host memory and how many bytes, as format_bytes writes
    them and exactly, before the device figures (which leave those bytes out)."""
    plan, report = offload_report("auto")
    assert plan.offloaded and plan.host_bytes > 0
    line = plan_line(report)
    names = ", ".join(plan.offloaded)
    assert f"{len(plan.offloaded)} offloaded to host memory ({names}): {format_bytes(plan.host_bytes)}" in line
    assert f"({plan.host_bytes:,} B) in host memory, not in the device figures that follow: activations" in line


def test_the_plan_line_says_so_when_offload_was_asked_and_nothing_is_offloaded():
    _, report = offload_report(False)
    assert "offload" not in plan_line(report)
    plan = make_plan(BIG, MIB, 0.5)
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, "auto", 0.5, None)
    rows = setting_rows(Measurement(8, BIG, MIB), setting_choices([c.name for c in BIG], plan), "auto")
    report = render(PlanResult("hand-made", built, Measurement(8, BIG, MIB), plan, None, 0.5, rows, static(Sharding())))
    assert ", none offloaded (offload 'auto'): 0 B in host memory:" in plan_line(report)


def test_the_settings_table_gives_host_bytes_in_their_own_column():
    """With offload the Settings table has a host memory column: the plan row's is the plan's host bytes, which
    its activations and peak do not count; the standard settings offload nothing under 'auto'."""
    plan, report = offload_report("auto")
    header = next(line for line in report.splitlines() if line.startswith("| setting |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[-1] == "host memory (B)"
    rows = settings_table(report)
    assert rows["plan"][-1] == f"{plan.host_bytes:,}" and rows["plan"][2] == f"{plan.planned_bytes:,}"
    assert {name: row[-1] for name, row in rows.items() if name != "plan"} == dict.fromkeys(
        ["none", "every_4th", "every_2nd", "every_layer", "selective"], "0")
    assert ("Host memory: what offloaded layers keep in host memory (with offload 'auto' only the plan offloads);"
            " activations, peak and static + activations are device memory and leave it out.") in report
    data = report_data(offload_result("auto"))  # plan.json: the same figures
    assert data["offload"] == "auto"
    assert {s["name"]: s["host_bytes"] for s in data["settings"]} == {name: int(row[-1].replace(",", ""))
                                                                     for name, row in rows.items()}
    # offload=True: every checkpointed layer's inputs go to the host, 1 MiB each
    _, report = offload_report(True)
    assert {name: row[-1] for name, row in settings_table(report).items()}["every_2nd"] == f"{2 * MIB:,}"
    assert "(with offload 'auto'" not in report
    # without offload: no such column
    _, report = offload_report(False)
    assert "host memory" not in report.split("## Settings", 1)[1]


def plot_data(offload: object = False) -> dict:
    """plan.json's figures for :func:`plot`, by hand: the plan lands on every_2nd's point (its label would be drawn
    over every_2nd's), bytes in MiB; with ``offload`` the plan and the front's two lowest plans keep bytes on the host."""
    def setting(name: str, mib: float, flops: float, host: int = 0) -> dict:
        return {"name": name, "activation_bytes": round(mib * MIB), "recompute_flops": flops, "host_bytes": host,
                "predicted_step_seconds": None}
    host = 3 * MIB if offload else 0
    settings = [setting("none", 3.1, 0), setting("every_4th", 2.4, 7.6e6), setting("every_2nd", 1.7, 15.3e6),
                setting("every_layer", 0.3, 30.5e6), setting("selective", 1.8, 1.2e6), setting("plan", 1.7, 15.3e6, host)]
    front = [{"budget_bytes": round(b * MIB), "activation_bytes": round(a * MIB), "recompute_flops": f,
              "host_bytes": h, "predicted_step_seconds": None}
             for b, a, f, h in [(1.0, 0.3, 30.5e6, host), (1.9, 1.7, 15.3e6, host), (2.6, 2.4, 7.6e6, 0), (3.2, 3.1, 0, 0)]]
    return {"config": "hand-made", "settings": settings, "front": front, "offload": offload}


def text_boxes(fig) -> dict:
    """Each point label's text box on the canvas (the text alone, not the line an annotation may draw to its point)."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    for t in fig.axes[0].texts:
        t.update_positions(renderer)
    return {t.get_text(): Text.get_window_extent(t, renderer) for t in fig.axes[0].texts}


def test_plan_png_labels_overlap_nothing_and_stay_inside_the_axes(tmp_path):
    """The plan drawn on every_2nd's point: the two labels (and every other) are placed apart, inside the axes."""
    fig = plot(plot_data(), tmp_path / "plan.png")
    [ax] = fig.axes
    boxes = text_boxes(fig)
    assert set(boxes) == {"none", "every_4th", "every_2nd", "every_layer", "selective", "plan (chosen)"}
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not boxes[a].overlaps(boxes[b]), (a, b, boxes[a], boxes[b])
    inside = ax.get_window_extent(fig.canvas.get_renderer())
    assert all(inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
               for box in boxes.values())
    # each label still belongs to its point: it starts within 30 points of it
    assert all(max(abs(dx), abs(dy)) <= 30 for dx, dy in (t.xyann for t in ax.texts))


def test_plan_png_byte_axis_is_in_binary_units_as_format_bytes_writes_them(tmp_path):
    fig = plot(plot_data(), tmp_path / "plan.png")
    [ax] = fig.axes
    low, high = ax.get_ylim()
    ticks = [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert len(ticks) >= 3
    assert [text for _, text in ticks] == [format_bytes(value) for value, _ in ticks]
    assert {text.split()[-1] for _, text in ticks} <= {"B", "KiB", "MiB"} and any("MiB" in t for _, t in ticks)
    assert all(value % (MIB // 2) == 0 for value, _ in ticks)  # round steps of the binary unit, not of 10^6
    assert "MB" not in ax.get_ylabel()


def test_plan_png_front_is_labelled_with_the_plan_s_offload_and_marks_plans_that_offload(tmp_path):
    fig = plot(plot_data("auto"), tmp_path / "plan.png")
    [ax] = fig.axes
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines) == ["planner's front over budgets (offload 'auto', as the plan)", "front: plans that offload"]
    assert lines["front: plans that offload"].get_xydata().tolist() == [[30.5e6, round(0.3 * MIB)],
                                                                      [15.3e6, round(1.7 * MIB)]]
    assert "plan (chosen), +3.0 MiB on host" in text_boxes(fig)
    assert ax.get_ylabel() == "activations held for backward on the device\n(not counting host memory)"


def test_the_intro_says_where_offload_auto_s_choices_are_shown():
    plan, report = offload_report("auto")
    assert ("Offload is 'auto': the plan chooses per layer what lives in host memory (`+offload` in the Layers"
            " table's plan column).") in report
    marked = [line.split("|")[1].strip() for line in report.split("## Layers", 1)[1].split("## Plan", 1)[0].splitlines()
              if "+offload" in line]
    assert marked == plan.offloaded


def test_the_plan_line_gives_the_activations_as_a_share_of_those_held_without_checkpointing():
    # By hand: l0 selective (4 MiB), l1 and l2 full (1 MiB each), l3 none (8 MiB), 1 MiB outside: 15 MiB of the
    # 4 x 8 + 1 = 33 MiB held without checkpointing, 45%. The peaks are set apart from the held bytes (36 MiB without
    # checkpointing), so that a share of the peak (42%) is told apart; recompute 10^7 + 2 x 10^9 FLOP.
    plan = replace(make_plan(BIG, MIB, 0.5), peak_bytes=16 * MIB, baseline_peak_bytes=36 * MIB)
    assert plan.layers == {"l0": "selective", "l1": "full", "l2": "full", "l3": "none"}
    built = Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None)
    rows = setting_rows(Measurement(8, BIG, MIB), setting_choices([c.name for c in BIG], plan), False)
    report = render(PlanResult("hand-made", built, Measurement(8, BIG, MIB), plan, None, 0.5, rows, static(Sharding())))
    assert plan_line(report) == (
        "3 of 4 layers checkpointed (l0: selective, l1: full, l2: full): activations 15.0 MiB (45% of 33.0 MiB without"
        " checkpointing), peak 16.0 MiB (budget 16.5 MiB, 36.0 MiB without checkpointing); recompute 2,010,000,000"
        " FLOP per step.")


def test_the_host_memory_paragraph_in_each_of_its_forms():
    from lightning_ckpt.commands.plan.report import host_memory_lines
    from lightning_ckpt.commands.plan.static_memory import HostMemory

    gib = 2**30
    plain, offloaded = StaticMemory(0, 0, 0, "AdamW"), StaticMemory(0, 0, 0, "AdamW", Sharding(cpu_offload=True),
                                                                   host_weights=3 * gib)
    given, here = HostMemory(8 * gib, given=True), HostMemory(8 * gib, given=False)
    assert host_memory_lines(plain, None, offload=True) == []
    assert host_memory_lines(plain, here) == [
        "Host memory planned with: nothing is planned there (offload is off, no CPU offload); --host-memory sets the"
        " target's (default: half of this machine's available memory).", ""]
    assert host_memory_lines(plain, given, offload=True) == [
        "Host memory planned with: 8.0 GiB per device (given: --host-memory). Offloaded activations may take all of"
        " it.", ""]
    assert host_memory_lines(plain, given) == [
        "Host memory planned with: 8.0 GiB per device (given: --host-memory). Nothing is planned there (offload is"
        " off).", ""]
    assert host_memory_lines(plain, here, offload="auto") == [
        "Host memory planned with: 8.0 GiB per device (this machine's: half of its available memory; pass"
        " --host-memory with the target's). Offloaded activations may take all of it.", ""]
    assert host_memory_lines(offloaded, HostMemory(8 * gib, given=True, static=3 * gib)) == [
        "Host memory planned with: 8.0 GiB per device (given: --host-memory). CPU offload keeps 3.0 GiB of it (this"
        " device's share of the parameters, gradients and optimizer state), leaving 5.0 GiB for offloaded"
        " activations.", ""]
    assert host_memory_lines(offloaded, HostMemory(2 * gib, given=False, static=3 * gib)) == [
        "Host memory planned with: 2.0 GiB per device (this machine's: half of its available memory; pass"
        " --host-memory with the target's). CPU offload keeps 3.0 GiB of it (this device's share of the parameters,"
        " gradients and optimizer state): **more than the host memory, so the run does not fit it**; pass the"
        " target's --host-memory, or shard over more devices.", ""]


def test_why_the_longest_length_was_shortened_in_words_each_reason_once_in_order():
    from lightning_ckpt.commands.plan.report import _host_hint, _shortened_text
    from lightning_ckpt.commands.plan.static_memory import HostMemory

    given, here = HostMemory(5 * 2**30, given=True), HostMemory(5 * 2**30, given=False)
    assert _host_hint(None) == ""
    assert _host_hint(given) == " (host memory for offloaded activations: 5.0 GiB, given by --host-memory)"
    assert _host_hint(here) == (" (host memory for offloaded activations: 5.0 GiB, this machine's; pass --host-memory"
                                " with the target's)")
    assert _shortened_text([], given) == "shorter lengths were measured)"
    assert _shortened_text(["overshot", "no_plan", "overshot", "host_memory"], given) == (
        "its least peak there overshot; then the planner found no plan within the room there; then no plan there fit"
        " the host memory for offloaded activations (5.0 GiB, given by --host-memory), so shorter lengths were"
        " measured)")
    assert _shortened_text(["host_memory", "odd"], None) == (
        "no plan there fit the host memory for offloaded activations; then odd, so shorter lengths were measured)")
