"""The stream/event interface offload schedules its copies through, and its implementation on an accelerator.

:class:`Streams` is what :class:`~lightning_ckpt.core.checkpoint.offload.OffloadEngine` needs from a device: a compute
stream, one side stream for copies, events, and pinned host buffers. :class:`DeviceStreams` implements it for CUDA (or
any device module with streams and events); :class:`~lightning_ckpt.core.checkpoint.fake_streams.FakeStreams`
implements it on the CPU for tests. Plain PyTorch.

Example::

    streams = DeviceStreams("cuda:0")
    engine = OffloadEngine(streams)  # what default_engine("cuda:0") builds
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union

import torch

from lightning_ckpt.core.checkpoint.host_pool import _empty_host_cache, pinned_size

__all__ = ["DeviceStreams", "Streams"]


class Streams(Protocol):
    """What the engine needs from a device: a compute stream, one side stream for copies, and events.

    ``after`` lists events the side stream must reach before it starts a copy; the returned event marks the copy's
    end. ``wait`` makes the compute stream wait for an event (the host does not block); ``done`` asks without waiting.
    ``host_size`` is what pinning ``nbytes`` really takes (the allocator's rounding), and ``empty_host_cache`` gives
    pinned memory that nothing uses back to the system.
    """

    def offloadable(self, tensor: torch.Tensor) -> bool: ...

    def host_size(self, nbytes: int) -> int: ...

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...

    def empty_host_cache(self) -> None: ...

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def record(self) -> Any: ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceStreams:
    """Copies on a side stream of an accelerator that has streams and events (CUDA, or its peers in ``torch``).

    Example::

        streams = DeviceStreams("cuda:0")
    """

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._module = torch.get_device_module(self.device.type)
        # A device without streams (MPS) copies in line on its one queue, as offload did before side streams.
        self._side = self._module.Stream(self.device) if hasattr(self._module, "Stream") else None

    def offloadable(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def host_size(self, nbytes: int) -> int:
        return pinned_size(nbytes)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty_host_cache(self) -> None:
        # A pinned tensor that dies goes back to torch's caching host allocator and stays pinned until this call
        # (blocks whose copies are still running are kept by the allocator until their events complete).
        _empty_host_cache()

    def empty_device(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Allocated on the compute stream: the tensor is the compute stream's once the copy is done, so autograd may
        # free it there without `record_stream`. The side stream waits for an event recorded after this allocation
        # (see `OffloadEngine._start_to_device`), so kernels still using the recycled block finish before the copy.
        # The engine holds it until the copy's event is done, even if its handle dies first (`_landing`).
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)

    def record(self) -> Any:
        if self._side is None:
            return None
        event = self._module.Event()
        event.record(self._module.current_stream(self.device))
        return event

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any:
        if self._side is None:
            dst.copy_(src)
            return None
        for event in after:
            if event is not None:
                self._side.wait_event(event)
        with self._module.stream(self._side):
            dst.copy_(src, non_blocking=True)
            event = self._module.Event()
            event.record(self._side)
        return event

    to_host = _copy
    to_device = _copy

    def wait(self, event: Any) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        if self._side is not None:
            self._side.synchronize()
