"""Time the prompt-size fused MoE gate/up GEMM (`moe_up`) at its tuned tile and at others.

    [PYTHONPATH=TREE] python benchmarks/kernels/moe_up_paired.py [--tokens 131072,16384,4096] [--shipped-only]

Since a36a4e6 the TMA path loads BLOCK_N gate rows interleaved with the same up rows as one box
(a 4-D descriptor over w13 viewed as [E, I, 2, H]) and computes both in one MMA of twice the
width; before, it loaded two boxes and ran two MMAs. With --shipped-only only the tuned tile is
timed, so running it under PYTHONPATH set to each of two trees, alternating, is an A/B of the
kernels at the same config. Otherwise a few other tiles follow (stages, GROUP_M, BLOCK_N), each
with its largest difference from the tuned tile's output (real rows only). Weights read cold (L2 flushed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[2]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_prefill_variants import V2_LITE_MOE, prompt_cases  # noqa: E402

from moeserve.ops.triton.fused_moe import moe_up  # noqa: E402
from moeserve.ops.triton.tune_moe import _with, time_us  # noqa: E402

TILES = [  # BLOCK_N (of each of gate and up), BLOCK_K, warps, stages, GROUP_M; all with TMA
    (128, 64, 8, 3, 8), (128, 64, 8, 4, 8), (128, 64, 8, 3, 16), (64, 64, 8, 4, 8), (64, 128, 8, 3, 8),
]


def main() -> None:
    """Time moe_up at each --tokens size: the tuned tile, then (unless --shipped-only) the others."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="131072,16384,4096")
    ap.add_argument("--shipped-only", action="store_true", help="only the tuned tile (an A/B of two trees)")
    args = ap.parse_args()
    torch.manual_seed(0)
    _, hidden_size, inter, topk = V2_LITE_MOE
    for tokens, inp, config, plan, flush in prompt_cases([int(t) for t in args.tokens.split(",")]):
        hidden, w13 = inp["hidden"], inp["w13"]
        flop = 2 * tokens * topk * hidden_size * 2 * inter
        ref = moe_up(hidden, w13, plan)
        # In block order (ACT_TMA) the padding rows of each block are never written: compare real rows.
        real = plan.sorted_ids < tokens * topk if config.get("ACT_TMA") else slice(None)
        t = time_us(lambda h=hidden, w=w13, p=plan: moe_up(h, w, p), 10, flush)
        print(f"T={tokens} tuned {config['up']} BM{config['BLOCK_M']}: {t:.1f} us ({flop / t / 1e6:.0f} TF/s)",
              flush=True)
        for bn, bk, warps, stages, group_m in [] if args.shipped_only else TILES:
            up = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages,
                  "TMA": True}
            try:
                other = _with(plan, "up", up)
                err = (moe_up(hidden, w13, other)[real].float() - ref[real].float()).abs().max().item()
                t = time_us(lambda h=hidden, w=w13, p=other: moe_up(h, w, p), 10, flush)
                print(f"  {up}: {t:.1f} us ({flop / t / 1e6:.0f} TF/s) err {err:.3g}", flush=True)
            except Exception as exc:  # out of shared memory or registers at this tile
                print(f"  {up} failed: {type(exc).__name__} {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
