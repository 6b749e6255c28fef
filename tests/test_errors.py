"""Every error the package raises, met as a new user meets it.

Each case triggers one error from the public surface (the callback, ``apply_checkpointing``, ``plan_checkpointing``,
the ``lightning-ckpt`` commands, and the few public helpers that raise on their own) and checks that the message
names the bad value and says what to pass or do instead. Each message's fixed part (a case's ``readme``) is a line of
the documentation's Troubleshooting page, ``docs/troubleshooting.md``, and every ``raise`` (and ``parser.error``) in
the package has a case here, or a reason in :data:`NOT_A_USER_ERROR` why a user cannot meet it.
"""

from __future__ import annotations

import ast
import collections
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader

import lightning_ckpt
from lightning_ckpt import DeviceProfile, FabricCheckpointing, GradientCheckpointing, MemoryMonitor, apply_checkpointing
from lightning_ckpt.callbacks.fabric import check_fabric_strategy
from lightning_ckpt.callbacks.gradient_checkpointing import find_checkpointing_callback
from lightning_ckpt.commands.cli import main as cli_main
from lightning_ckpt.commands.compare.stats import measurements
from lightning_ckpt.core.checkpoint.chunked_loss import chunk_causal_lm_loss
from lightning_ckpt.core.checkpoint.fake_streams import FakeStreams
from lightning_ckpt.core.checkpoint.offload import OffloadEngine, use_engine
from lightning_ckpt.core.checkpoint.lean import apply_lean
from lightning_ckpt.core.checkpoint.tiling import apply_tiling
from lightning_ckpt.core.measure.layer_timing import time_modes, timing_limits
from lightning_ckpt.core.plan.budget import auto_memory_budget
from lightning_ckpt.core.plan.planner import LayerCost, make_plan, plan_checkpointing
from lightning_ckpt.demos import GPT, Block, CountingDataModule, Transformer
from lightning_ckpt.strategies.ddp import check_ddp_settings
from lightning_ckpt.strategies.fsdp import CheckpointingFSDPStrategy, mixed_precision_policy, shard_for_checkpointing

from helpers import OwnMLP

ROOT = Path(__file__).parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
PACKAGE = Path(lightning_ckpt.__file__).parent


