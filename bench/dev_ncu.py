"""Development: one gate_up-shaped launch of each CUDA GPTQ kernel, for Nsight Compute."""

from __future__ import annotations

import torch

from bench.bench_gptq import pagedq_weights
from cuda_ext.build import gptq_ext_available
from pagedq.ops import gptq as ops

assert gptq_ext_available(torch.device("cuda"))
w = pagedq_weights(1)[2]
x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
big = torch.empty(45 * 2**20, dtype=torch.uint8, device="cuda")
for _ in range(3):
    ops._launch_cuda(x, w, None, kernel="mma", split=1)
    ops._launch_cuda(x, w, None, kernel="gemv")
    big.clone()
torch.cuda.synchronize()
