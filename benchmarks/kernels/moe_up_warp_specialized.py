"""The prompt-size MoE gate/up GEMM: the Hopper (Gluon) kernel against the Triton one, at the power cap.

    python benchmarks/kernels/moe_up_warp_specialized.py [--tokens 16384,131072] [--rounds 3] [--output FILE]

Both write silu(gate) * up in block order for V2-Lite's routed experts (64 x 1408 x 2048, top-6);
the Triton kernel at its tuned tile (`moe_up`), the Gluon one (`moe_up_hopper`, persistent and
warp-specialized, its stores by TMA under the next tile's wgmmas). Each is checked against the other
(bit for bit on the rows the down GEMM reads), captured in a CUDA graph and timed in bursts and at
the power cap (replays back to back for 1.5 s first), taking turns within each round. The variants
dropped on the way (unpaired gate and up boxes, stores from registers) are in this file at 2cb922d.
"""

from __future__ import annotations

import argparse

import torch
from moe_tiles_power_capped import capped_us  # beside this script

from moeserve.bench.common import record, write_results
from moeserve.bench.roofline import capture_graph, replay_ms
from moeserve.ops.triton.fused_moe import moe_up, plan_route
from moeserve.ops.triton.moe_config import get_config
from moeserve.ops.triton.moe_up_hopper import moe_up_hopper
from moeserve.ops.triton.tune_moe import make_inputs, make_weights

EXPERTS, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6  # DeepSeek-V2-Lite's routed experts


def time_size(tokens: int, w13: torch.Tensor, w2: torch.Tensor, rounds: int) -> dict:
    """Burst and capped microseconds of both kernels at one token count, after checking they agree."""
    inputs = make_inputs(tokens, (w13, w2), TOP_K)
    x = inputs["hidden"]
    plan = plan_route(inputs["weights"], inputs["ids"], EXPERTS, get_config(x, w13, TOP_K))
    assert plan.config["ACT_TMA"] and plan.config["BLOCK_M"] == 128, "the Gluon kernel writes 128-row block order"
    variants = {
        "triton": lambda: moe_up(x, w13, plan),
        "gluon": lambda: moe_up_hopper(x, w13, plan.sorted_ids, plan.block_expert, plan.num_padded, plan.num_m,
                                       TOP_K),
    }
    read = plan.sorted_ids[: int(plan.num_padded)] < tokens * TOP_K
    outs = [fn()[: read.numel()][read] for fn in variants.values()]
    assert torch.equal(*outs), "the two kernels disagree"
    flops = tokens * TOP_K * 2 * INTER * HIDDEN * 2
    graphs = {name: capture_graph(fn) for name, fn in variants.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"burst_us": [], "capped_us": []} for name in graphs}
    for r in range(rounds):
        for name, graph in graphs.items():
            burst = replay_ms(graph, 20) * 1e3
            capped = capped_us(graph, 1.5)
            times[name]["burst_us"].append(round(burst, 1))
            times[name]["capped_us"].append(round(capped, 1))
            print(f"{tokens} tokens, round {r}, {name}: burst {burst:.1f} us ({flops / burst / 1e6:.0f} TFLOP/s), "
                  f"capped {capped:.1f} us ({flops / capped / 1e6:.0f})", flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384,131072", help="comma-separated token counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    w13, w2 = make_weights(EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda")
    rows = [record("moe_up_hopper_against_triton", "cuda", tokens=t, times=time_size(t, w13, w2, a.rounds))
            for t in (int(s) for s in a.tokens.split(","))]
    write_results(a.output, rows)


if __name__ == "__main__":
    main()
