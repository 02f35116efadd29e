"""Triton skinny GEMM: out[b] = x[b] @ w[b]^T when x has few rows (decode-size batches).

With few rows the weight is the whole cost. The weight rows fill the MMA's M side (swap-AB) in
narrow BLOCK_N slices, and a float32 output can also split K across programs, summed with atomic
adds, so even a 64-row weight (the MoE router) spreads over many SMs. Rows past BLOCK_M take more
programs (each re-reads its weight slice, from L2). Strides are free, so one kernel serves
nn.Linear weights (B = 1) and the per-head absorbed MLA matmuls. Each program loads its first
weight tile before the PDL wait. Measured on H200 it beats cuBLAS on the router (3.4 vs 5.2 us)
and the per-head matmuls at <= 16 rows (2.9 vs 3.2, 3.3 vs 3.7 us); callers use it only where
it wins (thresholds beside them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

BLOCK_M = 64  # rows of x a program takes at most; more rows, more programs
PER_HEAD_MAX_ROWS = 16  # the per-head MLA matmuls: measured faster than cuBLAS's bmm up to here

_COMPUTE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_ob, stride_om, stride_on,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, K_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n block x m block, batch, k split): acc[BLOCK_N, BLOCK_M] = W tile @ X^T over its K range."""
    b = tl.program_id(1).to(tl.int64)
    # The m blocks of one weight slice are neighbours, so they run together and share it in L2.
    m_blocks = tl.cdiv(M, BLOCK_M)
    offs_n = (tl.program_id(0) // m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (tl.program_id(0) % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = tl.program_id(2) * K_PER_SPLIT
    w_ptrs = w_ptr + b * stride_wb + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :] * stride_wk
    x_ptrs = x_ptr + b * stride_xb + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None] * stride_xk
    # The first weight tile is loaded before waiting on the previous kernel (weights are never a
    # kernel's output), so under PDL it streams in while that kernel finishes.
    k_ok = (k_lo + offs_k) < K
    w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    wait_for_prior_grid(PDL)
    xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
    acc = tl.dot(w.to(COMPUTE), xt.to(COMPUTE), input_precision=PRECISION)
    # Every split takes K_STEPS blocks; only the last one can run past K (masked unless EVEN_K).
    # K is a constexpr: it is fixed per weight, and the interpreter needs a plain loop bound.
    for step in range(1, K_STEPS):
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k_lo + step * BLOCK_K + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w.to(COMPUTE), xt.to(COMPUTE), acc, input_precision=PRECISION)
    out_ptrs = out_ptr + b * stride_ob + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
    mask = n_ok[:, None] & m_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: BLOCK_N weight rows and up to block_m rows of x per program, BLOCK_K per step,
    K cut into split_k parts."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = BLOCK_M


def pick_config(m: int, n: int, k: int, batch: int, out_dtype: torch.dtype, device: torch.device) -> SkinnyConfig:
    """Tiles measured on H200 (benchmarks/kernels/check_skinny_gemm.py --sweep); K split only into float32."""
    if device.type != "cuda":
        return SkinnyConfig(block_n=16, block_k=16, split_k=2 if out_dtype == torch.float32 and k >= 64 else 1,
                            num_warps=1, num_stages=1)
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    if out_dtype == torch.float32:
        # A router-like [64, 2048] weight: 4 slices of 16 rows, K cut 8 ways fill 32 SMs.
        programs = triton.cdiv(n, 16) * batch * triton.cdiv(m, BLOCK_M)
        split = max(1, min(8, sm_count(device) // max(programs, 1), k // block_k))
        return SkinnyConfig(block_n=16, block_k=block_k, split_k=split)
    if m > 16:
        # More rows: wider weight slices, so x is re-read fewer times.
        return SkinnyConfig(block_n=64, block_k=block_k, num_stages=3)
    return SkinnyConfig(block_n=64 if n <= 128 else 32, block_k=block_k)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 3 or w.dim() != 3 or out.dim() != 3:
        raise ValueError(f"skinny_bmm: x, w, out must be 3-D, got {x.dim()}, {w.dim()}, {out.dim()}")
    (b, m, k), (bw, n, kw) = x.shape, w.shape
    if bw != b or kw != k or tuple(out.shape) != (b, m, n):
        raise ValueError(f"skinny_bmm: x {tuple(x.shape)} @ w {tuple(w.shape)}^T does not fit out {tuple(out.shape)}")


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The reference per_head_matmul: this kernel up to PER_HEAD_MAX_ROWS tokens, cuBLAS's bmm past them."""
    if x.shape[0] > PER_HEAD_MAX_ROWS:
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    else:
        skinny_bmm(x.transpose(0, 1), w.transpose(1, 2), out.transpose(0, 1))
    return out


def skinny_bmm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """out[b] = x[b] @ w[b]^T for x [B, M, K], w [B, N, K] (any strides), float32 accumulation.

    `w` must be a weight, not the output of the kernel just before: it is read before the wait.
    """
    _check(x, w, out)
    batch, m, k = x.shape
    n = w.shape[1]
    if out.numel() == 0:
        return out
    config = config or pick_config(m, n, k, batch, out.dtype, x.device)
    atomic = config.split_k > 1
    if atomic:
        if out.dtype != torch.float32:
            raise ValueError("skinny_bmm: split K needs a float32 output")
        out.zero_()
    # The interpreter's dot mishandles 16-bit floats, so CPU runs compute in float32.
    compute = _COMPUTE[x.dtype] if x.is_cuda and x.dtype == w.dtype else tl.float32
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    block_m = max(16, min(config.block_m, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, block_m), batch, triton.cdiv(k, k_per_split))
    _skinny_kernel[grid](
        x, w, out, m, n,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        K=k, K_PER_SPLIT=k_per_split, K_STEPS=k_per_split // config.block_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % k_per_split == 0, ATOMIC=atomic, COMPUTE=compute,
        PRECISION="ieee" if compute == tl.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x),
    )
    return out
