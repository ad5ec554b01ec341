"""Snapshot copies into host memory: pinned buffers, a side stream, a completion event.

A rollback snapshot kept on the accelerator doubles the device memory of weights and
optimizer state (16 bytes per parameter for bf16 weights with fp32 AdamW moments and
master weights: 112 GB for a 7B model). Kept on the host it costs no device memory:
the buffers are allocated once (pinned when the source is on CUDA, so the copy is a
DMA that does not go through pageable memory) and written again at every snapshot.

The copy of CUDA tensors runs on a side stream that first waits for the current
stream (so it copies the values the step computed), with ``non_blocking=True``; an
event recorded after it says when it is complete. Nothing here waits on the host:

- :meth:`HostCopy.fence` makes the *current stream* wait for the copy (a device-side
  wait, no host synchronization): called before anything overwrites the source
  (the optimizer step);
- :meth:`HostCopy.wait` blocks the host until the copy is complete: called before the
  host buffers are read (a rollback, a write to disk).

CPU tensors are copied synchronously (the same code: ``non_blocking`` is a no-op
there), and the copy is complete when :meth:`start` returns.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["CudaCopies", "HostCopy", "host_buffer"]


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``t`` (contiguous), pinned when ``t`` is on CUDA
    (pinned memory needs a CUDA runtime; elsewhere plain host memory)."""
    pin = t.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


class CudaCopies:
    """What :class:`HostCopy` asks of the device runtime (CUDA's streams and events); a
    test passes a stand-in with the same methods."""

    def asynchronous(self, src: list[torch.Tensor]) -> torch.device | None:
        """The device whose copies run asynchronously (None: copy synchronously)."""
        return next((s.device for s in src if s.device.type == "cuda"), None)

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def keep(self, t: torch.Tensor, stream: Any) -> None:
        """The allocator must not reuse ``t``'s memory before ``stream`` read it."""
        t.record_stream(stream)


class HostCopy:
    """One snapshot's device-to-host copy in flight (or done): :meth:`start` it,
    :meth:`fence` the stream that will overwrite the source, :meth:`wait` before
    reading the buffers; :meth:`seconds` is what the copy took, once known."""

    def __init__(self, runtime: CudaCopies | None = None) -> None:
        self.runtime = runtime or CudaCopies()
        self._done: Any = None  # the completion event while a copy may be in flight
        self._begin: Any = None
        self._device: torch.device | None = None
        self._stream: Any = None
        self._seconds: float | None = None

    def start(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        early: list[bool] | None = None,
    ) -> None:
        """Copy ``src[i]`` into ``dst[i]`` (same shapes and dtypes). Accelerator sources:
        on a side stream after the current stream's work, non-blocking, timed by events;
        the sources are marked as used by the side stream (``record_stream``).

        ``early[i]``: ``src[i]`` is written by the work the current stream runs next (a
        module buffer, which the forward updates in place: BatchNorm's statistics); it
        is copied on the current stream itself, ordered before that work (still no host
        wait), so only what nothing but the optimizer writes is copied alongside."""
        self.wait()  # a previous copy into these buffers must be over
        self._seconds = None
        device = self.runtime.asynchronous(src)
        if device is not None and early is not None and any(early):
            first = [i for i, e in enumerate(early) if e]
            with torch.no_grad():
                torch._foreach_copy_([dst[i] for i in first], [src[i] for i in first],
                                     non_blocking=True)  # fmt: skip
            rest = [i for i, e in enumerate(early) if not e]
            dst, src = [dst[i] for i in rest], [src[i] for i in rest]
        if device is None:
            began = time.perf_counter()
            with torch.no_grad():
                if dst:
                    torch._foreach_copy_(dst, src, non_blocking=True)
            self._seconds = time.perf_counter() - began
            return
        rt = self.runtime
        if self._stream is None or self._device != device:
            self._stream, self._device = rt.stream(device), device
        side = self._stream
        side.wait_stream(rt.current_stream(device))
        self._begin, self._done = rt.event(), rt.event()
        with rt.use(side), torch.no_grad():
            self._begin.record(side)
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)
            self._done.record(side)
        for s in src:
            if s.device == device:
                rt.keep(s, side)

    def fence(self) -> None:
        """The current stream waits for the copy (device-side; the host goes on)."""
        if self._done is not None and self._device is not None:
            self.runtime.current_stream(self._device).wait_event(self._done)

    def ready(self) -> bool:
        """Whether the copy is complete (a query, never a wait)."""
        return self._done is None or bool(self._done.query())

    def wait(self) -> None:
        """Block the host until the copy is complete (before the buffers are read)."""
        if self._done is not None:
            if not self._done.query():  # (a copy long done costs no synchronization)
                self._done.synchronize()
            self._finish()

    def seconds(self) -> float | None:
        """What the last copy took (device time for an accelerator, read once it is
        complete, without waiting for it); None while it is in flight."""
        if self._seconds is None and self._done is not None and self._done.query():
            self._finish()
        return self._seconds

    def _finish(self) -> None:
        if self._done is not None and self._begin is not None:
            self._seconds = float(self._begin.elapsed_time(self._done)) / 1e3
        self._done = self._begin = None


class HostShard:
    """A DTensor's local part (this rank's shard under FSDP2) kept in a host buffer, with
    what rebuilds the DTensor: its mesh, placements, global shape and stride.

    A host snapshot keeps each rank's own shard, so the snapshot's host memory per
    rank is the shard's size, not the model's. :meth:`rebuild` makes the DTensor
    again, its local part copied back to the mesh's device (a rollback or a save)."""

    __slots__ = ("device", "local", "mesh", "placements", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        d: Any = t
        with torch.no_grad():
            part = d.to_local()
            self.device = part.device  # where the shard goes back (not the current device)
            self.local = host_buffer(part)
        self.mesh = d.device_mesh
        self.placements = tuple(d.placements)
        self.shape = tuple(d.shape)
        self.stride = tuple(d.stride())

    def fits(self, t: torch.Tensor) -> bool:
        """``t`` (a live DTensor) is laid out as this one was: the same mesh, placements,
        global shape, and a local part of the buffer's shape and dtype."""
        d: Any = t
        if d.device_mesh != self.mesh or tuple(d.placements) != self.placements:
            return False
        if tuple(d.shape) != self.shape:
            return False
        local = d.to_local()
        return bool(local.shape == self.local.shape and local.dtype == self.local.dtype)

    def rebuild(self) -> torch.Tensor:
        """The DTensor again, its local part a new copy on the mesh's device."""
        from torch.distributed.tensor import DTensor

        local = self.local.to(self.device, copy=True)
        out: torch.Tensor = DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
            stride=self.stride,
        )  # fmt: skip
        return out
