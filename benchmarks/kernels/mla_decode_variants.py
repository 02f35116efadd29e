"""MLA decode's score as one MMA chain or several, and keys on the MMA's M side (swapAB).

    python benchmarks/kernels/mla_decode_variants.py      # H200: b256 at 1,152 keys

Stand-alone kernels, one program per sequence with all 16 heads and no splits, every KV tile
masked (so a little slower than the shipped kernel, timed beside them):
- v0: the shipped structure: heads on M, the score one dot chained over 512 + 64 columns;
- v1: the latent in two column halves, the score three independent dots summed (shipped since);
- v1q: four quarters;
- v2: swapAB: keys on M (wgmma needs 64), heads on N; s^T = latent @ q^T, o^T += latent^T @ p^T.
On H200 v1 ran 6% faster than v0 and v1q no faster than v1; v2 28% slower (row
`mla_decode_variants` of the results at 4f6bc9d).
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import decode_case, time_us  # noqa: E402

from moeserve.ops.triton.mla_decode import mla_decode  # noqa: E402
from moeserve.ops.triton.mla_tiles import Tiles  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _v0(q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, stride_page, stride_table, qk_scale,
        H: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0)
    seq = tl.load(lens_ptr + b)
    h = tl.arange(0, H)
    c = tl.arange(0, LAT)
    p = tl.arange(0, ROPE)
    q_lat = tl.load(q_lat_ptr + (b * H + h)[:, None] * LAT + c[None, :])
    q_rope = tl.load(q_rope_ptr + (b * H + h)[:, None] * ROPE + p[None, :])
    acc = tl.zeros([H, LAT], tl.float32)
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table = table_ptr + b.to(tl.int64) * stride_table
    pages = tl.load(table + offs // PAGE, mask=offs < seq, other=0)
    for start in range(0, seq, BLOCK_N):
        n = start + offs
        rows = kv_ptr + pages.to(tl.int64) * stride_page + (n % PAGE) * (LAT + ROPE)
        ok = n < seq
        lat = tl.load(rows[:, None] + c[None, :], mask=ok[:, None], other=0.0)
        rope = tl.load(rows[:, None] + LAT + p[None, :], mask=ok[:, None], other=0.0)
        pages = tl.load(table + (n + BLOCK_N) // PAGE, mask=n + BLOCK_N < seq, other=0)
        s = tl.dot(q_lat, tl.trans(lat))
        s = tl.dot(q_rope, tl.trans(rope), acc=s) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = tl.dot(pr.to(tl.bfloat16), lat, acc=acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + (b * H + h)[:, None] * LAT + c[None, :], o.to(tl.bfloat16))


@triton.jit
def _v1(q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, stride_page, stride_table, qk_scale,
        H: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """QK as two independent dots over latent halves plus the rope dot; PV into two half accumulators."""
    HALF: tl.constexpr = LAT // 2
    b = tl.program_id(0)
    seq = tl.load(lens_ptr + b)
    h = tl.arange(0, H)
    c = tl.arange(0, HALF)
    p = tl.arange(0, ROPE)
    qrow = q_lat_ptr + (b * H + h)[:, None] * LAT
    qa = tl.load(qrow + c[None, :])
    qb = tl.load(qrow + HALF + c[None, :])
    q_rope = tl.load(q_rope_ptr + (b * H + h)[:, None] * ROPE + p[None, :])
    acc_a = tl.zeros([H, HALF], tl.float32)
    acc_b = tl.zeros([H, HALF], tl.float32)
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table = table_ptr + b.to(tl.int64) * stride_table
    pages = tl.load(table + offs // PAGE, mask=offs < seq, other=0)
    for start in range(0, seq, BLOCK_N):
        n = start + offs
        rows = kv_ptr + pages.to(tl.int64) * stride_page + (n % PAGE) * (LAT + ROPE)
        ok = n < seq
        la = tl.load(rows[:, None] + c[None, :], mask=ok[:, None], other=0.0)
        lb = tl.load(rows[:, None] + HALF + c[None, :], mask=ok[:, None], other=0.0)
        rope = tl.load(rows[:, None] + LAT + p[None, :], mask=ok[:, None], other=0.0)
        pages = tl.load(table + (n + BLOCK_N) // PAGE, mask=n + BLOCK_N < seq, other=0)
        s = tl.dot(qa, tl.trans(la)) + tl.dot(qb, tl.trans(lb)) + tl.dot(q_rope, tl.trans(rope))
        s = s * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None]).to(tl.bfloat16)
        l_i = l_i * alpha + tl.sum(pr.to(tl.float32), 1)
        acc_a = tl.dot(pr, la, acc=acc_a * alpha[:, None])
        acc_b = tl.dot(pr, lb, acc=acc_b * alpha[:, None])
        m_i = m_new
    orow = out_ptr + (b * H + h)[:, None] * LAT
    tl.store(orow + c[None, :], (acc_a / l_i[:, None]).to(tl.bfloat16))
    tl.store(orow + HALF + c[None, :], (acc_b / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def _v2(q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, stride_page, stride_table, qk_scale,
        H: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """swapAB: keys on the MMA's M side (wgmma needs M a multiple of 64), heads on N."""
    b = tl.program_id(0)
    seq = tl.load(lens_ptr + b)
    h = tl.arange(0, H)
    c = tl.arange(0, LAT)
    p = tl.arange(0, ROPE)
    q_lat_t = tl.load(q_lat_ptr + (b * H + h)[None, :] * LAT + c[:, None])  # [LAT, H]
    q_rope_t = tl.load(q_rope_ptr + (b * H + h)[None, :] * ROPE + p[:, None])  # [ROPE, H]
    acc = tl.zeros([LAT, H], tl.float32)
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table = table_ptr + b.to(tl.int64) * stride_table
    pages = tl.load(table + offs // PAGE, mask=offs < seq, other=0)
    for start in range(0, seq, BLOCK_N):
        n = start + offs
        rows = kv_ptr + pages.to(tl.int64) * stride_page + (n % PAGE) * (LAT + ROPE)
        ok = n < seq
        lat = tl.load(rows[:, None] + c[None, :], mask=ok[:, None], other=0.0)  # [N, LAT]
        rope = tl.load(rows[:, None] + LAT + p[None, :], mask=ok[:, None], other=0.0)
        pages = tl.load(table + (n + BLOCK_N) // PAGE, mask=n + BLOCK_N < seq, other=0)
        st = tl.dot(lat, q_lat_t)
        st = tl.dot(rope, q_rope_t, acc=st) * qk_scale  # [N, H]
        st = tl.where(ok[:, None], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        alpha = tl.exp2(m_i - m_new)
        pt = tl.exp2(st - m_new[None, :]).to(tl.bfloat16)
        l_i = l_i * alpha + tl.sum(pt.to(tl.float32), 0)
        acc = tl.dot(tl.trans(lat), pt, acc=acc * alpha[None, :])  # [LAT, H]
        m_i = m_new
    o = acc / l_i[None, :]
    tl.store(out_ptr + (b * H + h)[None, :] * LAT + c[:, None], o.to(tl.bfloat16))


@triton.jit
def _v1q(q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, stride_page, stride_table, qk_scale,
         H: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """QK as four independent dots over latent quarters plus the rope dot."""
    Q: tl.constexpr = LAT // 4
    b = tl.program_id(0)
    seq = tl.load(lens_ptr + b)
    h = tl.arange(0, H)
    c = tl.arange(0, Q)
    p = tl.arange(0, ROPE)
    qrow = q_lat_ptr + (b * H + h)[:, None] * LAT
    q0 = tl.load(qrow + c[None, :])
    q1 = tl.load(qrow + Q + c[None, :])
    q2 = tl.load(qrow + 2 * Q + c[None, :])
    q3 = tl.load(qrow + 3 * Q + c[None, :])
    q_rope = tl.load(q_rope_ptr + (b * H + h)[:, None] * ROPE + p[None, :])
    a0 = tl.zeros([H, Q], tl.float32)
    a1 = tl.zeros([H, Q], tl.float32)
    a2 = tl.zeros([H, Q], tl.float32)
    a3 = tl.zeros([H, Q], tl.float32)
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table = table_ptr + b.to(tl.int64) * stride_table
    pages = tl.load(table + offs // PAGE, mask=offs < seq, other=0)
    for start in range(0, seq, BLOCK_N):
        n = start + offs
        rows = kv_ptr + pages.to(tl.int64) * stride_page + (n % PAGE) * (LAT + ROPE)
        ok = n < seq
        l0 = tl.load(rows[:, None] + c[None, :], mask=ok[:, None], other=0.0)
        l1 = tl.load(rows[:, None] + Q + c[None, :], mask=ok[:, None], other=0.0)
        l2 = tl.load(rows[:, None] + 2 * Q + c[None, :], mask=ok[:, None], other=0.0)
        l3 = tl.load(rows[:, None] + 3 * Q + c[None, :], mask=ok[:, None], other=0.0)
        rope = tl.load(rows[:, None] + LAT + p[None, :], mask=ok[:, None], other=0.0)
        pages = tl.load(table + (n + BLOCK_N) // PAGE, mask=n + BLOCK_N < seq, other=0)
        s = tl.dot(q0, tl.trans(l0)) + tl.dot(q1, tl.trans(l1))
        s += tl.dot(q2, tl.trans(l2)) + tl.dot(q3, tl.trans(l3))
        s += tl.dot(q_rope, tl.trans(rope))
        s = s * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        pr = pr.to(tl.bfloat16)
        a0 = tl.dot(pr, l0, acc=a0 * alpha[:, None])
        a1 = tl.dot(pr, l1, acc=a1 * alpha[:, None])
        a2 = tl.dot(pr, l2, acc=a2 * alpha[:, None])
        a3 = tl.dot(pr, l3, acc=a3 * alpha[:, None])
        m_i = m_new
    orow = out_ptr + (b * H + h)[:, None] * LAT
    tl.store(orow + c[None, :], (a0 / l_i[:, None]).to(tl.bfloat16))
    tl.store(orow + Q + c[None, :], (a1 / l_i[:, None]).to(tl.bfloat16))
    tl.store(orow + 2 * Q + c[None, :], (a2 / l_i[:, None]).to(tl.bfloat16))
    tl.store(orow + 3 * Q + c[None, :], (a3 / l_i[:, None]).to(tl.bfloat16))


KERNELS = {"v0": _v0, "v1": _v1, "v2": _v2, "v1q": _v1q}


def run(kernel, q_lat, q_rope, cache, table, lens, scale, block_n, warps, stages):
    batch, heads, lat = q_lat.shape
    out = torch.empty_like(q_lat)
    q_rope = q_rope.contiguous()
    kernel[(batch,)](q_lat, q_rope, cache, table, lens, out, cache.stride(0), table.stride(0), scale * LOG2E,
                     H=heads, LAT=lat, ROPE=q_rope.shape[-1], BLOCK_N=block_n, PAGE=cache.shape[1],
                     num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    variants = [("v0", 32, 4, 3), ("v1", 32, 4, 3), ("v1q", 32, 4, 3), ("v1", 32, 4, 4), ("v2", 64, 4, 2)]
    for batch, ctx in [(256, 1152), (128, 1152)]:
        args, nbytes = decode_case(batch, ctx, torch.bfloat16, gen)
        q_lat, q_rope, cache, table, lens, scale, _ = args
        want = mla_decode(*args)
        us = time_us(lambda args=args: mla_decode(*args, num_splits=1, tiles=Tiles(1, 16, 32, 4, 3, 1)))
        print(f"B={batch} ctx={ctx} | shipped (one split) {us:.1f} us {nbytes / us / 1e3:.0f} GB/s", flush=True)
        for name, bn, w, s in variants:
            try:
                got = run(KERNELS[name], q_lat, q_rope, cache, table, lens, scale, bn, w, s)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                us = time_us(lambda name=name, bn=bn, w=w, s=s, args=args: run(
                    KERNELS[name], args[0], args[1], args[2], args[3], args[4], args[5], bn, w, s))
                print(f"   {name} N{bn} w{w} s{s}: {us:.1f} us {nbytes / us / 1e3:.0f} GB/s rel err {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a shape past shared memory: report and go on
                print(f"   {name} N{bn} w{w} s{s}: {type(e).__name__}", flush=True)


if __name__ == "__main__":
    main()
