"""How ``compare`` runs: the config of each variant's process, the worker that trains one, launching it,
and the one measured step of the model that the predicted slowdowns are priced from.

Each process is ``python -m lightning_ckpt.commands.compare --worker DIR``: it trains the config
:func:`variant_config` wrote to ``DIR/config.yaml`` and leaves the monitor's ``DIR/metrics.csv``, ``DIR/result.json``
(:func:`run_worker`) and, in round 1, the loss and gradients of the first step (:class:`FirstStepRecorder`).
"""

from __future__ import annotations

import copy
import csv
import json
import multiprocessing
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_ckpt.commands.compare.stats import TimeModel
from lightning_ckpt.commands.compare.variants import (
    PLANNED,
    VARIANTS,
    available_variants,
    checkpointing_args,
    is_callback,
    planned_settings,
)
from lightning_ckpt.core.measure.layer_timing import timing_limits
from lightning_ckpt.core.measure.memory_stats import STEP_SEC

PERTURB_ENV = "LIGHTNING_CKPT_COMPARE_PERTURB_GRAD"
CALLBACK_PATH = "lightning_ckpt.GradientCheckpointing"
#: The rounds and seconds the time model's layers are timed in (``timing_limits``): a measuring step's are 3 and 0.03 s.
TIME_MODEL_TIMING = (15, 0.5)
#: What one process leaves: the monitor's rows (:func:`read_monitor_csv`) and its ``result.json`` (:func:`run_worker`).
Output = tuple[list[dict[str, float]], Any]
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------- variants


def variant_config(base: Mapping[str, Any], variant: str, steps: int, run_dir: Path, seed: int,
                   perturb_grad: bool = False, record_first_step: bool = True, warmup: int = 1) -> dict[str, Any]:
    """The LightningCLI config of one process of one variant: ``base`` with its checkpointing replaced and
    measurement added, training ``steps`` steps and writing its logs and metrics to ``run_dir``. The monitor counts
    the activations held in the first ``warmup`` steps (at least one), untimed: its saved-tensor hook would slow the
    timed steps without checkpointing more than those with.

    Example::

        >>> cfg = variant_config({"trainer": {"callbacks": []}}, "every_2nd", 5, Path("out"), seed=0)
        >>> cfg["trainer"]["callbacks"][1]["init_args"]
        {'every_n_layers': 2, 'mode': 'full', 'offload': False}
    """
    if variant == PLANNED:
        settings = planned_settings(base)
        if settings is None:
            raise ValueError(f"The {PLANNED!r} variant needs a `memory_budget` in the config's GradientCheckpointing"
                             f" init_args (e.g. `memory_budget: 0.5`); choose from {', '.join(VARIANTS)}.")
    elif variant in VARIANTS:
        settings = VARIANTS[variant]
    else:
        raise ValueError(f"Unknown variant {variant!r}; choose from {', '.join(available_variants(base))}.")
    config = copy.deepcopy(dict(base))
    for key in ("ckpt_path", "fit", "validate", "test", "predict", "subcommand"):
        config.pop(key, None)
    trainer = dict(config.get("trainer") or {})
    callbacks = trainer.get("callbacks") or []
    callbacks = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks)
    kept = [c for c in callbacks
            if not is_callback(c, "GradientCheckpointing") and not is_callback(c, "MemoryMonitor")]
    ckpt_args = checkpointing_args(base)
    ckpt_args.pop("memory_budget", None)  # the fixed variants choose the layers themselves
    # The monitor before the checkpointing: saved-tensor hooks entered later are inner, and a budget's measuring
    # step must see every saved tensor itself.
    kept.append({"class_path": "lightning_ckpt.callbacks.memory_monitor.MemoryMonitor",
                 "init_args": {"log_every_n_steps": 1, "activation_steps": max(1, warmup)}})
    if variant == PLANNED:
        kept.append({"class_path": CALLBACK_PATH, "init_args": dict(settings)})
    elif settings is not None:
        kept.append({"class_path": CALLBACK_PATH, "init_args": {**ckpt_args, **settings}})
    if record_first_step:
        recorder_args: dict[str, Any] = {"path": str(run_dir / "first_step.pt")}
        if perturb_grad:
            recorder_args["perturb_grad"] = True
        kept.append({"class_path": "lightning_ckpt.commands.compare.run.FirstStepRecorder", "init_args": recorder_args})
    trainer.update(
        callbacks=kept,
        max_steps=steps,
        max_epochs=-1,
        max_time=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(run_dir),
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir.parent), "name": run_dir.name, "version": ""}},
    )
    config["trainer"] = trainer
    config["seed_everything"] = seed
    return config


def config_seed(base: Mapping[str, Any], default: int = 1234) -> int:
    """The config's ``seed_everything`` if it is a number, else ``default`` (every variant must use the same)."""
    seed = base.get("seed_everything")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else default


