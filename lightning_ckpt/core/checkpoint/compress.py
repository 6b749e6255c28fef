"""Compressed checkpoints: hold a checkpointed layer's inputs as bf16 or fp8 until its recompute.

A fully checkpointed layer keeps only its inputs for backward; they are the floor that checkpointing leaves
(layers x tokens x hidden). :class:`CompressSaved` is a pair of saved-tensor hooks put around the checkpoint
call: torch's checkpoint saves the layer's inputs through them (``save_for_backward``, in both implementations),
so they keep a compressed copy instead and hand the recompute a decompressed one. The forward itself runs on the
exact inputs, so the step's loss is unchanged; the recompute, and the backward with it, starts from the
decompressed copy, so gradients are close, not equal.

- ``"bf16"``: each value rounded to the nearest ``torch.bfloat16`` (2 bytes).
- ``"fp8"``: ``torch.float8_e4m3fn`` (1 byte) with one float32 scale (absmax / 448) per :data:`FP8_GROUP`
  consecutive values in row-major order, i.e. per 128 values along the last dimension when it is a multiple of
  128 (hidden sizes are); otherwise groups run on across rows, and the last one is padded with zeros (at most
  127 values per tensor). 128 is the tile that FP8 training recipes scale activations by: one outlier spoils the
  precision of 127 neighbours at most, and the scales add 4/128 of a byte per value (fp32 inputs: 0.258x).

A layer with BatchNorm keeps its inputs exact under ``"fp8"`` (:func:`layer_compress`): its recompute would
normalise the rounded inputs by their own batch statistics, and the gradients move away from exact far more than
elsewhere (a ResNet-style CNN's step-1 gradient cosine: 0.964 with fp8, 0.9976 with bf16, which such layers keep).

Kept exactly as they are: tensors that are not floating point, already at or below the target width (a bf16
tensor under ``"bf16"``), smaller than one group (:data:`MIN_VALUES`), parameters and views of parameters
(they stay resident anyway), and tensor subclasses. A storage that several layers save (a shared mask or rotary
table) is compressed once. With offload, the compressed copy is what goes to host memory, so the host bytes and
the transfer shrink too. Plain PyTorch; nothing here imports Lightning.

Example::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> layer = torch.nn.Linear(256, 256)
    >>> x = torch.randn(4, 256, requires_grad=True)
    >>> with CompressSaved("bf16"):
    ...     y = checkpoint(layer, x, use_reentrant=False)
    >>> y.sum().backward()  # the weight's gradient is computed from x rounded to bf16
    >>> expected = x.detach().bfloat16().float().sum(0).expand(256, 256)
    >>> torch.equal(layer.weight.grad, expected)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt.core.checkpoint import offload
from lightning_ckpt.core.checkpoint.storages import report_held, storage_key, tensor_bytes

__all__ = ["COMPRESS", "FP8_GROUP", "FP8_MAX", "MIN_VALUES", "Compress", "CompressSaved", "check_compress",
           "compress_tensor", "compressed_bytes", "compressible", "decompress_tensor", "held_bytes",
           "layer_compress", "validate_compress"]

Compress = Literal["bf16", "fp8"]
COMPRESS: tuple[Compress, ...] = ("bf16", "fp8")

FP8_GROUP = 128
"""Values that share one fp8 scale."""

FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn``: a group's absmax is scaled to it."""

MIN_VALUES = FP8_GROUP
"""Tensors with fewer values are kept exactly: compressing them saves under 512 bytes."""

_WIDTH = {"bf16": 2, "fp8": 1}


def validate_compress(value: object) -> Optional[Compress]:
    """``value`` if it names a compression (or is ``None``), else a ``ValueError`` listing what is accepted.

    Example::

        >>> validate_compress("fp8"), validate_compress(None)
        ('fp8', None)
    """
    if value is None or value in COMPRESS:
        return value  # type: ignore[return-value]
    raise ValueError(f"`compress={value!r}` is not understood. Pass None (exact inputs, the default), 'bf16' (hold"
                     " checkpointed layers' inputs rounded to bfloat16, half of fp32) or 'fp8' (float8_e4m3fn with"
                     f" one scale per {FP8_GROUP} values, about a quarter of fp32).")


