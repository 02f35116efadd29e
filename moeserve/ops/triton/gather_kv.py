"""Triton gather of cached rows: each sequence's latent + rotary key rows, in token order, packed.

Used to decompress a cached prefix for the MHA prefill form. A program copies BLOCK_T rows of one
sequence, following its page table; FP8 caches (slots in pairs, see reference.attention) are
widened and multiplied by kv_scale (exactly as the reference dequantizes: float32 first, then the
output dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.mla_checks import check_key_pairs
from moeserve.ops.triton.mla_key_tiles import slot_rows
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid


@triton.jit(do_not_specialize=["stride_table"])  # the block table's width varies by batch
def _gather_kernel(
    kv_ptr, table_ptr, seq_lens_ptr, cu_ptr, out_ptr,
    stride_page, stride_slot, stride_table, stride_out, kv_scale,
    WIDTH: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DEQUANT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_grid(PDL)
    b = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < seq_len
    if tl.program_id(1) * BLOCK_T >= seq_len:
        return
    page = tl.load(table_ptr + b.to(tl.int64) * stride_table + offs_t // PAGE_SIZE, mask=t_ok, other=0)
    src = slot_rows(kv_ptr, page, offs_t, stride_page, stride_slot, PAGE_SIZE, DEQUANT)  # FP8: key pairs
    step: tl.constexpr = 2 if DEQUANT else 1
    dst = out_ptr + (tl.load(cu_ptr + b) + offs_t).to(tl.int64) * stride_out
    for d0 in range(0, WIDTH, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = t_ok[:, None] & (offs_d[None, :] < WIDTH)
        rows = tl.load(src[:, None] + step * offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if DEQUANT:
            rows = rows * kv_scale
        tl.store(dst[:, None] + offs_d[None, :], rows.to(out_ptr.dtype.element_ty), mask=mask)


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_dtype: torch.dtype,
    kv_scale: float = 1.0,
    total: int | None = None,
) -> torch.Tensor:
    """Each sequence's cached rows in token order, packed: [sum(seq_lens), kv_cache_dim]."""
    if kv_cache.dim() != 3 or kv_cache.stride(-1) != 1:
        raise ValueError(f"gather_kv: cache {tuple(kv_cache.shape)} is not a [pages, page_size, dim] tensor with contiguous rows")
    check_key_pairs(kv_cache, "gather_kv")
    batch = seq_lens.shape[0]
    if block_table.shape[0] != batch or cu_seqlens.shape[0] != batch + 1:
        raise ValueError(
            f"gather_kv: {batch} seq_lens but {block_table.shape[0]} block-table rows and {cu_seqlens.shape[0]} cu_seqlens"
        )
    if total is None:
        # A device read, which stalls the host until the GPU catches up: callers that know the
        # size pass it (the model runner does), so prefill launches run ahead of the GPU.
        total = int(cu_seqlens[-1])
    width = kv_cache.shape[-1]
    out = torch.empty(total, width, dtype=out_dtype, device=kv_cache.device)
    if total == 0:
        return out
    block_t = 32 if kv_cache.is_cuda else 16
    # No sequence is longer than its page-table row, a bound known without reading seq_lens.
    max_len = block_table.shape[1] * kv_cache.shape[1]
    _gather_kernel[(batch, triton.cdiv(max_len, block_t))](
        kv_cache, block_table, seq_lens, cu_seqlens, out,
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0), float(kv_scale),
        WIDTH=width, PAGE_SIZE=kv_cache.shape[1], BLOCK_T=block_t, BLOCK_D=min(128, triton.next_power_of_2(width)),
        DEQUANT=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4, **pdl_launch(out),
    )
    return out
