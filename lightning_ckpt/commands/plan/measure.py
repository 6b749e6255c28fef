"""How ``lightning-ckpt plan`` measures: one fully checkpointed training step of a built config (:func:`measure`), at a
batch size and sequence length of its loader's batches (:func:`batch_of_size`, :func:`batch_of_length`), and the
``--device`` profile.

Building the model and data is :mod:`~lightning_ckpt.commands.plan.build`, how the configured strategy shards static
memory :mod:`~lightning_ckpt.commands.plan.sharding`, and the static memory one device holds
:mod:`~lightning_ckpt.commands.plan.static_memory`; their names are importable from here too,
where they were before. The command itself is :mod:`lightning_ckpt.commands.plan`; the predictions made from these
measurements are in :mod:`lightning_ckpt.commands.plan.predictions`, the report in
:mod:`lightning_ckpt.commands.plan.report`.

Example::

    built = build(Path("config.yaml"), fake=True)
    measured = measure(built, batch_size=8)  # per-layer costs and the bytes outside the layers
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ckpt.core.checkpoint.chunked_loss import DEFAULT_CHUNK_TOKENS, chunk_loss_of, chunked_models
from lightning_ckpt.core.measure.device_profile import PRESET_NAMES, DeviceProfile
from lightning_ckpt.core.measure.fake_values import real_branches
from lightning_ckpt.core.measure.longest import batch_of_length as core_batch_of_length
from lightning_ckpt.core.measure.longest import length_limit, sequence_length_of
from lightning_ckpt.core.measure.op_curve import OpRecord
from lightning_ckpt.core.plan.planner import PLAN_MODES, ChunkedHead, LayerCost, measure_chunked_head, measure_step

# Building, sharding and static memory have their own modules (issue 43); their names are importable from here too, where
# tests, benchmarks and `commands.compare` import them.
from lightning_ckpt.commands.plan.build import (  # noqa: F401
    ONE_DEVICE,
    PLANNING_TRAINER,
    Built,
    accelerator_available,
    build,
    configured_accelerator,
)
from lightning_ckpt.commands.plan.sharding import CPU_OFFLOAD_NOTE, Sharding, device_count, sharding_of  # noqa: F401
from lightning_ckpt.commands.plan.static_memory import (  # noqa: F401
    HostMemory,
    StaticMemory,
    gathered_bytes,
    sharded_bytes,
    static_memory,
    this_machine_host_memory,
    would_not_fit,
)


_LOG_WARNING = r"You are trying to `self.log\(\)` but the `self.trainer` reference is not registered"


class AttentionKernels(TorchDispatchMode):
    """Records the names of the attention kernels that run (``aten._scaled_dot_product_flash_attention_for_cpu``, ...).

    Example::

        >>> q = torch.randn(1, 2, 8, 16)
        >>> with AttentionKernels() as seen:
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        >>> sorted(seen.names)
        ['aten._scaled_dot_product_flash_attention_for_cpu']
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        name = str(func.overloadpacket)
        if "attention" in name and "backward" not in name:
            self.names.add(f"aten.{name.split('.')[-1]}")
        return func(*args, **(kwargs or {}))


