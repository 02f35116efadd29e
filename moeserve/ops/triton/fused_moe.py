"""Fused MoE on the GPU: gate/up GEMM with SiLU-and-mul, down GEMM with routing weights, top-k sum.

Two ways to group tokens (chosen per call by `moe_config`):
- sorted: `moe_align` sorts (token, slot) pairs by expert into BLOCK_M-row blocks, and each
  program multiplies one block by a tile of its expert's weights, so every touched expert's
  weights stream from HBM once per block of its tokens;
- dense (seed 001, "experts as GEMM"): for a handful of tokens, one program per (token, slot)
  whose expert has not appeared earlier multiplies *all* tokens by that expert's tile and keeps
  the rows routed to it. No sort, so three launches in all, and each expert is still read once.
Tiles are multiplied three ways (`MODE`): `dot` (tl.dot, tokens on the MMA's M side), `swap`
(seed 002's swapAB: weight rows on M, tokens on N, for 16-32 tokens an expert) and `gemv` (no
tl.dot; multiply-reduce one row at a time, for 1-8 rows, where an MMA tile would be mostly padding).
A GEMM's config may ask for `TMA`: its weight tiles then arrive by bulk tensor copies from a
descriptor (Hopper's tensor-memory accelerator) instead of per-thread loads, which lifts the
compute-bound prefill sizes; the gathered token rows are ordinary loads. The gate/up GEMM's box
holds BLOCK_N gate rows interleaved with the same up rows (a 4-D descriptor over w13), so one MMA
of twice the width computes both and reads the token tile from shared memory once (H200, 131K
prompt tokens: 13.9-14.7 -> 13.3-13.5 ms, 16K: 2.01 -> 1.87-1.90 ms). A sorted `dot` config
may also set `ACT_TMA`: the gate/up GEMM then writes its activations in block order (a pair's row
is its place in the sorted layout) instead of pair order, so the down GEMM reads each block's rows
as one contiguous tile, by TMA too; its config may then make the down GEMM `PERSISTENT`: one
program per SM walks the used blocks' tiles in one flattened loop, so the next tile's loads
overlap this one's epilogue (H200 at 16K prompt tokens: 3% through fused_moe, 7% in a kernel sweep).
The per-(token, slot) results are summed over top-k by a small kernel rather than atomics:
deterministic, and no zero-fill or fp32 scratch the size of the output. A caller that adds a
residual and normalises next can take them unsummed (`sum_slots=False`) and let the fused
add + RMSNorm kernel sum them: one launch fewer per layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.gemv import add_norm_linear
from moeserve.ops.triton.moe_align import moe_align
from moeserve.ops.triton.moe_config import Config, get_config, validate_config
from moeserve.ops.triton.moe_tiles import block_rows, tile_ids, tile_matmul, tile_matmul_tma
from moeserve.ops.triton.norm_route import add_norm_route
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

_MODE_IDS = {"gemv": 0, "swap": 1, "dot": 2}
# Up to this many tokens (1 at most, the kernel's limit) the MoE is the persistent TMA-ring kernel
# of `moe_ring` on Hopper instead of the two launches below; its output is then the float32 sum
# [1, 1, H] (one slot) rather than per-expert parts, which the next add + RMSNorm takes as well.
# H200, V2-Lite, batch-1 decode-graph replay 1.948 -> 1.859 ms (-4.6%; benchmarks/ab_decode.py).
RING_MAX_TOKENS = 1
# On the ring kernel, the next layer's residual add + RMSNorm + first projection run in its tail
# (fused_moe_add_norm_linear): their weights stream through the ring while the MoE's last programs
# finish, and a grid barrier replaces the kernel boundary.
RING_TAIL = True
# On the ring kernel with its tail, the MoE's entry (residual add + RMSNorm, router, expert
# selection) runs in the ring's programs too (routed_moe_add_norm_linear, moe_ring_entry.py),
# instead of a kernel of its own before it.
RING_ENTRY = True


@triton.jit(do_not_specialize=["num_tokens", "num_m"])
def _moe_up_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_m,
    stride_xt, stride_we, stride_wn, stride_at,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    DENSE: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    ACT_TMA: tl.constexpr, PDL: tl.constexpr,
):
    """act[pair, n] = silu(x @ gate_n) * (x @ up_n) for one block of pairs and BLOCK_N columns.

    With TMA, `w_ptr` is a descriptor over the weights as [E, I, 2, H] (gate and up rows paired).
    With ACT_TMA the row of a pair in `act` is its place in the sorted layout, not its flat index.
    """
    wait_for_prior_grid(PDL)
    pid_m, pid_n = tile_ids(tl.program_id(0), num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    expert, flat, row_ok = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                                       TOPK, K_PAD, DENSE, BLOCK_M)
    if expert < 0:
        return
    # Gate and up rows interleaved so one MMA of 2 * BLOCK_N rows computes both; split after.
    if TMA:
        # Rows past INTER come back as zeros (outside the descriptor's I); their columns are not stored.
        acc = tile_matmul_tma(x_ptr, (flat // TOPK) * stride_xt, row_ok, w_ptr, expert, pid_n * BLOCK_N, INTER,
                               HIDDEN, MODE, BLOCK_M, 2 * BLOCK_N, BLOCK_K, PRECISION, True, False)
    else:
        r = tl.arange(0, 2 * BLOCK_N)
        n = pid_n * BLOCK_N + r // 2
        w_rows = ((r % 2) * INTER + n).to(tl.int64) * stride_wn
        acc = tile_matmul(x_ptr, (flat // TOPK) * stride_xt, row_ok, w_ptr + expert * stride_we, w_rows,
                           n < INTER, HIDDEN, MODE, BLOCK_M, 2 * BLOCK_N, BLOCK_K, PRECISION)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    act = gate * tl.sigmoid(gate) * up
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) if ACT_TMA else flat
    ptrs = act_ptr + rows[:, None] * stride_at + cols[None, :]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < INTER))


@triton.jit
def _down_tile(act_ptr, w_ptr, out_ptr, weights_ptr, pid_m, pid_n, expert, flat, row_ok, stride_at, stride_we,
               stride_wn, stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               TMA: tl.constexpr, ACT_TMA: tl.constexpr):
    """out rows of one (m block, n tile): routing weight * (act @ down_n), scattered to pair order."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:
        if ACT_TMA:
            acc = tile_matmul_tma(act_ptr, (pid_m * BLOCK_M).to(tl.int32), row_ok, w_ptr, expert, pid_n * BLOCK_N,
                                   HIDDEN, INTER, MODE, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, False, True)
        else:
            acc = tile_matmul_tma(act_ptr, flat * stride_at, row_ok, w_ptr, expert, pid_n * BLOCK_N,
                                   HIDDEN, INTER, MODE, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, False, False)
    else:
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) if ACT_TMA else flat
        acc = tile_matmul(act_ptr, rows * stride_at, row_ok, w_ptr + expert * stride_we,
                           n.to(tl.int64) * stride_wn, n < HIDDEN, INTER, MODE, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    acc *= tl.load(weights_ptr + flat, mask=row_ok, other=0.0)[:, None]
    ptrs = out_ptr + flat[:, None] * stride_ot + n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (n[None, :] < HIDDEN))


