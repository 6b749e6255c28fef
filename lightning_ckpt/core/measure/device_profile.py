"""What a device does per second: the figures that turn a plan's recompute and transfers into predicted time.

A :class:`DeviceProfile` prices one op of a layer's forward (an :class:`~lightning_ckpt.core.measure.op_curve.OpRecord`):

- matmul, convolution and attention run at ``matmul_flops``;
- every other op is memory-bound: the bytes it reads and writes over ``memory_bandwidth``;
- each op that is recomputed, or runs under an op-level (selective) policy, pays ``op_overhead``: the kernel
  launch and, under a policy, torch's Python dispatch of the op (``policy_overhead``, by default the same).
  On small layers this fixed cost dominates, which is why a plan for a profile can prefer full checkpointing
  to keeping matmul outputs;
- host transfers (offload) run at ``host_bandwidth`` in each direction.

Plain PyTorch; nothing here imports Lightning.

Example::

    >>> h100 = DeviceProfile.preset("h100-sxm")
    >>> round(1e6 * h100.op_seconds("aten.mm.default", flops=2 * 4096**3, io_bytes=3 * 4096**2 * 2))  # µs
    139
    >>> round(1e6 * h100.op_seconds("aten.gelu.default", flops=4096**2, io_bytes=2 * 4096**2 * 2))  # memory-bound
    20
    >>> DeviceProfile(matmul_flops=1e12, memory_bandwidth=1e11, host_bandwidth=1e10).name
    'custom'
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_ckpt.core.checkpoint.policies import COMPUTE_HEAVY_OPS
from lightning_ckpt.core.measure.op_curve import OpRecord

__all__ = ["PRESET_NAMES", "DeviceProfile", "resolve_device"]

_HEAVY = frozenset(str(op) for op in COMPUTE_HEAVY_OPS)

# name -> (matmul FLOP/s: dense BF16 tensor cores; memory B/s; host link B/s, each direction; op overhead s)
_PRESETS: dict[str, tuple[float, float, float, float]] = {
    "h100-sxm": (989e12, 3.35e12, 64e9, 1e-5),
    "h100-pcie": (756e12, 2.0e12, 64e9, 1e-5),
    "a100-80gb": (312e12, 2.039e12, 32e9, 1e-5),
    "l4": (121e12, 300e9, 32e9, 1e-5),
    "rtx-4090": (165.2e12, 1008e9, 32e9, 1e-5),
    "gh200": (989e12, 4.0e12, 450e9, 1e-5),
    "h200": (989e12, 4.8e12, 64e9, 1e-5),  # H200 SXM: H100's compute, 141 GB of HBM3e at 4.8 TB/s, PCIe 5
}


#: The names :meth:`DeviceProfile.preset` knows.
PRESET_NAMES = tuple(_PRESETS)


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device, per second; ``op_overhead`` (and ``policy_overhead``) in seconds per op.

    Presets (:meth:`preset`), from the vendors' datasheets: dense BF16 tensor-core FLOP/s (the sparse figure
    halved), memory bandwidth, and the host link per direction:

    ========== ============== ========== ==================== ==============================================
    name       matmul FLOP/s  memory B/s host B/s (each way)  source
    ========== ============== ========== ==================== ==============================================
    h100-sxm   989e12         3.35e12    64e9 (PCIe Gen5 x16) NVIDIA H100 Tensor Core GPU datasheet (SXM5)
    h100-pcie  756e12         2.0e12     64e9 (PCIe Gen5 x16) NVIDIA H100 Tensor Core GPU datasheet (PCIe)
    a100-80gb  312e12         2.039e12   32e9 (PCIe Gen4 x16) NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)
    l4         121e12         300e9      32e9 (PCIe Gen4 x16) NVIDIA L4 Tensor Core GPU datasheet
    rtx-4090   165.2e12       1008e9     32e9 (PCIe Gen4 x16) NVIDIA Ada Lovelace architecture whitepaper
                                                              (FP16/BF16 tensor, FP32 accumulate)
    gh200      989e12         4.0e12     450e9 (NVLink-C2C)   NVIDIA GH200 Grace Hopper Superchip datasheet
                                                              (96 GB HBM3; C2C 900 GB/s both ways)
    ========== ============== ========== ==================== ==============================================

    Their ``op_overhead`` is 10 µs, a typical eager-mode launch plus dispatch; datasheets do not give it, and
    :meth:`measure` does. Peak rates are not reached by every kernel: a plan priced on a preset ranks choices
    well but predicts times optimistically; a measured profile is closer.
    """

    matmul_flops: float
    memory_bandwidth: float
    host_bandwidth: float
    op_overhead: float = 0.0
    name: str = "custom"
    policy_overhead: Optional[float] = None  # extra per op under a selective policy; None: ``op_overhead``
    #: This is the device the layers were measured on (:meth:`measure` sets it): a layer's choices are priced by the
    #: times its measuring step took here (``LayerCost.full_ns``, ...), where it has them, and the rates above price
    #: only the rest. A preset or a profile built by hand prices every layer from its FLOPs and bytes.
    layer_times: bool = False

    def __post_init__(self) -> None:
        for field_name in ("matmul_flops", "memory_bandwidth", "host_bandwidth"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{field_name}` must be a positive number per second, got {value!r}. Pass the"
                                 " device's datasheet figure, or start from DeviceProfile.preset('h100-sxm').")
        for field_name in ("op_overhead", "policy_overhead"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"`{field_name}` must be seconds per op (0 or more), got {value!r}. Pass e.g."
                                 " 5e-6, or None to leave it out.")

    @classmethod
    def preset(cls, name: str) -> DeviceProfile:
        """A datasheet profile: ``h100-sxm``, ``h100-pcie``, ``a100-80gb``, ``l4``, ``rtx-4090`` or ``gh200``.

        Example::

            >>> DeviceProfile.preset("l4").memory_bandwidth
            300000000000.0
        """
        if name not in _PRESETS:
            raise ValueError(f"Unknown device preset {name!r}. Known: {', '.join(_PRESETS)}; or build a"
                             " DeviceProfile(matmul_flops=..., memory_bandwidth=..., host_bandwidth=...), or"
                             " measure one with DeviceProfile.measure(device).")
        return cls(*_PRESETS[name], name=name)

    @classmethod
    def measure(cls, device: Union[str, torch.device, None] = None, seconds: float = 3.0) -> DeviceProfile:
        """Measure ``device`` (default: the current accelerator, else the CPU) in about ``seconds`` (at most 5).

        A square matmul (BF16 on an accelerator, float32 on the CPU) for ``matmul_flops``; a large device copy
        (read and write) for ``memory_bandwidth``; copies between pinned host memory and the device for
        ``host_bandwidth`` (on the CPU: the memory bandwidth); a few tiny transformer blocks trained plainly, fully
        and selectively checkpointed for ``op_overhead`` (what one more op in the recompute costs) and
        ``policy_overhead`` (what each op under a policy costs on top; see :func:`_overheads`). Each figure is a
        median.
        """
        device = torch.device(device) if device is not None else _default_device()
        budget = min(float(seconds), 5.0) / 5
        cpu = device.type == "cpu"
        n = 1024 if cpu else 4096
        a = torch.randn(n, n, device=device, dtype=torch.float32 if cpu else torch.bfloat16)
        matmul = 2 * n**3 / _median_seconds(lambda: torch.mm(a, a), device, budget)
        big = torch.empty((64 if cpu else 512) * 2**20, dtype=torch.uint8, device=device)
        other = torch.empty_like(big)
        memory = 2 * big.numel() / _median_seconds(lambda: other.copy_(big), device, budget)
        if cpu:
            host = memory
        else:
            pinned = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
            up = _median_seconds(lambda: big.copy_(pinned, non_blocking=True), device, budget / 2)
            down = _median_seconds(lambda: pinned.copy_(big, non_blocking=True), device, budget / 2)
            host = big.numel() / max(up, down)
        per_op, under_policy = _overheads(device, budget)
        return cls(matmul, memory, host, per_op, name=f"measured {device}", policy_overhead=under_policy,
                   layer_times=True)

    @property
    def per_op_under_policy(self) -> float:
        return self.op_overhead if self.policy_overhead is None else self.policy_overhead

    def op_seconds(self, op: str, flops: int, io_bytes: int) -> float:
        """Time of one run of ``op`` (without the fixed per-op cost): FLOPs at ``matmul_flops`` for matmul,
        convolution and attention, else bytes read and written at ``memory_bandwidth``."""
        return flops / self.matmul_flops if op in _HEAVY else io_bytes / self.memory_bandwidth

    def record_seconds(self, record: OpRecord, calls: int = 1) -> float:
        """Time of one recorded op (summed over ``calls``), the per-op cost included."""
        return self.op_seconds(record.op, record.flops, record.io_bytes) + calls * self.op_overhead

    def transfer_seconds(self, nbytes: int) -> float:
        """One direction of a host transfer."""
        return nbytes / self.host_bandwidth


def resolve_device(device: Union[None, str, DeviceProfile]) -> Optional[DeviceProfile]:
    """``None``, a :class:`DeviceProfile`, or a preset name (see :meth:`DeviceProfile.preset`)."""
    if device is None or isinstance(device, DeviceProfile):
        return device
    if isinstance(device, str):
        return DeviceProfile.preset(device)
    raise TypeError(f"`device` must be None, a DeviceProfile or a preset name such as 'h100-sxm', got {device!r}.")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _median_seconds(fn: Callable[[], Any], device: torch.device, budget: float) -> float:
    """Median wall time of ``fn`` (synchronised on accelerators), repeated within about ``budget`` seconds."""
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians(fns: list[Callable[[], Any]], device: torch.device, budget: float) -> list[float]:
    """Median wall time of each of ``fns``, run in turn (synchronised on accelerators) for about ``budget`` seconds."""
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget
    while len(times[0]) < 5 or (time.perf_counter() < deadline and len(times[0]) < 100):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def _overheads(device: torch.device, budget: float, blocks: int = 8) -> tuple[float, float]:
    """``(op_overhead, policy_overhead)``: ``blocks`` tiny transformer blocks' ops (layer norm, matmuls, views,
    softmax, GELU, dropout, the residual add, on a few elements each, so that compute is nothing) trained plainly,
    fully checkpointed and selectively checkpointed with this package's policy.

    ``op_overhead``: what the recompute adds per op (the op run again, and checkpoint's hooks on what it saves);
    ``policy_overhead``: what each op under the policy adds on top, in forward and in the recompute (torch's Python
    dispatch, the cache of kept outputs), the kept matmuls not being recomputed. The ops are those of the layers
    the planner prices, with their mix of arguments, saved tensors and kept outputs: a chain of one op (each saving
    its one input, keeping nothing) put the recompute's cost per op about 1.5 times too high and the policy's too low.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from lightning_ckpt.core.checkpoint.policies import selective_context_fn

    w1 = torch.randn(4, 8, device=device, requires_grad=True)
    w2 = torch.randn(8, 4, device=device, requires_grad=True)
    x = torch.randn(2, 4, device=device, requires_grad=True)

    def chain(y: torch.Tensor) -> torch.Tensor:
        for _ in range(blocks):
            q = (torch.nn.functional.layer_norm(y, (4,)) @ w1).view(2, 2, 4).transpose(0, 1)
            h = torch.softmax(q @ q.transpose(-1, -2), -1) @ q
            h = torch.nn.functional.gelu(h.transpose(0, 1).reshape(2, 8)) @ w2
            y = y + torch.nn.functional.dropout(h, 0.1, training=True)
        return y

    class _Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Ops() as seen:
        chain(x)
    ops, heavy = len(seen.names), sum(name in _HEAVY for name in seen.names)

    def step(**kwargs: Any) -> Callable[[], None]:
        return lambda: checkpoint(chain, x, use_reentrant=False, **kwargs).sum().backward()

    # Interleaved, so that a busy moment of the machine falls on all three alike.
    plain, full, selective = _interleaved_medians(
        [lambda: chain(x).sum().backward(), step(), step(context_fn=selective_context_fn)], device, 3 * budget)
    per_op = max(0.0, (full - plain) / ops)
    return per_op, max(0.0, (selective - full + heavy * per_op) / (2 * ops))
