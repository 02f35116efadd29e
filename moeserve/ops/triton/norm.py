"""Triton RMSNorm, plain and fused with the residual add: one program per row, one pass over it.

Rows may be strided (a column slice of a wider tensor, like the latent inside kv_a's output) as
long as each row is contiguous; other layouts are copied to a contiguous tensor first. Outputs
are new contiguous tensors in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

MAX_WIDTH = 16384  # a whole row lives in registers; wider rows would spill


@triton.jit
def normalize_row(x, w, width, eps, OUT_DTYPE: tl.constexpr):
    """x * rsqrt(mean(x^2) + eps) * w in float32, rounded like the reference (-> OUT_DTYPE)."""
    mean_sq = tl.sum(x * x, axis=0) / width
    normed = (x * tl.rsqrt(mean_sq + eps)).to(OUT_DTYPE).to(tl.float32)
    # The reference rounds the normalised row to x's dtype before the weight multiply.
    return (normed * w).to(OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_res,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One row per program: optional residual add, then RMSNorm, the whole row in registers."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # x + residual rounds to x's dtype first, as the reference's add does.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * width + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normalize_row(x.to(tl.float32), w, width, eps, x.dtype)
    tl.store(out_ptr + row * width + cols, y, mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as [rows, width] with contiguous rows, copying only when that is impossible."""
    if t.dim() != 2:
        t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """Raise on inputs the kernel cannot take."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match width {width}")
    if width > MAX_WIDTH:
        raise ValueError(f"rms_norm: width {width} exceeds the kernel's maximum {MAX_WIDTH}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed); summed is `normed` itself when there is no residual."""
    _check(x, residual, weight)
    width = x.shape[-1]
    x2 = _rows(x, width)
    res2 = x2 if residual is None else _rows(residual, width)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = out if residual is None else torch.empty_like(out)
    if x2.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, summed, x2.stride(0), res2.stride(0), width, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
            **pdl_launch(x2),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension (float32 math, output in x's dtype)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over both inputs."""
    return _launch(x, residual, weight, eps)
