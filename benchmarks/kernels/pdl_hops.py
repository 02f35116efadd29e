"""What one dependent kernel costs at decode sizes: chains of minimal PDL kernels in a CUDA graph.

    python benchmarks/kernels/pdl_hops.py [--hops 208] [--json FILE]

Each kernel waits on the one before (pdl.py's rule), reads the 2048-value vector it wrote and
writes the next one; a chain of `--hops` of them is replayed from one graph and the time per
kernel printed. Variants:
- `empty`: the hop alone, 128 programs (about as many as SMs) or 16;
- `no_pdl`: the same launched without programmatic dependent launch;
- `l2_trip`: after the wait, a second load whose address depends on the first (as a MoE kernel
  reads its expert id, then the expert's rows): one more L2 round trip on the path;
- `gemv_8mb`: the hop as a 2048 x 2048 bf16 GEMV (o_proj's shape) whose weights load before the
  wait, over 26 weight copies (more than L2 holds), like the engine's decode GEMVs.
A batch-1 decode layer of DeepSeek-V2-Lite is eight such kernels in a row (add + norm + qkv_a,
rope + store + W_UK, MLA split, merge + W_UV, o_proj, add + norm + route, MoE gate/up, down), so
eight hops is the latency a kernel-per-phase layer cannot avoid, before any byte is streamed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import best_us  # noqa: E402

from moeserve.bench.common import record, write_results  # noqa: E402
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid  # noqa: E402

WIDTH = 2048
WEIGHT_COPIES = 26


@triton.jit
def _hop_kernel(x_ptr, w_ptr, idx_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHTS: tl.constexpr,
                TWO_TRIPS: tl.constexpr, PDL: tl.constexpr):
    """y[this program's BLOCK_N values] from the vector x the previous kernel wrote."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K)
    if WEIGHTS:
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
    wait_for_prior_grid(PDL)
    x = tl.load(x_ptr + offs_k).to(tl.float32)
    if TWO_TRIPS:
        # An address known only after the first load: x's first value picks the row (always 0).
        first = tl.sum(tl.where(offs_k == 0, x, 0.0), axis=0).to(tl.int32) & 0
        x += tl.load(idx_ptr + first * K + offs_k).to(tl.float32)
    if WEIGHTS:
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1) * (1.0 / K)
    else:
        y = tl.sum(x, axis=0) * (1.0 / K) + offs_n.to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty))


def chain_us(hops: int, programs: int, weights: bool, two_trips: bool, pdl: bool) -> float:
    """Microseconds per kernel of a `hops`-long dependent chain replayed from one CUDA graph."""
    vecs = [torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    idx = torch.zeros(WIDTH, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_COPIES if weights else 1)]
    launch = pdl_launch(vecs[0]) if pdl else {"PDL": False}
    warps = 8 if weights and WIDTH // programs >= 16 else 4

    def chain() -> None:
        for i in range(hops):
            _hop_kernel[(programs,)](
                vecs[i % 2], ws[i % len(ws)], idx, vecs[(i + 1) % 2], K=WIDTH, BLOCK_N=WIDTH // programs,
                WEIGHTS=weights, TWO_TRIPS=two_trips, num_warps=warps, **launch,
            )

    return best_us(chain, iters=1) / hops


VARIANTS = {
    "empty_128": dict(programs=128, weights=False, two_trips=False, pdl=True),
    "empty_16": dict(programs=16, weights=False, two_trips=False, pdl=True),
    "no_pdl_128": dict(programs=128, weights=False, two_trips=False, pdl=False),
    "l2_trip_128": dict(programs=128, weights=False, two_trips=True, pdl=True),
    "gemv_8mb_256": dict(programs=256, weights=True, two_trips=False, pdl=True),
    "gemv_8mb_128": dict(programs=128, weights=True, two_trips=False, pdl=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hops", type=int, default=208)
    parser.add_argument("--json", help="append a results row to this JSON list")
    args = parser.parse_args()
    us = {name: round(chain_us(args.hops, **v), 3) for name, v in VARIANTS.items()}
    for name, value in us.items():
        print(f"{name:14s} {value:7.3f} us a kernel")
    workload = {"hops": args.hops, "width": WIDTH, "weight_copies": WEIGHT_COPIES}
    write_results(args.json, [record("pdl_hops", "cuda", workload=workload, us_per_kernel=us)])


if __name__ == "__main__":
    main()
