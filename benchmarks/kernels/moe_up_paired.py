"""Time the prefill gate/up GEMM with gate and up rows paired in one TMA tile against the shipped kernel.

    python benchmarks/kernels/moe_up_paired.py [--tokens 131072,16384,4096]

The shipped TMA path multiplies each token block by a gate tile and an up tile in two MMAs of
BLOCK_N columns. Here one 4-D descriptor over w13 viewed as [E, I, 2, H] (strides 2IH, H, IH, 1)
loads BLOCK_N gate rows and the same BLOCK_N up rows interleaved into one [2 * BLOCK_N, BLOCK_K]
tile, so one MMA of twice the width computes both (the activation is read from shared memory
once, not twice) and the interleaved accumulator splits in registers. Prints microseconds, TF/s
and the largest difference from the shipped kernel's output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve.ops.triton.fused_moe import _tile_ids, moe_up, plan_route  # noqa: E402
from moeserve.ops.triton.moe_config import get_config  # noqa: E402
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us  # noqa: E402


@triton.jit
def _up_paired(x_ptr, w_desc, act_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_m, stride_xt, stride_at,
               INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_ORDER: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = flat < num_tokens * TOPK
    x_rows = (flat // TOPK) * stride_xt
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        w = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, 0, k0])
        w = tl.reshape(w, [2 * BLOCK_N, BLOCK_K])
        x = tl.load(x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    act = gate * tl.sigmoid(gate) * up
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) if BLOCK_ORDER else flat
    tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < INTER))


def up_paired(hidden: torch.Tensor, w13: torch.Tensor, plan, cfg: dict, block_order: bool) -> torch.Tensor:
    """silu(gate) * up by the paired kernel, rows in block order or pair order like the shipped kernel."""
    experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    bm, bn, bk = plan.config["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    rows = plan.num_m * bm if block_order else plan.num_tokens * plan.topk
    act = torch.empty(rows, inter, dtype=hidden.dtype, device=hidden.device)
    desc = TensorDescriptor(w13, [experts, inter, 2, hidden_size], [two_inter * hidden_size, hidden_size,
                            inter * hidden_size, 1], [1, bn, 2, bk])
    grid = (plan.num_m * triton.cdiv(inter, bn),)
    _up_paired[grid](hidden, desc, act, plan.sorted_ids, plan.block_expert, plan.num_tokens, plan.num_m,
                     hidden.stride(0), act.stride(0), INTER=inter, HIDDEN=hidden_size, TOPK=plan.topk,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], BLOCK_ORDER=block_order,
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return act


VARIANTS = [  # BLOCK_N (of each of gate and up), BLOCK_K, warps, stages, GROUP_M
    (128, 64, 8, 3, 8), (128, 64, 8, 4, 8), (64, 64, 8, 4, 8), (64, 64, 4, 4, 8), (128, 64, 8, 3, 16),
    (64, 128, 8, 3, 8),
]


def main() -> None:
    """Time the shipped moe_up and the paired variants at each --tokens size."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="131072,16384,4096")
    ap.add_argument("--shipped-only", action="store_true", help="time only moe_up (an A/B of two trees)")
    args = ap.parse_args()
    torch.manual_seed(0)
    experts, hidden_size, inter, topk = 64, 2048, 1408, 6
    weights = make_weights(experts, hidden_size, inter, torch.bfloat16, "cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        inp = make_inputs(tokens, weights, topk)
        hidden, w13 = inp["hidden"], inp["w13"]
        config = get_config(hidden, w13, topk)
        plan = plan_route(inp["weights"], inp["ids"], experts, config)
        block_order = bool(config.get("ACT_TMA", False))
        flop = 2 * tokens * topk * hidden_size * 2 * inter
        ref = moe_up(hidden, w13, plan)
        t = time_us(lambda hidden=hidden, w13=w13, plan=plan: moe_up(hidden, w13, plan), 10, flush)
        print(f"T={tokens} shipped {config['up']} BM{config['BLOCK_M']}: {t:.1f} us ({flop / t / 1e6:.0f} TF/s)",
              flush=True)
        ok = (plan.sorted_ids < tokens * topk) if block_order else slice(None)
        for bn, bk, warps, stages, gm in [] if args.shipped_only else VARIANTS:
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "GROUP_M": gm}
            try:
                act = up_paired(hidden, w13, plan, cfg, block_order)
                err = (act[ok].float() - ref[ok].float()).abs().max().item()
                t = time_us(lambda c=cfg, h=hidden, w=w13, p=plan, bo=block_order: up_paired(h, w, p, c, bo), 10, flush)
                print(f"  paired {cfg}: {t:.1f} us ({flop / t / 1e6:.0f} TF/s) err {err:.3g}", flush=True)
            except Exception as exc:  # out of shared memory or registers at this tile
                print(f"  paired {cfg} failed: {type(exc).__name__} {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
