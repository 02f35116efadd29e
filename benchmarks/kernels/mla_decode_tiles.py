"""MLA decode tile shapes through the real launch, splits as the engine's graphs pick them.

    python benchmarks/kernels/mla_decode_tiles.py [--kv bf16|fp8] [--batches 16,64,256] [--ctx 1152]
    python benchmarks/kernels/mla_decode_tiles.py --long     # batch 1-4 at 1K-64K keys, W_UV fused

Each shape (key tile, warps, stages, programs an SM [, e = first tile before the PDL wait]) gets
the split count `num_splits_for` gives it for a graph's 4,096-key page table, and is graph-timed
(best of three) beside `decode_tiles`' own choice ("default"). `--long` times the batch-1-4
shapes with the merge + W_UV fused where the engine fuses it (mla_decode's w_uv argument).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import FP8, best_us, decode_case  # noqa: E402

from moeserve.ops.triton.mla_decode import mla_decode  # noqa: E402
from moeserve.ops.triton.mla_tiles import Tiles, decode_tiles, num_splits_for  # noqa: E402

SHAPES = {
    "bf16": [(32, 4, 3, 1), (32, 4, 2, 2), (64, 8, 3, 1), (64, 4, 3, 1), (64, 4, 2, 1), (16, 4, 3, 2)],
    # FP8 key pairs take 32+ key tiles (mla_pairs.py).
    "fp8": [(32, 8, 4, 1), (32, 4, 4, 1), (32, 4, 3, 1), (32, 4, 2, 1), (32, 4, 4, 2), (32, 4, 3, 2), (32, 4, 2, 2),
            (64, 8, 2, 1), (64, 8, 3, 1), (64, 4, 2, 1), (64, 4, 3, 1), (64, 4, 2, 2)],
}
LONG_SHAPES = [(32, 8, 3, 2), (64, 8, 2, 1), (64, 8, 3, 1), (32, 8, 2, 2), (64, 4, 3, 1)]
GRAPH_KEYS = 4096


def sweep(batch: int, ctx: int, kv: str, gen: torch.Generator, shapes, early: bool, w_uv=None) -> str:
    """One line: the default's time, then each shape's (with its split count)."""
    dev = torch.device("cuda")
    args, _ = decode_case(batch, ctx, FP8 if kv == "fp8" else torch.bfloat16, gen)
    width = max(GRAPH_KEYS, ctx + 64)
    extra = {} if w_uv is None else {"w_uv": w_uv, "out": torch.empty(batch, 16, 128, device=dev, dtype=torch.bfloat16)}
    default = decode_tiles(16, torch.bfloat16, args[2].dtype, dev, batch)
    splits = num_splits_for(batch, width, default, dev)
    line = [f"{kv} b{batch} {ctx} keys: default {best_us(lambda: mla_decode(*args, num_splits=splits, **extra)):.1f}"]
    for n, warps, stages, ctas in shapes:
        tiles = Tiles(1, 16, n, warps, stages, ctas, early)
        s = num_splits_for(batch, width, tiles, dev)
        try:
            us = best_us(lambda t=tiles, s=s: mla_decode(*args, num_splits=s, tiles=t, **extra))
            line.append(f"{n}/{warps}/{stages}/{ctas}{'e' if early else ''} x{s}: {us:.1f}")
        except Exception as e:  # noqa: BLE001 - a shape past shared memory: report and go on
            line.append(f"{n}/{warps}/{stages}/{ctas}: {type(e).__name__}")
    return " | ".join(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", choices=list(SHAPES), default="bf16")
    ap.add_argument("--batches", default="8,16,32,48,64,96,128,192,256")
    ap.add_argument("--ctx", type=int, default=1152)
    ap.add_argument("--long", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if a.long:
        w_uv = torch.randn(16, 128, 512, device="cuda", dtype=torch.bfloat16) * 0.05
        for batch in (1, 2, 4):
            for ctx in (1152, 4096, 16384, 65536):
                print(sweep(batch, ctx, "bf16", gen, LONG_SHAPES, True, w_uv), flush=True)
        return
    for batch in [int(b) for b in a.batches.split(",")]:
        print(sweep(batch, a.ctx, a.kv, gen, SHAPES[a.kv], False), flush=True)


if __name__ == "__main__":
    main()
