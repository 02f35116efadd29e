"""A/B two fused-MoE config files through the real kernels: time per GEMM and check both agree.

    python benchmarks/kernels/ab_moe_configs.py --baseline OLD.json [--candidate NEW.json]
        [--experts 64 --hidden 2048 --inter 1408 --topk 6 --shared 0] [--tokens 4096 8192 16384]

The candidate defaults to the shipped file for the shape on this GPU; OLD.json may be an older
version of it (`git show REV:moeserve/ops/triton/moe_configs/NAME > OLD.json`). Each token count
runs its bucket's config from each file on the same inputs (L2 flushed before every timed call,
as tune_moe times), and prints route / up / down / sum microseconds and the outputs' difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve.ops.triton.fused_moe import moe_down, moe_topk_sum, moe_up, plan_route  # noqa: E402
from moeserve.ops.triton.moe_config import CONFIG_DIR, config_file_name, device_name, pick_config  # noqa: E402
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us  # noqa: E402


def _configs(path: Path) -> dict[int, dict]:
    raw = json.loads(path.read_text())
    return {int(k): v for k, v in raw.items() if not k.startswith("_")}


def measure(inputs: dict, config: dict, experts: int, flush: torch.Tensor, iters: int) -> tuple[dict, torch.Tensor]:
    """Microseconds of each stage under `config`, and the summed output."""
    hidden, w13, w2 = inputs["hidden"], inputs["w13"], inputs["w2"]
    plan = plan_route(inputs["weights"], inputs["ids"], experts, config)
    act = moe_up(hidden, w13, plan)
    parts = moe_down(act, w2, plan)
    times = {
        "route": time_us(lambda: plan_route(inputs["weights"], inputs["ids"], experts, config), iters, flush),
        "up": time_us(lambda: moe_up(hidden, w13, plan), iters, flush),
        "down": time_us(lambda: moe_down(act, w2, plan), iters, flush),
        "sum": time_us(lambda: moe_topk_sum(parts, plan.topk), iters, flush),
    }
    return times, moe_topk_sum(parts, plan.topk)


def main() -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--candidate", type=Path, default=None)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--shared", type=int, default=0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    experts = a.experts + a.shared
    name = config_file_name(experts, a.inter, a.hidden, device_name(torch.device("cuda")), torch.bfloat16)
    files = {"baseline": a.baseline, "candidate": a.candidate or CONFIG_DIR / name}
    tables = {label: _configs(path) for label, path in files.items()}
    weights = make_weights(experts, a.hidden, a.inter, torch.bfloat16, "cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for tokens in a.tokens:
        inputs = make_inputs(tokens, weights, a.topk, a.shared)
        outs = {}
        for label, table in tables.items():
            config = pick_config(table, tokens, experts, a.topk + a.shared)
            times, outs[label] = measure(inputs, config, experts, flush, a.iters)
            total = sum(times.values())
            print(f"T={tokens:6d} {label:9s} total {total:8.1f} us  " + "  ".join(f"{k} {v:7.1f}" for k, v in times.items())
                  + f"  down {json.dumps(config['down'])}", flush=True)
        diff = (outs["baseline"].float() - outs["candidate"].float()).abs().max().item()
        print(f"T={tokens:6d} max |baseline - candidate| = {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