def check_compress(compress: Optional[Compress], devices: Iterable[torch.device]) -> None:
    """Refuse ``compress="fp8"`` where a device in ``devices``, or the accelerator the model may be moved to later,
    cannot convert to ``torch.float8_e4m3fn``."""
    if compress != "fp8":
        return
    devices = set(devices)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        devices.add(torch.device(accelerator.type))
    for device in devices:
        try:
            torch.ones(2, device=device).to(torch.float8_e4m3fn).float()
        except (RuntimeError, TypeError, AttributeError) as err:
            raise ValueError(
                f"`compress='fp8'` needs float8_e4m3fn support on {device}, which this torch does not have there"
                f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Pass compress='bf16'"
                " (half the bytes of fp32, on every device) or compress=None.") from err


def layer_compress(layer: torch.nn.Module, compress: Optional[Compress]) -> Optional[Compress]:
    """How ``layer`` holds its inputs under ``compress``: ``None`` (exact) for ``"fp8"`` on a layer with BatchNorm,
    whose recompute re-normalises the rounded inputs by their own batch statistics; else ``compress``.

    Example::

        >>> block = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3), torch.nn.BatchNorm2d(3))
        >>> layer_compress(block, "fp8"), layer_compress(block, "bf16"), layer_compress(torch.nn.Linear(2, 2), "fp8")
        (None, 'bf16', 'fp8')
    """
    batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in layer.modules())
    return None if compress == "fp8" and batch_norm else compress


def compressible(tensor: torch.Tensor, compress: Compress) -> bool:
    """Whether :class:`CompressSaved` compresses ``tensor`` (see the module's docstring for what is kept; a fake
    tensor counts as the tensor it stands for)."""
    return ((type(tensor) is torch.Tensor or isinstance(tensor, FakeTensor)) and tensor.layout == torch.strided and tensor.is_floating_point()
            and tensor.element_size() > _WIDTH[compress] and tensor.numel() >= MIN_VALUES
            and not offload.is_parameter(tensor))


