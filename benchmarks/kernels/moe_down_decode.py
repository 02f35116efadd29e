"""Tried and dropped: the decode-size down GEMM in block order by TMA, and persistent at 1-4 programs an SM.

    python benchmarks/kernels/moe_down_decode.py

At 256 tokens (E=66, the shared experts fused), 64 (E=66) and 8 (E=64): the shipped config's
down GEMM against ACT_TMA (activations in block order, read by TMA) with several tiles, each also
persistent with 1-4 programs per SM (one program per SM keeps a third of the bytes in flight that
three resident tile programs do). Prints microseconds and the touched experts' bytes over them.
"""

from __future__ import annotations

import torch

from moeserve.ops.triton import fused_moe as fm
from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.moe_config import Config, get_config
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us

SHAPES = [(256, 66, 2), (64, 66, 2), (8, 64, 0)]  # (tokens, experts incl. shared, shared)
TILES = [(128, 64, 3), (128, 64, 4), (64, 64, 4), (128, 128, 3), (256, 64, 3)]  # (BLOCK_N, BLOCK_K, stages)


def down_us(inputs: dict, experts: int, config: Config, flush: torch.Tensor, per_sm: int | None = None) -> float:
    """Replay time of the down GEMM alone under `config` (persistent launches at per_sm programs an SM)."""
    original = fm._programs
    if per_sm:
        fm._programs = lambda t: per_sm * sm_count(t.device)
    try:
        plan = fm.plan_route(inputs["weights"], inputs["ids"], experts, config)
        act = fm.moe_up(inputs["hidden"], inputs["w13"], plan)
        return time_us(lambda: fm.moe_down(act, inputs["w2"], plan), 30, flush)
    finally:
        fm._programs = original


def main() -> None:
    torch.manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for tokens, experts, shared in SHAPES:
        inputs = make_inputs(tokens, make_weights(experts, 2048, 1408, torch.bfloat16, "cuda"), 6, shared)
        base = get_config(inputs["hidden"], inputs["w13"], 6 + shared)
        nbytes = int(torch.unique(inputs["ids"]).numel()) * 2048 * 1408 * 2

        def show(name: str, us: float, tokens: int = tokens, nbytes: int = nbytes) -> None:
            print(f"  {tokens} {name:48s} {us:7.1f} us {nbytes / us / 1e6:6.2f} TB/s", flush=True)

        print(tokens, "shipped", base, flush=True)
        show("shipped", down_us(inputs, experts, base, flush))
        if base["MODE"] != "dot" or base["DENSE"]:
            continue
        for bn, bk, stages in TILES:
            warps = 4 if bn * base["BLOCK_M"] <= 8192 else 8
            down = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages, "TMA": True}
            config = {**base, "ACT_TMA": True, "down": down}
            show(f"act_tma {bn}x{bk} s{stages}", down_us(inputs, experts, config, flush))
            for per_sm in (1, 2, 3, 4):
                persistent = {**config, "down": {**down, "PERSISTENT": True}}
                show(f"act_tma {bn}x{bk} s{stages} persistent x{per_sm}", down_us(inputs, experts, persistent, flush, per_sm))


if __name__ == "__main__":
    main()
