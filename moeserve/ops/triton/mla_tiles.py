"""Launch shapes of the MLA split kernel (mla_decode.py): tiles per batch size, and key splits.

The split count depends on shapes only (programs and the graph's context capacity), so a decode
step is capturable in a CUDA graph whatever its sequences' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.ops.triton.device import sm_count

# One tile per split is still worth it: at serving-length contexts (1-2K keys) a few programs
# walking many tiles each are latency-bound (benchmarks/kernels/sweep_mla_short.py).
MIN_SPLIT_KEYS = 32
MAX_SPLITS = 512


@dataclass(frozen=True)
class Tiles:
    """Launch shape: BLOCK_Q tokens x BLOCK_H heads per program, BLOCK_N keys per step."""

    block_q: int
    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    # Programs that fit on an SM at once (registers, shared memory as compiled for sm_90): the
    # split count aims at exactly one wave of them.
    ctas_per_sm: int = 1
    # Decode: each split loads its first KV tile before waiting on the previous kernel.
    early_tile: bool = False


def num_splits_for(programs: int, max_ctx: int, tiles: Tiles, device: torch.device) -> int:
    """Key splits that fill one wave of the GPU with `programs` x splits, from shapes only."""
    slots = tiles.ctas_per_sm * sm_count(device)
    cap = max(1, min(MAX_SPLITS, max_ctx // max(MIN_SPLIT_KEYS, tiles.block_n)))
    return max(1, min(slots // max(programs, 1), cap))


def decode_tiles(
    num_heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, batch: int = 1
) -> Tiles:
    """Decode launch shape: one token per program, all heads of a group sharing each KV tile."""
    if device.type != "cuda":
        return Tiles(block_q=1, block_h=16, block_n=16, num_warps=1, num_stages=1)
    # Checked for sm_90 with ptxas (no spills; shared memory for the stated programs per SM).
    if q_dtype == torch.float32:  # tests only: fp32 tiles are twice the size
        return Tiles(block_q=1, block_h=16, block_n=16, num_warps=8, num_stages=2, ctas_per_sm=2)
    if num_heads > 16:
        return Tiles(block_q=1, block_h=32, block_n=32, num_warps=8, num_stages=3, ctas_per_sm=1)
    if kv_dtype == torch.float8_e4m3fn:
        # Key pairs read as 16-bit words (mla_pairs.py), measured at 1,152 keys (H100,
        # benchmarks/kernels/mla_decode_tiles.py --kv fp8; 2026-12-07): 64-key tiles on eight
        # warps, two stages at 1 row (9.0 us); 32-key tiles on four warps, three stages at 2-8
        # (b4 12.3 -> 11.2, b8 14.6 -> 13.9) and past 128 (b256 93.4 -> 85.0), two stages at
        # 9-32; 64-key tiles on eight warps, three stages at 33-128 (b64 35.6 -> 34.4, b128 58.1
        # -> 52.6; four warps measured a little faster but spill). All without spills (mla_sass.py).
        if batch == 1:
            return Tiles(block_q=1, block_h=16, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)
        if batch <= 8 or batch > 128:
            return Tiles(block_q=1, block_h=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=1)
        if batch <= 32:
            return Tiles(block_q=1, block_h=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1)
        return Tiles(block_q=1, block_h=16, block_n=64, num_warps=8, num_stages=3, ctas_per_sm=1)
    # Measured at 1-2K keys (sweep_mla_short.py): 64-key tiles win from 33 to 128 queries (two
    # splits each; four warps since the latent halves: b128 50.5 -> 47.0 us), four warps on 32-key
    # tiles from 2 to 32; one program per SM sets the splits.
    if 32 < batch <= 128:
        return Tiles(block_q=1, block_h=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=1)
    # One sequence: each split is a single short program, and eight warps shorten its chain
    # (1280 keys on H200 with PDL: 10.4 us for split + reduce against 11.3 with four warps).
    # Its first tile streams in behind the previous kernel: decode-graph replay 2.189 -> 2.135 ms
    # at batch 1, while at 8 and 64 (longer splits) it cost 1.5%. 64-key tiles, one program an
    # SM: half the splits for the merge to read (split + merge + W_UV, H200: 1,152 keys 11.5 ->
    # 11.0 us, 4K 21.7 -> 14.4, 16K 45.1 -> 26.0, 64K 77.0 -> 50.0).
    if batch == 1:
        return Tiles(block_q=1, block_h=16, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, early_tile=True)
    return Tiles(block_q=1, block_h=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=1)
