"""Prompt attention on Hopper (Gluon): the MHA prefill form, the softmax hidden under the next key
tile's scores, the loads in a warp of their own.

The Triton kernel (flash_attention.py) computes a key tile's scores, waits for them, runs the
softmax, then multiplies by the values, so the tensor cores idle during every softmax; Triton
waits on a wgmma as soon as its result is used or carried, and cannot be told otherwise. Here the
compute warps issue the next tile's scores as asynchronous wgmmas before this tile's softmax
(FlashAttention-3's intra-warpgroup overlap) and wait only for what the softmax needs; the loop is
unrolled by two, so in-flight scores never change registers across its back edge (ptxas would
serialize every wgmma). One more warp issues the TMA copies: Gluon puts a block-wide barrier
before each copy, which in the compute warps' loop cost as much as the overlap gained.

Operands arrive in 64-column boxes (128 bytes, the swizzle's width): the query's head dim in QC
boxes (the key's own columns, then the rotary key's, shared by all heads), the values in VC = 2
boxes, each with its own accumulator. A program owns BLOCK_M queries of one head of one sequence
on two warpgroups; keys stream through STAGES slots of shared memory.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeserve.ops.triton.device import tma_readable
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

BOX = 64  # columns of a TMA box: 128 bytes of bf16
_BOX = gl.constexpr(BOX)
BLOCK_M = 128
BLOCK_N = 64
STAGES = 4
WARPS = 8


@gluon.jit
def _load_keys(k_desc, r_desc, v_desc, k_smem, v_smem, ready, t, row0, k_col, v_col,
               KC: gl.constexpr, RC: gl.constexpr, VC: gl.constexpr, STAGES: gl.constexpr):
    """Issue key tile t's copies (its key, rotary key and value boxes) into slot t % STAGES."""
    QC: gl.constexpr = KC + RC
    BN: gl.constexpr = k_desc.block_type.shape[0]
    stage = t % STAGES
    bar = ready.index(stage)
    mbarrier.expect(bar, QC * k_desc.block_type.nbytes + VC * v_desc.block_type.nbytes)
    row = row0 + t * BN
    for c in gl.static_range(KC):
        tma.async_copy_global_to_shared(k_desc, [row, k_col + c * _BOX], bar, k_smem.index(stage * QC + c))
    for c in gl.static_range(RC):
        tma.async_copy_global_to_shared(r_desc, [row, c * _BOX], bar, k_smem.index(stage * QC + KC + c))
    for c in gl.static_range(VC):
        tma.async_copy_global_to_shared(v_desc, [row, v_col + c * _BOX], bar, v_smem.index(stage * VC + c))


@gluon.jit
def _issue_scores(q_smem, k_smem, ready, t, s, QC: gl.constexpr, STAGES: gl.constexpr):
    """Wait for key tile t, then issue its q . k products (asynchronous; QC wgmma groups) into `s`,
    a finished score tile whose registers are free: zeroing new ones while another tile's products
    are in flight would make ptxas serialize every wgmma."""
    stage = t % STAGES
    mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
    for c in gl.static_range(QC):
        s = warpgroup_mma(q_smem.index(c), k_smem.index(stage * QC + c).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    return s


@gluon.jit
def _softmax_step(s, t, m_i, l_i, acc0, acc1, v_smem, q_pos, mid, hi, qk_scale,
                  VC: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Fold tile t's (finished) scores into the running softmax; issue its value products."""
    BN: gl.constexpr = s.type.shape[1]
    start = t * BN
    s = s * qk_scale
    if start + BN > mid:  # the diagonal and the ragged end
        offs_n = start + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        keep = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < hi)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # Rows past the sequence's end may see no key; exp2(-inf - 0) keeps them at zero weight.
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_base)
    p = gl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2))
    stage = t % STAGES
    acc0 = warpgroup_mma(p_op, v_smem.index(stage * VC), acc0 * alpha[:, None], is_async=True)
    acc1 = warpgroup_mma(p_op, v_smem.index(stage * VC + 1), acc1 * alpha[:, None], is_async=True)
    return m_new, l_i, acc0, acc1


@gluon.jit
def _store(out_ptr, acc, l_i, rows, m_ok, col0, stride_ot, layout: gl.constexpr):
    """The normalised output's columns col0 .. col0 + 63 of the block's rows that hold queries."""
    BN: gl.constexpr = acc.type.shape[1]
    out = acc / gl.where(l_i == 0.0, 1.0, l_i)[:, None]
    cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols[None, :] >= 0))


