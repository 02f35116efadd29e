"""Merging flash-decoding splits of MLA attention, and the merge fused with the output projections.

The split kernel (mla_decode.py) leaves, per query row, head and split, a normalised partial
output over its keys and their log-sum-exp (base 2). The merge weighs each partial by its share
of the total exp-sum. At batch 1 the merge, and the per-head value projection (W_UV) after it,
are each a few-microsecond launch whose time is latency; `reduce_and_project` does both in one:
each program loads its W_UV rows before waiting on the split kernel (weights; see pdl.py), then
merges its head's splits and multiplies. At batch 1 it can apply o_proj as well: each program
also loads its values' o_proj columns (from a transposed copy where the caller keeps one,
`transposed_o_proj`) and adds their products into a float32 output row by atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.pdl import launch_next_early, pdl_launch, wait_for_prior_grid

REDUCE_BLOCK_S = 16  # splits merged per step of the reduce
REDUCE_BLOCK_C = 64  # latent columns per reduce program when rows are few
REDUCE_MIN_PROGRAMS = 256  # rows x heads from which a reduce program takes a whole row
# Decode batches up to this size merge and project in one kernel: each (row, head) re-reads its
# partials once per value block, which costs more than a launch past a couple of rows. H200
# decode-graph replay, fused against apart (benchmarks/ab_decode.py): b1 -2.2%, b2 -1.1%; fused
# up to b8 made b8 4.5% slower.
PROJECT_MAX_ROWS = 2
PROJECT_BLOCK_V = 32  # value columns (W_UV rows) per fused program
# The fused merge lets the next kernel (o_proj's GEMV, which loads its weights before its wait)
# launch before its own wait, so o_proj's weights stream during the split kernel's math instead
# of beside the merge's reads. H200 decode-graph replay: b1 1.853 -> 1.820 ms (-1.8%), b2 even.
PROJECT_EARLY_LAUNCH = True
# H200 b1 decode-graph replay against eight warps: four +3.7%, two +7.1%, sixteen +2.0%.
PROJECT_WARPS = 8
# Given o_proj's weight as well, at batch 1 the fused merge applies it too: each program multiplies
# its BLOCK_V values by their o_proj columns and adds the sums into a float32 row by atomics (zeroed
# by the split kernel after its wait). That takes o_proj's kernel, its hop and its dependent read of
# the values off batch 1's attention chain. H200 b1 decode-graph replay against o_proj's GEMV after
# the merge: -0.7% / -0.5% on two machines with every o_proj row in a program (64 programs, one an SM
# beside the split kernel's keyed programs); 1,024 rows (128 programs, some of which wait for an SM
# and load their columns late) +2.0%; 64 values a program +1.0%; the MoE entry launched early
# +0.8%. At batch 2 (128 programs) +0.7%, so the op leaves batch 2 to the GEMV, and shapes with
# more programs than half the SMs (the split kernel's keyed programs fill the SMs they are on).
PROJECT_OUTPUT = True
OUTPUT_MAX_ROWS = 1
OUTPUT_BLOCK_R = 2048  # o_proj rows a program adds into
OUTPUT_WARPS = 8
# A program's o_proj block [2048 rows, 32 values] is 2,048 runs of 64 bytes in o_proj's own layout,
# one run of 128 KB in a transposed copy (transposed_o_proj): H200 b1 decode-graph replay -0.6% on
# two machines, for 8 MiB a layer. Whole 128-byte lines from the own layout instead (64 values,
# 1,024 rows) +2.1%. False: no copy, and a given one is ignored (A/B timing).
TRANSPOSED_O_PROJ = True


@dataclass(frozen=True)
class Projection:
    """What the decode merge applies after merging: W_UV [H, v, rank] into out [B, H, v]; with
    w_o (o_proj [hidden, H * v]) that too, added into out, then a zeroed float32 [B, 1, hidden]
    (read from w_o_t, its transposed copy, when given: see transposed_o_proj)."""

    w_uv: torch.Tensor
    out: torch.Tensor
    w_o: torch.Tensor | None = None
    w_o_t: torch.Tensor | None = None  # w_o transposed [H * v, hidden], contiguous (read instead, if given)


@triton.jit
def split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of one sequence: an even share rounded up to whole tiles, at least one."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def query_span(seq_lens_ptr, qstart_ptr, b, DECODE: tl.constexpr, CACHE: tl.constexpr):
    """(first query row, query count, cached + new length) of sequence b; CACHE ".cg" (L2 only)
    where they are read before the wait (the split kernel's first tile)."""
    seq_len = tl.load(seq_lens_ptr + b, cache_modifier=CACHE)
    if DECODE:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(qstart_ptr + b, cache_modifier=CACHE)
        q_len = tl.load(qstart_ptr + b + 1, cache_modifier=CACHE) - q_start
    return q_start, q_len, seq_len


@triton.jit
def _merge(part_o_ptr, part_lse_ptr, first, n_valid, offs_c,
           LATENT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 columns offs_c of one (row, head)'s merged output over its first n_valid splits."""
    offs_s = tl.arange(0, BLOCK_S)
    # One pass with a running max: a second pass over the lse would add a dependent memory round
    # trip, and at decode sizes this kernel's time is its latency.
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        ok = s0 + offs_s < n_valid
        lse = tl.load(part_lse_ptr + first + s0 + offs_s, mask=ok, other=float("-inf"))
        o = tl.load(
            part_o_ptr + (first + s0 + offs_s)[:, None] * LATENT + offs_c[None, :],
            mask=ok[:, None] & (offs_c[None, :] < LATENT), other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)  # 0 on the first chunk (m = -inf, m_new finite)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    # The largest split weighs exactly 1, so den >= 1.
    return acc / tl.maximum(den, 1.0)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, qstart_ptr, out_ptr, stride_ot, stride_oh, num_heads,
    num_splits, LATENT: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query row x head, sequence, column block): merge that row's splits."""
    wait_for_prior_grid(PDL)
    tok = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    b = tl.program_id(1)
    q_start, q_len, seq_len = query_span(seq_lens_ptr, qstart_ptr, b, DECODE, "")
    if tok >= q_len:
        return
    # Splits holding a key this row may see; every one of them was written with a finite lse.
    pos = seq_len - q_len + tok
    n_valid = tl.cdiv(pos + 1, split_len(seq_len, num_splits, BLOCK_N))
    q_row = (q_start + tok).to(tl.int64)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    o = _merge(part_o_ptr, part_lse_ptr, (q_row * num_heads + head) * num_splits, n_valid, offs_c, LATENT, BLOCK_S, BLOCK_C)
    ptrs = out_ptr + q_row * stride_ot + head * stride_oh + offs_c
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_c < LATENT)


