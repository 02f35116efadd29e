"""A MoE layer's entry at decode sizes in one launch: residual add + RMSNorm, router, expert selection.

At a few tokens each of these is a few-microsecond kernel whose time is mostly the gap behind
the one before it. Here program (expert block, token) loads its slice of the router weight before
waiting on the previous kernel (pdl.py), then adds and normalises its token's row itself (every
program of a token computes the same row; the first one stores it), and writes its experts'
float32 logits. The last program to finish, found by an atomic counter, reads all the logits back
and selects every token's experts with the same code as `select_experts`.

From MAX_TOKENS + 1 to PER_TOKEN_MAX_TOKENS each token has its own counter, so the last program
of each token selects that token's experts, and programs score more experts each (one selecting
program would take too long). Past that the three kernels are faster: at 24-256 tokens this
kernel made decode-graph replay 1-3% slower on H200, and a program per 16 tokens scoring all
experts by a dot (two passes over the row) 4-7% slower: too few programs to stream the rows.

The counters live in device memory per GPU and the last program resets its own, so calls must
not overlap on one device (one compute stream, as the engine runs). Past PER_TOKEN_MAX_TOKENS,
for other dtypes, or for rows too wide for registers, the call falls back to the three kernels.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.gemv import linear
from moeserve.ops.triton.norm import MAX_WIDTH, fused_add_rms_norm, normalize_row
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid
from moeserve.ops.triton.routing import select_experts, select_rows, selection_constants, store_selection

MAX_TOKENS = 8
BLOCK_E = 2  # experts a program scores: many small programs keep the most weight loads in flight
# At one token, one expert a program (64 programs for V2-Lite): b1 decode-graph replay -0.3 / -0.5%
# on two H200s; four +0.4%. At 8 tokens one was +0.6%, within that size's spread, so two stay.
ONE_TOKEN_BLOCK_E = 1
MAX_HIDDEN = 8192  # a program holds BLOCK_E router rows and a token's row in registers
# Past MAX_TOKENS, a counter per token and more experts a program (decode-graph replay on H200
# against the three kernels: b12 -1.7%, b16 -1.8%, b24 +1.1%, b32 even).
PER_TOKEN_MAX_TOKENS = 16
PER_TOKEN_BLOCK_E = 4


@functools.lru_cache(maxsize=16)
def _counters(device: torch.device) -> torch.Tensor:
    """This device's arrival counters, one per group of tokens (zero between calls: each group's
    last program resets its own)."""
    return torch.zeros(PER_TOKEN_MAX_TOKENS, dtype=torch.int32, device=device)


@triton.jit(do_not_specialize=["num_tokens"])
def _norm_route_kernel(
    x_ptr, res_ptr, norm_w_ptr, router_ptr, bias_ptr, normed_ptr, summed_ptr, logits_ptr, topk_w_ptr, topk_ids_ptr,
    counter_ptr, num_tokens, stride_x, stride_res, eps, routed_scaling_factor,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, E_PAD: tl.constexpr, T_PAD: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_SUM: tl.constexpr, MASK_FILL: tl.constexpr,
    NORMALISE: tl.constexpr, SCALE: tl.constexpr, NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr,
    G_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Program (expert block, token m): norm row m, score BLOCK_E experts; the last program of
    m's group of T_PAD tokens selects that group's experts."""
    pid_e = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_H)
    h_ok = cols < HIDDEN
    w = tl.load(router_ptr + experts[:, None] * HIDDEN + cols[None, :],
                mask=(experts < NUM_EXPERTS)[:, None] & h_ok[None, :], other=0.0)
    norm_w = tl.load(norm_w_ptr + cols, mask=h_ok, other=0.0).to(tl.float32)
    wait_for_prior_grid(PDL)
    # x may be a float32 sum (attention with o_proj fused in): rounded to the residual's dtype first.
    x = tl.load(x_ptr + m * stride_x + cols, mask=h_ok, other=0.0).to(res_ptr.dtype.element_ty)
    res = tl.load(res_ptr + m * stride_res + cols, mask=h_ok, other=0.0)
    # Rounded as the reference rounds: the sum to the residual's dtype, then the normalised row.
    summed = (x.to(tl.float32) + res.to(tl.float32)).to(res.dtype)
    normed = normalize_row(summed.to(tl.float32), norm_w, HIDDEN, eps, res.dtype)
    if pid_e == 0:
        tl.store(summed_ptr + m * HIDDEN + cols, summed, mask=h_ok)
        tl.store(normed_ptr + m * HIDDEN + cols, normed, mask=h_ok)
    logits = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + m * E_PAD + experts, logits, mask=experts < NUM_EXPERTS)
    # Every thread's logits are stored before the one atomic (a release at GPU scope) says so.
    tl.debug_barrier()
    group = m // T_PAD
    arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.minimum(T_PAD, num_tokens - group * T_PAD) - 1:
        tl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")
        rows = group * T_PAD + tl.arange(0, T_PAD)
        ecols = tl.arange(0, E_PAD)
        valid = (rows[:, None] < num_tokens) & (ecols[None, :] < NUM_EXPERTS)
        # Other programs' stores: read from L2 (".cg"), never from this SM's incoherent L1.
        all_logits = tl.load(logits_ptr + rows[:, None] * E_PAD + ecols[None, :], mask=valid, other=float("-inf"),
                             cache_modifier=".cg")
        all_logits = tl.where((rows < num_tokens)[:, None], all_logits, 0.0)  # no NaN in padding rows
        top_w, top_i = select_rows(
            all_logits, valid, ecols, bias_ptr, routed_scaling_factor, NUM_EXPERTS, TOP_K, SIGMOID, HAS_BIAS,
            N_GROUP, TOPK_GROUP, TOP2_SUM, MASK_FILL, NORMALISE, SCALE, NUM_SHARED, T_PAD, K_PAD, G_PAD,
        )
        store_selection(topk_w_ptr, topk_ids_ptr, rows, num_tokens, top_w, top_i, TOP_K, NUM_SHARED, K_PAD)


