"""Tried and dropped: V2-Lite decode projections at 64-256 rows, cuBLAS against a plain Triton GEMM.

    python benchmarks/kernels/projection_tiles.py

Tiles (64/128 rows x 32/64/128 columns x 64/128 K, 4/8 warps, 3/4 stages, pointer or TMA loads)
are swept and graph-timed over 24 weight copies; on H200 cuBLAS stayed faster at every size
(benchmarks/results/nvidia-h200-2026-11-24-6d940e6.json, rows decode_projection_*).
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_skinny_gemm import graph_us  # noqa: E402

SHAPES = {"qkv_a": 3648, "o_proj": 2048}  # N; K is the hidden size, 2048
K = 2048


@triton.jit
def _gemm(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out = x @ w^T, programs n-major so the m blocks of one weight tile run together."""
    num_m = tl.cdiv(M, BM)
    pid_n, pid_m = tl.program_id(0) // num_m, tl.program_id(0) % num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + (k0 + offs_k)[:, None], mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _gemm_tma(x_desc, w_desc, out_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The same with both operands' tiles arriving by TMA."""
    num_m = tl.cdiv(M, BM)
    pid_n, pid_m = tl.program_id(0) // num_m, tl.program_id(0) % num_m
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc = tl.dot(x_desc.load([pid_m * BM, k0]), w_desc.load([pid_n * BN, k0]).T, acc)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def triton_calls(x, ws, out, tile) -> list:
    """One launch per weight copy for tile (bm, bn, bk, warps, stages, tma)."""
    bm, bn, bk, warps, stages, tma = tile
    m, n = out.shape
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    meta = dict(K=K, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    if tma:
        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        return [functools.partial(_gemm_tma[grid], xd, TensorDescriptor.from_tensor(w, [bn, bk]), out, m, n, **meta)
                for w in ws]
    return [functools.partial(_gemm[grid], x, w, out, m, n, **meta) for w in ws]


def main() -> None:
    for name, n in SHAPES.items():
        ws = [torch.randn(n, K, device="cuda", dtype=torch.bfloat16) for _ in range(24)]
        for m in (64, 128, 256):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cublas = graph_us([functools.partial(torch.mm, x, w.t(), out=out) for w in ws])
            results = []
            for tile in itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4), (False, True)):
                if tile[0] > m:
                    continue
                try:
                    us = graph_us(triton_calls(x, ws, out, tile), 1)
                except Exception:  # out of shared memory at this tile: skip it
                    continue
                torch.testing.assert_close(out.float(), x.float() @ ws[-1].float().t(), rtol=2e-2, atol=2e-1)
                results.append((us, tile))
            results.sort()
            best = "  ".join(f"{us:.2f} {tile}" for us, tile in results[:4])
            print(f"{name} M={m}: floor {n * K * 2 / 4.2e6:.1f} cuBLAS {cublas:.2f} us; best (bm, bn, bk, warps, "
                  f"stages, tma) {best}", flush=True)


if __name__ == "__main__":
    main()