@triton.jit
def _down_tile_of(tile, used_m, num_n, act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
                  num_tokens, stride_at, stride_we, stride_wn, stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr,
                  TOPK: tl.constexpr, K_PAD: tl.constexpr, DENSE: tl.constexpr, MODE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, TMA: tl.constexpr, ACT_TMA: tl.constexpr):
    """One tile of a persistent down GEMM: every block below used_m holds pairs, so none is skipped."""
    pid_m, pid_n = tile_ids(tile, used_m, num_n, GROUP_M)
    expert, flat, row_ok = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                                       TOPK, K_PAD, DENSE, BLOCK_M)
    _down_tile(act_ptr, w_ptr, out_ptr, weights_ptr, pid_m, pid_n, expert, flat, row_ok, stride_at, stride_we,
               stride_wn, stride_ot, INTER, HIDDEN, MODE, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, TMA, ACT_TMA)


@triton.jit(do_not_specialize=["num_tokens", "num_m"])
def _moe_down_kernel(
    act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens, num_m,
    stride_at, stride_we, stride_wn, stride_ot,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    DENSE: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    ACT_TMA: tl.constexpr, PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (act @ down_n) for one block of pairs and BLOCK_N columns.

    With TMA, `w_ptr` is a descriptor over the weights as [E * H, I] rows. With ACT_TMA the
    activations are in block order, and with TMA too `act_ptr` is a descriptor over them.
    PERSISTENT (sorted, both operands by TMA): PROGRAMS programs walk the used blocks' tiles in
    one flattened loop, so a tile's loads start while the one before finishes.
    """
    wait_for_prior_grid(PDL)
    num_n = tl.cdiv(HIDDEN, BLOCK_N)
    if PERSISTENT:
        used_m = tl.load(num_padded_ptr) // BLOCK_M  # on the device: the launch stays graph-safe
        if INTERPRETED:  # the interpreter cannot range over a runtime int; same tiles, unflattened
            tile = tl.program_id(0)
            while tile < used_m * num_n:
                _down_tile_of(tile, used_m, num_n, act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr,
                              block_expert_ptr, num_tokens, stride_at, stride_we, stride_wn, stride_ot, INTER, HIDDEN,
                              TOPK, K_PAD, DENSE, MODE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PRECISION, TMA, ACT_TMA)
                tile += PROGRAMS
        else:
            for tile in tl.range(tl.program_id(0), used_m * num_n, PROGRAMS, flatten=True):
                _down_tile_of(tile, used_m, num_n, act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr,
                              block_expert_ptr, num_tokens, stride_at, stride_we, stride_wn, stride_ot, INTER, HIDDEN,
                              TOPK, K_PAD, DENSE, MODE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PRECISION, TMA, ACT_TMA)
    else:
        pid_m, pid_n = tile_ids(tl.program_id(0), num_m, num_n, GROUP_M)
        expert, flat, row_ok = block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                                           TOPK, K_PAD, DENSE, BLOCK_M)
        if expert < 0:
            return
        _down_tile(act_ptr, w_ptr, out_ptr, weights_ptr, pid_m, pid_n, expert, flat, row_ok, stride_at,
                   stride_we, stride_wn, stride_ot, INTER, HIDDEN, MODE, BLOCK_M, BLOCK_N, BLOCK_K,
                   PRECISION, TMA, ACT_TMA)


@triton.jit
def _topk_sum_kernel(src_ptr, dst_ptr, HIDDEN: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """dst[t] = sum over slots of src[t * k + slot], in fp32."""
    wait_for_prior_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, K_PAD)
    mask = (slots[:, None] < TOPK) & (cols[None, :] < HIDDEN)
    vals = tl.load(src_ptr + (t * TOPK + slots[:, None]) * HIDDEN + cols[None, :], mask=mask, other=0.0)
    tl.store(dst_ptr + t * HIDDEN + cols, tl.sum(vals.to(tl.float32), axis=0).to(dst_ptr.dtype.element_ty),
             mask=cols < HIDDEN)


@dataclass(frozen=True)
class RoutePlan:
    """How one call's (token, slot) pairs are grouped into m blocks for the two GEMMs."""

    config: Config
    ids: torch.Tensor  # [T * k] expert per pair
    weights: torch.Tensor  # [T * k] fp32 routing weight per pair
    sorted_ids: torch.Tensor  # sorted path: flat pair index per block row; dense: unused
    block_expert: torch.Tensor  # sorted path: expert per m block; dense: unused
    num_tokens: int
    topk: int
    num_m: int  # m blocks in the launch grid (shape-only, so graph-safe)
    num_padded: torch.Tensor | None = None  # sorted path: int32 [1], rows the used blocks hold (on the device)


def plan_route(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, config: Config) -> RoutePlan:
    """Group pairs as `config` says: sorted by expert (moe_align) or the dense small-batch layout."""
    tokens, topk = topk_ids.shape
    problem = validate_config(config, tokens)
    if problem:
        raise ValueError(f"fused_moe config unusable for {tokens} tokens: {problem}")
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous().float()
    if config["DENSE"]:
        return RoutePlan(config, ids, weights, ids, ids, tokens, topk, tokens * topk)
    sorted_ids, block_expert, num_padded = moe_align(ids, num_experts, config["BLOCK_M"])
    return RoutePlan(config, ids, weights, sorted_ids, block_expert, tokens, topk, block_expert.numel(), num_padded)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tma_ready(w: torch.Tensor) -> bool:
    """Whether TMA can read these expert weights: experts packed back to back, 16-byte aligned rows."""
    row_bytes = w.stride(1) * w.element_size()
    return w.stride(0) == w.shape[1] * w.stride(1) and row_bytes % 16 == 0 and w.data_ptr() % 16 == 0


def _act_tma(plan: RoutePlan) -> bool:
    """Whether the activations go in block order, for a down GEMM that reads them by TMA."""
    return bool(plan.config.get("ACT_TMA", False))


def _programs(t: torch.Tensor) -> int:
    """Programs of a persistent launch: one per SM (a few in the interpreter, so each loops)."""
    if not t.is_cuda:
        return 3
    return sm_count(t.device)


def _launch_args(plan: RoutePlan, part: str, x: torch.Tensor, w: torch.Tensor) -> dict:
    gemm = plan.config[part]
    return {
        "TOPK": plan.topk, "K_PAD": triton.next_power_of_2(plan.topk), "DENSE": plan.config["DENSE"],
        "MODE": _MODE_IDS[plan.config["MODE"]], "BLOCK_M": plan.config["BLOCK_M"], "BLOCK_N": gemm["BLOCK_N"],
        "BLOCK_K": gemm["BLOCK_K"], "GROUP_M": 1 if plan.config["DENSE"] else gemm["GROUP_M"],
        "PRECISION": "ieee" if x.dtype == torch.float32 or _interpreting() else None,
        # Weights TMA cannot read get pointer loads even when the config asks for TMA.
        "TMA": bool(gemm.get("TMA", False)) and _tma_ready(w),
        "ACT_TMA": _act_tma(plan),
        "num_warps": gemm["num_warps"], "num_stages": gemm["num_stages"], **pdl_launch(x),
    }


def _weights_arg(w: torch.Tensor, args: dict, paired: bool = False) -> torch.Tensor | TensorDescriptor:
    """The weights as the kernel takes them: a pointer, or with TMA a descriptor over [E * N, K] rows;
    `paired` (w13): over [E, I, 2, K], so one box holds BLOCK_N gate rows interleaved with their up rows."""
    if not args["TMA"]:
        return w
    bn, bk = args["BLOCK_N"], args["BLOCK_K"]
    if paired:
        experts, inter, k = w.shape[0], w.shape[1] // 2, w.shape[2]
        strides = [w.stride(0), w.stride(1), inter * w.stride(1), 1]
        return TensorDescriptor(w, [experts, inter, 2, k], strides, [1, bn, 2, bk])
    rows = w.view(-1, w.shape[2])
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bn, bk])