@triton.jit
def _merged_values(part_o_ptr, part_lse_ptr, w, seq_len, row, head, num_heads, num_splits, offs_c,
                   DTYPE: tl.constexpr, LATENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """float32 values [BLOCK_V] of (row, head): its splits merged, rounded to DTYPE as the merged
    latent is when the projection runs apart, times its W_UV rows `w`."""
    n_valid = tl.cdiv(seq_len, split_len(seq_len, num_splits, BLOCK_N))
    o = _merge(part_o_ptr, part_lse_ptr, (row * num_heads + head) * num_splits, n_valid, offs_c, LATENT, BLOCK_S, BLOCK_C)
    o = o.to(DTYPE).to(tl.float32)
    return tl.sum(w.to(tl.float32) * o[None, :], axis=1)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_project_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, w_ptr, out_ptr, stride_wh, stride_wv, stride_ot, stride_oh,
    num_heads, num_splits, V_DIM: tl.constexpr, LATENT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence x head, value block): out[b, h, v] = merged latent [b, h] . W_UV[h, v]."""
    if EARLY_LAUNCH:
        launch_next_early(PDL)
    b = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.arange(0, BLOCK_C)
    w = tl.load(w_ptr + head * stride_wh + offs_v[:, None] * stride_wv + offs_c[None, :],
                mask=(offs_v[:, None] < V_DIM) & (offs_c[None, :] < LATENT), other=0.0)
    # Written by the step's input unpacking, many kernels back: readable before the wait (pdl.py).
    seq_len = tl.load(seq_lens_ptr + b, cache_modifier=".cg")
    wait_for_prior_grid(PDL, EARLY_LAUNCH)
    row = b.to(tl.int64)
    v = _merged_values(part_o_ptr, part_lse_ptr, w, seq_len, row, head, num_heads, num_splits, offs_c,
                       out_ptr.dtype.element_ty, LATENT, BLOCK_N, BLOCK_S, BLOCK_C)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_v, v.to(out_ptr.dtype.element_ty), mask=offs_v < V_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_project_output_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, w_ptr, wo_ptr, out_ptr, stride_wh, stride_wv, stride_wo, num_heads,
    num_splits, HIDDEN: tl.constexpr, V_DIM: tl.constexpr, LATENT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    WO_T: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence x head, value block, output block): out[b, 0, r] += sum over the block's
    values v of W_o[r, (h, v)] * (merged latent [b, h] . W_UV[h, v]); WO_T: wo_ptr holds W_o^T."""
    b = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.arange(0, BLOCK_C)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    v_ok = offs_v < V_DIM
    w = tl.load(w_ptr + head * stride_wh + offs_v[:, None] * stride_wv + offs_c[None, :],
                mask=v_ok[:, None] & (offs_c[None, :] < LATENT), other=0.0)
    if WO_T:
        w_o = tl.load(wo_ptr + (head * V_DIM + offs_v)[None, :].to(tl.int64) * stride_wo + rows[:, None],
                      mask=(rows[:, None] < HIDDEN) & v_ok[None, :], other=0.0)
    else:
        w_o = tl.load(wo_ptr + rows[:, None].to(tl.int64) * stride_wo + head * V_DIM + offs_v[None, :],
                      mask=(rows[:, None] < HIDDEN) & v_ok[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + b, cache_modifier=".cg")  # the step's input (pdl.py)
    wait_for_prior_grid(PDL)
    row = b.to(tl.int64)
    v = _merged_values(part_o_ptr, part_lse_ptr, w, seq_len, row, head, num_heads, num_splits, offs_c,
                       w_ptr.dtype.element_ty, LATENT, BLOCK_N, BLOCK_S, BLOCK_C)
    # Rounded as the separate kernels round the values before o_proj.
    v = v.to(w_ptr.dtype.element_ty).to(tl.float32)
    y = tl.sum(w_o.to(tl.float32) * v[None, :], axis=1)
    tl.atomic_add(out_ptr + row * HIDDEN + rows, y, mask=rows < HIDDEN, sem="relaxed")


def reduce_splits(
    part_o: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, qstart: torch.Tensor, out: torch.Tensor,
    max_query_len: int, batch: int, num_splits: int, block_n: int, decode: bool,
) -> None:
    """Merge the splits into `out`: a program per (row, head), whole rows unless that leaves the GPU idle."""
    _, heads, rank = out.shape
    full = triton.next_power_of_2(rank)
    # Few rows (batch 1-8 decode): narrower column blocks give more programs in flight. The
    # variant depends on the batch alone, so the decode graphs compile every one an eager decode
    # can pick; extends keep the narrow one (warmed up at start-up). BLOCK_S is fixed for the
    # same reason: a block sized to the split count would vary with context length.
    wide = decode and max_query_len * heads * batch >= REDUCE_MIN_PROGRAMS
    block_c = full if wide else min(full, REDUCE_BLOCK_C)
    _mla_reduce_kernel[(max_query_len * heads, batch, triton.cdiv(rank, block_c))](
        part_o, part_lse, seq_lens, qstart, out, out.stride(0), out.stride(1), heads,
        num_splits, LATENT=rank, BLOCK_N=block_n, DECODE=decode, BLOCK_S=REDUCE_BLOCK_S, BLOCK_C=block_c,
        **pdl_launch(out),
    )


def reduce_and_project(
    part_o: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, project: Projection, num_splits: int,
    block_n: int,
) -> torch.Tensor:
    """Decode: merge the splits and apply W_UV [H, v, rank] per head (and o_proj, given) in one
    launch -> project.out.

    Without o_proj the kernel after this one may launch before the merge has waited on the split
    kernel (PROJECT_EARLY_LAUNCH): it must read nothing but weights before its own wait (o_proj's GEMV).
    """
    w_uv, out = project.w_uv, project.out
    if w_uv.stride(-1) != 1:
        w_uv = w_uv.contiguous()
    if project.w_o is not None:
        return _reduce_project_output(part_o, part_lse, seq_lens, w_uv, project.w_o, project.w_o_t, out, num_splits,
                                      block_n)
    batch, heads, v_dim = out.shape
    rank = part_o.shape[-1]
    _reduce_project_kernel[(batch * heads, triton.cdiv(v_dim, PROJECT_BLOCK_V))](
        part_o, part_lse, seq_lens, w_uv, out, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        heads, num_splits, V_DIM=v_dim, LATENT=rank, BLOCK_N=block_n, BLOCK_S=REDUCE_BLOCK_S,
        BLOCK_C=triton.next_power_of_2(rank), BLOCK_V=PROJECT_BLOCK_V, EARLY_LAUNCH=PROJECT_EARLY_LAUNCH,
        num_warps=PROJECT_WARPS, **pdl_launch(out),
    )
    return out


def fuses_output(batch: int, heads: int, v_dim: int, hidden: int, device: torch.device) -> bool:
    """Whether the merge applies o_proj too (see PROJECT_OUTPUT): batch 1, and few enough programs
    that each finds an SM of its own to load its o_proj columns on."""
    programs = batch * heads * triton.cdiv(v_dim, PROJECT_BLOCK_V) * triton.cdiv(hidden, OUTPUT_BLOCK_R)
    on_gpu_fits = device.type != "cuda" or programs <= sm_count(device) // 2
    return PROJECT_OUTPUT and batch <= OUTPUT_MAX_ROWS and on_gpu_fits


def transposed_o_proj(w_uv: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor | None:
    """o_proj's weight transposed ([H * v, hidden], contiguous), which batch 1's fused merge reads
    faster than the weight itself (see OUTPUT_BLOCK_R), where batch 1 fuses it; else None."""
    heads, v_dim = w_uv.shape[0], w_uv.shape[1]
    if not (TRANSPOSED_O_PROJ and w_o.is_cuda and fuses_output(1, heads, v_dim, w_o.shape[0], w_o.device)):
        return None
    return w_o.t().contiguous()


def _reduce_project_output(
    part_o: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, w_uv: torch.Tensor, w_o: torch.Tensor,
    w_o_t: torch.Tensor | None, out: torch.Tensor, num_splits: int, block_n: int,
) -> torch.Tensor:
    """Merge, W_UV and o_proj in one launch, added into the zeroed float32 out [B, 1, hidden]."""
    batch, heads, rank = part_o.shape[0], part_o.shape[1], part_o.shape[-1]
    v_dim, hidden = w_uv.shape[1], w_o.shape[0]
    if not TRANSPOSED_O_PROJ:
        w_o_t = None
    if w_o_t is not None:
        w_o = w_o_t
    elif w_o.stride(-1) != 1:
        w_o = w_o.contiguous()
    grid = (batch * heads, triton.cdiv(v_dim, PROJECT_BLOCK_V), triton.cdiv(hidden, OUTPUT_BLOCK_R))
    _reduce_project_output_kernel[grid](
        part_o, part_lse, seq_lens, w_uv, w_o, out, w_uv.stride(0), w_uv.stride(1), w_o.stride(0), heads,
        num_splits, HIDDEN=hidden, V_DIM=v_dim, LATENT=rank, BLOCK_N=block_n, BLOCK_S=REDUCE_BLOCK_S,
        BLOCK_C=triton.next_power_of_2(rank), BLOCK_V=PROJECT_BLOCK_V, BLOCK_R=min(OUTPUT_BLOCK_R, triton.next_power_of_2(hidden)),
        WO_T=w_o_t is not None, num_warps=OUTPUT_WARPS, **pdl_launch(out),
    )
    return out