@gluon.jit
def _retire_and_fold(s, t, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid, hi, qk_scale,
                     PENDING: gl.constexpr, VC: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Wait for tile t's scores and the value products before them (PENDING: the next tile's score
    groups, left in flight), hand tile t - 1's slot back to the loader, fold tile t in."""
    s, acc0, acc1 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(s, acc0, acc1))
    if t > 0:
        mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
    m_i, l_i, acc0, acc1 = _softmax_step(s, t, m_i, l_i, acc0, acc1, v_smem, q_pos, mid, hi, qk_scale, VC, STAGES,
                                         layout)
    return s, m_i, l_i, acc0, acc1


@gluon.jit
def _loader(q_desc, k_desc, r_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, q_col, k_start,
            k_col, v_col, n, KC: gl.constexpr, RC: gl.constexpr, VC: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the query's copies, then each key tile's once its slot is free."""
    QC: gl.constexpr = KC + RC
    mbarrier.expect(q_bar, QC * q_desc.block_type.nbytes)
    for c in gl.static_range(QC):
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col + c * _BOX], q_bar, q_smem.index(c))
    for t in range(n):
        if t >= STAGES:
            mbarrier.wait(empty.index(t % STAGES), (t // STAGES - 1) & 1)
        _load_keys(k_desc, r_desc, v_desc, k_smem, v_smem, ready, t, k_start, k_col, v_col, KC, RC, VC, STAGES)


@gluon.jit
def _compute(q_smem, k_smem, v_smem, q_bar, ready, empty, out_ptr, rows, m_ok, q_pos, mid, hi, n, stride_ot,
             qk_scale, QC: gl.constexpr, VC: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
             BN: gl.constexpr, layout: gl.constexpr):
    """The default warps: scores, softmax and value products, the next tile's scores in flight."""
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    acc0 = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, layout))
    acc1 = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, layout))
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_l)
    l_i = gl.zeros([BM], gl.float32, rows_l)
    mbarrier.wait(q_bar, 0)
    spare = gl.zeros([BM, BN], gl.float32, layout)
    sa = _issue_scores(q_smem, k_smem, ready, 0, gl.zeros([BM, BN], gl.float32, layout), QC, STAGES)
    sa = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(sa,)))
    for t in range(0, n - 2, 2):
        sb = _issue_scores(q_smem, k_smem, ready, t + 1, spare, QC, STAGES)
        s, m_i, l_i, acc0, acc1 = _retire_and_fold(sa, t, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid, hi,
                                                   qk_scale, QC, VC, STAGES, layout)
        sa = _issue_scores(q_smem, k_smem, ready, t + 2, s, QC, STAGES)
        spare, m_i, l_i, acc0, acc1 = _retire_and_fold(sb, t + 1, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid,
                                                       hi, qk_scale, QC, VC, STAGES, layout)
    last = (n - 1) // 2 * 2
    if last + 1 < n:
        sb = _issue_scores(q_smem, k_smem, ready, last + 1, spare, QC, STAGES)
        s, m_i, l_i, acc0, acc1 = _retire_and_fold(sa, last, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid, hi,
                                                   qk_scale, QC, VC, STAGES, layout)
        s, m_i, l_i, acc0, acc1 = _retire_and_fold(sb, last + 1, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid,
                                                   hi, qk_scale, 0, VC, STAGES, layout)
    else:
        s, m_i, l_i, acc0, acc1 = _retire_and_fold(sa, last, m_i, l_i, acc0, acc1, v_smem, empty, q_pos, mid, hi,
                                                   qk_scale, 0, VC, STAGES, layout)
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    _store(out_ptr, acc0, l_i, rows, m_ok, 0, stride_ot, layout)
    _store(out_ptr, acc1, l_i, rows, m_ok, BN, stride_ot, layout)


