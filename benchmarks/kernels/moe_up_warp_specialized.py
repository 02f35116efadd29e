"""A warp-specialized, persistent gate/up GEMM for prompt-size MoE in Gluon, against the shipped one.

    python benchmarks/kernels/moe_up_warp_specialized.py [--tokens 131072] [--rounds 2] [--output FILE]

The shipped up GEMM (fused_moe.py, Triton) multiplies a block of expert-sorted token rows, gathered
by pointer loads, by TMA-loaded weight tiles, software-pipelined over three stages; Triton ran it at
half speed when made persistent over pointer loads. This kernel tries what a hand-written Hopper
GEMM would: a loading partition of four warps gathers the token rows by cp.async (each thread's
copies arrive on the stage's mbarrier) and the gate and up weight tiles by TMA into STAGES slots,
running ahead into the next tile while two warpgroups finish this one (wgmmas into a gate and an up
accumulator, or with `paired` one accumulator over interleaved gate / up rows, then silu(gate) * up
stored in block order, as the shipped ACT_TMA path does). Its output matches the shipped kernel's bit
for bit; it is timed in bursts and at the power cap (replays back to back for 1.5 s first). Kept as
a record: on an H100 at 131,072 tokens, storing from registers, it comes within 0.3-2% of the shipped
kernel at the cap (three stages: 14.22-14.42 against 13.92-14.19 ms), never faster; the first build
(4-byte stores straight from the MMA layout) was 8-11% slower. `async_store` puts each tile's output
in shared memory by stmatrix and hands it to a TMA store that runs under the next tile's wgmmas:
paired, 0.9-3.7% faster than the shipped kernel at the cap at 131,072 tokens (14.22-14.34 against
14.74-14.82 ms in one run, 13.94-14.12 against 14.25-14.44 in another), 1.6% faster to 6.9% slower at
16,384. Wired into fused_moe from 8,192 tokens (e7594b3), it left b256's prompt steps even (2,040-2,066
against 2,045-2,049 ms on an H100), so it is not shipped.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeserve.bench.common import record, write_results
from moeserve.bench.roofline import capture_graph, replay_ms
from moeserve.ops.triton.fused_moe import moe_up, plan_route
from moeserve.ops.triton.moe_config import get_config
from moeserve.ops.triton.moe_tiles import tile_ids
from moeserve.ops.triton.tune_moe import make_inputs, make_weights

EXPERTS, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6  # DeepSeek-V2-Lite's routed experts


LOADER_WARPS = gl.constexpr(4)


@gluon.jit
def _loader(x_ptr, w_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready, empty,
            numel, stride_xt, num_n, INTER: gl.constexpr, TOPK: gl.constexpr, BM: gl.constexpr,
            BN: gl.constexpr, BK: gl.constexpr, K_STEPS: gl.constexpr, STAGES: gl.constexpr,
            GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr, PAIRED: gl.constexpr):
    """The loading warps: each k step's token rows (cp.async) and weight boxes (TMA) into a free slot."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])
    used_m = gl.load(num_padded_ptr) // BM
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    it = 0
    for tile in range(gl.program_id(0), used_m * num_n, PROGRAMS):
        pid_m, pid_n = tile_ids(tile, used_m, num_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m)
        flat = gl.load(sorted_ptr + pid_m * BM + rows)
        token = gl.where(flat < numel, flat // TOPK, 0)
        base = x_ptr + token.to(gl.int64)[:, None] * stride_xt + cols[None, :]
        w_row = expert * (2 * INTER) + pid_n * BN
        for k in range(K_STEPS):
            s = it % STAGES
            if it >= STAGES:
                mbarrier.wait(empty.index(s), (it // STAGES - 1) & 1)
            if PAIRED:
                mbarrier.expect(b_ready.index(s), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [expert, pid_n * BN, 0, k * BK], b_ready.index(s), b_smem.index(s))
            else:
                mbarrier.expect(b_ready.index(s), 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [w_row, k * BK], b_ready.index(s), b_smem.index(2 * s))
                tma.async_copy_global_to_shared(w_desc, [w_row + INTER, k * BK], b_ready.index(s),
                                                b_smem.index(2 * s + 1))
            async_copy.async_copy_global_to_shared(a_smem.index(s), base + k * BK)
            # Each thread arrives once its own copies land: the barrier counts every loading thread.
            async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
            it += 1


@gluon.jit
def _wait_stage(a_ready, b_ready, it, STAGES: gl.constexpr):
    """Wait until load `it`'s token rows and weights are in its slot; -> the slot."""
    s = it % STAGES
    phase = (it // STAGES) & 1
    mbarrier.wait(a_ready.index(s), phase)
    mbarrier.wait(b_ready.index(s), phase)
    # The rows came by cp.async (the generic proxy); the wgmmas read through the async proxy.
    fence_async_shared()
    return s


@gluon.jit
def _consumer(act_ptr, sorted_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready, empty, numel, stride_at,
              num_n, INTER: gl.constexpr, TOPK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              K_STEPS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr,
              layout: gl.constexpr, PAIRED: gl.constexpr, BK: gl.constexpr, act_desc, staging,
              ASYNC_STORE: gl.constexpr):
    """The two compute warpgroups: a tile's wgmmas one slot behind the loads, then silu(gate) * up."""
    used_m = gl.load(num_padded_ptr) // BM
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    it = 0
    for tile in range(gl.program_id(0), used_m * num_n, PROGRAMS):
        pid_m, pid_n = tile_ids(tile, used_m, num_n, GROUP_M)
        if PAIRED:
            gu = warpgroup_mma_init(gl.zeros([BM, 2 * BN], gl.float32, layout))
            for k in range(K_STEPS):
                s = _wait_stage(a_ready, b_ready, it, STAGES)
                b_tile = b_smem.index(s).reshape([2 * BN, BK])
                gu = warpgroup_mma(a_smem.index(s), b_tile.permute((1, 0)), gu, is_async=True)
                gu = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(gu,)))
                if k > 0:
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
                it += 1
            gu = warpgroup_mma_wait(num_outstanding=0, deps=(gu,))
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            g, u = gl.split(gl.reshape(gu, [BM, BN, 2]))
            act = (g / (1.0 + gl.exp(-g)) * u).to(act_ptr.dtype.element_ty)
        else:
            g = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, layout))
            u = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, layout))
            for k in range(K_STEPS):
                s = _wait_stage(a_ready, b_ready, it, STAGES)
                g = warpgroup_mma(a_smem.index(s), b_smem.index(2 * s).permute((1, 0)), g, is_async=True)
                u = warpgroup_mma(a_smem.index(s), b_smem.index(2 * s + 1).permute((1, 0)), u, is_async=True)
                g, u = warpgroup_mma_wait(num_outstanding=2, deps=(g, u))
                g = warpgroup_mma_init(g)
                u = warpgroup_mma_init(u)
                if k > 0:
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
                it += 1
            g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            act = (g / (1.0 + gl.exp(-g)) * u).to(act_ptr.dtype.element_ty)
        if ASYNC_STORE:
            # Padding rows are written too (the down GEMM masks them); the copy runs under the next tile.
            tma.store_wait(0)
            staging.store(act)
            fence_async_shared()
            tma.async_copy_shared_to_global(act_desc, [pid_m * BM, pid_n * BN], staging)
        else:
            # 16-byte stores from a blocked layout: straight from the MMA layout (4-byte) cost 8-11%.
            act = gl.convert_layout(act, out_layout)
            out_rows = (pid_m * BM + rows).to(gl.int64)
            flat = gl.load(sorted_ptr + pid_m * BM + rows)
            n = pid_n * BN + cols
            ptrs = act_ptr + out_rows[:, None] * stride_at + n[None, :]
            gl.store(ptrs, act, mask=(flat < numel)[:, None] & (n < INTER)[None, :])
    if ASYNC_STORE:
        tma.store_wait(0)


