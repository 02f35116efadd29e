"""Triton MLA attention in the absorbed form over the paged latent cache: split-KV and its reduce.

Every head reads the same cached rows (latent + rotary key), so one program handles a block of
BLOCK_Q query tokens x BLOCK_H heads as the M side of its matmuls and loads each KV tile once for
all of them. The keys of a sequence are cut into num_splits even, tile-aligned ranges, each a
program of its own (flash-decoding), so a single long sequence still fills the GPU; a second
kernel merges the splits by their log-sum-exp. num_splits and the grid depend only on shapes: a
sequence shorter than the splits leaves the trailing ones empty, which makes decode capturable
in a CUDA graph (the merge, alone or fused with W_UV, is in mla_reduce.py). mla_extend.py reuses
these kernels for prefill chunks (BLOCK_Q > 1, causal).
At batch 1, decode loads each split's first tile before waiting on the previous kernel (PDL),
all but the newest key, which this step's store may just have written. On Hopper, batch 1's
16-bit decode runs the split as the Gluon kernel in mla_decode_hopper.py instead (same partials).

An FP8 cache holds value / kv_scale, its slots in key pairs: with float16 matmuls (the default)
tiles are read as 16-bit words and widened a word at a time (mla_pairs.py), the query saturating
at float16's range; kv_scale is folded into the score scale and the output. Scores use exp2, so lse is
kept in base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton import mla_reduce
from moeserve.ops.triton.gemv import linear
from moeserve.ops.triton.mla_checks import check_inputs, check_projections
from moeserve.ops.triton.mla_key_tiles import first_tile_then_wait, load_pages, load_rows
from moeserve.ops.triton.mla_pairs import attend_pair_tiles
from moeserve.ops.triton.mla_reduce import (
    Projection,
    query_span,
    reduce_and_project,
    reduce_splits,
    split_len,
)
from moeserve.ops.triton.mla_tiles import Tiles, decode_tiles, num_splits_for
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid
from moeserve.ops.triton.skinny_gemm import per_head_matmul

LOG2E = 1.4426950408889634
# FP8 tiles widen to float16 for the matmuls: one conversion a pair of values, where bfloat16
# takes a second (F2F) per value. Query values past float16's range saturate (SATURATE). Off, the
# key pairs are read a byte at a time, a column apart (slow: kept for accuracy A/Bs).
FP8_F16_MATMULS = True
# Decode batches up to this size run the split as the Gluon kernel on sm_90 (mla_decode_hopper.py,
# where it takes the shapes). H200 decode-graph replay against the Triton kernel: b1 -2.2 / -2.3%;
# taken up to 8 rows, b2 +0.6%, b4 -1.5%, b8 +0.9% (all inside the rounds' spread).
HOPPER_SPLIT_MAX_BATCH = 1
F16_MAX = tl.constexpr(65504.0)

_COMPUTE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _as_compute(q, COMPUTE: tl.constexpr, SATURATE: tl.constexpr):
    """Query values in the matmuls' dtype, clamped to its range first when SATURATE."""
    if SATURATE:
        return tl.clamp(q.to(tl.float32), -F16_MAX, F16_MAX).to(COMPUTE)
    return q.to(COMPUTE)


@triton.jit
def _load_query(
    q_lat_ptr, q_rope_ptr, q_row, head, row_ok, offs_c, offs_p, stride_qt, stride_qh, stride_rt, stride_rh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, COMPUTE: tl.constexpr, SATURATE: tl.constexpr,
):
    """The program's query rows in the matmuls' dtype -> (latent halves, rotary part)."""
    q_ptrs = q_lat_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_c[None, :]
    q_a = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_c[None, :] < LATENT), other=0.0)
    q_b = tl.load(q_ptrs + HALF, mask=row_ok[:, None] & (HALF + offs_c[None, :] < LATENT), other=0.0)
    q_rope = tl.load(
        q_rope_ptr + q_row[:, None] * stride_rt + head[:, None] * stride_rh + offs_p[None, :],
        mask=row_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0,
    )
    return _as_compute(q_a, COMPUTE, SATURATE), _as_compute(q_b, COMPUTE, SATURATE), _as_compute(q_rope, COMPUTE, SATURATE)


