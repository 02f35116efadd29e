"""The Triton skinny GEMM against cuBLAS on DeepSeek-V2-Lite's decode projections (microseconds).

    python benchmarks/kernels/check_skinny_gemm.py [--rows 1,8,16,32,64] [--sweep]

Each timed call reads a different copy of the weight (copies exceed L2), as a model's layers do.
With --sweep, tile shapes and K splits are timed too, for tuning `pick_config`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moeserve.ops.triton.skinny_gemm import SkinnyConfig, pick_config, skinny_bmm  # noqa: E402

PROJECTIONS = {  # name: (batch, N, K, out dtype); the per-head ones as the attention layer views them
    "fused_qkv_a": (1, 3648, 2048, torch.bfloat16),
    "o_proj": (1, 2048, 2048, torch.bfloat16),
    "router": (1, 64, 2048, torch.float32),
    "w_uk": (16, 512, 128, torch.bfloat16),
    "w_uv": (16, 128, 512, torch.bfloat16),
}
L2_BYTES = 256 * 2**20


def graph_us(calls: list, reps: int = 3) -> float:
    """Microseconds per call of `calls` (closures), replayed from one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    return sorted(times)[2]


def case(name: str, rows: int):
    batch, n, k, out_dtype = PROJECTIONS[name]
    copies = max(4, min(256, L2_BYTES // (batch * n * k * 2)))
    ws = [torch.randn(batch, n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(batch, rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, rows, n, device="cuda", dtype=out_dtype)
    return ws, x, out


def cublas_calls(ws, x, out):
    if out.dtype == torch.float32:
        return [lambda w=w: torch.mm(x[0], w[0].t(), out_dtype=torch.float32) for w in ws]
    return [lambda w=w: torch.bmm(x, w.transpose(1, 2), out=out) for w in ws]


def triton_calls(ws, x, out, config: SkinnyConfig | None = None):
    return [lambda w=w: skinny_bmm(x, w, out, config=config) for w in ws]


def sweep(ws, x, out, k: int) -> tuple[float, SkinnyConfig]:
    """The fastest of a few tile shapes (and K splits for a float32 output)."""
    best = (float("inf"), None)
    rows = x.shape[1]
    splits = (1, 2, 4, 8) if out.dtype == torch.float32 else (1,)
    block_ms = (64, 128) if rows > 64 else (64,)
    for bn, bk, split, bm, warps in itertools.product((16, 32, 64, 128), (64, 128, 256), splits, block_ms, (4, 8)):
        if bk > k or (bn == 128 and bk == 256):
            continue
        c = SkinnyConfig(bn, bk, split, warps, 4 if bn * bk <= 64 * 128 else 3, bm)
        try:
            best = min(best, (graph_us(triton_calls(ws, x, out, c), 1), c), key=lambda t: t[0])
        except Exception as exc:  # out of shared memory at this tile: skip it
            print(f"      {c}: {type(exc).__name__}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated projection names (default: all)")
    a = ap.parse_args()
    for name, (batch, n, k, out_dtype) in PROJECTIONS.items():
        if a.only and name not in a.only.split(","):
            continue
        floor = batch * n * k * 2 / 4.2e6  # us at 4.2 TB/s
        for rows in [int(r) for r in a.rows.split(",")]:
            ws, x, out = case(name, rows)
            cublas = graph_us(cublas_calls(ws, x, out))
            ours = graph_us(triton_calls(ws, x, out))
            cfg = pick_config(rows, n, k, batch, out_dtype, x.device)
            line = f"{name:12s} M={rows:3d}  floor {floor:6.1f}  cublas {cublas:6.1f}  triton {ours:6.1f} us ({cfg})"
            if a.sweep:
                us, c = sweep(ws, x, out, k)
                line += f"\n      best {us:6.1f} us {c}"
            print(line, flush=True)
            del ws


if __name__ == "__main__":
    main()