def _launch(kernel, grid: tuple[int], compile_only: bool, *args, **kwargs) -> None:
    """Run `kernel`, or only compile it (the tuner compiles candidates in parallel first)."""
    if compile_only:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def moe_up(hidden: torch.Tensor, w13: torch.Tensor, plan: RoutePlan, compile_only: bool = False) -> torch.Tensor:
    """[T * k, I] silu(gate) * up for every (token, slot) pair ([blocks * BLOCK_M, I] in block order
    with ACT_TMA)."""
    inter = w13.shape[1] // 2
    rows = plan.num_m * plan.config["BLOCK_M"] if _act_tma(plan) else plan.num_tokens * plan.topk
    act = torch.empty(rows, inter, dtype=hidden.dtype, device=hidden.device)
    args = _launch_args(plan, "up", hidden, w13)
    weights = _weights_arg(w13, args, paired=True)
    grid = (plan.num_m * triton.cdiv(inter, args["BLOCK_N"]),)
    _launch(
        _moe_up_kernel, grid, compile_only,
        hidden, weights, act, plan.ids, plan.sorted_ids, plan.block_expert, plan.num_tokens, plan.num_m,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), INTER=inter, HIDDEN=hidden.shape[1], **args,
    )
    return act


def moe_down(act: torch.Tensor, w2: torch.Tensor, plan: RoutePlan, compile_only: bool = False) -> torch.Tensor:
    """[T * k, H] routing weight * down(act) for every (token, slot) pair."""
    hidden_size = w2.shape[1]
    out = torch.empty(plan.num_tokens * plan.topk, hidden_size, dtype=act.dtype, device=act.device)
    args = _launch_args(plan, "down", act, w2)
    weights = _weights_arg(w2, args)
    act_arg = act
    both_tma = args["ACT_TMA"] and args["TMA"]
    if both_tma:
        act_arg = TensorDescriptor(act, list(act.shape), list(act.stride()), [args["BLOCK_M"], args["BLOCK_K"]])
    tiles = plan.num_m * triton.cdiv(hidden_size, args["BLOCK_N"])
    # Persistent only where both operands come by TMA: flattened loops over pointer loads ran at
    # half speed (H200); otherwise (e.g. weights TMA cannot read) the tile-per-program launch.
    persistent = both_tma and bool(plan.config["down"].get("PERSISTENT", False))
    # One program per SM whatever the load, so the compiled kernel never depends on the batch.
    programs = _programs(act) if persistent else 1
    grid = (programs if persistent else tiles,)
    # The dense path has no padded count; the kernel reads it only when persistent, so any pointer does.
    num_padded = plan.num_padded if plan.num_padded is not None else plan.ids
    _launch(
        _moe_down_kernel, grid, compile_only,
        act_arg, weights, out, plan.weights, plan.ids, plan.sorted_ids, plan.block_expert, num_padded,
        plan.num_tokens, plan.num_m, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        INTER=act.shape[1], HIDDEN=hidden_size, PERSISTENT=persistent, PROGRAMS=programs,
        INTERPRETED=_interpreting(), **args,
    )
    return out


