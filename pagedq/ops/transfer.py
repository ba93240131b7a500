"""Small tensors made on the host, moved to the device without waiting for it.

`torch.tensor(data, device="cuda")` copies from pageable memory and synchronises the stream:
the host then waits for everything queued before it, a forward launched ahead included. The
engine's per-step inputs and the sampler's per-row values go through `to_device` instead.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (a list, nested lists or a numpy array) as a `dtype` tensor on `device`; on CUDA
    through pinned memory and an asynchronous copy (the pinned block is not reused before the
    copy has run: PyTorch's host allocator records it)."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
