"""Reference small-batch matmuls: what the Triton skinny GEMM and GEMV compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.reference.norm import fused_add_rms_norm, rms_norm


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b] = x[b] @ w[b]^T for x [B, M, K], w [B, N, K] (any strides), accumulated in float32.

    `out` [B, M, N] is written in place in its own dtype (a float32 `out` keeps the full sums).
    """
    out.copy_(torch.bmm(x.float(), w.float().transpose(1, 2)))
    return out


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t, h] = x[t, h] @ w[h] for x [T, H, a], w [H, a, b]: one batched GEMM over heads, written
    token-major into `out` [T, H, b] (a transposed view of it is a valid strided output: no copy)."""
    torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight^T (+ bias) as nn.Linear computes it, or in out_dtype (operands widened to it first);
    written into `out` when given."""
    if out_dtype is None or out_dtype == x.dtype:
        result = F.linear(x, weight, bias)
    else:
        result = F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
    return result if out is None else out.copy_(result)


def add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a pre-norm layer's first projection with the
    residual add before it; x may be [T, slots, H] parts to sum first (see fused_add_rms_norm)."""
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), summed


def embed_norm_linear(
    ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(table[ids])), table[ids]): a model's token embedding, then its first layer's
    norm and first projection."""
    embedded = F.embedding(ids, table)
    return linear(rms_norm(embedded, norm_weight, eps), weight, bias), embedded