def compressed_bytes(numel: int, compress: Compress) -> int:
    """Bytes a compressed copy of ``numel`` values holds (fp8: values padded to whole groups, plus the scales).

    Example::

        >>> compressed_bytes(1024, "bf16"), compressed_bytes(1024, "fp8"), compressed_bytes(1000, "fp8")
        (2048, 1056, 1056)
    """
    if compress == "bf16":
        return 2 * numel
    groups = -(-numel // FP8_GROUP)
    return groups * FP8_GROUP + 4 * groups


def held_bytes(tensors: Iterable[torch.Tensor], compress: Compress) -> int:
    """Bytes that the saved ``tensors`` hold under ``compress``, each storage once (as the planner counts inputs).

    Example::

        >>> x, mask = torch.zeros(4, 256), torch.ones(4, 256, dtype=torch.bool)
        >>> held_bytes([x, x, mask], "bf16"), held_bytes([x, mask], "fp8")  # x once; the mask is kept as it is
        (3072, 2080)
    """
    unique = {storage_key(t): t for t in tensors}.values()
    return sum(compressed_bytes(t.numel(), compress) if compressible(t, compress) else tensor_bytes([t])
               for t in unique)


@dataclass
class _Compressed:
    """A compressed saved tensor: ``data`` (and ``scale``, for fp8) are tensors, or offload's handles for them."""

    data: Any
    scale: Any
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    __weakref__: Any = None


def compress_tensor(tensor: torch.Tensor, compress: Compress) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The compressed values of ``tensor`` (flat, in row-major order) and, for fp8, one scale per group.

    Example::

        >>> data, scale = compress_tensor(torch.tensor([[1.0, -2.0] * 64]), "fp8")
        >>> data.dtype, data.shape, scale.tolist()  # 2.0 / 448: -2.0 is stored as -448
        (torch.float8_e4m3fn, torch.Size([128]), [0.004464285913854837])
    """
    with torch.no_grad():
        flat = tensor.detach().reshape(-1)
        if compress == "bf16":
            return flat.to(torch.bfloat16), None
        pad = -flat.numel() % FP8_GROUP
        groups = torch.nn.functional.pad(flat, (0, pad)).view(-1, FP8_GROUP).float()
        scale = groups.abs().amax(dim=1, keepdim=True) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale is exact
        return (groups / scale).to(torch.float8_e4m3fn).view(-1), scale.view(-1)


def decompress_tensor(data: torch.Tensor, scale: Optional[torch.Tensor], shape: torch.Size, stride: tuple[int, ...],
                      dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape``, ``stride`` and ``dtype`` that :func:`compress_tensor`'s output stands for.

    Example::

        >>> x = torch.randn(3, 200)
        >>> y = decompress_tensor(*compress_tensor(x, "fp8"), x.shape, x.stride(), x.dtype)
        >>> y.shape == x.shape and bool(((y - x).abs() <= x.abs().max() / 16).all())
        True
    """
    with torch.no_grad():
        values = data if scale is None else (data.float().view(-1, FP8_GROUP) * scale.view(-1, 1)).view(-1)
        out = values[:shape.numel()].to(dtype).view(shape)
        if out.stride() != stride and shape.numel() > 0:  # channels-last and other layouts come back as they were
            out = torch.empty_strided(shape, stride, dtype=dtype, device=out.device).copy_(out)
        return out


_shared: offload.SavedCopies[_Compressed] = offload.SavedCopies()  # a storage saved by several layers: compressed once


def _hold(tensor: Optional[torch.Tensor], group: Optional[int], origin: Optional[torch.Tensor] = None) -> Any:
    """Keep ``tensor`` on its device, or, when ``group`` is given, offload it (``origin``: the saved tensor it is the
    compressed copy of)."""
    if tensor is None:
        return None
    if group is None:
        report_held(tensor, "kept")  # these hooks hide it from outer counters
        return tensor
    return offload.pack_saved(tensor, group, origin=origin)


def _share(held: Any, group: Optional[int]) -> None:
    """A copy held for one layer call, saved again by another: the offload engine must know both want it back."""
    if group is None:
        if isinstance(held, torch.Tensor):
            report_held(held, "kept")  # a counter entered since the first save has not seen it
    elif not isinstance(held, torch.Tensor):
        held.engine.share(held, group)


def _pack(tensor: torch.Tensor, compress: Compress, group: Optional[int]) -> Any:
    if not compressible(tensor, compress):
        return _hold(tensor, group)
    packed = _shared.get(tensor)
    if packed is not None:
        _share(packed.data, group)
        _share(packed.scale, group)
        return packed
    data, scale = compress_tensor(tensor, compress)
    packed = _Compressed(_hold(data, group, tensor), _hold(scale, group, tensor), tensor.shape, tensor.stride(),
                         tensor.dtype)
    _shared.put(tensor, packed)
    return packed


def _unpack(packed: Union[torch.Tensor, _Compressed, Any]) -> torch.Tensor:
    if not isinstance(packed, _Compressed):
        return offload.unpack_saved(packed)
    data = offload.unpack_saved(packed.data)
    scale = None if packed.scale is None else offload.unpack_saved(packed.scale)
    return decompress_tensor(data, scale, packed.shape, packed.stride, packed.dtype)


class CompressSaved(saved_tensors_hooks):
    """Saved-tensor hooks that hold the tensors saved inside them compressed (and offloaded, with ``offload``).

    Put around a checkpoint call, they compress exactly what the checkpoint keeps for its recompute: the layer's
    inputs. With ``offload=True`` the compressed copy goes to host memory through
    :class:`~lightning_ckpt.core.checkpoint.offload.OffloadToHost`'s engine, as one layer call's group.

    Example::

        >>> hooks = CompressSaved("fp8")
        >>> hooks.compress, hooks.group is None
        ('fp8', True)
    """

    def __init__(self, compress: Compress, offload_to_host: bool = False) -> None:
        self.compress = validate_compress(compress)
        self.group = offload.next_group() if offload_to_host else None
        super().__init__(functools.partial(_pack, compress=self.compress, group=self.group), _unpack)