def module_name(path: Path) -> str:
    """``core.plan.planner`` for ``lightning_ckpt/core/plan/planner.py``, ``commands.plan`` for ``commands/plan/__init__.py``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of the package, as :func:`module_name` names it.
MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}


@dataclass(frozen=True)
class Case:
    """One error: where it is raised (``module.function``, as :func:`raise_sites` names it), how a user triggers it,
    and what its message must say: the bad value, what to do instead, and the fixed text the Troubleshooting page
    (docs/troubleshooting.md) quotes."""

    where: str
    trigger: Callable[[], Any]
    error: type[Exception]
    bad: str
    fix: str
    readme: str


def _fp8_on_mps() -> None:
    """``compress='fp8'`` with the model bound for an accelerator without float8 (MPS; this machine has no MPS, so
    making a tensor there fails as float8 would)."""
    from unittest import mock

    with mock.patch.object(torch.accelerator, "is_available", lambda: True), \
            mock.patch.object(torch.accelerator, "current_accelerator", lambda: torch.device("mps")):
        apply_checkpointing(blocks(), compress="fp8")


def blocks(n: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(8, 2) for _ in range(n)])


def step_of(model: nn.Module) -> Callable[[], torch.Tensor]:
    x = torch.randn(2, 4, 8)
    return lambda: model(x).sum()


def _llama_scaling_its_logits() -> None:
    """A Transformers Llama whose logits are scaled between head and loss (as Cohere's logit_scale), chunked."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config).train()
    chunk_causal_lm_loss(model)
    model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    ids = torch.randint(0, 32, (1, 8))
    model(input_ids=ids, labels=ids)


def _plan_chunked_out_of_reach() -> None:
    """The demo Transformer's loss in chunks, planned for 1 KiB."""
    torch.manual_seed(0)
    model = Transformer(64, 16, 2, 16, 2, 0.0)
    idx = torch.randint(0, 64, (2, 17))
    plan_checkpointing(model, lambda: model(idx[:, :-1], idx[:, 1:]), 1024, chunk_loss=True)


def _tiled_called_with_two_tensors() -> None:
    holder = nn.ModuleDict({"mlp": OwnMLP()})
    apply_tiling(holder, tile_cls=OwnMLP, tile_tokens=2)
    holder["mlp"](torch.randn(1, 4, 8, requires_grad=True), torch.ones(8))


class _Pool(nn.Module):
    """One row for the whole sequence: not token-wise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(-2, keepdim=True)


def _tiled_pool() -> None:
    holder = nn.ModuleDict({"pool": _Pool()})
    apply_tiling(holder, tile_cls=_Pool, tile_tokens=2)
    holder["pool"](torch.randn(1, 4, 8, requires_grad=True))


def _tiles_nested() -> None:
    model = Transformer(16, 8, 1, 8, 2, 0.0)
    apply_tiling(model)
    apply_tiling(model, tile_cls=Block)


def tiny_gpt() -> GPT:
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_embd=16, n_head=2)


def fit_tiny_gpt(callback: GradientCheckpointing, length: int = 8) -> None:
    """One step of :func:`tiny_gpt` on batches of 2 x ``length`` tokens."""
    data = CountingDataModule(vocab_size=32, block_size=length, batch_size=2, num_samples=4)
    cpu_trainer(max_steps=1, callbacks=[callback]).fit(tiny_gpt(), data)


def cpu_trainer(**kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, **kwargs)


def cpu_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def fabric_setup_twice() -> None:
    ckpt = FabricCheckpointing(cpu_fabric())
    ckpt.setup(tiny_gpt())
    ckpt.setup(tiny_gpt())


def setup_callback(callback: GradientCheckpointing, trainer: Any) -> None:
    callback.setup(trainer, tiny_gpt(), "fit")


def two_callbacks() -> None:
    """Lightning refuses two at ``Trainer(callbacks=...)`` (stateful callbacks of one type); one added later reaches
    the strategies, which look the callback up."""
    trainer = cpu_trainer(callbacks=[GradientCheckpointing(every_n_layers=2)])
    trainer.callbacks.append(GradientCheckpointing())
    find_checkpointing_callback(trainer)


def wrapped_after_the_callback() -> None:
    """A wrapper added after the callback checkpointed, as ``apply_activation_checkpointing`` in a user's hook does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    trainer, module, callback = cpu_trainer(), tiny_gpt(), GradientCheckpointing()
    callback.setup(trainer, module, "fit")
    module.configure_model()  # what the Trainer runs next; the callback checkpoints right after it
    module.model.blocks[0] = checkpoint_wrapper(module.model.blocks[0])
    callback.on_fit_start(trainer, module)


def several_block_classes() -> nn.Module:
    return nn.ModuleDict({"a": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
                          "b": nn.ModuleList([nn.Conv1d(2, 2, 1), nn.Conv1d(2, 2, 1)])})


def nested() -> None:
    model = blocks()
    apply_checkpointing(model, layer_cls=Block)
    apply_checkpointing(model, layer_cls=nn.Linear)


class FakeCache:
    """Duck-typed like Transformers' ``Cache``."""

    def update(self, *args: Any) -> None: ...

    def get_seq_length(self) -> int:
        return 0


class CachedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        return self.linear(x)


def cache_in_training() -> None:
    model = nn.ModuleList([CachedBlock(), CachedBlock()])
    apply_checkpointing(model)
    model[0](torch.randn(2, 4, requires_grad=True), past_key_values=FakeCache())


def a_plan() -> Any:
    return make_plan([LayerCost("0", "Block", none_bytes=100, full_bytes=10, selective_bytes=40, offloadable_bytes=0,
                                full_flops=50, selective_flops=5)], 0, 1.0)


def sharded_at_the_root_only() -> None:
    """FSDP2 on the whole model, not per layer: the planner cannot re-run one layer (one process, gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ckpt.core.checkpoint.placement import _fsdp2

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            _fsdp2().fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            x = torch.randn(2, 4)
            plan_checkpointing(model, lambda: model(x).sum(), 0.5, layer_cls=nn.Linear)
        finally:
            dist.destroy_process_group()



class OwnParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.body = nn.Linear(2, 2)


def reentrant_model() -> nn.Module:
    model = blocks()
    apply_checkpointing(model, layer_cls=Block, use_reentrant=True)
    return model


def sixteen_mixed() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    mixed_precision_policy(MixedPrecision("16-mixed", "cpu"))


CASES: dict[str, Case] = {
    # --- the callback's options (GradientCheckpointing(...), or setting them as attributes)
    "length_fn not callable": Case(
        "callbacks.gradient_checkpointing.GradientCheckpointing.__init__",
        lambda: GradientCheckpointing(memory_budget=0.5, length_fn=64), TypeError,
        "got 64", "a function of the batch returning its tokens", "`length_fn` must be a function of the batch"),
    "max_length not a length": Case(
        "callbacks.gradient_checkpointing._validate", lambda: GradientCheckpointing(memory_budget=0.5, max_length="64"),
        ValueError, "got '64'", "pass an int >= 1", "`max_length` is the longest sequence the run will see"),
    "max_length above block_size": Case(
        "core.measure.longest.longest_length", lambda: fit_tiny_gpt(GradientCheckpointing(memory_budget=0.5, max_length=100)),
        ValueError, "`max_length=100` is longer than the model can take: its block_size is 8",
        "Pass max_length=8 or less", "is longer than the model can take"),
    "budget out of reach at the longest length": Case(
        "core.plan.budget_driver.BudgetDriver.plan_longest",
        lambda: fit_tiny_gpt(GradientCheckpointing(memory_budget="1KiB", max_length=8), length=4), ValueError,
        "length 8, from max_length", "pass `max_length=` its longest length",
        "Planned before the first step for the longest sequences the run may see"),
    "every_n_layers type": Case(
        "core.checkpoint.selection.validate_every_n_layers", lambda: GradientCheckpointing(every_n_layers="2"), TypeError,
        "got '2' of type str", "(1 = every layer, 4 = layers 0, 4, 8, ...)", "`every_n_layers` must be an int >= 1"),
    "every_n_layers value": Case(
        "core.checkpoint.selection.validate_every_n_layers", lambda: GradientCheckpointing(every_n_layers=0), ValueError,
        "got 0", "remove the callback instead", "`every_n_layers` must be >= 1"),
    "layer_cls not dotted": Case(
        "core.checkpoint.selection.import_class", lambda: GradientCheckpointing(layer_cls="Block"), ValueError,
        "`layer_cls='Block'`", "Pass a dotted import path such as", "is not a dotted import path"),
    "layer_cls not importable": Case(
        "core.checkpoint.selection.import_class", lambda: GradientCheckpointing(layer_cls="my_project.model.Block"), ValueError,
        "`layer_cls='my_project.model.Block'`", "Pass a dotted import path such as", "could not be imported"),
    "layer_cls not a module": Case(
        "core.checkpoint.selection.import_class", lambda: GradientCheckpointing(layer_cls="torch.nn.functional.relu"), TypeError,
        "`layer_cls='torch.nn.functional.relu'`", "Pass a dotted import path such as",
        "not an `nn.Module` subclass"),
    "layer_cls empty": Case(
        "core.checkpoint.selection.resolve_layer_classes", lambda: GradientCheckpointing(layer_cls=[]), TypeError,
        "got [].", "a non-empty list of those, or None", "`layer_cls` must be an `nn.Module` subclass"),
    "layer_cls entry": Case(
        "core.checkpoint.selection.resolve_layer_classes", lambda: GradientCheckpointing(layer_cls=[nn.Linear, 3]), TypeError,
        "got 3.", "must be `nn.Module` subclasses or dotted import paths", "`layer_cls` entries must be"),
    "mode": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__", lambda: GradientCheckpointing(mode="partial"), ValueError,
        "`mode='partial'`", "Pass 'full' (recompute the whole layer), 'selective'", "is not understood. Pass 'full'"),
    "mode none without offload": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__", lambda: GradientCheckpointing(mode="none"), ValueError,
        "`mode='none'`", "Pass offload=True, or mode='full' or 'selective'", "recomputes nothing"),
    "flag not a bool": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__",
        lambda: GradientCheckpointing(preserve_rng_state="yes"), TypeError,
        "got 'yes'", "must be True or False", "must be True or False"),
    "checkpoint_kwargs type": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__",
        lambda: GradientCheckpointing(checkpoint_kwargs=[("use_reentrant", False)]), TypeError,
        "got [('use_reentrant', False)]", "keyword arguments or None", "`checkpoint_kwargs` must be a dict"),
    "reentrant and selective": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__",
        lambda: GradientCheckpointing(mode="selective", use_reentrant=True),
        ValueError, "`mode='selective'`", "Pass `use_reentrant=False` (the default) or `mode='full'`",
        "Reentrant checkpointing cannot run a `context_fn`"),
    "compress value": Case(
        "core.checkpoint.compress.validate_compress", lambda: GradientCheckpointing(compress="int4"), ValueError,
        "`compress='int4'`", "Pass None (exact inputs, the default), 'bf16'", "is not understood. Pass None (exact"),
    "compress with mode none": Case(
        "core.checkpoint.wrapping.CheckpointOptions.__post_init__",
        lambda: GradientCheckpointing(mode="none", offload=True, compress="bf16"), ValueError,
        "`compress='bf16'`", "Pass mode='full' or 'selective' to compress, or compress=None",
        "holds a checkpointed layer's inputs compressed until its recompute, but `mode='none'`"),
    "fp8 without float8 support": Case(
        "core.checkpoint.compress.check_compress", lambda: _fp8_on_mps(), ValueError,
        "on mps", "Pass compress='bf16'", "`compress='fp8'` needs float8_e4m3fn support"),
    "budget auto outside the callback": Case(
        "core.checkpoint.selection.parse_memory_budget", lambda: plan_checkpointing(blocks(), lambda: None, "auto"), ValueError,
        "`memory_budget='auto'`", "Pass None, a fraction", "is only understood by the GradientCheckpointing callback"),
    "budget bool": Case(
        "core.checkpoint.selection.parse_memory_budget", lambda: GradientCheckpointing(memory_budget=True), TypeError,
        "`memory_budget=True`", "Pass None, a fraction", "is not understood. Pass None"),
    "budget fraction": Case(
        "core.checkpoint.selection.parse_memory_budget", lambda: GradientCheckpointing(memory_budget=1.5), ValueError,
        "`memory_budget=1.5`", "Pass None, a fraction", "a fraction must be in (0, 1]"),
    "budget bytes": Case(
        "core.checkpoint.selection._checked_bytes", lambda: GradientCheckpointing(memory_budget=0), ValueError,
        "`memory_budget=0`", "Pass None, a fraction", "bytes must be positive"),
    "budget under 1 KiB": Case(
        "core.checkpoint.selection._checked_bytes", lambda: GradientCheckpointing(memory_budget=1), ValueError,
        "`memory_budget=1`", "pass a float such as 1.0 or 0.5; for bytes pass '1KiB' or more",
        "under the least byte budget of 1024 B"),
    "budget text": Case(
        "core.checkpoint.selection.parse_memory_budget", lambda: GradientCheckpointing(memory_budget="50%"), ValueError,
        "`memory_budget='50%'`", "bytes such as '2GiB' or 500_000_000", "is not understood. Pass None"),
    "budget type": Case(
        "core.checkpoint.selection.parse_memory_budget", lambda: GradientCheckpointing(memory_budget=[0.5]), TypeError,
        "`memory_budget=[0.5]`", "bytes such as '2GiB' or 500_000_000", "is not understood. Pass None"),
    "budget and every_n_layers": Case(
        "callbacks.gradient_checkpointing._validate",
        lambda: GradientCheckpointing(memory_budget=0.5, every_n_layers=2), ValueError,
        "`memory_budget=0.5` and `every_n_layers=2`", "Pass one", "are two ways of choosing the checkpointed layers"),
    "unknown option": Case(
        "callbacks.gradient_checkpointing._merged_settings",
        lambda: GradientCheckpointing().load_state_dict({"settings": {"every_n": 2}}), ValueError,
        "no option 'every_n'", "the options are layer_cls, every_n_layers", "GradientCheckpointing has no option"),
    # --- the callback in a Trainer
    "budget auto on the CPU": Case(
        "core.plan.budget_driver.BudgetDriver.prepare",
        lambda: setup_callback(GradientCheckpointing(memory_budget="auto"), cpu_trainer()), ValueError,
        "`memory_budget='auto'`", "Pass a fraction of the un-checkpointed activation memory (`memory_budget=0.5`)",
        "plans for the accelerator's memory, but this run is on the CPU"),
    "offload auto on the CPU": Case(
        "core.plan.budget_driver._measure_device",
        lambda: setup_callback(GradientCheckpointing(memory_budget=0.5, offload="auto"), cpu_trainer()), ValueError,
        "`offload='auto'`", "Pass offload=False on the CPU, or run on a GPU", "this run is on the CPU, where nothing is"
        " offloaded"),
    "offload auto without a budget": Case(
        "callbacks.gradient_checkpointing._validate", lambda: GradientCheckpointing(offload="auto"), ValueError,
        "`memory_budget=None`", "Pass a memory_budget (0.5, '2GiB' or 'auto'), or offload=True / False",
        "lets the memory-budget plan choose which layers offload"),
    "two callbacks": Case(
        "callbacks.gradient_checkpointing.find_checkpointing_callback", two_callbacks, ValueError,
        "has 2 `GradientCheckpointing` callbacks", "pass one (its `layer_cls` can be a list", "`GradientCheckpointing` callbacks; pass one"),
    # --- FabricCheckpointing in a Fabric loop
    "Fabric loss_fn": Case(
        "callbacks.fabric.FabricCheckpointing.__init__", lambda: FabricCheckpointing(cpu_fabric(), loss_fn=3),
        TypeError, "got 3", "`loss_fn(module, batch) -> loss`", "`loss_fn` must be a function"),
    "Fabric monitor": Case(
        "callbacks.fabric.FabricCheckpointing.__init__", lambda: FabricCheckpointing(cpu_fabric(), monitor="yes"),
        TypeError, "got 'yes'", "True, False or a MemoryMonitor", "`monitor` must be True, False or a MemoryMonitor"),
    "Fabric setup twice": Case(
        "callbacks.fabric.FabricCheckpointing.setup", fabric_setup_twice, RuntimeError, "was already called",
        "use one FabricCheckpointing per model", "FabricCheckpointing.setup was already called"),
    "Fabric step before setup": Case(
        "callbacks.fabric.FabricCheckpointing.step", lambda: FabricCheckpointing(cpu_fabric()).step(None).__enter__(),
        RuntimeError, "before the first `step`", "Call `FabricCheckpointing.setup(model)`",
        "before the first `step`"),
    "Fabric FSDP checkpointing too": Case(
        "callbacks.fabric.check_fabric_strategy",
        lambda: FabricCheckpointing(SimpleNamespace(strategy=FabricFSDPStrategy(activation_checkpointing_policy={Block}))),
        ValueError, "`FSDPStrategy(activation_checkpointing_policy=...)`",
        "Remove `activation_checkpointing_policy` from the strategy", "and `FabricCheckpointing` would both checkpoint"),
    "Fabric DeepSpeed": Case(
        "callbacks.fabric.check_fabric_strategy",
        lambda: check_fabric_strategy(FabricDeepSpeedStrategy.__new__(FabricDeepSpeedStrategy)),  # deepspeed not needed
        ValueError, "DeepSpeed", "shard with FSDP2 (`ModelParallelStrategy`)",
        "`FabricCheckpointing` does not support DeepSpeed"),
    "Lightning FSDP checkpointing too": Case(
        "callbacks.gradient_checkpointing.check_lightning_strategy",
        lambda: setup_callback(GradientCheckpointing(),
                               SimpleNamespace(strategy=FSDPStrategy(activation_checkpointing_policy={Block}))),
        ValueError, "`FSDPStrategy(activation_checkpointing_policy=...)`", "Remove `activation_checkpointing_policy`",
        "would both checkpoint the model"),
    "budget auto, device full": Case(
        "core.plan.budget.auto_memory_budget", lambda: auto_memory_budget(80 * 2**30, 75 * 2**30, 2 * 2**30), ValueError,
        "0.9 x 80.0 GiB of device memory leaves nothing for activations after 75.0 GiB",
        "shard the weights and optimizer state (`strategy='fsdp_ckpt'`)", "leaves nothing for activations"),
    "CheckpointWrapper too": Case(
        "core.checkpoint.placement.check_checkpointing_placement", wrapped_after_the_callback, ValueError,
        "`model.blocks.0._checkpoint_wrapped_module` is checkpointed", "Remove one of them",
        "is checkpointed by GradientCheckpointing and by torch's `CheckpointWrapper`"),
    # --- apply_checkpointing
    "apply to a non-module": Case(
        "core.checkpoint.wrapping.apply_checkpointing", lambda: apply_checkpointing([nn.Linear(2, 2)]), TypeError,
        "got list", "takes an `nn.Module`", "`apply_checkpointing` takes an `nn.Module`"),
    "no layer matches": Case(
        "core.checkpoint.wrapping.apply_checkpointing", lambda: apply_checkpointing(blocks(), layer_cls=nn.Conv2d), ValueError,
        "torch.nn.modules.conv.Conv2d", "The repeated block looks like lightning_ckpt.demos.Block",
        "is an instance of"),
    "no repeated block": Case(
        "core.checkpoint.selection.detect_block_class", lambda: apply_checkpointing(nn.Linear(2, 2)), ValueError,
        "of Linear", "Pass `layer_cls=` the block class", "Could not detect the repeated layer"),
    "several repeated blocks": Case(
        "core.checkpoint.selection.detect_block_class", lambda: apply_checkpointing(several_block_classes()), ValueError,
        "torch.nn.modules.linear.Linear (in a), torch.nn.modules.conv.Conv1d (in b)",
        "Pass `layer_cls=` the one (or the list)", "Found several repeated layer classes"),
    "nested": Case(
        "core.checkpoint.wrapping.check_no_nesting", nested, ValueError, "`0.attn.qkv` would be checkpointed inside or around `0`",
        "Call `remove_checkpointing` first, or select the same layers", "which already is: nested checkpoints"),
    "cache in training": Case(
        "core.checkpoint.wrapping._refuse_caches", cache_in_training, ValueError, "A key/value cache (FakeCache)",
        "pass `use_cache=False`", "reaches the checkpointed layer"),
    # --- plan_checkpointing and its plan
    "plan a non-module": Case(
        "core.measure.layer_costs.check_module_and_step", lambda: plan_checkpointing("model", lambda: None, 0.5), TypeError,
        "got str", "takes an `nn.Module`", "`plan_checkpointing` takes an `nn.Module`"),
    "step not callable": Case(
        "core.measure.layer_costs.check_module_and_step", lambda: plan_checkpointing(blocks(), None, 0.5), TypeError,
        "got None", "a callable with no arguments that returns the loss", "`step` must be a callable"),
    "modes": Case(
        "core.measure.costs.validate_modes", lambda: plan_checkpointing(blocks(), lambda: None, 0.5, modes=("fast",)),
        ValueError, "`modes=('fast',)`", "Pass a non-empty tuple of ('full', 'selective', 'ops')", "is not understood. Pass a"
        " non-empty tuple"),
    "plan offload not understood": Case(
        "core.measure.costs.validate_offload", lambda: plan_checkpointing(blocks(), lambda: None, 0.5, offload="yes"),
        ValueError, "`offload='yes'`", "Pass False (nothing offloaded), True", "is not understood. Pass False"),
    "auto offload without a device profile": Case(
        "core.plan.planner._check_plan_arguments",
        lambda: make_plan([LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
                                     offloadable_bytes=0, full_flops=50, selective_flops=5)], 0, 0.5, offload="auto"),
        ValueError, "`offload='auto'`", "pass `device=` a preset such as 'h100-sxm'", "needs a device profile"),
    "host memory not bytes": Case(
        "core.plan.planner._check_plan_arguments",
        lambda: make_plan([LayerCost("a", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
                                     offloadable_bytes=0, full_flops=50, selective_flops=5)], 0, 0.5, offload=True,
                                               host_memory=-1),
        ValueError, "got -1", "bytes (an int >= 0) or None", "`host_memory` must be bytes"),
    "plan without a budget": Case(
        "core.plan.planner.plan_checkpointing", lambda: plan_checkpointing(blocks(), lambda: None, None), ValueError,
        "`memory_budget=None`", "Pass a fraction such as 0.5 or bytes such as '2GiB'", "asks for no plan"),
    "make_plan without a budget": Case(
        "core.plan.planner._check_plan_arguments", lambda: make_plan([], 0, None), ValueError,
        "`memory_budget=None`", "Pass a fraction such as 0.5 or bytes such as '2GiB'", "asks for no plan"),
    "budget out of reach": Case(
        "core.plan.planner.make_plan",
        lambda: (lambda m: plan_checkpointing(m, step_of(m), 0.01, layer_cls=Block))(blocks()), ValueError,
        "`memory_budget=0.01` asks for an activation peak of at most", "To fit: pass a budget of at least",
        "but the least reachable is"),
    "budget out of reach with the loss in chunks": Case(
        "core.plan.planner.make_plan", _plan_chunked_out_of_reach, ValueError,
        "(with the LM head and loss chunked,", "To fit: pass a budget of at least", "but the least reachable is"),
    "chunk_tokens": Case(
        "core.checkpoint.chunked_loss.chunk_size",
        lambda: lightning_ckpt.lm_loss(torch.randn(2, 4), nn.Linear(4, 8), torch.tensor([1, 2]), chunk_tokens=0),
        ValueError, "got 0", "Pass e.g. 1024, or None for the default", "`chunk_tokens` must be a positive number"),
    "lm_loss labels": Case(
        "core.checkpoint.chunked_loss.lm_loss", lambda: lightning_ckpt.lm_loss(torch.randn(3, 4), nn.Linear(4, 8),
                                                                    torch.tensor([1, 2])),
        ValueError, "got 3 hidden states and 2 labels", "Pass one label per hidden state", "hidden states and"),
    "chunk_loss with logits changed before the loss": Case(
        "core.checkpoint.chunked_loss._HeadSwap.hidden_from", _llama_scaling_its_logits, RuntimeError,
        "cannot chunk LlamaForCausalLM's loss", "Pass chunk_loss=False for this model",
        "changes the logits between the head and the loss"),
    "chunk_loss type (apply)": Case(
        "core.checkpoint.wrapping.apply_checkpointing", lambda: apply_checkpointing(blocks(), chunk_loss="yes"), TypeError,
        "got 'yes'", "Pass True to compute the LM head and the loss in chunks", "`chunk_loss` is True or False"),
    "chunk_loss type (plan)": Case(
        "core.plan.planner.plan_checkpointing",
        lambda: (lambda m: plan_checkpointing(m, step_of(m), 0.5, chunk_loss="yes"))(blocks()), TypeError,
        "got 'yes'", "None (the plan chooses)", "`chunk_loss` is True, False or None"),
    "tile_mlp type (plan)": Case(
        "core.plan.planner.plan_checkpointing",
        lambda: (lambda m: plan_checkpointing(m, step_of(m), 0.5, tile_mlp="yes"))(blocks()), TypeError,
        "got 'yes'", "False (whole) or None (the plan chooses)", "`tile_mlp` is True, False or None, got"),
    "chunk_loss type (callback)": Case(
        "callbacks.gradient_checkpointing._validate", lambda: GradientCheckpointing(chunk_loss="yes"), TypeError,
        "got 'yes'", "None (a budget's plan chooses)", "`chunk_loss` is True, False or None"),
    "time_layers type (callback)": Case(
        "callbacks.gradient_checkpointing._validate", lambda: GradientCheckpointing(time_layers="yes"), TypeError,
        "got 'yes'", "Pass True (plans priced by the times measured on the device) or False", "`time_layers` is True or False"),
    "lean_layers type (callback)": Case(
        "callbacks.gradient_checkpointing._validate", lambda: GradientCheckpointing(lean_layers="yes"), TypeError,
        "got 'yes'", "Pass True (norms and gated MLPs hold less for backward", "`lean_layers` is True or False"),
    "lean_layers, nothing known": Case(
        "core.checkpoint.lean.apply_lean", lambda: apply_lean(nn.Sequential(nn.Linear(4, 4))), ValueError,
        "in Sequential", "Pass lean_layers=False", "lean_layers=True found no norm or gated MLP it knows"),
    "apply_lean, not a module": Case(
        "core.checkpoint.lean.apply_lean", lambda: apply_lean("model"), TypeError,
        "got str", "takes an `nn.Module`", "`apply_lean` takes an `nn.Module`"),
    "timing rounds": Case(
        "core.measure.layer_timing.time_modes", lambda: time_modes(lambda mode: None, ("plain",), torch.device("cpu"), rounds=0),
        ValueError, "`rounds=0`", "the number of timed runs of each mode", "must be 1 or more: the number of timed runs"),
    "timing limits": Case(
        "core.measure.layer_timing.timing_limits", lambda: timing_limits(0, 0.5).__enter__(), ValueError,
        "`timing_limits(0, 0.5)`", "pass at least 1 round and more than 0 seconds",
        "pass at least 1 round and more than 0 seconds"),
    "monitor activation_steps": Case(
        "callbacks.memory_monitor.MemoryMonitor.__init__", lambda: MemoryMonitor(activation_steps=0), ValueError,
        "got 0", "an int >= 1 or None (count on every logging step)", "`activation_steps` must be an int >= 1 or None"),
    "tile_tokens": Case(
        "core.checkpoint.tiling.validate_tile_tokens", lambda: apply_checkpointing(blocks(), tile_mlp=True, tile_tokens=0),
        ValueError, "got 0", "pass an int >= 1", "`tile_tokens` is the tokens per tile along the sequence"),
    "tile_mlp type (apply)": Case(
        "core.checkpoint.wrapping._tiles_asked", lambda: apply_checkpointing(blocks(), tile_mlp="yes"), TypeError,
        "got 'yes'", "Pass True to run each layer's MLP over tiles", "`tile_mlp` is True or False"),
    "tile options without tile_mlp (apply)": Case(
        "core.checkpoint.wrapping._tiles_asked", lambda: apply_checkpointing(blocks(), tile_tokens=64), ValueError,
        "`tile_tokens=64`", "Pass tile_mlp=True with them", "but tile_mlp is False"),
    "tile_mlp type (callback)": Case(
        "callbacks.gradient_checkpointing._validate_tiles", lambda: GradientCheckpointing(tile_mlp="auto"), TypeError,
        "got 'auto'", "None (whole until a budget's plan chooses)", "`tile_mlp` is True, False or None"),
    "tile options with tile_mlp=False (callback)": Case(
        "callbacks.gradient_checkpointing._validate_tiles",
        lambda: GradientCheckpointing(tile_mlp=False, tile_cls="torch.nn.Linear"), ValueError,
        "`tile_cls='torch.nn.Linear'`", "Pass tile_mlp=True (or None) with them", "but `tile_mlp=False` tiles nothing"),
    "tile_cls import": Case(
        "core.checkpoint.tiling.tile_classes", lambda: apply_checkpointing(blocks(), tile_mlp=True, tile_cls="my_model.MLP"),
        ValueError, "`tile_cls='my_model.MLP'`", "Pass a dotted import path", "could not be imported"),
    "tile_mlp, no MLP known": Case(
        "core.checkpoint.tiling.check_tiling", lambda: apply_checkpointing(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                                                                tile_mlp=True),
        ValueError, "in Sequential", "Pass tile_cls= the class of your layers' MLP",
        "found no MLP it knows to be token-wise"),
    "apply_tiling type": Case(
        "core.checkpoint.tiling.check_tiling", lambda: apply_tiling("model"), TypeError, "got str", "takes an `nn.Module`",
        "`apply_tiling` takes an `nn.Module`"),
    "tile_cls takes more than the hidden states": Case(
        "core.checkpoint.tiling.check_tiling", lambda: apply_tiling(nn.ModuleDict({"a": nn.MultiheadAttention(8, 2)}),
                                                         tile_cls=nn.MultiheadAttention),
        TypeError, "`a` (torch.nn.modules.activation.MultiheadAttention)", "Pass tile_cls= a class called with the"
        " hidden states alone", "takes more than one tensor argument"),
    "tiles nested": Case(
        "core.checkpoint.tiling.check_tiling", _tiles_nested, ValueError, "`blocks.0.ln1` would be tiled inside `blocks.0`",
        "Pass a tile_cls that matches one of them", "which is tiled too"),
    "checkpointed as the tiled module": Case(
        "core.checkpoint.wrapping._check_tiles_inside",
        lambda: apply_checkpointing(Transformer(16, 8, 1, 8, 2, 0.0), layer_cls=nn.LayerNorm, tile_mlp=True),
        ValueError, "`blocks.0.ln1` would be checkpointed as the tiled `blocks.0.ln1`",
        "Pass a layer_cls around the MLP", "whose tiles already run under checkpoint"),
    "tiled module called with two tensors": Case(
        "core.checkpoint.tiling.TiledForward.__call__", _tiled_called_with_two_tensors, TypeError,
        "was called with more than one tensor (2)", "Tile a module that takes the hidden states alone",
        "tiling splits only its first argument"),
    "tiled module not token-wise": Case(
        "core.checkpoint.tiling.TiledForward.__call__", _tiled_pool, TypeError, "returned (1, 1, 8) for a tile of (1, 2, 8)",
        "Pass tile_mlp=False, or tile_cls= a token-wise class", "a tiled module must return one tensor with a row per"
        " token"),
    "plan in eval mode": Case(
        "core.measure.layer_costs._measure", lambda: plan_checkpointing(blocks().eval(), lambda: None, 0.5), ValueError,
        "the module is in eval mode", "Call `module.train()` first", "measures a training step, but the module is in"
        " eval mode"),
    "plan, no layer matches": Case(
        "core.measure.layer_costs._measure", lambda: plan_checkpointing(blocks(), lambda: None, 0.5, layer_cls=nn.Conv2d),
        ValueError, "`layer_cls=<class 'torch.nn.modules.conv.Conv2d'>`", "pass the class of the model's repeated"
        " block", "matches `layer_cls="),
    "step runs no layer": Case(
        "core.measure.layer_costs._measure",
        lambda: plan_checkpointing(blocks(), lambda: torch.zeros((), requires_grad=True), 0.5), ValueError,
        "never called a matched layer (0, 1, ...)", "pass a step that runs the model's forward and returns the loss",
        "never called a matched layer"),
    "device profile rate": Case(
        "core.measure.device_profile.DeviceProfile.__post_init__",
        lambda: DeviceProfile(matmul_flops=0, memory_bandwidth=1e12, host_bandwidth=1e10), ValueError,
        "`matmul_flops` must be a positive number per second, got 0", "DeviceProfile.preset('h100-sxm')",
        "must be a positive number per second"),
    "device profile overhead": Case(
        "core.measure.device_profile.DeviceProfile.__post_init__",
        lambda: DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e12, host_bandwidth=1e10, op_overhead=-1),
        ValueError, "got -1", "Pass e.g. 5e-6, or None", "must be seconds per op (0 or more)"),
    "device preset": Case(
        "core.measure.device_profile.DeviceProfile.preset", lambda: DeviceProfile.preset("h300"), ValueError,
        "Unknown device preset 'h300'", "Known: h100-sxm", "Unknown device preset"),
    "device type": Case(
        "core.measure.device_profile.resolve_device",
        lambda: plan_checkpointing(blocks(), lambda: None, 0.5, device=3), TypeError,
        "got 3", "a preset name such as 'h100-sxm'", "`device` must be None, a DeviceProfile or a preset name"),
    "sharded, not per layer": Case(
        "core.measure.layer_costs.LayerCostRecorder.__init__", sharded_at_the_root_only, ValueError,
        "`0` has sharded (DTensor) parameters", "Shard each layer as its own unit",
        "has sharded (DTensor) parameters but is not an FSDP unit"),
    "plan.apply options": Case(
        "core.plan.checkpoint_plan.CheckpointPlan.apply", lambda: a_plan().apply(blocks(), mode="full"), TypeError,
        "got ['mode']", "`apply` takes use_reentrant, preserve_rng_state, checkpoint_kwargs and tile_cls",
        "`apply` takes use_reentrant"),
    "plan.apply elsewhere": Case(
        "core.plan.checkpoint_plan.CheckpointPlan.apply", lambda: a_plan().apply(nn.Linear(2, 2)), ValueError,
        "names layer `0`, which Linear does not have", "apply a plan to the module it was made for",
        "does not have: apply a plan"),
    # --- MemoryMonitor
    "monitor log_every_n_steps": Case(
        "callbacks.memory_monitor.MemoryMonitor.__init__", lambda: MemoryMonitor(log_every_n_steps=0), ValueError,
        "got 0", "an int >= 1 or None (use the trainer's)", "`log_every_n_steps` must be an int >= 1 or None"),
    "monitor function": Case(
        "callbacks.memory_monitor.MemoryMonitor.__init__", lambda: MemoryMonitor(batch_size_fn=3), TypeError,
        "`batch_size_fn`", "a function of the batch returning an int, got 3", "must be a function of the batch"),
    "monitor batch size": Case(
        "callbacks.memory_monitor.MemoryMonitor._batch_size", lambda: fit_on_text_batches(MemoryMonitor()), ValueError,
        "the batch holds no tensor", "Pass `MemoryMonitor(batch_size_fn=lambda batch: ...)`",
        "MemoryMonitor could not find the batch size"),
    # --- offload's engine
    "offload min_bytes": Case(
        "core.checkpoint.offload.OffloadEngine.__init__", lambda: OffloadEngine(FakeStreams(), min_bytes=-1), ValueError,
        "got -1", "Pass e.g. 1048576 (1 MiB) or 0 to offload everything", "`min_bytes` must be an int >= 0"),
    "offload lag": Case(
        "core.checkpoint.offload.OffloadEngine.__init__", lambda: OffloadEngine(FakeStreams(), lag=1.5), ValueError,
        "got 1.5", "Pass e.g.", "`lag` must be an int >= 0"),
    "offload engine": Case(
        "core.checkpoint.offload.use_engine", lambda: use_engine("cuda").__enter__(), TypeError,
        "got str", "Build one with `OffloadEngine(DeviceStreams('cuda'))`", "`use_engine` takes an `OffloadEngine`"),
    # --- strategies
    "DDP, reentrant, unused parameters": Case(
        "strategies.ddp.check_ddp_settings",
        lambda: check_ddp_settings(reentrant_model(), {"find_unused_parameters": True}), ValueError,
        "Reentrant checkpointing (2 layers: 0, 1)", "Pass `GradientCheckpointing(use_reentrant=False)`",
        "cannot be combined with DDP's `find_unused_parameters=True`"),
    "DDP, reentrant, no static graph": Case(
        "strategies.ddp.check_ddp_settings", lambda: check_ddp_settings(reentrant_model(), {}), ValueError,
        "Reentrant checkpointing (2 layers: 0, 1)", "Pass `GradientCheckpointing(use_reentrant=False)`",
        "is only safe under DDP with `static_graph=True`"),
    "FSDP, parameters at the root": Case(
        "strategies.fsdp.shard_for_checkpointing",
        lambda: shard_for_checkpointing(OwnParameters(), None, layer_cls=nn.Linear), ValueError,
        "OwnParameters registers parameters directly (scale)", "Move them into a submodule",
        "registers parameters directly"),
    "FSDP, 16-mixed": Case(
        "strategies.fsdp.mixed_precision_policy", sixteen_mixed, ValueError,
        "`precision='16-mixed'`", "Pass `precision='bf16-mixed'`", "does not support `precision='16-mixed'`"),
    "FSDP start_method": Case(
        "strategies.fsdp.CheckpointingFSDPStrategy.__init__",
        lambda: CheckpointingFSDPStrategy(start_method="thread"), ValueError,
        "`start_method='thread'`", "Pass 'popen', 'spawn', 'fork' or 'forkserver'", "is not understood. Pass 'popen'"),
    "FSDP cpu_offload": Case(
        "strategies.fsdp.cpu_offload_policy", lambda: CheckpointingFSDPStrategy(cpu_offload="yes"), ValueError,
        "`cpu_offload='yes'`", "or a `torch.distributed.fsdp.CPUOffloadPolicy`",
        "is not understood. Pass True (parameters, gradients and optimizer state in host memory)"),
}


class TextBatches(LightningModule):
    """Trains on batches of strings (what a tokenizer-in-the-step pipeline yields)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.w.sum() * len(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(["a b", "c d", "e f", "g h"], batch_size=2)


def fit_on_text_batches(callback: Any) -> None:
    cpu_trainer(max_steps=1, callbacks=[callback]).fit(TextBatches())


# --------------------------------------------------------------------------------------------- the commands


class StringData(LightningDataModule):
    """Batches of strings: the tokenizer runs in the training step."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(["a b", "c d", "e f"], batch_size=2)


class EmptyData(LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader([], batch_size=2)


class MixedData(LightningDataModule):
    """A tuple batch of one sample, then a dict: ``plan --device-memory`` needs a batch of two."""

    def train_dataloader(self) -> list:
        tokens = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(0))
        return [(tokens[:1], tokens[:1]), {"idx": tokens[1:], "targets": tokens[1:]}]


class NoLossGPT(GPT):
    """Returns nothing from ``training_step`` (as manual optimisation often does)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)


def config(tmp_path: Path, model: str = "lightning_ckpt.demos.GPT", data: str = "lightning_ckpt.demos.CountingDataModule",
           **trainer: Any) -> str:
    """``configs/tiny.yaml`` with another model or data class (same init_args for the model, none for other data)."""
    base = yaml.safe_load(TINY.read_text())
    base["model"]["class_path"] = model
    if data != base["data"]["class_path"]:
        base["data"] = {"class_path": data}
    base["trainer"].update(trainer)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


def plan(tmp_path: Path, *args: str) -> int:
    return cli_main(["plan", *args, "--output-dir", str(tmp_path / "out")])


COMMAND_CASES: dict[str, Case] = {
    "plan, text batches": Case(
        "commands.plan.measure.batch_size_of",
        lambda tmp: plan(tmp, "--config", config(tmp, data="test_errors.StringData")),
        ValueError, "got a list of no tensor", "Make the dataloader yield tensors",
        "the training batch has no tensor with a batch dimension"),
    "plan, empty data": Case(
        "commands.plan.measure._cycle", lambda tmp: plan(tmp, "--config", config(tmp, data="test_errors.EmptyData")),
        ValueError, "the training dataloader is empty", "check the data's settings in the config",
        "the training dataloader is empty"),
    "plan, batches of two structures": Case(
        "commands.plan.measure.batch_of_size",
        lambda tmp: plan(tmp, "--config", config(tmp, data="test_errors.MixedData"), "--device-memory", "1GiB"),
        ValueError, "cannot make a batch of 2 samples", "Make the dataloader yield every batch in one structure",
        "the loader's batches differ in structure"),
    "plan, no loss": Case(
        "commands.plan.measure._loss", lambda tmp: plan(tmp, "--config", config(tmp, model="test_errors.NoLossGPT")),
        ValueError, "`training_step` returned None", "returns the loss, or a dict with 'loss': return it",
        "(manual optimization?)"),
    "compare, a run of no step": Case(
        "commands.compare.stats.measurements",
        lambda tmp: measurements("every_layer", [([], {})], warmup=0), ValueError,
        "every_layer: the run trained no step", "Check the config's `limit_train_batches` and `max_steps`",
        "the run trained no step, so the monitor logged nothing"),
}


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")  # pytest's own argv
def test_fit_shows_the_callbacks_message(tmp_path):
    """`lightning-ckpt fit` builds the callback through LightningCLI, whose error quotes ours."""
    base = yaml.safe_load(TINY.read_text())
    base["trainer"]["callbacks"][0]["init_args"]["every_n_layers"] = 0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ValueError) as info:
        cli_main(["fit", "--config", str(tmp_path / "config.yaml"), f"--trainer.default_root_dir={tmp_path}"])
    assert "`every_n_layers` must be >= 1 (1 = every layer, 4 = layers 0, 4, 8, ...), got 0." in str(info.value)


