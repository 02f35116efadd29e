"""MLA decode at serving-length contexts: microseconds per split count and tile shape.

    python benchmarks/kernels/sweep_mla_short.py [--ctx 1280] [--batches 1,8,64,256] [--wide]

The split rule is tuned here for the contexts the latency workloads decode at (1-2K keys), where
a step reads little KV and the kernel's latency, not bandwidth, sets its time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import decode_case, time_us  # noqa: E402

from moeserve.ops.triton.mla_decode import mla_decode  # noqa: E402
from moeserve.ops.triton.mla_tiles import Tiles, decode_tiles, num_splits_for  # noqa: E402

TILES = [
    Tiles(1, 16, 32, 8, 3, 2),
    Tiles(1, 16, 16, 4, 3, 2),
    Tiles(1, 16, 64, 8, 3, 1),
    Tiles(1, 16, 32, 4, 3, 2),
]
# --wide: every key-tile width, warp count and stage count (shapes that do not compile are skipped).
WIDE = [Tiles(1, 16, n, w, s, 1) for n in (16, 32, 64) for w in (4, 8) for s in (2, 3, 4, 5)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=1280)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--wide", action="store_true", help="sweep the WIDE tile grid instead of TILES")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    for batch in [int(b) for b in a.batches.split(",")]:
        args, nbytes = decode_case(batch, a.ctx, torch.bfloat16, gen)
        tiles = decode_tiles(16, torch.bfloat16, torch.bfloat16, dev, batch)
        default, graph = num_splits_for(batch, a.ctx, tiles, dev), num_splits_for(batch, 4096, tiles, dev)
        print(f"B={batch} ctx={a.ctx}: default splits {default} (eager), {graph} (graph table width 4096)")
        for tiles in WIDE if a.wide else TILES:
            line = []
            for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 132, 264):
                if batch * s > 4 * 264 or s * tiles.block_n > 2 * a.ctx:
                    continue
                try:
                    us = time_us(
                        lambda args=args, t=tiles, s=s: mla_decode(*args, num_splits=s, tiles=t), iters=10
                    )
                except Exception as e:  # noqa: BLE001 - a shape past shared memory: report and go on
                    line.append(f"{s}:{type(e).__name__}")
                    continue
                line.append(f"{s}:{us:.1f}({nbytes / us / 1e3:.0f}GB/s)")
            print(f"  tiles {tuple(tiles.__dict__.values())}: " + " ".join(line), flush=True)
        del args


if __name__ == "__main__":
    main()
