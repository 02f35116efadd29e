"""Greedy argmax over [rows, 102400] bf16 logits: torch.argmax against the one-launch Triton kernel.

    python benchmarks/kernels/check_argmax.py [--rows 1,8,64,256]

Times are per call, replayed from a CUDA graph (as the decode graphs run it), over 8 logits
tensors in turn; each result is checked against torch.argmax first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_skinny_gemm import graph_us  # noqa: E402

from moeserve.ops.triton.argmax import argmax_rows  # noqa: E402

VOCAB = 102400


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--blocks", default="1024,2048,4096,8192")
    a = ap.parse_args()
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        xs[0][0, 5] = xs[0][0, 99000] = 100.0  # a tie: the first index wins
        for x in xs:
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), rows
        line = f"rows {rows:4d}: torch {graph_us([lambda x=x: x.argmax(dim=-1) for x in xs]):6.1f}"
        for block in [int(b) for b in a.blocks.split(",")]:
            line += f"  triton/{block} {graph_us([lambda x=x, b=block: argmax_rows(x, block=b) for x in xs]):6.1f}"
        print(line + " us", flush=True)


if __name__ == "__main__":
    main()
