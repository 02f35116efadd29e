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
    stride_slot,
    stride_res,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SLOTS: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program: optional slot sum and residual add, then RMSNorm, the row in registers."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    # With a residual, rows are in its dtype (x may be a MoE's float32 sum); else in x's.
    row_dtype: tl.constexpr = res_ptr.dtype.element_ty if HAS_RESIDUAL else x_ptr.dtype.element_ty
    if SLOTS == 1:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(row_dtype)
    else:
        # A MoE's per-expert outputs: summed in float32, rounded once (as its top-k sum would).
        slots = tl.arange(0, SLOTS_PAD)
        ptrs = x_ptr + row * stride_x + slots[:, None] * stride_slot + cols[None, :]
        parts = tl.load(ptrs, mask=(slots[:, None] < SLOTS) & mask[None, :], other=0.0)
        x = tl.sum(parts.to(tl.float32), axis=0).to(row_dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # x + residual rounds to the row dtype first, as the reference's add does.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(row_dtype)
        tl.store(sum_ptr + row * width + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normalize_row(x.to(tl.float32), w, width, eps, x.dtype)
    tl.store(out_ptr + row * width + cols, y, mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as [rows, width] with contiguous rows, copying only when that is impossible."""
    if t.dim() != 2:
        t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def check_inputs(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """Raise on (x, residual, norm weight) the norm kernels cannot take."""
    width = x.shape[-1]
    parts = residual is not None and x.dim() == residual.dim() + 1
    if parts:
        x = x[..., 0, :]  # [T, slots, H] parts to sum (float32 ones too): checked as the [T, H] they sum to
    if weight.shape != (width,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match width {width}")
    if width > MAX_WIDTH:
        raise ValueError(f"rms_norm: width {width} exceeds the kernel's maximum {MAX_WIDTH}")
    summed_parts = parts and x.dtype == torch.float32
    if residual is not None and (residual.shape != x.shape or (residual.dtype != x.dtype and not summed_parts)):
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed); summed is `normed` itself when there is no residual."""
    check_inputs(x, residual, weight)
    width = x.shape[-1]
    has_slots = residual is not None and x.dim() == residual.dim() + 1
    slots = x.shape[-2] if has_slots else 1
    x3 = x.reshape(-1, slots, width)  # a view for row-strided inputs (the latent inside kv_a's output)
    x3 = x3 if x3.stride(-1) == 1 else x3.contiguous()
    res2 = x3[:, 0] if residual is None else _rows(residual, width)
    out = torch.empty(residual.shape if has_slots else x.shape, dtype=x.dtype if residual is None else residual.dtype,
                      device=x.device)
    summed = out if residual is None else torch.empty_like(out)
    if x3.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(x3.shape[0],)](
            x3, res2, weight.contiguous(), out, summed, x3.stride(0), x3.stride(1), res2.stride(0), width,
            float(eps), HAS_RESIDUAL=residual is not None, SLOTS=slots, SLOTS_PAD=triton.next_power_of_2(slots),
            BLOCK=block, num_warps=min(max(block // 256, 1), 16), **pdl_launch(x3),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension (float32 math, output in x's dtype)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x may be [T, slots, H] parts to sum first."""
    return _launch(x, residual, weight, eps)
