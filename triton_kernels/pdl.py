"""Early launch of the next kernel (programmatic dependent launch, sm_90+).

The CUDA GPTQ matmuls are launched as programmatic dependents: once the kernel before them
signals, their CTAs take free SM slots and stream their first weights, and they read that
kernel's output only after `griddepcontrol.wait`, which returns once its grid has finished
and flushed. A Triton kernel that runs just before a matmul (RMSNorm, SiLU-mul, decode
attention) therefore signals on entry, when its `PDL` constexpr is set. A kernel launched the
usual way after it is unaffected.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def early_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may signal early launch (a CUDA device of sm_90 or later;
    never for CPU tensors, whose kernels run interpreted)."""
    if device.type != "cuda":
        return False
    return _sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())