@triton.jit
def _attend_tiles(
    acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv_ptr, table_row, lo, hi, pos, offs_c, offs_p,
    stride_page, stride_slot, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr, RELOAD: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr,
):
    """Online softmax over keys lo .. hi (lo tile-aligned). Unmasked: whole tiles all rows see.

    Page ids are read a tile ahead so a tile's addresses never wait on a load of the same
    iteration; otherwise Triton's pipeliner keeps only one KV tile in flight.
    """
    offs = tl.arange(0, BLOCK_N)
    pages = load_pages(table_row, lo + offs, hi, PAGE_SIZE, "")
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + offs
        lat_a, lat_b, rope, pv_a, pv_b = load_rows(
            kv_ptr, pages, offs_n, hi, offs_c, offs_p, stride_page, stride_slot,
            LATENT, ROPE, HALF, PAGE_SIZE, MASKED, RELOAD, "", PAIRED,
        )
        pages = load_pages(table_row, offs_n + BLOCK_N, hi, PAGE_SIZE, "")
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, lat_a, lat_b, rope, pv_a, pv_b, offs_n, hi, pos, qk_scale,
            MASKED, COMPUTE, PRECISION,
        )
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _attend_tile(
    acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, lat_a, lat_b, rope, pv_a, pv_b, offs_n, hi, pos, qk_scale,
    MASKED: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over the loaded keys offs_n."""
    # Three independent products summed, not one chained accumulator (see mla_key_tiles.load_rows).
    s = tl.dot(q_a, tl.trans(lat_a.to(COMPUTE)), input_precision=PRECISION)
    s += tl.dot(q_b, tl.trans(lat_b.to(COMPUTE)), input_precision=PRECISION)
    s += tl.dot(q_rope, tl.trans(rope.to(COMPUTE)), input_precision=PRECISION)
    s *= qk_scale
    if MASKED:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] < hi), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may have no visible key yet in a causal tile; exp2(-inf - 0) keeps it at zero weight.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(COMPUTE)
    acc_a = tl.dot(p, pv_a.to(COMPUTE), acc=acc_a * alpha[:, None], input_precision=PRECISION)
    acc_b = tl.dot(p, pv_b.to(COMPUTE), acc=acc_b * alpha[:, None], input_precision=PRECISION)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _store_half(o, cols, q_row, head, row_ok, part, out_ptr, part_o_ptr, stride_ot, stride_oh,
                LATENT: tl.constexpr, SPLIT_KV: tl.constexpr):
    """Latent columns `cols` of the normalised output, to `out` or, with several splits, as partial `part`."""
    mask = row_ok[:, None] & (cols[None, :] < LATENT)
    if not SPLIT_KV:
        ptrs = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_o_ptr + part[:, None] * LATENT + cols[None, :], o, mask=mask)


@triton.jit
def _store_result(
    acc_a, acc_b, m_i, l_i, q_row, head, row_ok, offs_c, split, num_heads, out_scale,
    out_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh,
    num_splits, LATENT: tl.constexpr, HALF: tl.constexpr, SPLIT_KV: tl.constexpr,
):
    """The normalised output, straight to `out` or, with several splits, as a partial + lse."""
    inv = (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    part = (q_row * num_heads + head) * num_splits + split
    _store_half(acc_a * inv, offs_c, q_row, head, row_ok, part, out_ptr, part_o_ptr, stride_ot, stride_oh,
                LATENT, SPLIT_KV)
    _store_half(acc_b * inv, HALF + offs_c, q_row, head, row_ok, part, out_ptr, part_o_ptr, stride_ot, stride_oh,
                LATENT, SPLIT_KV)
    if SPLIT_KV:
        # -inf for rows with no visible key in this split (l_i = 0, m_i = -inf).
        tl.store(part_lse_ptr + part, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=row_ok)


@triton.jit
def _clear_row(clear_ptr, b, split, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Zero sequence b's float32 row of o_proj's output, which the merge adds into (mla_reduce's
    PROJECT_OUTPUT): here, after the wait, because a kernel before this one may still read it."""
    if (split == 0) & (tl.program_id(0) == 0):  # the one program every sequence has
        offs = tl.arange(0, BLOCK)
        tl.store(clear_ptr + b * WIDTH + offs, tl.zeros_like(offs).to(tl.float32), mask=offs < WIDTH)


@triton.jit
def _program_rows(q_block, head_groups, q_start, q_len, prefix, num_heads, BLOCK_Q: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The program's BLOCK_Q x BLOCK_H query rows (token-major) -> (head, valid, key position, query row)."""
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = (tl.program_id(0) % head_groups) * BLOCK_H + offs_m % BLOCK_H
    row_ok = (tok < q_len) & (head < num_heads)
    return head, row_ok, prefix + tok, (q_start + tok).to(tl.int64)


# Ints that change from batch to batch are not specialised (a value of 1 or a multiple of 16
# would otherwise compile a new variant mid-serving, a second-long stall).
@triton.jit(do_not_specialize=["stride_table", "num_q_blocks", "num_splits"])
def _mla_split_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, seq_lens_ptr, qstart_ptr, out_ptr, part_o_ptr, part_lse_ptr, clear_ptr,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_page, stride_slot, stride_table, stride_ot, stride_oh,
    num_heads, num_q_blocks, num_splits, qk_scale, out_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, DECODE: tl.constexpr, EARLY_TILE: tl.constexpr, RELOAD: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, SATURATE: tl.constexpr,
    CLEAR_WIDTH: tl.constexpr = 0, CLEAR_BLOCK: tl.constexpr = 1, PAIRED: tl.constexpr = False,
    WORDS: tl.constexpr = False,
):
    if not EARLY_TILE:
        wait_for_prior_grid(PDL)
    head_groups = tl.cdiv(num_heads, BLOCK_H)
    # The last query blocks see the most keys; starting them first evens out the causal tail.
    q_block = num_q_blocks - 1 - tl.program_id(0) // head_groups
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start, q_len, seq_len = query_span(seq_lens_ptr, qstart_ptr, b, DECODE, ".cg" if EARLY_TILE else "")
    if q_block * BLOCK_Q >= q_len:
        return
    prefix = seq_len - q_len
    chunk = split_len(seq_len, num_splits, BLOCK_N)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tl.minimum(seq_len, prefix + (q_block + 1) * BLOCK_Q))
    if SPLIT_KV and lo >= hi:
        return  # the reduce never reads an empty split
    head, row_ok, pos, q_row = _program_rows(q_block, head_groups, q_start, q_len, prefix, num_heads, BLOCK_Q, BLOCK_H)
    offs_c = tl.arange(0, HALF)
    offs_p = tl.arange(0, BLOCK_P)
    if EARLY_TILE:
        table_row = table_ptr + b.to(tl.int64) * stride_table
        first_n, first_a, first_b, first_rope, first_pv_a, first_pv_b = first_tile_then_wait(
            kv_ptr, table_row, lo, hi, seq_len, offs_c, offs_p, stride_page, stride_slot,
            LATENT, ROPE, HALF, BLOCK_N, PAGE_SIZE, RELOAD, PDL, PAIRED,
        )
    if CLEAR_WIDTH:
        _clear_row(clear_ptr, b, split, CLEAR_WIDTH, CLEAR_BLOCK)
    q_a, q_b, q_rope = _load_query(
        q_lat_ptr, q_rope_ptr, q_row, head, row_ok, offs_c, offs_p, stride_qt, stride_qh, stride_rt, stride_rh,
        LATENT, ROPE, HALF, COMPUTE, SATURATE,
    )
    acc_a = tl.zeros([BLOCK_Q * BLOCK_H, HALF], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_Q * BLOCK_H, HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    if not EARLY_TILE:
        # Computed here, not above, so every batch but 1 compiles to the PTX measured before.
        table_row = table_ptr + b.to(tl.int64) * stride_table
    else:
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, first_a, first_b, first_rope, first_pv_a, first_pv_b, first_n,
            hi, pos, qk_scale, True, COMPUTE, PRECISION,
        )
        lo += BLOCK_N
    # Whole tiles below the block's first query position are visible to every row: no masks.
    diag = (prefix + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    mid = tl.maximum(lo, tl.minimum(diag, hi // BLOCK_N * BLOCK_N))
    if WORDS:  # a key-pair FP8 cache read as 16-bit words (kv_ptr, strides in words): mla_pairs.py
        acc_a, acc_b, m_i, l_i = attend_pair_tiles(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv_ptr, table_row, lo, mid, pos, offs_c, offs_p,
            stride_page, stride_slot, qk_scale, LATENT, ROPE, HALF, BLOCK_N, PAGE_SIZE, False, PRECISION,
        )
        acc_a, acc_b, m_i, l_i = attend_pair_tiles(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv_ptr, table_row, mid, hi, pos, offs_c, offs_p,
            stride_page, stride_slot, qk_scale, LATENT, ROPE, HALF, BLOCK_N, PAGE_SIZE, True, PRECISION,
        )
    else:
        acc_a, acc_b, m_i, l_i = _attend_tiles(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv_ptr, table_row, lo, mid, pos, offs_c, offs_p, stride_page,
            stride_slot, qk_scale, LATENT, ROPE, HALF, BLOCK_N, PAGE_SIZE, False, RELOAD, COMPUTE, PRECISION, PAIRED,
        )
        acc_a, acc_b, m_i, l_i = _attend_tiles(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv_ptr, table_row, mid, hi, pos, offs_c, offs_p, stride_page,
            stride_slot, qk_scale, LATENT, ROPE, HALF, BLOCK_N, PAGE_SIZE, True, RELOAD, COMPUTE, PRECISION, PAIRED,
        )
    _store_result(
        acc_a, acc_b, m_i, l_i, q_row, head, row_ok, offs_c, split, num_heads, out_scale,
        out_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh, num_splits, LATENT, HALF, SPLIT_KV,
    )


def _matmul_dtype(q_latent: torch.Tensor, fp8: bool) -> tuple[tl.dtype, bool]:
    """The split kernel's matmul dtype, and whether the query must saturate into it (float16)."""
    if not q_latent.is_cuda:
        return tl.float32, False  # the interpreter's dot mishandles 16-bit floats
    if fp8 and q_latent.dtype == torch.bfloat16 and FP8_F16_MATMULS:
        return tl.float16, True
    return _COMPUTE[q_latent.dtype], False


def run_absorbed(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    max_query_len: int,
    scale: float,
    kv_scale: float,
    tiles: Tiles,
    num_splits: int,
    project: Projection | None = None,
) -> torch.Tensor:
    """Launch the split kernel (and the reduce when num_splits > 1); query_start_loc None = decode.

    `project`, decode with splits only: the reduce applies W_UV (and o_proj) too
    (mla_reduce.reduce_and_project) and this returns project.out.
    """
    check_inputs(q_latent, q_rope, kv_cache, block_table)
    # Rows may be strided (q_rope is a slice of q); only the innermost dim must be contiguous.
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    rows, heads, rank = q_latent.shape
    fused = project is not None
    assert not fused or (query_start_loc is None and num_splits > 1), "the fused value projection merges decode splits"
    # Fused, the projection's output is the result (the split kernel writes only partials then).
    out = project.out if fused else torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    clear_width = out.shape[-1] if fused and project.w_o is not None else 0  # o_proj's float32 row to zero
    batch = seq_lens.shape[0]
    if rows == 0 or batch == 0 or max_query_len <= 0:
        return out
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    kv_scale = float(kv_scale) if fp8 else 1.0
    compute, saturate = _matmul_dtype(q_latent, fp8)
    decode = query_start_loc is None
    qstart = seq_lens if decode else query_start_loc
    num_q_blocks = triton.cdiv(max_query_len, tiles.block_q)
    part_o, part_lse = _partials(rows, heads, num_splits, rank, out)
    if decode and not fp8 and batch <= HOPPER_SPLIT_MAX_BATCH and num_splits > 1 and q_latent.is_cuda:
        from moeserve.ops.triton import mla_decode_hopper  # Gluon: imported only where it may run

        block_n = mla_decode_hopper.try_decode_split(q_latent, q_rope, kv_cache, block_table, seq_lens, scale * LOG2E,
                                                     num_splits, part_o, part_lse, out if clear_width else None)
        if block_n:  # the merge finds each split's keys as that kernel dealt them, in its tiles
            return _merge_splits(part_o, part_lse, seq_lens, qstart, out, project, block_n, num_splits, batch)
    _launch_split(q_latent, q_rope, kv_cache, block_table, seq_lens, qstart, out, part_o, part_lse, clear_width,
                  num_q_blocks, num_splits, scale * kv_scale * LOG2E, kv_scale, tiles, decode, fp8, compute, saturate)
    return _merge_splits(part_o, part_lse, seq_lens, qstart, out, project, tiles.block_n, num_splits, batch,
                         max_query_len, decode)


def _launch_split(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, qstart: torch.Tensor, out: torch.Tensor, part_o: torch.Tensor,
                  part_lse: torch.Tensor, clear_width: int, num_q_blocks: int, num_splits: int, qk_scale: float,
                  kv_scale: float, tiles: Tiles, decode: bool, fp8: bool, compute: tl.dtype, saturate: bool) -> None:
    """The split kernel over every (query block x head group, sequence, split)."""
    heads, rank = q_latent.shape[1], q_latent.shape[2]
    grid = (num_q_blocks * triton.cdiv(heads, tiles.block_h), seq_lens.shape[0], num_splits)
    # An FP8 cache holds its slots in pairs (mla_pairs.py); with float16 matmuls it is read as 16-bit words.
    words = fp8 and compute == tl.float16
    if words and (decode and tiles.early_tile or tiles.block_n < 32):
        raise ValueError(f"MLA attention: {tiles} for an FP8 cache: key pairs need 32+ key tiles, none before the wait")
    kv = kv_cache.view(torch.int16) if words else kv_cache
    stride_page, stride_slot = (kv.stride(0), 2 * kv.stride(1)) if words else (kv.stride(0), kv.stride(1))
    _mla_split_kernel[grid](
        q_latent, q_rope, kv, block_table, seq_lens, qstart, out, part_o, part_lse, out if clear_width else part_lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        stride_page, stride_slot, block_table.stride(0), out.stride(0), out.stride(1),
        heads, num_q_blocks, num_splits, qk_scale, kv_scale,
        LATENT=rank, ROPE=q_rope.shape[-1],
        HALF=max(16, triton.next_power_of_2(rank) // 2), BLOCK_P=max(16, triton.next_power_of_2(q_rope.shape[-1])),
        BLOCK_Q=tiles.block_q, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, PAGE_SIZE=kv_cache.shape[1],
        SPLIT_KV=num_splits > 1, DECODE=decode, EARLY_TILE=decode and tiles.early_tile,
        RELOAD=fp8 and compute != tl.float32 and not words, COMPUTE=compute, SATURATE=saturate,
        PRECISION="ieee" if compute == tl.float32 else "tf32",
        CLEAR_WIDTH=clear_width, CLEAR_BLOCK=triton.next_power_of_2(max(clear_width, 1)), PAIRED=fp8, WORDS=words,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(q_latent),
    )


def _merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, qstart: torch.Tensor,
                  out: torch.Tensor, project: Projection | None, block_n: int, num_splits: int, batch: int,
                  max_query_len: int = 1, decode: bool = True) -> torch.Tensor:
    """The splits (of whole `block_n`-key tiles) merged, and projected with `project`, into the op's result."""
    if project is not None:
        return reduce_and_project(part_o, part_lse, seq_lens, project, num_splits, block_n)
    if num_splits > 1:
        reduce_splits(part_o, part_lse, seq_lens, qstart, out, max_query_len, batch, num_splits, block_n, decode)
    return out


def _partials(rows: int, heads: int, num_splits: int, rank: int, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The splits' partial outputs and log-sum-exps (float32), or `out` twice with one split (unused)."""
    if num_splits == 1:
        return out, out
    part_o = torch.empty(rows, heads, num_splits, rank, dtype=torch.float32, device=out.device)
    return part_o, torch.empty(rows, heads, num_splits, dtype=torch.float32, device=out.device)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    *,
    w_uv: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w_o: torch.Tensor | None = None,
    w_o_t: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Absorbed-form decode over the paged latent cache -> [B, H, rank]; with w_uv [H, v, rank] the
    per-head value projection too -> [B, H, v] (into `out` if given); with w_o [hidden, H * v] as
    well, o_proj's output: [B, hidden], or at batch 1 its float32 one-slot part [B, 1, hidden]
    (mla_reduce.PROJECT_OUTPUT), which the next add + RMSNorm takes alike, reading w_o_t (w_o
    transposed, mla_reduce.transposed_o_proj) instead of w_o if given. Other keywords: tuning
    overrides.

    With w_uv and no w_o at batch 1-2 the kernel launched next may start before this op's last
    kernel has waited on the one before (mla_reduce.PROJECT_EARLY_LAUNCH): it must read only
    weights before its own PDL wait, as o_proj's GEMV does.
    """
    batch, heads = q_latent.shape[0], q_latent.shape[1]
    if seq_lens.shape[0] != batch or block_table.shape[0] != batch:
        raise ValueError(
            f"mla_decode: {batch} queries but {seq_lens.shape[0]} seq_lens and {block_table.shape[0]} block-table rows"
        )
    tiles = tiles or decode_tiles(heads, q_latent.dtype, kv_cache.dtype, q_latent.device, batch)
    if num_splits is None:
        programs = batch * triton.cdiv(heads, tiles.block_h)
        num_splits = num_splits_for(programs, block_table.shape[1] * kv_cache.shape[1], tiles, q_latent.device)
    project = None
    if w_o is not None and w_uv is None:
        raise ValueError("mla_decode: o_proj's weight w_o needs w_uv")
    if w_uv is not None:
        check_projections(q_latent, w_uv, w_o, w_o_t)
        if out is None:
            out = q_latent.new_empty(batch, heads, w_uv.shape[1])
        if num_splits > 1 and batch <= mla_reduce.PROJECT_MAX_ROWS:
            if w_o is not None and mla_reduce.fuses_output(batch, heads, w_uv.shape[1], w_o.shape[0], w_o.device):
                summed = torch.empty(batch, 1, w_o.shape[0], dtype=torch.float32, device=q_latent.device)
                project = Projection(w_uv, summed, w_o, w_o_t)
            else:
                project = Projection(w_uv, out)
    result = run_absorbed(q_latent, q_rope, kv_cache, block_table, seq_lens, None, 1, scale, kv_scale, tiles,
                          num_splits, project=project)
    if w_uv is None or (project is not None and project.w_o is not None):
        return result
    if project is None:
        result = per_head_matmul(result, w_uv.transpose(1, 2), out)
    return result if w_o is None else linear(result.flatten(1), w_o)
