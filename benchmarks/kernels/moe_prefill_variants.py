"""Time persistent fused-MoE gate/up and down GEMMs at prefill sizes against the shipped kernels and cuBLAS.

    python benchmarks/kernels/moe_prefill_variants.py [--tokens 16384,8192,4096] [--ws-only]

For 16384, 8192 and 4096 prompt tokens (or --tokens) (64 experts, hidden 2048, inter 1408, top-6, bf16) it times
the shipped moe_up / moe_down, cuBLAS on one dense GEMM of the same FLOPs as each, and the gather of
x into block order; then persistent variants of both GEMMs: the tile loop flattened or not, and the
gate/up's token rows gathered by pointer or pre-gathered and read by TMA, and Triton's automatic
warp specialization of the tile loop (`ws`; --ws-only times just those against the shipped). Each prints microseconds,
TF/s and the largest difference from the shipped kernel's output.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve.ops.triton.fused_moe import RoutePlan, moe_down, moe_up, plan_route  # noqa: E402
from moeserve.ops.triton.moe_align import moe_align  # noqa: E402
from moeserve.ops.triton.moe_config import get_config  # noqa: E402
from moeserve.ops.triton.moe_tiles import tile_ids  # noqa: E402
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us  # noqa: E402


@triton.jit
def _up_persistent(x_ptr, w_desc, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens,
                   stride_xt, stride_at, INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, X_TMA: tl.constexpr, WS: tl.constexpr):
    num_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(INTER, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = tile_ids(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = flat < num_tokens * TOPK
        x_rows = (flat // TOPK).to(tl.int64) * stride_xt
        gate_row = (expert * 2 * INTER + pid_n * BLOCK_N).to(tl.int32)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            wa = w_desc.load([gate_row, k0])
            wb = w_desc.load([gate_row + INTER, k0])
            if X_TMA:
                x = x_ptr.load([(pid_m * BLOCK_M).to(tl.int32), k0])
            else:
                x = tl.load(x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None], other=0.0)
            acc_g = tl.dot(x, tl.trans(wa), acc_g)
            acc_u = tl.dot(x, tl.trans(wb), acc_u)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < INTER))


@triton.jit
def _down_persistent(act_desc, w_desc, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                     num_tokens, stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    num_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(HIDDEN, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = tile_ids(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = flat < num_tokens * TOPK
        row = (expert * HIDDEN + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a = act_desc.load([(pid_m * BLOCK_M).to(tl.int32), k0])
            w = w_desc.load([row, k0])
            acc = tl.dot(a, tl.trans(w), acc)
        acc *= tl.load(weights_ptr + flat, mask=row_ok, other=0.0)[:, None]
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + flat.to(tl.int64)[:, None] * stride_ot + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (n[None, :] < HIDDEN))


def up_persistent(hidden: torch.Tensor, w13: torch.Tensor, plan: RoutePlan, num_padded: torch.Tensor,
                  cfg: dict, x_sorted: torch.Tensor | None = None) -> torch.Tensor:
    """Gate/up GEMM + SiLU*mul by the persistent kernel; x by pointer, or by TMA from `x_sorted`."""
    inter = w13.shape[1] // 2
    bm, bn, bk = plan.config["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    act = torch.empty(plan.num_m * bm, inter, dtype=hidden.dtype, device=hidden.device)
    rows = w13.view(-1, w13.shape[2])
    w_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bn, bk])
    x_arg = hidden
    if x_sorted is not None:
        x_arg = TensorDescriptor(x_sorted, list(x_sorted.shape), list(x_sorted.stride()), [bm, bk])
    nprog = cfg["programs"]
    _up_persistent[(nprog,)](x_arg, w_desc, act, plan.sorted_ids, plan.block_expert, num_padded,
                             plan.num_tokens, hidden.stride(0), act.stride(0), INTER=inter,
                             HIDDEN=hidden.shape[1], TOPK=plan.topk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=nprog,
                             FLATTEN=cfg["flatten"], X_TMA=x_sorted is not None, WS=cfg.get("ws", False),
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return act


def down_persistent(act: torch.Tensor, w2: torch.Tensor, plan: RoutePlan, num_padded: torch.Tensor,
                    cfg: dict) -> torch.Tensor:
    """Down GEMM, routing-weighted, by the persistent kernel with act read by TMA: [T * topk, hidden]."""
    hidden_size = w2.shape[1]
    bm, bn, bk = plan.config["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    out = torch.empty(plan.num_tokens * plan.topk, hidden_size, dtype=act.dtype, device=act.device)
    rows = w2.view(-1, w2.shape[2])
    w_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bn, bk])
    a_desc = TensorDescriptor(act, list(act.shape), list(act.stride()), [bm, bk])
    nprog = cfg["programs"]
    _down_persistent[(nprog,)](a_desc, w_desc, out, plan.weights, plan.sorted_ids, plan.block_expert,
                               num_padded, plan.num_tokens, out.stride(0), INTER=act.shape[1],
                               HIDDEN=hidden_size, TOPK=plan.topk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=nprog, FLATTEN=cfg["flatten"],
                               WS=cfg.get("ws", False),
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


UP_VARIANTS = [  # BLOCK_N, BLOCK_K, warps, stages, GROUP_M, flatten, programs per SM, x by TMA, ws
    (128, 64, 8, 3, 8, False, 1, False, False), (128, 64, 8, 3, 8, True, 1, False, False),
    (128, 64, 8, 4, 8, True, 1, False, False), (128, 64, 8, 3, 8, True, 1, True, False),
    (128, 64, 8, 4, 8, True, 1, True, False), (64, 64, 4, 4, 8, True, 2, False, False),
    (64, 64, 4, 4, 8, True, 2, True, False),
    (128, 64, 8, 3, 16, True, 1, False, False), (64, 128, 4, 3, 8, True, 2, False, False),
    # Not flattened, 4 stages: token rows by pointer, then pre-gathered and read by TMA.
    (128, 64, 8, 4, 8, False, 1, False, False), (128, 64, 8, 4, 8, False, 1, True, False),
]
UP_WS = [  # warp-specialized: every operand by TMA (x pre-gathered), or x rows by pointer
    (128, 64, 8, 3, 8, True, 1, True, True), (128, 64, 8, 4, 8, True, 1, True, True),
    (128, 64, 4, 3, 8, True, 1, True, True), (128, 64, 4, 4, 8, True, 1, True, True),
    (128, 64, 8, 3, 8, True, 1, False, True),
]
DOWN_VARIANTS = [  # BLOCK_N, BLOCK_K, warps, stages, GROUP_M, flatten, programs per SM, ws
    (256, 64, 8, 3, 8, False, 1, False), (256, 64, 8, 3, 8, True, 1, False), (256, 64, 8, 4, 8, True, 1, False),
    (128, 64, 8, 4, 8, True, 1, False), (128, 64, 4, 4, 8, True, 2, False), (128, 128, 8, 3, 8, True, 1, False),
    (256, 64, 8, 3, 16, True, 1, False),
]
DOWN_WS = [
    (256, 64, 8, 3, 8, True, 1, True), (256, 64, 8, 4, 8, True, 1, True), (128, 64, 8, 4, 8, True, 1, True),
    (128, 64, 4, 4, 8, True, 1, True), (256, 64, 4, 3, 8, True, 1, True), (128, 128, 8, 3, 8, True, 1, True),
]


V2_LITE_MOE = (64, 2048, 1408, 6)  # experts, hidden, inter, top-k


def prompt_cases(token_counts: list[int]):
    """Yield (tokens, inputs, tuned config, route plan, L2 flush buffer) for each count, on one set of
    random V2-Lite-shaped expert weights (bf16, on the GPU)."""
    experts, hidden_size, inter, topk = V2_LITE_MOE
    weights = make_weights(experts, hidden_size, inter, torch.bfloat16, "cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for tokens in token_counts:
        inp = make_inputs(tokens, weights, topk)
        config = get_config(inp["hidden"], inp["w13"], topk)
        yield tokens, inp, config, plan_route(inp["weights"], inp["ids"], experts, config), flush


def main() -> None:
    """Run every measurement at the --tokens sizes and print it."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,8192,4096")
    ap.add_argument("--ws-only", action="store_true", help="only the warp-specialized variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    experts, hidden_size, inter, topk = V2_LITE_MOE
    for tokens, inp, config, plan, flush in prompt_cases([int(t) for t in args.tokens.split(",")]):
        hidden, w13, w2 = inp["hidden"], inp["w13"], inp["w2"]
        _, _, num_padded = moe_align(plan.ids, experts, config["BLOCK_M"])
        pairs = tokens * topk
        up_flop = 2 * pairs * hidden_size * 2 * inter
        down_flop = 2 * pairs * inter * hidden_size
        act_ref = moe_up(hidden, w13, plan)
        out_ref = moe_down(act_ref, w2, plan)
        t_up = time_us(lambda hidden=hidden, w13=w13, plan=plan: moe_up(hidden, w13, plan), 20, flush)
        t_down = time_us(lambda act_ref=act_ref, w2=w2, plan=plan: moe_down(act_ref, w2, plan), 20, flush)
        print(f"T={tokens} shipped BM{config['BLOCK_M']} up {t_up:.1f} us ({up_flop / t_up / 1e6:.0f} TF/s) "
              f"down {t_down:.1f} us ({down_flop / t_down / 1e6:.0f} TF/s)", flush=True)
        # cuBLAS on the same FLOPs as one dense GEMM (the ceiling without grouping)
        a = torch.randn(pairs, hidden_size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(2 * inter, hidden_size, device="cuda", dtype=torch.bfloat16)
        t = time_us(lambda a=a, b=b: a @ b.T, 20, flush)
        print(f"  cublas up-shape {t:.1f} us ({up_flop / t / 1e6:.0f} TF/s)")
        a2 = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)
        b2 = torch.randn(hidden_size, inter, device="cuda", dtype=torch.bfloat16)
        t = time_us(lambda a2=a2, b2=b2: a2 @ b2.T, 20, flush)
        print(f"  cublas down-shape {t:.1f} us ({down_flop / t / 1e6:.0f} TF/s)", flush=True)
        # gather cost for a TMA-read A
        idx = (plan.sorted_ids.long() // topk).clamp(max=tokens - 1)
        t = time_us(lambda hidden=hidden, idx=idx: hidden.index_select(0, idx), 20, flush)
        print(f"  gather x to block order {t:.1f} us", flush=True)
        x_sorted = hidden.index_select(0, idx)
        ok = plan.sorted_ids < pairs
        for bn, bk, warps, stages, gm, flat, mult, xt, ws in UP_WS if args.ws_only else UP_VARIANTS + UP_WS:
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "GROUP_M": gm,
                   "flatten": flat, "programs": sms * mult, "ws": ws}
            try:
                xs = x_sorted if xt else None
                act = up_persistent(hidden, w13, plan, num_padded, cfg, xs)
                err = (act[ok] - act_ref[plan.sorted_ids[ok].long()] if not config.get("ACT_TMA")
                       else act[ok] - act_ref[ok]).abs().max().item()
                t = time_us(lambda c=cfg, xs=xs, hidden=hidden, w13=w13, plan=plan, num_padded=num_padded:
                            up_persistent(hidden, w13, plan, num_padded, c, xs), 20, flush)
                print(f"  up persistent {cfg} xtma={xt}: {t:.1f} us ({up_flop / t / 1e6:.0f} TF/s) "
                      f"err {err:.3g}", flush=True)
            except Exception as exc:
                print(f"  up persistent {cfg} failed: {str(exc)[:200]}", flush=True)
        act_blk = up_persistent(hidden, w13, plan, num_padded, {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8,
                                "num_stages": 3, "GROUP_M": 8, "flatten": False, "programs": sms})
        for bn, bk, warps, stages, gm, flat, mult, ws in DOWN_WS if args.ws_only else DOWN_VARIANTS + DOWN_WS:
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "GROUP_M": gm,
                   "flatten": flat, "programs": sms * mult, "ws": ws}
            try:
                out = down_persistent(act_blk, w2, plan, num_padded, cfg)
                err = (out.float() - out_ref.float()).abs().max().item()
                t = time_us(lambda c=cfg, act_blk=act_blk, w2=w2, plan=plan, num_padded=num_padded:
                            down_persistent(act_blk, w2, plan, num_padded, c), 20, flush)
                print(f"  down persistent {cfg}: {t:.1f} us ({down_flop / t / 1e6:.0f} TF/s) err {err:.3g}",
                      flush=True)
            except Exception as exc:
                print(f"  down persistent {cfg} failed: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
