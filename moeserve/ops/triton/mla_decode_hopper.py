"""Batch 1's MLA decode split on Hopper (Gluon): keys on the MMA's M side, operands by TMA.

At one token a split program attends 16 heads to one 64-key tile, so its time is latency, and in
the Triton kernel (mla_decode.py) most of it goes to staging: the tile and the query go through
registers into shared memory in the MMA operand layouts (about 140 KB of shared stores and
reloads a tile for 1.2 MFLOP), and scores are a chain of 36 dependent mma.sync steps per warp.
Here the tile's pages and the query arrive by TMA straight into swizzled shared memory, and one
warpgroup runs the products as wgmma with the keys as M (64) and the heads as N (16), so nothing
is padded: scores S^T = K Q^T over 9 column boxes (512 latent + 64 rotary), and the output
O^T = V^T P^T for 8 latent boxes, V read from the same tile (the latent columns), P^T through a
2 KB buffer. Splits of several tiles keep two tiles in flight.

The first tile's pages are copied before the PDL wait, all but the page holding the newest key,
which this step's cache store may just have written (as the Triton kernel's early tile does).
A fifth warp issues every copy (gl.warp_specialize): from the warpgroup, each copy sat behind a
block-wide barrier that Gluon inserts, and the 18 after the wait (that page, the query) were on
the products' path (H200 b1 decode-graph replay 1.724 -> 1.706 ms, -1.0%).
Rows past the split's end are masked in the scores and zeroed in the tile before the value
product, since a cache page's unused rows may hold anything. Writes the same partials (normalised
output, base-2 log-sum-exp) as the Triton kernel, so the merge kernels are shared.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeserve.ops.triton.device import tma_readable
from moeserve.ops.triton.mla_reduce import split_len
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

# MOESERVE_HOPPER_SPLIT=0 keeps the Triton split kernel everywhere (A/B timing).
ENABLED = os.environ.get("MOESERVE_HOPPER_SPLIT", "1") != "0"
BOX = 64  # columns of a TMA box: 128 bytes of bf16
BLOCK_N = 64  # keys a tile: the wgmma's M
WARPS = 4  # one warpgroup
_BOX, _BLOCK_N = gl.constexpr(BOX), gl.constexpr(BLOCK_N)


@gluon.jit
def _split_range(seq_lens_ptr, b, split, num_splits):
    """(first key, end key, sequence length) of this split: an even share of whole tiles."""
    seq_len = gl.load(seq_lens_ptr + b, cache_modifier=".cg")  # a step input: readable before the wait
    chunk = split_len(seq_len, num_splits, _BLOCK_N)  # as the merge deals them
    lo = split * chunk
    return lo, gl.minimum(lo + chunk, seq_len), seq_len


@gluon.jit
def _copy_page(kv_desc, kv_smem, bar, table_row, start, p, hi, stage, BOXES: gl.constexpr, PAGE: gl.constexpr):
    """Page p of the tile at key `start` (the scratch page 0 past `hi`) into the stage's boxes."""
    first = start + p * PAGE
    page = gl.load(table_row + first // PAGE, mask=first < hi, other=0, cache_modifier=".cg")
    for c in gl.static_range(BOXES):
        tma.async_copy_global_to_shared(kv_desc, [page * PAGE, c * _BOX], bar,
                                        kv_smem.index(stage * BOXES + c).slice(p * PAGE, PAGE))


@gluon.jit
def _copy_tile(kv_desc, kv_smem, bar, table_row, start, hi, stage, skip, BOXES: gl.constexpr, PAGE: gl.constexpr):
    """The tile at key `start` into `stage` (its full bytes expected on `bar`), but page `skip`."""
    mbarrier.expect(bar, BOXES * kv_desc.block_type.nbytes * (_BLOCK_N // PAGE))
    for p in gl.static_range(_BLOCK_N // PAGE):
        if p != skip:
            _copy_page(kv_desc, kv_smem, bar, table_row, start, p, hi, stage, BOXES, PAGE)


@gluon.jit
def _zero_rows_past(kv_smem, stage, valid, BOXES: gl.constexpr, LATENT_BOXES: gl.constexpr):
    """Zero the value rows (latent boxes) at and past `valid` in a landed tile: the value product
    would turn garbage (NaN, Inf) times a zero weight into NaN."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, layout))[:, None]
    for c in gl.static_range(LATENT_BOXES):
        box = kv_smem.index(stage * BOXES + c)
        x = box.load(layout)
        box.store(gl.where(rows < valid, x, gl.zeros_like(x)))
    gl.thread_barrier()
    fence_async_shared()


@gluon.jit
def _attend(kv_smem, q_smem, p_smem, stage, acc, m_i, l_i, start, hi, qk_scale, BOXES: gl.constexpr,
            LATENT_BOXES: gl.constexpr, HEADS: gl.constexpr, s_layout: gl.constexpr):
    """One tile into the running softmax (per head: the columns) and the output boxes `acc`."""
    s = gl.zeros([_BLOCK_N, HEADS], gl.float32, s_layout)
    for c in gl.static_range(BOXES):
        s = warpgroup_mma(kv_smem.index(stage * BOXES + c), q_smem.index(c).permute((1, 0)), s, use_acc=c > 0,
                          is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    keys = start + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    s = gl.where((keys < hi)[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)  # every tile holds a visible key: m_new is finite
    p = gl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    p_smem.store(p.to(p_smem.dtype))
    gl.thread_barrier()
    fence_async_shared()
    out = ()
    for c in gl.static_range(LATENT_BOXES):
        out = out + (warpgroup_mma(kv_smem.index(stage * BOXES + c).permute((1, 0)), p_smem, acc[c] * alpha[None, :],
                                   is_async=True),)
    out = warpgroup_mma_wait(num_outstanding=0, deps=out)
    return out, m_new, l_i


@gluon.jit
def _store_partials(acc, m_i, l_i, part_o_ptr, part_lse_ptr, b, split, num_splits, out_scale,
                    LATENT_BOXES: gl.constexpr, s_layout: gl.constexpr):
    """The split's normalised output [heads, latent] and log-sum-exp (base 2), as mla_decode stores them."""
    heads: gl.constexpr = acc[0].type.shape[1]
    h = gl.arange(0, heads, layout=gl.SliceLayout(0, s_layout))
    d = gl.arange(0, _BOX, layout=gl.SliceLayout(1, s_layout))
    part = (b * heads + h) * num_splits + split
    scale = out_scale / l_i
    for c in gl.static_range(LATENT_BOXES):
        ptrs = part_o_ptr + part[None, :].to(gl.int64) * (LATENT_BOXES * _BOX) + c * _BOX + d[:, None]
        gl.store(ptrs, acc[c] * scale[None, :])
    gl.store(part_lse_ptr + part, m_i + gl.log2(l_i))


@gluon.jit
def _buffers(q_desc, kv_desc, HEADS: gl.constexpr, BOXES: gl.constexpr):
    """Shared memory: two stages of a KV tile's boxes, the query's boxes, P^T, and the barriers
    (a stage landed, a stage read, the query landed)."""
    kv_smem = gl.allocate_shared_memory(kv_desc.dtype, [2 * BOXES, _BLOCK_N, _BOX], kv_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BOXES, HEADS, _BOX], q_desc.layout)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [_BLOCK_N, HEADS],
                                       gl.NVMMASharedLayout.get_default_for([_BLOCK_N, HEADS], q_desc.dtype))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()
    return kv_smem, q_smem, p_smem, ready, empty, q_bar


@gluon.jit
def _clear_row(clear_ptr, b, split, CLEAR_WIDTH: gl.constexpr, CLEAR_BLOCK: gl.constexpr):
    """Split 0 zeroes sequence b's float32 o_proj row, which the merge adds into (after the wait)."""
    if CLEAR_WIDTH:  # noqa: SIM102 (a constexpr, then a tensor: Gluon takes no `and` across them)
        if split == 0:
            offs = gl.arange(0, CLEAR_BLOCK, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
            gl.store(clear_ptr + b * CLEAR_WIDTH + offs, gl.zeros_like(offs).to(gl.float32), mask=offs < CLEAR_WIDTH)


@gluon.jit
def _load_warp(q_desc, r_desc, kv_desc, kv_smem, q_smem, ready, empty, q_bar, table_row, lo, hi, skip, b,
               LATENT_BOXES: gl.constexpr, PAGE: gl.constexpr, PDL: gl.constexpr):
    """The loading warp: the first tile but the newest key's page, the PDL wait, that page and the
    query, then each later tile once the products of the tile two back have released its stage."""
    BOXES: gl.constexpr = LATENT_BOXES + 1
    HEADS: gl.constexpr = q_desc.block_type.shape[0]
    _copy_tile(kv_desc, kv_smem, ready.index(0), table_row, lo, hi, 0, skip, BOXES, PAGE)
    wait_for_prior_grid(PDL, True)  # the compute warps let the next kernel launch
    for p in gl.static_range(_BLOCK_N // PAGE):
        if p == skip:
            _copy_page(kv_desc, kv_smem, ready.index(0), table_row, lo, p, hi, 0, BOXES, PAGE)
    mbarrier.expect(q_bar, BOXES * q_desc.block_type.nbytes)
    for c in gl.static_range(LATENT_BOXES):
        tma.async_copy_global_to_shared(q_desc, [b * HEADS, c * _BOX], q_bar, q_smem.index(c))
    tma.async_copy_global_to_shared(r_desc, [b * HEADS, 0], q_bar, q_smem.index(LATENT_BOXES))
    n = (hi - lo + _BLOCK_N - 1) // _BLOCK_N
    for t in range(1, n):
        stage = t % 2
        if t >= 2:
            mbarrier.wait(empty.index(stage), (t // 2 - 1) & 1)
        _copy_tile(kv_desc, kv_smem, ready.index(stage), table_row, lo + t * _BLOCK_N, hi, stage, -1, BOXES, PAGE)


@gluon.jit
def _compute_warps(kv_smem, q_smem, p_smem, ready, empty, q_bar, clear_ptr, part_o_ptr, part_lse_ptr, b, split,
                   num_splits, lo, hi, qk_scale, out_scale, LATENT_BOXES: gl.constexpr, HEADS: gl.constexpr,
                   CLEAR_WIDTH: gl.constexpr, CLEAR_BLOCK: gl.constexpr, PDL: gl.constexpr):
    """The warpgroup beside the loading warp: each tile's products into the running softmax, its
    stage handed back through `empty`; then the partials."""
    BOXES: gl.constexpr = LATENT_BOXES + 1
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, HEADS, 16])
    wait_for_prior_grid(PDL)
    _clear_row(clear_ptr, b, split, CLEAR_WIDTH, CLEAR_BLOCK)
    acc = ()
    for _ in gl.static_range(LATENT_BOXES):
        acc = acc + (gl.zeros([_BOX, HEADS], gl.float32, s_layout),)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, s_layout))
    n = (hi - lo + _BLOCK_N - 1) // _BLOCK_N
    mbarrier.wait(q_bar, 0)
    for t in range(n):
        stage = t % 2
        start = lo + t * _BLOCK_N
        mbarrier.wait(ready.index(stage), (t // 2) & 1)
        if start + _BLOCK_N > hi:
            _zero_rows_past(kv_smem, stage, hi - start, BOXES, LATENT_BOXES)
        acc, m_i, l_i = _attend(kv_smem, q_smem, p_smem, stage, acc, m_i, l_i, start, hi, qk_scale, BOXES,
                                LATENT_BOXES, HEADS, s_layout)
        mbarrier.arrive(empty.index(stage))
    _store_partials(acc, m_i, l_i, part_o_ptr, part_lse_ptr, b, split, num_splits, out_scale, LATENT_BOXES, s_layout)


@gluon.jit
def _split_kernel(q_desc, r_desc, kv_desc, table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, clear_ptr,
                  stride_table, num_splits, qk_scale, out_scale,
                  LATENT_BOXES: gl.constexpr, PAGE: gl.constexpr, CLEAR_WIDTH: gl.constexpr,
                  CLEAR_BLOCK: gl.constexpr, PDL: gl.constexpr):
    """Program (split, sequence): its keys' partial over every head. Empty splits return at once
    (without the PDL wait: they touch no memory, and a finished program counts as launched)."""
    BOXES: gl.constexpr = LATENT_BOXES + 1
    HEADS: gl.constexpr = q_desc.block_type.shape[0]
    split = gl.program_id(0)
    b = gl.program_id(1)
    lo, hi, seq_len = _split_range(seq_lens_ptr, b, split, num_splits)
    if lo < hi:
        kv_smem, q_smem, p_smem, ready, empty, q_bar = _buffers(q_desc, kv_desc, HEADS, BOXES)
        table_row = table_ptr + b.to(gl.int64) * stride_table
        # The newest key's page, if in the first tile, waits for the previous kernel's cache store.
        newest = (seq_len - 1 - lo) // PAGE
        skip = gl.where(newest < _BLOCK_N // PAGE, newest, -1)
        gl.warp_specialize(
            [(_compute_warps, (kv_smem, q_smem, p_smem, ready, empty, q_bar, clear_ptr, part_o_ptr, part_lse_ptr, b,
                               split, num_splits, lo, hi, qk_scale, out_scale, LATENT_BOXES, HEADS, CLEAR_WIDTH,
                               CLEAR_BLOCK, PDL)),
             (_load_warp, (q_desc, r_desc, kv_desc, kv_smem, q_smem, ready, empty, q_bar, table_row, lo, hi, skip,
                           b, LATENT_BOXES, PAGE, PDL))],
            [1], [48])
        for i in gl.static_range(2):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(q_bar)


def decode_split_usable(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the Hopper split takes this decode: sm_90, a 16-bit cache of the query's dtype,
    8-32 heads, latent and rotary widths in 64-column boxes, pages of 8-64 rows, operands TMA can read."""
    if not (q_latent.is_cuda and torch.cuda.get_device_capability(q_latent.device)[0] == 9):
        return False
    heads, rank, rope = q_latent.shape[1], q_latent.shape[2], q_rope.shape[-1]
    page = kv_cache.shape[1]
    return (
        q_latent.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q_latent.dtype
        and q_rope.dtype == q_latent.dtype and heads % 8 == 0 and 8 <= heads <= 32
        and rank % BOX == 0 and rope == BOX and kv_cache.shape[2] == rank + rope
        and page in (8, 16, 32, 64) and BLOCK_N % page == 0
        and all(tma_readable(t) for t in (q_latent, q_rope, kv_cache))
        # rows (sequence, head) and (page, slot) evenly strided, as one 2-D TMA view each
        and q_latent.stride(0) == heads * q_latent.stride(1) and q_rope.stride(0) == heads * q_rope.stride(1)
        and kv_cache.stride(0) == page * kv_cache.stride(1)
    )


def _descriptor(t: torch.Tensor, rows: int, width: int, row_stride: int, box_rows: int) -> TensorDescriptor:
    """TMA over `t`'s storage as [rows, width] with the given row stride, boxes of [box_rows, 64]."""
    gl_dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([box_rows, BOX], gl_dtype)
    return TensorDescriptor(t, [rows, width], [row_stride, 1], [box_rows, BOX], layout)


def decode_split(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, qk_scale: float, out_scale: float, num_splits: int, part_o: torch.Tensor,
                 part_lse: torch.Tensor, clear: torch.Tensor | None) -> None:
    """Every split's partial of a decode step (the caller has checked `decode_split_usable`):
    part_o [B, H, splits, rank] float32, part_lse [B, H, splits]; with `clear` ([B, width] float32),
    its rows zeroed after the PDL wait."""
    batch, heads, rank = q_latent.shape
    pages, page, width = kv_cache.shape
    q_rows, r_rows = q_latent.stride(1), q_rope.stride(1)
    clear_width = 0 if clear is None else clear.shape[-1]
    _split_kernel[(num_splits, batch)](
        _descriptor(q_latent, batch * heads, rank, q_rows, heads),
        _descriptor(q_rope, batch * heads, q_rope.shape[-1], r_rows, heads),
        _descriptor(kv_cache, pages * page, width, kv_cache.stride(1), page),
        block_table, seq_lens, part_o, part_lse, clear if clear is not None else part_lse,
        block_table.stride(0), num_splits, qk_scale, out_scale,
        LATENT_BOXES=rank // BOX, PAGE=page, CLEAR_WIDTH=clear_width,
        CLEAR_BLOCK=max(32 * WARPS, 1 << max(clear_width - 1, 0).bit_length()),
        num_warps=WARPS, **pdl_launch(q_latent),
    )


def try_decode_split(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, qk_scale: float, num_splits: int, part_o: torch.Tensor,
                     part_lse: torch.Tensor, clear: torch.Tensor | None) -> int:
    """`decode_split` of a 16-bit cache (out_scale 1) where this kernel takes the call (ENABLED,
    `decode_split_usable`) -> the keys of its tile, by which the merge finds each split's keys; 0
    when it declines."""
    if not (ENABLED and decode_split_usable(q_latent, q_rope, kv_cache)):
        return 0
    decode_split(q_latent, q_rope, kv_cache, block_table, seq_lens, qk_scale, 1.0, num_splits, part_o, part_lse, clear)
    return BLOCK_N
