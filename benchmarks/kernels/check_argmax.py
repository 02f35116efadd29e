"""Greedy argmax over [rows, 102400] bf16 logits: torch.argmax against the one-launch Triton kernel.

    python benchmarks/kernels/check_argmax.py [--rows 1,8,64,128,256] [--configs 2048x1x4,4096x4x8]

A config is BLOCKxSTEPSxWARPS (entries a load, loads a program, warps); `default` is what
argmax_rows picks for that row count.

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

from moeserve.ops.triton.argmax import ArgmaxConfig, argmax_rows  # noqa: E402

VOCAB = 102400


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,128,256")
    ap.add_argument("--configs", default="1024x1x4,2048x1x4,4096x1x8,4096x2x8,4096x4x8,4096x7x8,4096x25x8")
    a = ap.parse_args()
    configs = {"default": None}
    for spec in a.configs.split(","):
        block, steps, warps = (int(v) for v in spec.split("x"))
        configs[spec] = ArgmaxConfig(block, steps, warps)
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        xs[0][0, 5] = xs[0][0, 99000] = 100.0  # a tie: the first index wins
        xs[1][-1, 7] = float("nan")  # NaN wins, as in torch
        line = f"rows {rows:4d}: torch {graph_us([lambda x=x: x.argmax(dim=-1) for x in xs]):6.1f}"
        for name, config in configs.items():
            for x in xs:
                assert torch.equal(argmax_rows(x, config=config), x.argmax(dim=-1)), (rows, name)
            line += f"  {name} {graph_us([lambda x=x, c=config: argmax_rows(x, config=c) for x in xs]):6.1f}"
        print(line + " us", flush=True)


if __name__ == "__main__":
    main()