@gluon.jit
def _moe_up_ws_kernel(x_ptr, w_desc, act_ptr, act_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, numel,
                      stride_xt, stride_at, INTER: gl.constexpr, HIDDEN: gl.constexpr, TOPK: gl.constexpr,
                      BM: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, PAIRED: gl.constexpr, ASYNC_STORE: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[1] if PAIRED else w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[3] if PAIRED else w_desc.block_type.shape[1]
    K_STEPS: gl.constexpr = HIDDEN // BK
    WARPS: gl.constexpr = gl.num_warps()
    NW: gl.constexpr = 2 * BN if PAIRED else BN
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, NW, 16])
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_layout)
    if PAIRED:
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BN, 2, BK], w_desc.layout)
    else:
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BN, BK], w_desc.layout)
    staging = gl.allocate_shared_memory(gl.bfloat16, [BM, BN] if ASYNC_STORE else [1, BN], act_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=LOADER_WARPS * 32)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    num_n = gl.cdiv(INTER, BN)
    gl.warp_specialize(
        [(_consumer, (act_ptr, sorted_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready, empty, numel,
                      stride_at, num_n, INTER, TOPK, BM, BN, K_STEPS, STAGES, GROUP_M, PROGRAMS, layout, PAIRED, BK,
                      act_desc, staging, ASYNC_STORE)),
         (_loader, (x_ptr, w_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready,
                    empty, numel, stride_xt, num_n, INTER, TOPK, BM, BN, BK, K_STEPS, STAGES, GROUP_M, PROGRAMS,
                    PAIRED))],
        [LOADER_WARPS.value], [LOADER_REGS])