def fits(x: torch.Tensor, residual: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether the one-launch kernel takes this call (otherwise: the three separate kernels). x is
    [T, H] in the residual's dtype or a float32 one-slot part [T, 1, H]."""
    half = (torch.bfloat16, torch.float16)
    part = x.dim() == 3 and x.shape[1] == 1 and x.dtype == torch.float32
    row = x[:, 0] if part else x
    return (
        (part or x.dtype == residual.dtype) and row.dim() == 2 and 0 < row.shape[0] <= PER_TOKEN_MAX_TOKENS
        and row.shape[1] <= MAX_HIDDEN and residual.dtype in half and router_weight.dtype == residual.dtype
        and residual.shape == row.shape and row.stride(1) == 1 and residual.stride(1) == 1
        and router_weight.is_contiguous()
    )


def add_norm_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
    **routing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, summed, weights fp32 [T, k + S], ids int32 [T, k + S]); `routing`: select_experts' keywords."""
    experts, hidden = router_weight.shape
    if x.shape[-1] != hidden or norm_weight.shape != (hidden,) or x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"add_norm_route: x {tuple(x.shape)}, norm {tuple(norm_weight.shape)} and router "
                         f"{tuple(router_weight.shape)} disagree")
    if not fits(x, residual, router_weight):
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
        return normed, summed, *select_experts(linear(normed, router_weight, out_dtype=torch.float32), **routing)
    constants = selection_constants(experts, **routing)
    width = routing["top_k"] + routing.get("num_shared", 0)
    correction_bias = routing["correction_bias"]
    tokens = x.shape[0]
    e_pad = triton.next_power_of_2(experts)
    normed, summed = torch.empty_like(residual), torch.empty_like(residual)
    logits = torch.empty(tokens, e_pad, dtype=torch.float32, device=x.device)
    weights = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=x.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else weights
    # Up to MAX_TOKENS one group (one program selects all); past it a group per token.
    few = tokens <= MAX_TOKENS
    block_e = (ONE_TOKEN_BLOCK_E if tokens == 1 else BLOCK_E) if few else PER_TOKEN_BLOCK_E
    _norm_route_kernel[(triton.cdiv(experts, block_e), tokens)](
        x, residual, norm_weight.contiguous(), router_weight, bias, normed, summed, logits, weights, ids,
        _counters(x.device), tokens, x.stride(0), residual.stride(0), float(eps),
        float(routing["routed_scaling_factor"]), HIDDEN=hidden, BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_E=block_e, E_PAD=e_pad, T_PAD=MAX_TOKENS if few else 1, **constants,
        num_warps=4, **pdl_launch(x),
    )
    return normed, summed, weights, ids