@gluon.jit
def _hopper_varlen_kernel(
    q_desc, k_desc, r_desc, v_desc, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_ot, stride_oh, q_head, k_head, v_head, num_m_blocks, qk_scale,
    KC: gl.constexpr, RC: gl.constexpr, VC: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
):
    """One program: BLOCK_M queries of one head of one sequence (the last blocks, which see the most
    keys, first), split into the compute warps and the loading warp."""
    QC: gl.constexpr = KC + RC
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    WARPS: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BN, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    wait_for_prior_grid(PDL)
    m_block = num_m_blocks - 1 - gl.program_id(0)
    head = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + b)
    q_len = gl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BM < q_len:
        k_start = gl.load(cu_k_ptr + b)
        kv_len = gl.load(cu_k_ptr + b + 1) - k_start
        hi = gl.minimum(kv_len, gl.maximum((m_block + 1) * BM + kv_len - q_len, 0))
        mid = gl.minimum(gl.maximum(m_block * BM + kv_len - q_len + 1, 0) // BN * BN, hi)
        n = gl.maximum((hi + BN - 1) // BN, 1)
        offs_m = m_block * BM + gl.arange(0, BM, layout=rows_l)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [QC, BM, _BOX], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QC, BN, _BOX], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES * VC, BN, _BOX], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        rows = (q_start + offs_m).to(gl.int64)
        gl.warp_specialize(
            [(_compute, (q_smem, k_smem, v_smem, q_bar, ready, empty, out_ptr + head * stride_oh, rows,
                         offs_m < q_len, offs_m + kv_len - q_len, mid, hi, n, stride_ot, qk_scale, QC, VC, STAGES, BM,
                         BN, layout)),
             (_loader, (q_desc, k_desc, r_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                        q_start + m_block * BM, head * q_head, k_start, head * k_head, head * v_head, n, KC, RC, VC,
                        STAGES))],
            [1], [40])


def hopper_attention_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rope: torch.Tensor | None) -> bool:
    """Whether the Hopper kernel takes these operands: sm_90, 16-bit, head dims in 64-column boxes
    with two value boxes (DeepSeek's MLA: query 192 = key 128 + rotary 64, value 128), within shared
    memory, TMA-readable."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    rope = 0 if k_rope is None else k_rope.shape[-1]
    if k.shape[-1] % BOX or rope % BOX or v.shape[-1] != 2 * BOX or q.shape[-1] != k.shape[-1] + rope:
        return False
    if shared_bytes(q.shape[-1] // BOX, 2) > SHARED_LIMIT:
        return False
    if k_rope is not None and k_rope.dtype != q.dtype:
        return False
    return all(tma_readable(t) for t in (q, k, v) + ((k_rope,) if k_rope is not None else ()))


SHARED_LIMIT = 227 * 1024  # an sm_90 block's shared memory


def shared_bytes(query_boxes: int, value_boxes: int) -> int:
    """Shared memory a program takes: the query's boxes, and STAGES slots of key and value boxes
    (DeepSeek's 3 + 2: 208 KB; a 256-wide query would not fit)."""
    return 2 * BOX * (query_boxes * BLOCK_M + STAGES * (query_boxes + value_boxes) * BLOCK_N) + 8 * (2 * STAGES + 1)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """TMA over `t`'s rows as [T, columns], boxes of [rows, 64]."""
    gl_dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    width = t.stride(1) * (t.shape[1] - 1) + t.shape[2] if t.dim() == 3 else t.shape[1]
    layout = gl.NVMMASharedLayout.get_default_for([rows, BOX], gl_dtype)
    return TensorDescriptor(t, [t.shape[0], width], [t.stride(0), 1], [rows, BOX], layout)


def hopper_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, max_query_len: int, scale_log2: float,
                            k_rope: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """`flash_attention.varlen_attention` on Hopper; the caller has checked `hopper_attention_usable`
    and that `scale_log2` (scale * log2 e) is positive."""
    heads = q.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    num_m_blocks = -(-max_query_len // BLOCK_M)
    rope = k_rope if k_rope is not None else k[:, 0, :BOX]  # unread when RC == 0; any valid descriptor
    _hopper_varlen_kernel[(num_m_blocks, heads, batch)](
        _descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(rope, BLOCK_N), _descriptor(v, BLOCK_N),
        out, cu_seqlens_q, cu_seqlens_k, out.stride(0), out.stride(1), q.stride(1), k.stride(1), v.stride(1),
        num_m_blocks, scale_log2,
        KC=k.shape[-1] // BOX, RC=0 if k_rope is None else k_rope.shape[-1] // BOX, VC=v.shape[-1] // BOX,
        STAGES=STAGES, num_warps=WARPS, **pdl_launch(q),
    )
    return out