def weight_descriptor(w13: torch.Tensor, bn: int, bk: int, paired: bool = False) -> TensorDescriptor:
    """TMA over w13: [E * 2I, H] rows (an expert's gate rows, then its up rows) in [bn, bk] boxes, or with
    `paired` [E, I, 2, H] in [1, bn, 2, bk] boxes (gate and up rows interleaved, one MMA for both)."""
    if paired:
        e, inter, h = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
        layout = gl.NVMMASharedLayout.get_default_for([1, bn, 2, bk], gl.bfloat16)
        return TensorDescriptor(w13, [e, inter, 2, h], [w13.stride(0), w13.stride(1), inter * w13.stride(1), 1],
                                [1, bn, 2, bk], layout)
    rows = w13.view(-1, w13.shape[2])
    layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bn, bk], layout)


def moe_up_ws(hidden, w13, sorted_ids, block_expert, num_padded, num_m, topk, bm=128, bn=128, bk=64, stages=3,
              group_m=8, programs=132, loader_regs=64, warps=8, compile_only=False, paired=False, async_store=False):
    """act [num_m * bm, I] in block order, as fused_moe's ACT_TMA up GEMM writes it."""
    inter = w13.shape[1] // 2
    act = torch.empty(num_m * bm, inter, dtype=hidden.dtype, device=hidden.device)
    act_layout = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16)
    act_desc = TensorDescriptor(act, list(act.shape), list(act.stride()), [bm, bn], act_layout)
    args = (hidden, weight_descriptor(w13, bn, bk, paired), act, act_desc, sorted_ids, block_expert, num_padded,
            hidden.shape[0] * topk, hidden.stride(0), act.stride(0))
    kw = dict(INTER=inter, HIDDEN=hidden.shape[1], TOPK=topk, BM=bm, STAGES=stages, GROUP_M=group_m,
              PROGRAMS=programs, LOADER_REGS=loader_regs, PAIRED=paired, ASYNC_STORE=async_store, num_warps=warps)
    if compile_only:
        return _moe_up_ws_kernel.warmup(*args, grid=(programs,), **kw)
    _moe_up_ws_kernel[(programs,)](*args, **kw)
    return act


def main() -> None:
    from moe_tiles_power_capped import capped_us  # beside this script

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    w13, w2 = make_weights(EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda")
    inputs = make_inputs(a.tokens, (w13, w2), TOP_K)
    x = inputs["hidden"]
    plan = plan_route(inputs["weights"], inputs["ids"], EXPERTS, get_config(x, w13, TOP_K))
    assert plan.config["ACT_TMA"], "the Gluon kernel writes block order, as the ACT_TMA path does"
    ref = moe_up(x, w13, plan)
    valid = plan.sorted_ids[: ref.shape[0]] < a.tokens * TOP_K
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {"shipped": lambda: moe_up(x, w13, plan)}
    for stages, paired, regs, tma_store in ((3, False, 64, False), (3, True, 88, False), (3, False, 64, True),
                                            (3, True, 64, True)):
        def run(stages=stages, paired=paired, regs=regs, tma_store=tma_store):
            return moe_up_ws(x, w13, plan.sorted_ids, plan.block_expert, plan.num_padded, plan.num_m, TOP_K,
                             stages=stages, paired=paired, loader_regs=regs, async_store=tma_store,
                             programs=programs)
        name = f"gluon stages {stages} paired {paired} loader registers {regs} TMA store {tma_store}"
        err = (run()[valid].float() - ref[valid].float()).abs().max().item()
        print(f"{name}: max difference from the shipped kernel {err:.3g}", flush=True)
        variants[name] = run
    flops = a.tokens * TOP_K * 2 * INTER * HIDDEN * 2
    graphs = {name: capture_graph(fn) for name, fn in variants.items()}
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for name, graph in graphs.items():
            burst = replay_ms(graph, 20) * 1e3
            capped = capped_us(graph, 1.5)
            times.setdefault(name, {"burst_us": [], "capped_us": []})
            times[name]["burst_us"].append(round(burst, 1))
            times[name]["capped_us"].append(round(capped, 1))
            print(f"round {r} {name}: burst {burst:.1f} us ({flops / burst / 1e6:.0f} TFLOP/s), "
                  f"capped {capped:.1f} us ({flops / capped / 1e6:.0f})", flush=True)
    write_results(a.output, [record("moe_up_warp_specialized", "cuda", tokens=a.tokens, times=times)])


if __name__ == "__main__":
    main()
