"""Prompt-size MoE gate/up GEMM on Hopper (Gluon): persistent, warp-specialized, stored by TMA.

The Triton kernel (fused_moe.py) runs one program per (m block, n tile): its tensor cores idle while
it computes SiLU-and-mul and stores, and made persistent it gathered its token rows by pointer loads
at half speed. Here one program per SM walks the tiles in GROUP_M order. Four loading warps gather
each k step's token rows by cp.async (every thread's copies arrive on the stage's mbarrier, so the
barrier counts all loading threads) and the interleaved gate / up weight box by TMA, running ahead
into the next tile while two warpgroups issue one wgmma of twice BLOCK_N columns a k step. The
activations go to shared memory and out by a TMA store that runs under the next tile's wgmmas, in
block order, as the Triton kernel's ACT_TMA path writes them. The output equals the Triton kernel's
bit for bit. H100 at 131,072 tokens x top-6 of V2-Lite's 64 experts, at the power cap (replays
back to back for 1.5 s first): 14.22-14.34 against 14.74-14.82 ms (-3.5%); storing from registers
instead was at best even (benchmarks/kernels/moe_up_warp_specialized.py).
"""

from __future__ import annotations

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

from moeserve.ops.triton.device import sm_count, tma_readable
from moeserve.ops.triton.moe_tiles import tile_ids
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

BLOCK_M = 128  # pairs a block: the plan's BLOCK_M must match
BLOCK_N = 128  # gate (and as many up) columns a tile
BLOCK_K = 64  # hidden columns a k step: one 128-byte swizzle row of 16-bit values
STAGES = 3  # four stages were 4% slower (H100, 131,072 tokens)
GROUP_M = 8
WARPS = 8  # the two compute warpgroups
LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = 64  # the best of 40-88 registers a loading thread
# From this many tokens a call takes this kernel (where it can); below, the Triton kernel.
MIN_TOKENS = 8192


@gluon.jit
def _loader(x_ptr, w_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready, empty,
            numel, stride_xt, num_n, TOPK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            K_STEPS: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP: gl.constexpr, PROGRAMS: gl.constexpr):
    """The loading warps: each k step's token rows (cp.async) and weight box (TMA) into a free slot."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])
    used_m = gl.load(num_padded_ptr) // BM
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    it = 0
    for tile in range(gl.program_id(0), used_m * num_n, PROGRAMS):
        pid_m, pid_n = tile_ids(tile, used_m, num_n, GROUP)
        expert = gl.load(block_expert_ptr + pid_m)
        flat = gl.load(sorted_ptr + pid_m * BM + rows)
        # Padding rows read token 0: their outputs are stored but never read (the down GEMM masks them).
        token = gl.where(flat < numel, flat // TOPK, 0)
        base = x_ptr + token.to(gl.int64)[:, None] * stride_xt + cols[None, :]
        for k in range(K_STEPS):
            s = it % NUM_STAGES
            if it >= NUM_STAGES:
                mbarrier.wait(empty.index(s), (it // NUM_STAGES - 1) & 1)
            mbarrier.expect(b_ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [expert, pid_n * BN, 0, k * BK], b_ready.index(s),
                                            b_smem.index(s))
            async_copy.async_copy_global_to_shared(a_smem.index(s), base + k * BK)
            async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
            it += 1


@gluon.jit
def _consumer(act_desc, num_padded_ptr, a_smem, b_smem, staging, a_ready, b_ready, empty, num_n, BM: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, K_STEPS: gl.constexpr, NUM_STAGES: gl.constexpr,
              GROUP: gl.constexpr, PROGRAMS: gl.constexpr, layout: gl.constexpr):
    """The compute warpgroups: a tile's wgmmas one slot behind the loads, then silu(gate) * up out by TMA."""
    used_m = gl.load(num_padded_ptr) // BM
    it = 0
    for tile in range(gl.program_id(0), used_m * num_n, PROGRAMS):
        pid_m, pid_n = tile_ids(tile, used_m, num_n, GROUP)
        gu = warpgroup_mma_init(gl.zeros([BM, 2 * BN], gl.float32, layout))
        for k in range(K_STEPS):
            s = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            mbarrier.wait(a_ready.index(s), phase)
            mbarrier.wait(b_ready.index(s), phase)
            # The rows came by cp.async (the generic proxy); the wgmma reads through the async proxy.
            fence_async_shared()
            gu = warpgroup_mma(a_smem.index(s), b_smem.index(s).reshape([2 * BN, BK]).permute((1, 0)), gu,
                               is_async=True)
            gu = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(gu,)))
            if k > 0:  # the wgmma before this one is done with its slot
                mbarrier.arrive(empty.index((it - 1) % NUM_STAGES), count=1)
            it += 1
        gu = warpgroup_mma_wait(num_outstanding=0, deps=(gu,))
        mbarrier.arrive(empty.index((it - 1) % NUM_STAGES), count=1)
        g, u = gl.split(gl.reshape(gu, [BM, BN, 2]))
        act = (g / (1.0 + gl.exp(-g)) * u).to(act_desc.dtype)
        tma.store_wait(0)  # the previous tile's store has left the staging buffer
        staging.store(act)
        fence_async_shared()
        tma.async_copy_shared_to_global(act_desc, [pid_m * BM, pid_n * BN], staging)
    tma.store_wait(0)


