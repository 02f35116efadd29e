"""Time decode-size MoE GEMMs with weights row-major vs pre-tiled (each TMA tile one contiguous block).

    python benchmarks/kernels/moe_weight_layout.py

At 256, 128 and 512 tokens, with 66 experts (64 routed + 2 shared fused, top-6 + 2 = 8 per token,
hidden 2048, inter 1408, bf16), it times the shipped moe_up / moe_down, then the down and gate/up
GEMMs over a range of tile shapes, each with the weights row-major and pre-tiled, printing
microseconds and the largest difference from the shipped output. Last, a plain torch.sum over
380 MiB as a read-bandwidth reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve.ops.triton.fused_moe import moe_down, moe_up, plan_route  # noqa: E402
from moeserve.ops.triton.moe_config import get_config  # noqa: E402
from moeserve.ops.triton.moe_tiles import block_rows, tile_ids  # noqa: E402
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us  # noqa: E402


@triton.jit
def _down_tiled(act_ptr, w_desc, out_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                num_m, stride_at, stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                TILED: tl.constexpr):
    pid_m, pid_n = tile_ids(tl.program_id(0), num_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    expert, flat, row_ok = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, TOPK, 1,
                                       False, BLOCK_M)
    if expert < 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KT: tl.constexpr = INTER // BLOCK_K
    NT: tl.constexpr = HIDDEN // BLOCK_N
    for kt in range(0, KT):
        if TILED:
            w = w_desc.load([(((expert * NT + pid_n) * KT + kt) * BLOCK_N).to(tl.int32), 0])
        else:
            w = w_desc.load([(expert * HIDDEN + pid_n * BLOCK_N).to(tl.int32), kt * BLOCK_K])
        a = tl.load(act_ptr + flat[:, None] * stride_at + (kt * BLOCK_K + offs_k)[None, :],
                    mask=row_ok[:, None])
        acc = tl.dot(a, tl.trans(w), acc)
    acc *= tl.load(weights_ptr + flat, mask=row_ok, other=0.0)[:, None]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + flat[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _up_tiled(x_ptr, w_desc, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_m, stride_xt,
              stride_at, INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TILED: tl.constexpr):
    pid_m, pid_n = tile_ids(tl.program_id(0), num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    expert, flat, row_ok = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, TOPK, 1,
                                       False, BLOCK_M)
    if expert < 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = (flat // TOPK) * stride_xt
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KT: tl.constexpr = HIDDEN // BLOCK_K
    NT: tl.constexpr = 2 * INTER // BLOCK_N
    for kt in range(0, KT):
        if TILED:
            g = w_desc.load([(((expert * NT + pid_n) * KT + kt) * BLOCK_N).to(tl.int32), 0])
            u = w_desc.load([(((expert * NT + pid_n + NT // 2) * KT + kt) * BLOCK_N).to(tl.int32), 0])
        else:
            g = w_desc.load([(expert * 2 * INTER + pid_n * BLOCK_N).to(tl.int32), kt * BLOCK_K])
            u = w_desc.load([(expert * 2 * INTER + INTER + pid_n * BLOCK_N).to(tl.int32), kt * BLOCK_K])
        x = tl.load(x_ptr + x_rows[:, None] + (kt * BLOCK_K + offs_k)[None, :], mask=row_ok[:, None])
        acc_g = tl.dot(x, tl.trans(g), acc_g)
        acc_u = tl.dot(x, tl.trans(u), acc_u)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + flat[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tile(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[E, N, K] weights reordered so each [bn, bk] tile is one contiguous block, as rows of bk."""
    e, n, k = w.shape
    return w.view(e, n // bn, bn, k // bk, bk).permute(0, 1, 3, 2, 4).contiguous().view(-1, bk)


def main() -> None:
    """Run every measurement at 256, 128 and 512 tokens, then the torch.sum reference, and print them."""
    torch.manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    w13, w2 = make_weights(66, 2048, 1408, torch.bfloat16, "cuda")
    for tokens in (256, 128, 512):
        inp = make_inputs(tokens, (w13, w2), 6, shared=2)
        hidden = inp["hidden"]
        config = get_config(hidden, w13, 8)
        config = {**config, "MODE": "dot", "BLOCK_M": 64 if tokens >= 192 else 32}
        plan = plan_route(inp["weights"], inp["ids"], 66, config)
        act_ref = moe_up(hidden, w13, plan)
        out_ref = moe_down(act_ref, w2, plan)
        t_up = time_us(lambda hidden=hidden, plan=plan: moe_up(hidden, w13, plan), 30, flush)
        t_down = time_us(lambda act_ref=act_ref, plan=plan: moe_down(act_ref, w2, plan), 30, flush)
        print(f"T={tokens} shipped-ish ({config['MODE']} BM{config['BLOCK_M']}): up "
              f"{t_up:.1f} down {t_down:.1f} us", flush=True)
        bm = plan.config["BLOCK_M"]
        for bn, bk, warps, stages in [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 4, 3),
                                      (64, 128, 4, 4), (256, 64, 8, 3)]:
            if 1408 % bk or 2048 % bn:
                continue
            wt = tile(w2, bn, bk)
            for tiled in (False, True):
                src = wt if tiled else w2.view(-1, 1408)
                desc = TensorDescriptor(src, list(src.shape), list(src.stride()), [bn, bk])
                out = torch.empty_like(out_ref)
                grid = (plan.num_m * (2048 // bn),)

                def run(desc=desc, out=out, tiled=tiled, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid,
                        act_ref=act_ref, plan=plan, tokens=tokens, bm=bm) -> None:
                    _down_tiled[grid](act_ref, desc, out, plan.weights, plan.ids, plan.sorted_ids,
                                      plan.block_expert, tokens, plan.num_m, act_ref.stride(0), out.stride(0),
                                      INTER=1408, HIDDEN=2048, TOPK=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                      GROUP_M=8, TILED=tiled, num_warps=warps, num_stages=stages)
                run()
                err = (out.float() - out_ref.float()).abs().max().item()
                print(f"  down bn{bn} bk{bk} w{warps} s{stages} tiled={tiled}: "
                      f"{time_us(run, 30, flush):.1f} us err {err:.3g}", flush=True)
            del wt
        for bn, bk, warps, stages in [(64, 64, 4, 3), (64, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3),
                                      (128, 64, 8, 3)]:
            wt = tile(w13, bn, bk)
            for tiled in (False, True):
                src = wt if tiled else w13.view(-1, 2048)
                desc = TensorDescriptor(src, list(src.shape), list(src.stride()), [bn, bk])
                act = torch.empty_like(act_ref)
                grid = (plan.num_m * (1408 // bn if 1408 % bn == 0 else 0),)
                if grid[0] == 0:
                    continue

                def run(desc=desc, act=act, tiled=tiled, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid,
                        hidden=hidden, plan=plan, tokens=tokens, bm=bm) -> None:
                    _up_tiled[grid](hidden, desc, act, plan.ids, plan.sorted_ids, plan.block_expert, tokens,
                                    plan.num_m, hidden.stride(0), act.stride(0), INTER=1408, HIDDEN=2048,
                                    TOPK=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TILED=tiled,
                                    num_warps=warps, num_stages=stages)
                run()
                err = (act.float() - act_ref.float()).abs().max().item()
                print(f"  up bn{bn} bk{bk} w{warps} s{stages} tiled={tiled}: "
                      f"{time_us(run, 30, flush):.1f} us err {err:.3g}", flush=True)
            del wt
    # raw bandwidth: read 380 MB by torch sum
    big = torch.empty(380 * 2**20 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    us = time_us(lambda: big.sum(), 30, flush)
    print(f"torch sum over 380 MiB: {us:.1f} us = {big.numel() * 2 / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
