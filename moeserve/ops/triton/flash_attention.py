"""Triton causal flash attention over packed variable-length sequences (the MHA prefill form).

One program owns BLOCK_M queries of one head of one sequence and streams that sequence's keys
in BLOCK_N tiles with an online softmax. Queries are a sequence's last positions, so the causal
mask is aligned bottom-right: tiles wholly below the block's first query skip masking, and only
the diagonal tiles and the ragged end pay for it. Head dims need not be powers of two: the query
dim is cut into two power-of-two parts (192 = 128 + 64 for DeepSeek, so nothing is wasted) and
any remainder is masked, as is a padded value dim.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

LOG2E = 1.4426950408889634
# On Hopper, DeepSeek's head dims (query 192 as key 128 + rotary 64, value 128) take the Gluon
# kernel of flash_attention_hopper.py, which overlaps each softmax with the next tile's scores
# (H200: 1K-token prompts 11% faster, 8K 17%). MOESERVE_HOPPER_ATTENTION=0 keeps this kernel (A/B).
HOPPER = os.environ.get("MOESERVE_HOPPER_ATTENTION", "1") != "0"

_COMPUTE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _scores(
    q1, q2, k_rows, k2_rows, offs_d1, offs_d2, n_ok,
    DQ: tl.constexpr, SPLIT_D: tl.constexpr, MASKED: tl.constexpr, COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """q . k for one key tile, the two head-dim parts accumulated into one fp32 tile."""
    k_mask = offs_d1[None, :] < DQ
    if MASKED:
        k_mask = k_mask & n_ok[:, None]
    k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=k_mask, other=0.0).to(COMPUTE)
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
    if SPLIT_D:
        k_mask = offs_d2[None, :] < DQ
        if MASKED:
            k_mask = k_mask & n_ok[:, None]
        k2 = tl.load(k2_rows[:, None] + offs_d2[None, :], mask=k_mask, other=0.0).to(COMPUTE)
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=PRECISION)
    return s


@triton.jit
def _attend(
    acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, lo, hi, q_pos, offs_d1, offs_d2, offs_v,
    stride_kt, stride_k2t, stride_vt, qk_scale,
    DQ: tl.constexpr, DV: tl.constexpr, SPLIT_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online softmax over keys lo .. hi; MASKED applies the causal mask and the end (hi)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k_rows = k_base + offs_n.to(tl.int64) * stride_kt
        k2_rows = k2_base + offs_n.to(tl.int64) * stride_k2t
        s = _scores(q1, q2, k_rows, k2_rows, offs_d1, offs_d2, n_ok, DQ, SPLIT_D, MASKED, COMPUTE, PRECISION)
        if MASKED:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        # The running max is kept scaled and the scores are not: the scale then costs one
        # multiply-add a score inside exp2's argument (prompt attention 1.5-2% faster on H200).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # Rows past the sequence's end may see no key; exp2(-inf - 0) keeps them at zero weight.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s * qk_scale - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = offs_v[None, :] < DV
        if MASKED:
            v_mask = v_mask & n_ok[:, None]
        v_rows = v_base + offs_n.to(tl.int64) * stride_vt
        v = tl.load(v_rows[:, None] + offs_v[None, :], mask=v_mask, other=0.0).to(COMPUTE)
        acc = tl.dot(p.to(COMPUTE), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_m_blocks"])  # varies by batch: no mid-serving recompiles
def _varlen_kernel(
    q_ptr, k_ptr, k2_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_k2t, stride_k2h, stride_vt, stride_vh, stride_ot, stride_oh,
    num_m_blocks, qk_scale, K2_SHIFT: tl.constexpr,
    DQ: tl.constexpr, DV: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    SPLIT_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_grid(PDL)
    # The last query blocks see the most keys; starting them first evens out the causal tail.
    m_block = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + b)
    kv_len = tl.load(cu_k_ptr + b + 1) - k_start
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_pos = offs_m + kv_len - q_len
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    offs_v = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q1 = tl.load(q_rows[:, None] + offs_d1[None, :], mask=m_ok[:, None] & (offs_d1[None, :] < DQ), other=0.0)
    q1 = q1.to(COMPUTE)
    q2 = q1
    if SPLIT_D:
        q2 = tl.load(q_rows[:, None] + offs_d2[None, :], mask=m_ok[:, None] & (offs_d2[None, :] < DQ), other=0.0)
        q2 = q2.to(COMPUTE)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + head * stride_kh
    # The second head-dim part may live in its own tensor (MLA's rotary key, shared by all heads):
    # shifting its base lets both parts use the same column offsets.
    k2_base = k2_ptr + k_start.to(tl.int64) * stride_k2t + head * stride_k2h - K2_SHIFT
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + head * stride_vh
    # Keys up to the block's first query position are visible to all its rows: whole tiles of
    # them run unmasked; the rest, up to the last row's position, run masked.
    hi = tl.minimum(kv_len, tl.maximum((m_block + 1) * BLOCK_M + kv_len - q_len, 0))
    mid = tl.minimum(tl.maximum(m_block * BLOCK_M + kv_len - q_len + 1, 0) // BLOCK_N * BLOCK_N, hi)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, 0, mid, q_pos, offs_d1, offs_d2, offs_v,
        stride_kt, stride_k2t, stride_vt, qk_scale, DQ, DV, SPLIT_D, BLOCK_N, False, COMPUTE, PRECISION,
    )
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, mid, hi, q_pos, offs_d1, offs_d2, offs_v,
        stride_kt, stride_k2t, stride_vt, qk_scale, DQ, DV, SPLIT_D, BLOCK_N, True, COMPUTE, PRECISION,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = out_ptr + (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    mask = m_ok[:, None] & (offs_v[None, :] < DV)
    tl.store(out_rows[:, None] + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def head_dim_parts(dim: int) -> tuple[int, int]:
    """Two power-of-two blocks (the second 0 when unneeded) covering `dim`, each at least 16."""
    first = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - first
    return first, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def _tiles(dq: int, dv: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), checked for sm_90 with ptxas."""
    if device.type != "cuda":
        return 16, 16, 1, 1
    if dtype == torch.float32:  # tests only: fp32 tiles are twice the size
        return 32, 32, 8, 2
    if dq + dv <= 320:  # Dq = 192, Dv = 128: wgmma, no spills, 172 KB of shared memory
        return 128, 64, 8, 3
    return 64, 64, 8, 2  # up to 256 + 256


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rope: torch.Tensor | None, cu_q: torch.Tensor,
           cu_k: torch.Tensor) -> None:
    """Clear errors for shapes the kernel cannot take."""
    key_dim = q.shape[-1] - (0 if k_rope is None else k_rope.shape[-1])
    if q.dim() != 3 or k.shape[1:] != (q.shape[1], key_dim) or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
            f"[T, H, Dq], [S, H, {key_dim}], [S, H, Dv]"
        )
    if k_rope is not None and (k_rope.dim() != 2 or k_rope.shape[0] != k.shape[0]):
        raise ValueError(f"varlen_attention: k_rope {tuple(k_rope.shape)} is not [{k.shape[0]}, R]")
    if cu_q.shape != cu_k.shape:
        raise ValueError("varlen_attention: cu_seqlens_q and cu_seqlens_k must both be [B + 1]")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    k_rope: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal (bottom-right aligned) attention over packed variable-length sequences -> [T, H, Dv].

    `tiles` (BLOCK_M, BLOCK_N, warps, stages) overrides the device's choice (benchmarks sweep it).
    """
    _check(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k)
    if not scale > 0:  # the kernel scales the running max, not the scores: a max only commutes with scale > 0
        raise ValueError(f"varlen_attention: scale must be positive, got {scale}")
    tokens, heads, dq = q.shape
    d1, d2 = head_dim_parts(dq)
    if k_rope is not None and k.shape[-1] != d1:
        # The kernel's first head-dim part must be exactly k's own columns; otherwise join them.
        k, k_rope = torch.cat((k, k_rope[:, None, :].expand(-1, heads, -1)), dim=-1), None
    # Rows may be strided (v is a slice of kv_b_proj's output); only the head dim must be contiguous.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k_rope is not None and k_rope.stride(-1) != 1:
        k_rope = k_rope.contiguous()
    dv = v.shape[-1]
    if out is None:
        out = q.new_empty(tokens, heads, dv)
    elif out.shape != (tokens, heads, dv) or out.stride(-1) != 1:
        raise ValueError(f"varlen_attention: out must be [{tokens}, {heads}, {dv}] with a contiguous head dim")
    batch = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or batch <= 0 or max_query_len <= 0:
        return out
    if HOPPER and tiles is None and q.is_cuda:
        from moeserve.ops.triton import flash_attention_hopper as hopper  # Gluon: imported where it may run

        if hopper.hopper_attention_usable(q, k, v, k_rope):
            return hopper.hopper_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_query_len, scale * LOG2E,
                                                  k_rope, out)
    block_m, block_n, warps, stages = tiles or _tiles(dq, dv, q.dtype, q.device)
    # The interpreter's dot mishandles 16-bit floats, so CPU runs compute in float32.
    compute = _COMPUTE[q.dtype] if q.is_cuda else tl.float32
    num_m_blocks = triton.cdiv(max_query_len, block_m)
    k2, k2_strides, shift = (k, (k.stride(0), k.stride(1)), 0) if k_rope is None else (k_rope, (k_rope.stride(0), 0), d1)
    _varlen_kernel[(num_m_blocks, heads, batch)](
        q, k, k2, v, out, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *k2_strides, v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), num_m_blocks, scale * LOG2E, K2_SHIFT=shift,
        DQ=dq, DV=dv, BLOCK_D1=d1, BLOCK_D2=max(d2, 16), SPLIT_D=d2 > 0,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=block_m, BLOCK_N=block_n,
        COMPUTE=compute, PRECISION="ieee" if compute == tl.float32 else "tf32",
        num_warps=warps, num_stages=stages, **pdl_launch(q),
    )
    return out
