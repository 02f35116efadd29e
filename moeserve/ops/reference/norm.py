"""Reference RMSNorm, plain and fused with the residual add."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in float32 like the reference models."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block boundary in one op.

    x may also be [T, slots, H]: a MoE's per-expert outputs (or their float32 sum, one slot),
    summed in float32 and rounded to the residual's dtype before the add.
    """
    if x.dim() == residual.dim() + 1:
        x = x.float().sum(-2).to(residual.dtype)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
