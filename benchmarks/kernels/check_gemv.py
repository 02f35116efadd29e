"""The Triton GEMV against cuBLAS on DeepSeek-V2-Lite's decode projections, in a PDL chain.

    python benchmarks/kernels/check_gemv.py [--rows 1,2,4,8] [--sweep] [--skinny]

Each step is an RMSNorm (a PDL kernel, as in the model) followed by the projection, replayed from
one CUDA graph over weight copies that exceed L2; the printed time is per (norm + projection).
The GEMV prefetches its weights while the norm runs, which a standalone timing would not show.
With --skinny the skinny GEMM is timed too, over a sweep of tiles and pipeline depths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import time_us  # noqa: E402

from moeserve.ops.triton.gemv import GemvConfig, fits, gemv, pick_config  # noqa: E402
from moeserve.ops.triton.norm import rms_norm  # noqa: E402
from moeserve.ops.triton.skinny_gemm import SkinnyConfig, skinny_bmm  # noqa: E402

SHAPES = {"fused_qkv_a": (3648, 2048), "o_proj": (2048, 2048), "router": (64, 2048)}
L2_BYTES = 256 * 2**20


def chain_us(step, copies: int) -> float:
    """Microseconds per step(i), i running over the weight copies, from one replayed CUDA graph."""
    return time_us(lambda: [step(i) for i in range(copies)], iters=2) / copies


SKINNY_TILES = [(bn, bk, 4, st) for bn in (16, 32) for bk in (64, 128, 256) for st in (3, 4, 6, 8)]


def skinny_row(x: torch.Tensor, ws: list, norm_w: torch.Tensor, k: int, copies: int) -> str:
    """norm + skinny GEMM per tile (BLOCK_N, BLOCK_K, warps, stages)."""
    out = torch.empty(1, x.shape[0], ws[0].shape[0], device="cuda", dtype=torch.bfloat16)
    cells = []
    for bn, bk, warps, stages in SKINNY_TILES:
        c = SkinnyConfig(bn, bk, 1, warps, stages)
        us = chain_us(lambda i, c=c: skinny_bmm(rms_norm(x, norm_w, 1e-6)[None], ws[i][None], out, config=c), copies)
        cells.append(f"bn{bn}k{bk}s{stages}={us:.2f}")
    return " ".join(cells)


def measure(name: str, n: int, k: int, rows_list: list[int], sweep: bool, skinny: bool = False) -> None:
    """One projection at each row count: norm alone, norm + cuBLAS, norm + GEMV (each config)."""
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    out_dtype = torch.float32 if name == "router" else torch.bfloat16
    copies = max(4, min(64, L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        norm_only = chain_us(lambda i, x=x: rms_norm(x, norm_w, 1e-6), copies)
        if out_dtype == torch.float32:
            cublas = chain_us(
                lambda i, x=x: torch.mm(rms_norm(x, norm_w, 1e-6), ws[i].t(), out_dtype=out_dtype), copies
            )
        else:
            cublas = chain_us(lambda i, x=x: F.linear(rms_norm(x, norm_w, 1e-6), ws[i]), copies)
        configs = [pick_config(n, k, rows)]
        if sweep:
            configs += [GemvConfig(b, w) for b in (2, 4, 8, 16) for w in (4, 8) if GemvConfig(b, w) != configs[0]]
        row = [] if fits(x, ws[0]) else ["(past the GEMV's rows x N limit)"]
        for c in configs if not row else []:
            us = chain_us(lambda i, x=x, c=c: gemv(rms_norm(x, norm_w, 1e-6), ws[i], None, out_dtype, config=c), copies)
            row.append(f"bn{c.block_n}w{c.num_warps}={us:.2f}")
        print(
            f"{name:12s} rows={rows}  norm {norm_only:.2f}  norm+cuBLAS {cublas:.2f}  norm+gemv {' '.join(row)}"
            f"  (weight stream {n * k * 2 / 4.26e6:.2f} us)",
            flush=True,
        )
        if skinny and out_dtype == torch.bfloat16:
            print(f"{name:12s} rows={rows}  norm+skinny {skinny_row(x, ws, norm_w, k, copies)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skinny", action="store_true", help="also the skinny GEMM over a sweep of tiles")
    a = ap.parse_args()
    for name, (n, k) in SHAPES.items():
        measure(name, n, k, [int(r) for r in a.rows.split(",")], a.sweep, a.skinny)


if __name__ == "__main__":
    main()
