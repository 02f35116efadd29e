"""Triton SiLU-and-mul: the SwiGLU gate of the MLPs, silu(x[:, :I]) * x[:, I:] -> [T, I].

A program covers one row's columns up to MAX_BLOCK: at prompt sizes (millions of rows of the
shared experts' 1,408 columns) a program per 1,024 columns ran at 2.9 TB/s on an H200, one
covering the whole row (2,048 lanes, a third idle) at 3.9; two or four rows a program, or 4,096
lanes, were no faster (benchmarks/kernels/prefill_small_ops.py at e00afc7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

MAX_BLOCK = 2048  # columns a program covers at most (a power of two)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, block): BLOCK outputs of one row."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x of width 2 * I (float32 math, output in x's dtype)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_and_mul: last dimension {width} is not even")
    inter = width // 2
    x2 = x.reshape(-1, width) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and inter:
        block = min(MAX_BLOCK, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4, **pdl_launch(x2))
    return out
