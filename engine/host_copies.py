"""Copies between the host and a GPU that do not stall the CPU: pinned staging, non-blocking, one sync a step."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory, asynchronously: a pageable copy would first wait
    for every kernel already queued. torch's pinned allocator keeps the staging buffer until the copy is done."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host, through one pinned copy and one wait for it (a no-op on CPU)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host
