"""RMSNorm, computed in fp32 like the reference implementation (`pagedq.ops.fused`)."""

from __future__ import annotations

import torch
from torch import nn

from pagedq.ops.fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with the normalisation in fp32 and the product in x's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [hidden]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # [T, hidden]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of residual + x, residual + x): the residual add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)
