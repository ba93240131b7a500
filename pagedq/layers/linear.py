"""Dense linear layer (the unquantized path; GPTQ layers live in `pagedq.gptq.linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    """y = x @ weight^T + bias, with weights fused along N where several projections share x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [N]

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, K] -> [T, N]


class ConcatLinear(nn.Module):
    """Linears reading the same x, outputs concatenated in order: a fused projection whose parts
    are stored differently (some quantized, some dense)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
