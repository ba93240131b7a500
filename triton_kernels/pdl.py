"""Programmatic dependent launch (PDL, sm_90+) of the kernels of a decode step.

A kernel launched as a programmatic dependent may start as soon as every CTA of the kernel
before it has signalled (`griddepcontrol.launch_dependents`), and `griddepcontrol.wait`
returns once that kernel has finished and flushed its writes. The CUDA GPTQ matmuls stream
their first weights (never written by anyone) before they wait. The Triton kernels of a layer
(RMSNorm, RoPE, KV write, decode attention, SiLU-mul) set their `PDL` constexpr and are
launched with `launch_pdl`: they signal and then wait on entry, before any load or store, so
their launch latency hides behind the previous kernel's tail and nothing is read or written
early. A kernel launched the usual way (PyTorch's) waits for the one before it as ever.
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


def launch_options(pdl: bool) -> dict[str, bool]:
    """The Triton launch options of a kernel launched as a dependent (none otherwise)."""
    return {"launch_pdl": True} if pdl else {}