def test_compare_of_a_run_that_trains_no_step_exits_2_saying_why(tmp_path, capsys, monkeypatch):
    """It used to stop with a FileNotFoundError (no metrics.csv) from the comparing process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--variants", "none", "--steps", "1", "--rounds", "1", "--warmup", "0", "--output-dir", str(tmp_path / "out")]
    assert cli_main(["compare", "--config", config(tmp_path, limit_train_batches=0), *args]) == 2
    out = capsys.readouterr()
    assert "none (no checkpointing) ... FAILED: the run trained no step, so the monitor logged nothing. Check the" \
           " config's `limit_train_batches`" in out.out
    assert "the run without checkpointing failed" in out.err


@pytest.mark.parametrize("name", sorted(CASES) + sorted(COMMAND_CASES))
def test_the_message_names_the_bad_value_and_what_to_do(name, tmp_path):
    case = CASES.get(name) or COMMAND_CASES[name]
    with pytest.raises(case.error) as info:
        case.trigger() if name in CASES else case.trigger(tmp_path)
    message = str(info.value)
    assert case.bad in message, message
    assert case.fix in message, message
    assert case.readme in message, message
    assert raised_at(info.tb) == in_module(case.where)


@dataclass(frozen=True)
class Usage:
    """A usage error of a command: exit status 2 and argparse's ``error:`` line. ``{config}`` in ``argv`` is a file
    holding ``config_text``."""

    argv: list[str]
    where: str
    bad: str
    fix: str
    readme: str
    config_text: str = ""


USAGE_ERRORS: dict[str, Usage] = {
    "plan, no config": Usage(
        ["plan"], "commands.arguments.check_config_argument", "--config is required",
        "pass the LightningCLI YAML of the run to plan", "--config is required"),
    "plan, missing config": Usage(
        ["plan", "--config", "nowhere.yaml"], "commands.arguments.check_config_argument",
        "--config nowhere.yaml: no such file", "pass the path of a LightningCLI YAML config", ": no such file"),
    "plan, not an override": Usage(
        ["plan", "--config", str(TINY), "--fakes"], "commands.plan._parse", "unrecognized arguments: --fakes",
        "LightningCLI overrides start with --trainer., --model., --data.", "unrecognized arguments"),
    "plan, budget": Usage(
        ["plan", "--config", str(TINY), "--memory-budget", "lots"], "commands.plan._parse", "--memory-budget lots",
        "pass a fraction in (0, 1] of the activations without checkpointing, such as 0.3, or bytes, such as 2GiB",
        ": pass a fraction in (0, 1]"),
    "plan, device": Usage(
        ["plan", "--config", str(TINY), "--device", "h300"], "commands.arguments.check_device_argument",
        "--device h300",
        "pass a preset (h100-sxm", ": pass a preset ("),
    "plan, device memory": Usage(
        ["plan", "--config", str(TINY), "--device-memory", "0.5"], "commands.plan._parse", "--device-memory 0.5",
        "pass the device's memory in bytes, such as 80GiB", ": pass the device's memory in bytes"),
    "plan, host memory": Usage(
        ["plan", "--config", str(TINY), "--host-memory", "lots"], "commands.plan._parse", "--host-memory lots",
        "pass the target's host memory per device in bytes, such as 256GiB",
        ": pass the target's host memory per device in bytes"),
    "compare, no config": Usage(
        ["compare"], "commands.arguments.check_config_argument", "--config is required",
        "pass the LightningCLI YAML of the run to compare", "--config is required"),
    "compare, missing config": Usage(
        ["compare", "--config", "nowhere.yaml"], "commands.arguments.check_config_argument",
        "--config nowhere.yaml: no such file", "pass the path of a LightningCLI YAML config", ": no such file"),
    "compare, steps": Usage(
        ["compare", "--config", str(TINY), "--steps", "0"], "commands.compare._parse", "--steps must be >= 1, got 0",
        ">= 1", "must be >= 1, got"),
    "compare, not YAML": Usage(
        ["compare", "--config", "{config}"], "commands.compare._parse", "config.yaml: not valid YAML",
        "pass a LightningCLI YAML config", ": not valid YAML", config_text="model: [unclosed"),
    "compare, not a mapping": Usage(
        ["compare", "--config", "{config}"], "commands.compare._parse", "got a list",
        "expected a LightningCLI config (a mapping of trainer, model, data)", "expected a LightningCLI config",
        config_text="- trainer\n- model\n"),
    "compare, planned without a budget": Usage(
        ["compare", "--config", str(TINY), "--variants", "planned"], "commands.compare._variants",
        "the 'planned' variant needs a memory_budget", "(e.g. `memory_budget: 0.5`); choose from none, every_layer",
        "variant needs a memory_budget"),
    "compare, unknown variant": Usage(
        ["compare", "--config", str(TINY), "--variants", "none,every_3rd"], "commands.compare._variants",
        "unknown variant(s) every_3rd", "choose from none, every_layer", "unknown variant(s)"),
}


@pytest.mark.parametrize("name", sorted(USAGE_ERRORS))
def test_a_usage_error_exits_2_naming_the_bad_argument_and_what_to_pass(name, tmp_path, capsys):
    usage = USAGE_ERRORS[name]
    path = tmp_path / "config.yaml"
    path.write_text(usage.config_text)
    with pytest.raises(SystemExit) as info:
        cli_main([str(path) if arg == "{config}" else arg for arg in usage.argv])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"lightning-ckpt {usage.argv[0]}: error: " in err
    assert usage.bad in err and usage.fix in err and usage.readme in err, err
    assert in_module(usage.where) in frames(info.tb)


def frames(tb: Any) -> list[str]:
    """``module.function`` of every frame in a traceback, outermost first (the function's own name: a method's
    class is not in a frame before Python 3.11)."""
    names = []
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        module = module_name(path) if path.is_relative_to(PACKAGE) else path.stem
        name = tb.tb_frame.f_code.co_name
        # tests/mutate.sh: mutmut renames each function it mutates (x_name__mutmut_orig, xǁClassǁname__mutmut_3)
        renamed = re.fullmatch(r"x(?:_|ǁ\w+ǁ)(\w+?)__mutmut_(?:orig|\d+)", name)
        names.append(f"{module}.{renamed.group(1) if renamed else name}")
        tb = tb.tb_next
    return names


def in_module(where: str) -> str:
    """``module.Class.method`` as :func:`frames` names it: ``module.method``."""
    parts = where.split(".")
    module = next(".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in MODULES)
    return f"{module}.{parts[-1]}"


def raised_at(tb: Any) -> str:
    """``module.function`` of the frame that raised (the innermost)."""
    return frames(tb)[-1]


# ------------------------------------------------------------------------------------ the figures in the messages
# The cases above check each message's fixed text; these check the figures a message computes, against answers
# counted by hand from small made-up inputs (bytes under 1 KiB print whole).


def four_layers(offloadable: int) -> list[LayerCost]:
    """Four layers holding 100 B un-checkpointed, 10 B fully and 40 B selectively checkpointed, ``offloadable`` B of
    their inputs movable to the host; 100 B outside them: 500 B without checkpointing."""
    return [LayerCost(f"l{i}", "Block", none_bytes=100, full_bytes=10, selective_bytes=40,
                      offloadable_bytes=offloadable, full_flops=50, selective_flops=5) for i in range(4)]


@pytest.mark.parametrize(("offloadable", "modes", "figures"), [
    # Each layer's backward has its 100 B alive (no backward recorded: its un-checkpointed bytes) while the layers
    # before it hold theirs; the last one's sets the floor: 100 outside + 3 x 10 + 100 = 230 B, 46.0% of the 500 B
    # peak without checkpointing, 0.460. offload=True: 3 x (10 - 6) on the device, and the newest offloaded layer's
    # 6 B back for l3's backward: 100 + 12 + 100 + 6 = 218 B, 43.6%. "auto" can do no better (moving all a layer
    # saves brings all of it back for its backward). 50 / 230 = 21.7%: about 22%.
    (6, ("full", "selective"), ["but the least reachable is 230 B (46.0%), with every matched layer checkpointed.",
                                "the backward of `l3` sets that floor: it has 100 B alive at once",
                                "\n  To fit: pass a budget of at least 0.460 (or 230 bytes)\n",
                                "\n  - or offload=True, which reaches 218 B (43.6%)\n",
                                "about 22% of the current size would fit"]),
    # nothing to offload: offload=True reaches the same 230 B
    (0, ("full", "selective"), ["but the least reachable is 230 B (46.0%)", "at least 0.460 (or 230 bytes)",
                                "\n  - (offload=True would not help here: the layer inputs are in CPU memory, there is"
                                " no device memory for it to free)\n", "about 22% of the current size would fit"]),
    # selective only: 100 + 3 x 40 + 100, and the 10 B input a selective layer's recompute brings back into its
    # backward = 330 B, 66.0%; offload=True: 100 + 3 x 34 + 100 + 6 + 10 = 318 B, 63.6%; 50 / 330 = 15.2%: 16%.
    (6, ("selective",), ["but the least reachable is 330 B (66.0%)", "at least 0.660 (or 330 bytes)\n",
                         "\n  - or offload=True, which reaches 318 B (63.6%)\n",
                         "\n  - or allow modes=('full', 'selective')\n", "about 16% of the current size would fit"]),
])
def test_out_of_reach_budget_message_gives_the_least_reachable_and_what_would_fit(offloadable, modes, figures):
    with pytest.raises(ValueError) as info:
        make_plan(four_layers(offloadable), 100, 0.1, modes=modes)
    message = str(info.value)
    # 0.1 x 500 B = 50 B, 10.0% of the 500 B peak; the 100 B outside the layers stay whatever is checkpointed.
    assert message.startswith("`memory_budget=0.1` asks for an activation peak of at most 50 B (10.0% of the 500 B"
                              " peak without checkpointing)"), message
    assert "\n  Floor: 100 B of it is outside the matched layers" in message, message
    assert all(len(line) <= 240 for line in message.splitlines()), message  # a few short lines, not one long one
    for figure in figures:
        assert figure in message, (figure, message)
    assert ("allow modes" in message) == ("full" not in modes)
    assert "offload='auto'" not in message, message


@pytest.mark.parametrize("budget", [50, "50B"])
def test_out_of_reach_byte_budget_message_asks_for_bytes_not_a_fraction(budget):
    """A byte budget holds at every length; a fraction means another budget at each: a user who gave bytes is told
    the least reachable in bytes, on a line of its own."""
    with pytest.raises(ValueError) as info:
        make_plan(four_layers(6), 100, budget)
    lines = str(info.value).splitlines()
    assert lines[2] == "  To fit: pass a budget of at least 230 bytes (230 B)", lines
    assert "0.460" not in str(info.value)


def test_out_of_reach_budget_message_says_why_offload_would_not_help_one_layer():
    """One layer, its 6 B of inputs movable: offloaded, they are the newest offloaded layer's, kept on the device for
    its backward; the floor stays 100 B outside + its 100 B backward = 200 B either way."""
    with pytest.raises(ValueError) as info:
        make_plan(four_layers(6)[:1], 100, 0.1)
    assert ("least reachable is 200 B" in str(info.value) and "offload=True would not help here: what sets the floor"
            " is a layer's backward, whose inputs come back to the device for it)" in str(info.value)), str(info.value)


def test_host_memory_short_message_gives_the_budget_and_the_host_memory():
    """0.45 x 500 B = 225 B: l3's backward has 100 B outside, its own 100 B and the newest offloaded layer's 6 B
    back, so l0-l2 may keep 19 B on the device: all three fully checkpointed and offloaded (4 B each, 6 B each on the
    host), l3 plain. 17 B of host memory is short by one byte, 18 B is enough."""
    with pytest.raises(ValueError) as info:
        make_plan(four_layers(6), 100, 0.45, offload=True, host_memory=17)
    message = str(info.value)
    assert message.startswith("`memory_budget=0.45` (225 B of activations) needs more than `host_memory=17` (17 B) of"
                              " offloaded tensors. Nothing was applied.\n  To fit: pass a larger `host_memory`"), message
    assert message.endswith("(bytes of host memory the offloaded tensors may use)."), message
    # host memory is short, not device memory: no advice to shrink the batch or checkpoint more layers
    assert "smaller batch" not in message and "layer_cls" not in message, message
    plan = make_plan(four_layers(6), 100, 0.45, offload=True, host_memory=18)
    assert plan.planned_host_bytes == 18 and plan.peak_bytes == 100 + 12 + 100 + 6
    assert plan.layers == {"l0": "full", "l1": "full", "l2": "full", "l3": "none"}


@pytest.mark.parametrize(("n", "shown"), [(4, "4 layers: 0, 1, 2, 3)"), (5, "5 layers: 0, 1, 2, 3, ...)")])
def test_ddp_reentrant_message_counts_the_layers_and_shows_the_first_four(n, shown):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    apply_checkpointing(model, layer_cls=nn.Linear, use_reentrant=True)
    for kwargs in ({}, {"find_unused_parameters": True}):
        with pytest.raises(ValueError) as info:
            check_ddp_settings(model, kwargs)
        assert str(info.value).startswith(f"Reentrant checkpointing ({shown} "), str(info.value)


def test_two_callbacks_message_counts_them():
    trainer = cpu_trainer(callbacks=[GradientCheckpointing(every_n_layers=2)])
    trainer.callbacks += [GradientCheckpointing(), GradientCheckpointing(mode="selective")]
    with pytest.raises(ValueError, match=r"^The Trainer has 3 `GradientCheckpointing` callbacks; pass one"):
        find_checkpointing_callback(trainer)


def test_auto_budget_message_gives_each_part_and_refuses_exactly_when_nothing_is_left():
    # int(0.9 x 1000) = 900 B: 800 B static and 100 B other peak leave 0, 99 B of other peak leave 1.
    with pytest.raises(ValueError) as info:
        auto_memory_budget(1000, 800, 100)
    assert str(info.value).startswith(
        "`memory_budget='auto'`: 0.9 x 1000 B of device memory leaves nothing for activations after 800 B of weights,"
        " gradients and optimizer state and 100 B of other peak memory in the step."), str(info.value)
    assert auto_memory_budget(1000, 800, 99) == 1
    with pytest.raises(ValueError, match=r"^`memory_budget='auto'`: 0.5 x 1000 B of device memory leaves nothing for"
                                         r" activations after 400 B .* and 100 B of other peak"):
        auto_memory_budget(1000, 400, 100, fraction=0.5)
    assert auto_memory_budget(1000, 400, 99, fraction=0.5) == 1



# ----------------------------------------------------------------------------------------- every error, listed


#: Raise sites no user meets as such: how many in each function, and why.
NOT_A_USER_ERROR: dict[str, tuple[int, str]] = {
    # plan --lengths: plan's main prints these with exit status 2 (not raised to the user's code)
    "commands.plan._lengths": (1, "argparse's type check of --lengths; asserted in test_plan_command ('512,lots')"),
    "commands.plan.measure.check_length": (
        1, "printed by plan's main with exit status 2; asserted in test_plan_command (a length of 64, block_size 32)"),
    "commands.plan.measure.batch_of_length": (
        2, "a batch without token ids, or a length under 1 (which --lengths' parsing refuses first); the first is"
           " asserted in test_plan_command"),
    "commands.plan.measure.measure": (1, "a step that fails at one of --lengths, re-raised with the length named"),
    "core.measure.cost_fit.fit_peak": (1, "a misuse by its caller (fewer than two lengths), not a user setting"),
    "core.measure.cost_fit.CostFit.predict": (1, "a misuse by its caller (no fit yet: it predicts only where trusted), asserted in"
                                         " test_cost_fit"),
    "core.checkpoint.fake_streams.FakeStreams._queue": (1, "the offload tests' fake streams report a bug of the offload engine itself"),
    "core.checkpoint.fake_streams.FakeStreams._perform": (
        2, "the offload tests' fake streams report a bug of the offload engine itself"),
    "core.checkpoint.fake_streams.FakeStreams._check": (1, "the offload tests' fake streams report a bug of the offload engine itself"),
    "callbacks.gradient_checkpointing.check_lightning_strategy": (
        1, "DeepSpeed refused at setup: tested from a Trainer in test_parallelism.py, with a stand-in for deepspeed"
           " (not installed)"),
    "commands.plan.measure.device_profile": (
        1, "`plan --device auto` for an accelerator missing here: printed with exit 2"),
    "callbacks.gradient_checkpointing._loss_of": (
        1, "caught where it is raised: a training_step without a loss (manual optimization) is not measured at the"
           " longest length, as any step fake tensors cannot run (test_longest)"),
    "core.plan.solver.solve": (1, "make_plan turns it into the 'least reachable' message (case 'budget out of reach')"),
    "core.plan.budget_driver.BudgetDriver._make_plan": (
        1, "make_plan's 'least reachable' message (case 'budget out of reach') with the batch size appended; the size"
           " is asserted in test_budget_cycle's out-of-reach test"),
    "core.plan.budget_cycle.BudgetCycle.planned": (
        1, "a misuse of the core object by its caller (planned() without a measuring step), not a user setting;"
           " asserted in test_budget_cycle"),
    "commands.compare.run.variant_config": (
        2, "the command's parser refuses these first (usage errors 'compare, planned without a budget' and 'compare,"
           " unknown variant'); test_compare calls it directly"),
    "commands.arguments.parse_bytes_arg": (
        1, "the command turns it into a usage error (usage error 'plan, device memory')"),
    "commands.plan._build_without_fake": (
        2, "main prints them as 'plan: …' with exit status 2; test_configs asserts the --fake one on the ViT config (the"
           " other needs a model too large for this machine that fake tensors cannot build)"),
    "commands.plan.build.build": (
        1, "the command plans with fake tensors when the accelerator is missing; only `build` called alone raises it"
           " (test_plan_command)"),
    "strategies.fsdp._check_units_offloaded": (
        1, "cpu_offload with a configure_model that shards without it needs a distributed run: asserted with 2 spawned"
           " ranks in test_fsdp_cpu_offload.py (its Troubleshooting line is there too)"),
    "strategies.fsdp.CheckpointingFSDPStrategy.setup": (
        1, "FSDP1 modules under fsdp_ckpt: needs a distributed run with FSDP1 wrapping, left to the strategies' own"
           " tests"),
}


def raise_sites() -> collections.Counter:
    """``module.function`` (:func:`module_name`) of every ``raise SomeError(...)`` and ``parser.error(...)`` in the
    package, counted."""
    sites: collections.Counter = collections.Counter()

    def visit(node: ast.AST, path: Path, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, path, [*scope, child.name])
                continue
            raises = isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call)
            usage = (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "error"
                     and isinstance(child.func.value, ast.Name) and child.func.value.id == "parser")
            if raises or usage:
                sites[f"{module_name(path)}.{'.'.join(scope)}"] += 1
            visit(child, path, scope)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), path, [])
    return sites


def test_every_raise_in_the_package_has_a_case_or_a_reason():
    declared = collections.Counter(case.where for case in (*CASES.values(), *COMMAND_CASES.values()))
    # One raise is one message: plan and compare meet the same `--config` checks, which count once.
    declared += collections.Counter(where for where, _ in {(u.where, u.readme) for u in USAGE_ERRORS.values()})
    for where, (count, _) in NOT_A_USER_ERROR.items():
        declared[where] += count
    assert declared == raise_sites()


def troubleshooting() -> str:
    return (ROOT / "docs" / "troubleshooting.md").read_text()


def test_every_error_is_a_line_of_the_troubleshooting_page():
    section = troubleshooting()
    lines = [line for line in section.splitlines() if line.startswith("- ")]
    fragments = {c.readme for c in (*CASES.values(), *COMMAND_CASES.values(), *USAGE_ERRORS.values())}
    missing = sorted(f for f in fragments if not any(f in line for line in lines))
    assert not missing, missing
    assert all(" → " in line for line in lines)  # error → what to do
