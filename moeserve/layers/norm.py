"""RMSNorm module (optionally fused with the residual add)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve import ops


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
