"""Pinned host staging buffers for asynchronous host-to-device and device-to-host copies.

A copy from pageable memory larger than the driver's staging area waits for the work
already queued on the stream (measured: a 1 MB grammar bitmask held each sample until
the forward in flight had finished); from pinned memory it is queued like a kernel.

A low module (torch only): the model runner (step inputs, sampled tokens) and the sampler
(grammar bitmasks, sampling parameters) both use it.
"""

from __future__ import annotations

import torch


class PinnedRing:
    """A few reusable pinned host buffers for asynchronous copies.

    Fresh pinned tensors of a new size each step cost a cudaHostAlloc (about 2 ms per step
    on the H200 in W1); these grow by doubling and are reused in turn. A buffer is handed
    out again only after the copy recorded on it has finished; with at most two steps in
    flight, that wait is over long before the ring comes round.
    """

    def __init__(self, slots: int = 4) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = -1
        self.copy_stream: torch.cuda.Stream | None = None

    def take(self, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A pinned tensor of n elements; call record() after queueing its copy."""
        self.i = (self.i + 1) % len(self.bufs)
        ev, buf = self.events[self.i], self.bufs[self.i]
        if ev is not None:
            ev.synchronize()
        nbytes = n * dtype.itemsize
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 8192)
            buf = self.bufs[self.i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(dtype)

    def record(self, timing: bool = False) -> torch.cuda.Event:
        ev = self.events[self.i] = torch.cuda.Event(enable_timing=timing)
        ev.record()
        return ev

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy host (from the buffer take() just gave) to the device on a side stream, so
        that the copy runs while the current stream is still busy with earlier work (a
        forward); the current stream waits for it only where it uses the result."""
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.copy_stream):
            dev = host.to(device, non_blocking=True)
            self.record()
        current.wait_stream(self.copy_stream)
        dev.record_stream(current)  # allocated on the side stream, freed after its use here
        return dev
