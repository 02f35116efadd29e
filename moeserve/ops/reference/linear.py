"""Reference small-batch matmul: what the Triton skinny GEMM computes, in float32."""

from __future__ import annotations

import torch


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b] = x[b] @ w[b]^T for x [B, M, K], w [B, N, K] (any strides), accumulated in float32.

    `out` [B, M, N] is written in place in its own dtype (a float32 `out` keeps the full sums).
    """
    out.copy_(torch.bmm(x.float(), w.float().transpose(1, 2)))
    return out
