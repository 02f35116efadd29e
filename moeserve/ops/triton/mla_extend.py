"""Triton absorbed-form prefill (MLA extend) over the paged latent cache.

The kernels are decode's (mla_decode.py) with BLOCK_Q > 1: a program takes BLOCK_Q query tokens
of one sequence x BLOCK_H heads (64 rows on the GPU), attends causally, bottom-right aligned, to
the sequence's cached keys (its own new tokens are already stored), and loads every KV tile once
for all those rows. When there are too few query blocks to fill the GPU (short chunks after a
long prefix) the keys are split as in decode and merged by the same reduce kernel.
"""

from __future__ import annotations

import torch
import triton

from moeserve.ops.triton.mla_decode import run_absorbed
from moeserve.ops.triton.mla_tiles import Tiles, num_splits_for

BLOCK_M = 32  # query rows (tokens x heads) per program on the GPU; 64 spills the [64, 512] accumulator


def extend_tiles(num_heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> Tiles:
    """Extend launch shape: up to BLOCK_M rows, all of a token's heads together when they fit."""
    rows = BLOCK_M if device.type == "cuda" and q_dtype != torch.float32 else 16
    block_h = min(triton.next_power_of_2(num_heads), rows)
    if device.type != "cuda":
        return Tiles(block_q=rows // block_h, block_h=block_h, block_n=16, num_warps=1, num_stages=1)
    # Checked for sm_90 with ptxas (benchmarks/kernels/mla_sass.py --extend --rows 2,16): no spills
    # but FP8's 8 bytes; an FP8 cache's key pairs need 32-key tiles (mla_pairs.py).
    block_n = 32 if q_dtype != torch.float32 else 16
    stages = 2 if q_dtype == torch.float32 else 3
    return Tiles(block_q=rows // block_h, block_h=block_h, block_n=block_n, num_warps=8, num_stages=stages)


def mla_extend_absorbed(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_scale: float = 1.0,
    *,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Absorbed-form prefill: causal attention of each sequence's new rows -> [T, H, rank] (keywords: tuning)."""
    batch, heads = seq_lens.shape[0], q_latent.shape[1]
    if query_start_loc.shape[0] != batch + 1 or block_table.shape[0] != batch:
        raise ValueError(
            f"mla_extend_absorbed: {batch} seq_lens but {query_start_loc.shape[0]} query_start_loc "
            f"entries and {block_table.shape[0]} block-table rows"
        )
    tiles = tiles or extend_tiles(heads, q_latent.dtype, kv_cache.dtype, q_latent.device)
    if num_splits is None:
        programs = triton.cdiv(max_query_len, tiles.block_q) * batch * triton.cdiv(heads, tiles.block_h)
        num_splits = num_splits_for(programs, block_table.shape[1] * kv_cache.shape[1], tiles, q_latent.device)
    return run_absorbed(
        q_latent, q_rope, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale, kv_scale,
        tiles, num_splits,
    )
