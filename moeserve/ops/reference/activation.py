"""Reference activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x of width 2 * I, computed in float32."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