def batch_size_of(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch``."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        got = f"a 0-d tensor first in a {type(batch).__name__}" if leaves else f"a {type(batch).__name__} of no tensor"
        raise ValueError(f"plan: the training batch has no tensor with a batch dimension (got {got}). Make the"
                         " dataloader yield tensors, or tuples/lists/dicts of tensors, with the batch first.")
    return leaves[0].shape[0]


def loader_batch_size(loader: Any) -> int:
    """The batch size ``loader`` yields: its first batch's.

    Example::

        >>> loader_batch_size([(torch.zeros(6, 2), torch.zeros(6)), (torch.zeros(2, 2), torch.zeros(2))])
        6
    """
    return batch_size_of(next(_cycle(loader)))


def batch_of_size(loader: Any, size: int) -> Any:
    """A batch of ``size`` samples: the loader's batches concatenated along the first dimension, then cut.

    Example::

        >>> loader = [(torch.arange(4), torch.ones(4, 2)), (torch.arange(4, 8), torch.ones(4, 2))]
        >>> idx, x = batch_of_size(loader, 6)
        >>> idx.tolist(), tuple(x.shape)
        ([0, 1, 2, 3, 4, 5], (6, 2))
    """
    batches, have = [], 0
    for batch in _cycle(loader):
        batches.append(batch)
        have += batch_size_of(batch)
        if have >= size:
            break
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError("plan: the loader's batches differ in structure (keys, or tuple/list layout); cannot make a"
                         f" batch of {size} samples from them. Make the dataloader yield every batch in one structure.")
    # A copy of exactly `size` rows: a slice would keep (and count) the whole concatenated storage.
    leaves = [torch.cat(parts)[:size].clone() if isinstance(parts[0], torch.Tensor) else parts[0]
              for parts in zip(*(leaves for leaves, _ in flat))]
    return tree_unflatten(leaves, spec)


def batch_of_length(batch: Any, length: int) -> Any:
    """``batch`` at sequence length ``length``: :func:`lightning_ckpt.core.measure.longest.batch_of_length`, with ``--lengths``'
    errors for a batch without token ids or a length under 1.

    Example::

        >>> batch_of_length((torch.arange(6).view(2, 3),), 4)[0].tolist()
        [[0, 1, 2, 0], [3, 4, 5, 3]]
    """
    if length < 1:
        raise ValueError(f"plan: --lengths: a length of {length} tokens; pass lengths of 1 or more")
    resized = core_batch_of_length(batch, length)
    if resized is None:
        raise ValueError("plan: --lengths needs token ids in the batch (a 2-D integer tensor, batch x length) to know"
                         " the sequence length; the training batch has none.")
    return resized


def check_length(built: Built, length: int) -> None:
    """A ``ValueError`` naming ``length`` and why when the model cannot take sequences that long."""
    limit = length_limit(built.module)
    if limit is not None and length > limit[1]:
        name, value = limit
        raise ValueError(f"plan: --lengths: the model cannot take a length of {length} tokens: its {name} is {value}"
                         f" (its position table ends there). Pass lengths up to {value}, or a larger {name} (such as"
                         f" --model.init_args.{name}={length}).")


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("plan: the training dataloader is empty: check the data's settings in the config (the"
                             " number of samples, `batch_size` with `drop_last`).")


def _on_device(built: Built, batch: Any) -> Any:
    if built.fake_mode is None:
        return move_data_to_device(batch, built.device)
    fake_mode = built.fake_mode
    with fake_mode:
        return tree_map(lambda t: fake_mode.from_tensor(t).to(built.device) if isinstance(t, torch.Tensor) else t, batch)


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        what = "None" if output is None else f"a {type(output).__name__} without a tensor 'loss'"
        raise ValueError(f"plan: `training_step` returned {what} (manual optimization?)."
                         " `plan` measures models whose training_step returns the loss, or a dict with 'loss': return it.")
    return loss


# ------------------------------------------------------------------------------------------------ measuring


@dataclass
class Measurement:
    """Per-layer costs and the bytes outside the layers, at one batch size."""

    batch_size: int
    costs: list[LayerCost]
    outside_bytes: int
    outside_ops: tuple[OpRecord, ...] = ()  # the step's ops outside the layers (for predicted step times)
    head_bytes: int = 0  # of outside_bytes, saved after the last layer (see LayerCostRecorder.head_bytes)
    head_peak_bytes: int = 0  # what the head's backward makes alive at once (LayerCostRecorder.head_peak_bytes)
    length: Optional[int] = None  # the sequence length measured (dim 1 of the token ids); None without token ids
    chunked: Optional[ChunkedHead] = None  # the same step with the LM head and loss in chunks (see chunk_size)


def measure(built: Built, batch_size: Optional[int] = None, length: Optional[int] = None) -> Measurement:
    """One fully checkpointed training step at ``batch_size`` (default: the loader's; see
    :func:`~lightning_ckpt.core.plan.planner.measure_layer_costs`), with ``length`` its sequence length (default: the
    loader's; another cut or tiled by :func:`batch_of_length`, within :func:`check_length`)."""
    if batch_size is None:
        batch_size = loader_batch_size(built.loader)
    batch = batch_of_size(built.loader, batch_size)
    if length is not None:
        check_length(built, length)
        batch = batch_of_length(batch, length)
    measured_length = sequence_length_of(batch)
    real_batch = batch
    batch = _on_device(built, batch)
    # the real values of the batch's integer tensors, so that a fake step takes a real step's branches
    branches = (real_branches(dict(zip(tree_flatten(batch)[0], tree_flatten(real_batch)[0])))
                if built.fake_mode is not None else nullcontext())
    with built.mode():
        batch = built.precision.convert_input(batch)
    module = built.module

    def step() -> torch.Tensor:
        # The trainer's precision (autocast for "bf16-mixed"), as Lightning runs training_step.
        with built.precision.train_step_context(), AttentionKernels() as kernels:
            loss = _loss(module.training_step(batch, 0))
        built.attention_kernels |= kernels.names
        return loss

    with built.mode(), branches, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LOG_WARNING)
        try:
            measured = measure_step(module, step, built.layer_cls, time_layers=built.time_layers)
            chunk = chunk_size(built)
            chunked = None if chunk is None else measure_chunked_head(module, step, built.layer_cls, PLAN_MODES,
                                                                      chunk, time_layers=False)[1]
        except (IndexError, RuntimeError) as err:
            if length is None:
                raise
            raise ValueError(f"plan: --lengths: the step failed at a length of {length} tokens, which the model may"
                             f" not take ({type(err).__name__}: {err})") from err
    return Measurement(batch_size, measured.costs, measured.outside_bytes, measured.outside_ops, measured.head_bytes,
                       measured.head_peak_bytes, measured_length, chunked)


def chunk_size(built: Built) -> Optional[int]:
    """The tokens a chunk the plan measures the chunked LM head and loss with: the model's own chunk size if it has
    one, else :data:`~lightning_ckpt.core.checkpoint.chunked_loss.DEFAULT_CHUNK_TOKENS`; ``None`` when ``built.chunk_loss`` is
    ``False`` or the model has no loss :func:`~lightning_ckpt.core.checkpoint.chunked_loss.chunk_causal_lm_loss` can chunk.

    Example::

        >>> chunk_size(Built(torch.nn.Linear(2, 2), [], torch.device("cpu"), None, False, 0.5, None))  # no LM loss
    """
    names = chunked_models(built.module) if built.chunk_loss is not False else []
    if not names:
        return None
    return chunk_loss_of(built.module.get_submodule(names[0])) or DEFAULT_CHUNK_TOKENS


# ------------------------------------------------------------------------------------------------ device


def device_profile(device: Optional[str], built: Built) -> Optional[DeviceProfile]:
    """The ``--device`` profile: a preset, or ``auto``: the accelerator the step runs on, measured here."""
    if device is None or device != "auto":
        return DeviceProfile.preset(device) if device is not None else None
    if built.planned_for is not None:
        raise ValueError(f"--device auto measures the accelerator the step runs on, but the config's"
                         f" {built.planned_for!r} is not here; pass a preset instead ({', '.join(PRESET_NAMES)}).")
    return DeviceProfile.measure(built.device)