def moe_topk_sum(out: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, H] sum over each token's k slots of `out` [T * k, H]."""
    if topk == 1:
        return out
    tokens, hidden_size = out.shape[0] // topk, out.shape[1]
    dst = torch.empty(tokens, hidden_size, dtype=out.dtype, device=out.device)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    grid = (tokens, triton.cdiv(hidden_size, block_h))
    _topk_sum_kernel[grid](out, dst, HIDDEN=hidden_size, TOPK=topk, K_PAD=triton.next_power_of_2(topk),
                           BLOCK_H=block_h, num_warps=4, **pdl_launch(out))
    return dst


def _check_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    """Shape and layout checks (host-side metadata only, so capture-safe)."""
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_moe wants hidden [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    experts, two_inter, hidden_size = w13.shape
    if hidden.shape[1] != hidden_size or w2.shape != (experts, hidden_size, two_inter // 2) or two_inter % 2:
        raise ValueError(f"fused_moe shapes disagree: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError("fused_moe wants topk_weights and topk_ids both [T, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w13.stride(2) != 1 or w2.stride(2) != 1 or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError("fused_moe wants expert weights in hidden's dtype with contiguous rows")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    sum_slots: bool = True,
    fixed_tail: int = 0,
    config: Config | None = None,
) -> torch.Tensor:
    """Weighted sum over each token's experts of down(silu(gate(x)) * up(x)); see the reference.

    With sum_slots False: the per-expert parts [T, k, H], or (one token on the ring kernel) their
    float32 sum as [T, 1, H]; either way for an op that sums slots (the fused add + RMSNorm).

    A token's k expert ids must be distinct (top-k routing guarantees it; the dense path relies on
    it). `config` overrides the tuned or default block sizes (the tuner uses it).
    """
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    if hidden.shape[0] == 0:
        return hidden.new_empty(hidden.shape if sum_slots else (0, *topk_ids.shape[1:], hidden.shape[1]))
    hidden = hidden.contiguous()
    if config is None and hidden.shape[0] <= RING_MAX_TOKENS:
        from moeserve.ops.triton import moe_ring  # Gluon: imported only where it may run

        if moe_ring.ring_usable(hidden, w13, w2, topk_ids):
            out = moe_ring.moe_ring(hidden, w13, w2, topk_weights, topk_ids, fixed_tail)
            return out.view(hidden.shape).to(hidden.dtype) if sum_slots else out
    config = config or get_config(hidden, w13, topk_ids.shape[1])
    plan = plan_route(topk_weights, topk_ids, w13.shape[0], config)
    out = moe_down(moe_up(hidden, w13, plan), w2, plan)
    return moe_topk_sum(out, plan.topk) if sum_slots else out.view(*topk_ids.shape, hidden.shape[1])


def fused_moe_add_norm_linear(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fixed_tail: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_moe` and then `add_norm_linear` on its output; see the reference. At one token on the
    ring kernel, one launch (`moe_ring`'s tail)."""
    if RING_TAIL and hidden.shape[0] <= RING_MAX_TOKENS:
        from moeserve.ops.triton import moe_ring  # Gluon: imported only where it may run

        then = moe_ring.Tail(residual, norm_weight, eps, weight, bias)
        _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
        if moe_ring.ring_usable(hidden, w13, w2, topk_ids) and moe_ring.tail_usable(hidden, w13, then):
            return moe_ring.moe_ring(hidden.contiguous(), w13, w2, topk_weights, topk_ids, fixed_tail, then)
    parts = fused_moe(hidden, w13, w2, topk_weights, topk_ids, sum_slots=False, fixed_tail=fixed_tail)
    return add_norm_linear(parts, residual, norm_weight, eps, weight, bias)


def routed_moe_add_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    next_norm_weight: torch.Tensor,
    next_eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fixed_tail: int = 0,
    **routing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer from its input through the next layer's first projection; see the reference. At
    one token on the ring kernel, one launch (`moe_ring`'s entry and tail)."""
    if RING_ENTRY and RING_TAIL and x.shape[0] <= RING_MAX_TOKENS:
        from moeserve.ops.triton import moe_ring  # Gluon: imported only where it may run

        entry = moe_ring.Entry(residual, norm_weight, eps, router_weight, routing)
        then = moe_ring.Tail(residual, next_norm_weight, next_eps, weight, bias)
        width = routing["top_k"] + routing.get("num_shared", 0)
        weights = torch.empty(1, width, dtype=torch.float32, device=x.device)
        ids = torch.empty(1, width, dtype=torch.int32, device=x.device)
        if (
            fixed_tail == routing.get("num_shared", 0) and moe_ring.ring_usable(residual, w13, w2, ids)
            and moe_ring.tail_usable(residual, w13, then) and moe_ring.entry_usable(x, w13, entry, sm_count(x.device))
        ):
            out, next_residual = moe_ring.moe_ring(x, w13, w2, weights, ids, fixed_tail, then, entry)
            return out, next_residual, weights, ids
    normed, summed, weights, ids = add_norm_route(x, residual, norm_weight, eps, router_weight, **routing)
    out, next_residual = fused_moe_add_norm_linear(
        normed, w13, w2, weights, ids, summed, next_norm_weight, next_eps, weight, bias, fixed_tail
    )
    return out, next_residual, weights, ids