@gluon.jit
def _moe_up_hopper_kernel(x_ptr, w_desc, act_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, numel, stride_xt,
                          INTER: gl.constexpr, HIDDEN: gl.constexpr, TOPK: gl.constexpr, BM: gl.constexpr, NUM_STAGES: gl.constexpr,
                          GROUP: gl.constexpr, PROGRAMS: gl.constexpr, REGS: gl.constexpr, PDL: gl.constexpr):
    """act[block row, n] = silu(x @ gate_n) * (x @ up_n) for every used block's rows, persistent."""
    BN: gl.constexpr = w_desc.block_type.shape[1]
    BK: gl.constexpr = w_desc.block_type.shape[3]
    K_STEPS: gl.constexpr = HIDDEN // BK
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, 2 * BN, 16])
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], x_ptr.dtype.element_ty)
    wait_for_prior_grid(PDL)
    a_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NUM_STAGES, BM, BK], a_layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 1, BN, 2, BK], w_desc.layout)
    staging = gl.allocate_shared_memory(act_desc.dtype, [BM, BN], act_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(a_ready.index(i), count=LOADER_WARPS * 32)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    num_n = gl.cdiv(INTER, BN)
    gl.warp_specialize(
        [(_consumer, (act_desc, num_padded_ptr, a_smem, b_smem, staging, a_ready, b_ready, empty, num_n, BM, BN, BK,
                      K_STEPS, NUM_STAGES, GROUP, PROGRAMS, layout)),
         (_loader, (x_ptr, w_desc, sorted_ptr, block_expert_ptr, num_padded_ptr, a_smem, b_smem, a_ready, b_ready,
                    empty, numel, stride_xt, num_n, TOPK, BM, BN, BK, K_STEPS, NUM_STAGES, GROUP, PROGRAMS))],
        [LOADER_WARPS.value], [REGS])


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def moe_up_hopper_usable(hidden: torch.Tensor, w13: torch.Tensor, config: dict) -> bool:
    """Whether this kernel takes the call: sm_90, 16-bit, at least MIN_TOKENS tokens, a sorted `dot`
    plan in BLOCK_M-row blocks with ACT_TMA (block-order output), whole k steps, TMA-readable weights
    and 16-byte token rows for cp.async."""
    if not (hidden.is_cuda and torch.cuda.get_device_capability(hidden.device)[0] == 9):
        return False
    if hidden.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != hidden.dtype:
        return False
    if hidden.shape[0] < MIN_TOKENS or hidden.shape[1] % BLOCK_K or (w13.shape[1] // 2) % 8:
        return False
    if config["DENSE"] or config["MODE"] != "dot" or not config.get("ACT_TMA") or config["BLOCK_M"] != BLOCK_M:
        return False
    return tma_readable(w13) and tma_readable(hidden) and w13.stride(0) == w13.shape[1] * w13.stride(1)


def moe_up_hopper(hidden: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                  num_padded: torch.Tensor, num_m: int, topk: int) -> torch.Tensor:
    """[num_m * BLOCK_M, I] silu(gate) * up in block order, as fused_moe's ACT_TMA gate/up GEMM writes
    it; the caller has checked `moe_up_hopper_usable`."""
    experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    dtype = _gl_dtype(hidden.dtype)
    act = torch.empty(num_m * BLOCK_M, inter, dtype=hidden.dtype, device=hidden.device)
    act_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    act_desc = TensorDescriptor(act, list(act.shape), list(act.stride()), [BLOCK_M, BLOCK_N], act_layout)
    # One box holds BLOCK_N gate rows interleaved with their up rows: [E, I, 2, H] over w13's [E, 2I, H].
    w_layout = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 2, BLOCK_K], dtype)
    w_desc = TensorDescriptor(w13, [experts, inter, 2, hidden_size], [w13.stride(0), w13.stride(1),
                              inter * w13.stride(1), 1], [1, BLOCK_N, 2, BLOCK_K], w_layout)
    programs = sm_count(hidden.device)
    _moe_up_hopper_kernel[(programs,)](
        hidden, w_desc, act_desc, sorted_ids, block_expert, num_padded, hidden.shape[0] * topk, hidden.stride(0),
        INTER=inter, HIDDEN=hidden_size, TOPK=topk, BM=BLOCK_M, NUM_STAGES=STAGES, GROUP=GROUP_M, PROGRAMS=programs,
        REGS=LOADER_REGS, num_warps=WARPS, **pdl_launch(hidden),
    )
    return act