def steps_per_round(steps: int, rounds: int) -> list[int]:
    """``steps`` timed steps split as evenly as possible over at most ``rounds`` rounds (none empty).

    Example::

        >>> steps_per_round(30, 3), steps_per_round(7, 3), steps_per_round(2, 3)
        ([10, 10, 10], [3, 2, 2], [1, 1])
    """
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The order of the processes, ``(round, variant)``: rounds one after another, alternately forwards and
    backwards, so that slow drift of the machine falls evenly on every variant (the baseline runs first).

    Example::

        >>> schedule(["none", "a", "b"], 3)
        [(0, 'none'), (0, 'a'), (0, 'b'), (1, 'b'), (1, 'a'), (1, 'none'), (2, 'none'), (2, 'a'), (2, 'b')]
    """
    order = []
    for r in range(rounds):
        order += [(r, name) for name in (variants if r % 2 == 0 else list(variants)[::-1])]
    return order


# ---------------------------------------------------------------------------------------------------- worker


class FirstStepRecorder(Callback):
    """Saves the loss and every gradient of the first optimizer step (global rank zero), for ``compare``.

    Args:
        path: where to ``torch.save`` ``{"loss": float, "grads": {name: tensor}}``.
        perturb_grad: test hook only: add an error of 5% of the largest entry to one element of the first
            gradient before recording (and before the optimizer uses it), as a checkpointing bug would.
    """

    def __init__(self, path: str, perturb_grad: bool = False) -> None:
        self.path = path
        self.perturb_grad = perturb_grad
        self._loss = 0.0
        self._done = False

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == 0 and not self._done:
            self._loss += float(loss.detach())  # already divided by the accumulation steps

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._done:
            return
        self._done = True
        named = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
        if self.perturb_grad and named:
            grad = named[0][1]
            grad.view(-1)[0] += 0.05 * grad.abs().max() + 1e-3
        if trainer.is_global_zero:
            grads = {n: g.detach().float().cpu().clone() for n, g in named}
            torch.save({"loss": self._loss, "grads": grads}, self.path)


def run_worker(variant_dir: Path) -> None:
    """Train one variant from ``variant_dir/config.yaml`` and write ``variant_dir/result.json`` (rank zero)."""
    from lightning_ckpt.callbacks.gradient_checkpointing import GradientCheckpointing
    from lightning_ckpt.callbacks.memory_monitor import MemoryMonitor
    from lightning_ckpt.commands.cli_builder import run_cli

    with warnings.catch_warnings():
        # The worker's own command line (`--worker DIR`) is not for LightningCLI; the config comes as `args` on
        # purpose, so LightningCLI's caution against passing both would only be noise in every worker log.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        cli = run_cli(["--config", str(variant_dir / "config.yaml")], run=False, save_config_callback=None)
    trainer = cli.trainer
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if not trainer.is_global_zero:
        return
    layers = [c.checkpointed_layers for c in trainer.callbacks if isinstance(c, GradientCheckpointing)]
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    plans = [c.plan for c in trainer.callbacks if isinstance(c, GradientCheckpointing) and c.plan is not None]
    result = {"checkpointed_layers": layers[0] if layers else [], "device": trainer.strategy.root_device.type,
              "world_size": trainer.world_size, "steps": trainer.global_step, "summary": monitor.summary}
    if plans:  # the memory_budget plan, for the predicted slowdown of `planned`
        result["plan"] = {"layers": dict(plans[0].layers), "kept_ops": dict(plans[0].kept_ops),
                          "offloaded": list(plans[0].offloaded), "compress": plans[0].compress}
    (variant_dir / "result.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------- processes


def read_monitor_csv(path: Path) -> list[dict[str, float]]:
    """The rows :class:`~lightning_ckpt.callbacks.memory_monitor.MemoryMonitor` wrote to a CSVLogger ``metrics.csv``,
    as floats (none when the run logged nothing, and so wrote no file)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in rows if row.get(STEP_SEC)]


def run_process(run_dir: Path, env: Mapping[str, str]) -> tuple[Optional[Output], float]:
    """Train one process in ``run_dir``: its ``(monitor rows, result.json)``, ``None`` when it failed, and its
    seconds."""
    start = time.perf_counter()
    with open(run_dir / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "lightning_ckpt.commands.compare", "--worker", str(run_dir)],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    seconds = time.perf_counter() - start
    result_path = run_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        return None, seconds
    return (read_monitor_csv(run_dir / "metrics.csv"), json.loads(result_path.read_text())), seconds


# ---------------------------------------------------------------------------------------------------- time model


def measure_time_model(config: Path, device: Optional[str] = None) -> TimeModel:
    """Measure one step of ``config``'s model as ``lightning-ckpt plan`` does
    (:func:`~lightning_ckpt.commands.plan.measure.measure`) and get the profile ``device`` names (a preset, or
    ``None``/``"auto"``: the device the step runs on, measured with
    :meth:`~lightning_ckpt.core.measure.device_profile.DeviceProfile.measure`).

    It runs in a fresh process (:func:`in_fresh_process`), as each variant's run does: in ``compare``'s own process,
    after its runs, tiny.yaml's layers timed 1.3x to 1.5x slower than in a fresh one (CPU)."""
    return in_fresh_process(time_model_here, config, device)


def time_model_here(config: Path, device: Optional[str] = None) -> TimeModel:
    """:func:`measure_time_model` in this process. Its layers are timed over a longer window than a measuring
    step's (:data:`TIME_MODEL_TIMING`), and in the second of two measuring steps: in a fresh process the first timed
    tiny.yaml's layers at 1.5x what later ones did, and put the prediction 40% over."""
    from lightning_ckpt.commands.plan.measure import build, device_profile, measure

    built = build(config, fake=False)
    with timing_limits(*TIME_MODEL_TIMING):
        measure(built)
        measured = measure(built)
    profile = device_profile(device or "auto", built)
    assert profile is not None
    return TimeModel(measured, profile, offload_moves=not (device in (None, "auto") and built.device.type == "cpu"))


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a new (spawned) Python process: its result, or its exception raised here.

    Example::

        >>> import os
        >>> in_fresh_process(os.getpid) != os.getpid()
        True
    """
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
