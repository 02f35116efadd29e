"""Prompt-size fused-MoE tiles timed at the power cap, as the b256 and offline prompt steps run.

    python benchmarks/kernels/moe_tiles_power_capped.py [--tokens 131072] [--rounds 2] [--output FILE]

The tuner times short bursts after idle, at full clock; a long prompt step holds the H200 at its
700 W cap (about 1.56 GHz). Here each candidate of the shipped grouping (the tuner's tiles with the
shipped one's TMA setting, plus GROUP_M variants of the shipped tiles) is captured in a CUDA graph,
replayed back to back for `--settle` seconds so the clock settles, then timed over 40 replays.
Candidates take turns within each round. Prints microseconds and TFLOP/s per GEMM.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.bench.common import record, write_results
from moeserve.bench.roofline import capture_graph, replay_ms
from moeserve.ops.triton.fused_moe import RoutePlan, moe_down, moe_up, plan_route
from moeserve.ops.triton.moe_config import get_config
from moeserve.ops.triton.tune_moe import _with, candidate_gemms, make_inputs, make_weights

EXPERTS, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6  # DeepSeek-V2-Lite's routed experts


def candidates(config: dict) -> list[tuple[str, dict]]:
    """(part, tile) pairs: the tuner's tiles for the shipped grouping, and GROUP_M variants of the shipped ones."""
    grouping = {k: config[k] for k in ("DENSE", "MODE", "BLOCK_M", "ACT_TMA") if k in config}
    tma = config["up"].get("TMA", False)
    ups = [g for g in candidate_gemms(grouping, "up", 2, False, tma) if g.get("TMA", False) == tma]
    downs = [g for g in candidate_gemms(grouping, "down", 2, False, tma) if g.get("TMA", False) == tma]
    if config["down"].get("PERSISTENT"):
        downs = [{**g, "PERSISTENT": True} for g in downs] + [{k: v for k, v in config["down"].items() if k != "PERSISTENT"}]
    out = [("up", g) for g in ups] + [("down", g) for g in downs]
    out += [(part, {**config[part], "GROUP_M": m}) for part in ("up", "down") for m in (4, 16, 32)]
    shipped = [("up", config["up"]), ("down", config["down"])]
    return shipped + [c for c in out if c not in shipped]


def capped_us(graph: torch.cuda.CUDAGraph, settle_s: float, replays: int = 40) -> float:
    """Mean microseconds a replay after `settle_s` seconds of back-to-back replays."""
    start = time.perf_counter()
    while time.perf_counter() - start < settle_s:
        graph.replay()
        torch.cuda.synchronize()
    return replay_ms(graph, replays) * 1e3


def capture(plan: RoutePlan, inputs: dict, act: torch.Tensor, part: str, tile: dict) -> torch.cuda.CUDAGraph:
    """One call of the GEMM `part` with `tile`, compiled, run once and captured."""
    p = _with(plan, part, tile)
    fn = (lambda: moe_up(inputs["hidden"], inputs["w13"], p)) if part == "up" else (lambda: moe_down(act, inputs["w2"], p))
    return capture_graph(fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle", type=float, default=1.5, help="seconds of replays before each timing")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    w13, w2 = make_weights(EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda")
    inputs = make_inputs(a.tokens, (w13, w2), TOP_K)
    config = get_config(inputs["hidden"], w13, TOP_K)
    plan = plan_route(inputs["weights"], inputs["ids"], EXPERTS, config)
    act = moe_up(inputs["hidden"], w13, plan)
    graphs = []
    for part, tile in candidates(config):
        try:
            graphs.append((part, tile, capture(plan, inputs, act, part, tile)))
        except Exception as exc:  # a tile past shared memory or registers: skipped
            print("skipped", part, tile, exc)
    flops = {"up": a.tokens * TOP_K * 2 * INTER * HIDDEN * 2, "down": a.tokens * TOP_K * INTER * HIDDEN * 2}
    times: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for part, tile, graph in graphs:
            us = capped_us(graph, a.settle)
            key = f"{part} {sorted(tile.items())}"
            times.setdefault(key, []).append(round(us, 1))
            print(f"round {r} {key}: {us:.1f} us, {flops[part] / us / 1e6:.1f} TFLOP/s", flush=True)
    write_results(a.output, [record("moe_prefill_tiles_power_capped", "cuda", tokens=a.tokens, shipped=config,
                                    capped_us=times)])


if __name__ == "__main__":
    main()
