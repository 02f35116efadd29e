"""Prefill attention variants against the shipped varlen kernel, at the MHA prefill's real shapes.

    python benchmarks/kernels/attention_variants.py      # H200; prints a table, $OUT/attention_variants.json

Variants of `flash_attention._varlen_kernel` (same loop, knobs as constexprs): the softmax with
the scale folded into one multiply-add per score (FMA), Triton's automatic warp specialization
of the unmasked key loop (WS), and other tiles. Each is checked against the shipped kernel on
the same inputs, then graph-timed; TFLOP/s count causal FLOPs (QK^T 192 and PV 128 per pair).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_skinny_gemm import graph_us  # noqa: E402

from moeserve.ops.triton.flash_attention import LOG2E, varlen_attention  # noqa: E402

HEADS, DNOPE, DROPE, DV = 16, 128, 64, 128
CASES = {"b256_step_128x1024": [1024] * 128, "16x1024": [1024] * 16, "1x8192": [8192]}


@triton.jit
def _attend(acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, lo, hi, q_pos, offs_d1, offs_d2, offs_v,
            stride_kt, stride_k2t, stride_vt, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            FMA: tl.constexpr, WS: tl.constexpr):
    """The shipped online softmax (head dims exact, so no column masks), with the knobs."""
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k_rows = k_base + offs_n.to(tl.int64) * stride_kt
        k2_rows = k2_base + offs_n.to(tl.int64) * stride_k2t
        if MASKED:
            k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=n_ok[:, None], other=0.0)
            k2 = tl.load(k2_rows[:, None] + offs_d2[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k1 = tl.load(k_rows[:, None] + offs_d1[None, :])
            k2 = tl.load(k2_rows[:, None] + offs_d2[None, :])
        s = tl.dot(q1, tl.trans(k1))
        s = tl.dot(q2, tl.trans(k2), acc=s)
        if MASKED:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        if FMA:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s * qk_scale - m_base[:, None])
        else:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_base[:, None])
        alpha = tl.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_base + offs_n.to(tl.int64) * stride_vt
        if MASKED:
            v = tl.load(v_rows[:, None] + offs_v[None, :], mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_rows[:, None] + offs_v[None, :])
        acc = tl.dot(p.to(tl.bfloat16), v, acc=acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _variant_kernel(q_ptr, k_ptr, k2_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_k2t, stride_vt, stride_vh,
                    stride_ot, stride_oh, num_m_blocks, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr, WS: tl.constexpr):
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
    offs_d1 = tl.arange(0, 128)
    offs_d2 = tl.arange(0, 64)
    offs_v = tl.arange(0, 128)
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q1 = tl.load(q_rows[:, None] + offs_d1[None, :], mask=m_ok[:, None], other=0.0)
    q2 = tl.load(q_rows[:, None] + 128 + offs_d2[None, :], mask=m_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + head * stride_kh
    k2_base = k2_ptr + k_start.to(tl.int64) * stride_k2t
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + head * stride_vh
    hi = tl.minimum(kv_len, tl.maximum((m_block + 1) * BLOCK_M + kv_len - q_len, 0))
    mid = tl.minimum(tl.maximum(m_block * BLOCK_M + kv_len - q_len + 1, 0) // BLOCK_N * BLOCK_N, hi)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, 0, mid, q_pos, offs_d1, offs_d2,
                            offs_v, stride_kt, stride_k2t, stride_vt, qk_scale, BLOCK_N, False, FMA, WS)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q1, q2, k_base, k2_base, v_base, mid, hi, q_pos, offs_d1, offs_d2,
                            offs_v, stride_kt, stride_k2t, stride_vt, qk_scale, BLOCK_N, True, FMA, False)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = out_ptr + (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_rows[:, None] + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def variant(q, k, k_rope, v, cu, max_len, scale, out, bm, bn, warps, stages, fma, ws):
    """Launch one variant on the inputs the shipped kernel gets."""
    num_m = triton.cdiv(max_len, bm)
    _variant_kernel[(num_m, HEADS, cu.numel() - 1)](
        q, k, k_rope, v, out, cu, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k_rope.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), num_m, scale * LOG2E,
        BLOCK_M=bm, BLOCK_N=bn, FMA=fma, WS=ws, num_warps=warps, num_stages=stages)


VARIANTS = {  # name: (BLOCK_M, BLOCK_N, warps, stages, FMA, WS)
    "copy": (128, 64, 8, 3, False, False),
    "fma": (128, 64, 8, 3, True, False),
    "ws": (128, 64, 8, 3, False, True),
    "fma_ws": (128, 64, 8, 3, True, True),
    "fma_ws_s2": (128, 64, 8, 2, True, True),
    "fma_128x128_s2": (128, 128, 8, 2, True, False),
    "fma_64x64_w4_s2": (64, 64, 4, 2, True, False),
    "fma_64x128_w4_s2": (64, 128, 4, 2, True, False),
}


def inputs(lens: list[int], gen: torch.Generator):
    """q, k (a strided slice of a kv_b_proj-like output), the shared rotary key, v, as the model has them."""
    tokens = sum(lens)
    q = torch.randn(tokens, HEADS, DNOPE + DROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(tokens, HEADS, DNOPE + DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_rope = torch.randn(tokens, DROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    return q, kv[..., :DNOPE], k_rope, kv[..., DNOPE:], cu


def causal_flops(lens: list[int]) -> float:
    return sum(HEADS * n * (n + 1) / 2 * 2 * (DNOPE + DROPE + DV) for n in lens)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = (DNOPE + DROPE) ** -0.5
    rows = []
    for case, lens in CASES.items():
        q, k, k_rope, v, cu = inputs(lens, gen)
        n = max(lens)
        want = varlen_attention(q, k, v, cu, cu, n, n, scale, k_rope=k_rope)
        flops = causal_flops(lens)
        shipped = graph_us([functools.partial(varlen_attention, q, k, v, cu, cu, n, n, scale, k_rope=k_rope)])
        rows.append({"case": case, "variant": "shipped", "us": round(shipped, 1),
                     "tflops": round(flops / shipped / 1e6, 1), "max_err": 0.0})
        for name, cfg in VARIANTS.items():
            out = torch.empty_like(want)
            try:
                variant(q, k, k_rope, v, cu, n, scale, out, *cfg)
                err = (out.float() - want.float()).abs().max().item()
                us = graph_us([functools.partial(variant, q, k, k_rope, v, cu, n, scale, out, *cfg)])
            except Exception as exc:  # a tile that does not fit is a result too
                rows.append({"case": case, "variant": name, "error": str(exc).splitlines()[0][:160]})
                continue
            rows.append({"case": case, "variant": name, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                         "max_err": err})
    for r in rows:
        print(r)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
