"""Copies between the host and a CUDA device that are queued on the current stream without waiting
for the work queued before them (through pinned host memory): what lets the host queue a round's
next kernels before the device has run the last ones, and read a result without waiting for kernels
queued after it. On the CPU they are plain copies.

    host = to_host_queued(t)        # valid once everything queued before it has run: see `mark`
    done = mark(t.device)           # an event after it (None on the CPU: done already)
    dev = to_device_queued(h, dev)  # a host tensor on the device, copied in stream order
    buf.copy_(staged(h), non_blocking=True)   # the same into an existing device buffer
"""

from __future__ import annotations

import torch


def to_host_queued(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor `t`, queued (pinned memory on CUDA; from the CPU: copied now)."""
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on `device`'s current stream now (None on the CPU): its `synchronize()`
    waits for what was queued before it only."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` ready for a non-blocking copy to `device`: pinned for CUDA (a copy from pageable memory
    may wait for the stream), itself otherwise."""
    return host.pin_memory() if device.type == "cuda" and not host.is_pinned() else host


def to_device_queued(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied in stream order without the host waiting (CUDA: through pinned memory)."""
    if host.device == device:
        return host
    return staged(host, device).to(device, non_blocking=True)
