"""Expert selection on the GPU in one kernel: scoring, group limiting, top-k and weight scaling.

Each program routes BLOCK_T tokens with all E logits in registers (E <= a few hundred), picking
groups and experts by repeated argmax, so there is no sort and no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_SCORING = ("softmax", "sigmoid")


@triton.jit
def _group_keep(choice, cols, NUM_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                TOP2_SUM: tl.constexpr, BLOCK_T: tl.constexpr, G_PAD: tl.constexpr):
    """[BLOCK_T, E_PAD] mask of experts inside each token's TOPK_GROUP best groups."""
    size: tl.constexpr = NUM_EXPERTS // N_GROUP
    group_of = cols // size
    gcols = tl.arange(0, G_PAD)
    scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        vals = tl.where((group_of == g)[None, :], choice, float("-inf"))
        best = tl.max(vals, axis=1)
        if TOP2_SUM:
            # Drop one occurrence of the max only, so a tie still sums max + max like topk(2).
            first = tl.argmax(vals, axis=1)
            best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), vals), axis=1)
        scores = tl.where(gcols[None, :] == g, best[:, None], scores)
    keep = tl.zeros_like(choice) > 1.0
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(scores, axis=1)
        keep = keep | (group_of[None, :] == g[:, None])
        scores = tl.where(gcols[None, :] == g[:, None], float("-inf"), scores)
    return keep


@triton.jit
def select_rows(
    logits, valid, cols, bias_ptr, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_SUM: tl.constexpr, MASK_FILL: tl.constexpr,
    NORMALISE: tl.constexpr, SCALE: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
    K_PAD: tl.constexpr, G_PAD: tl.constexpr,
):
    """(weights fp32, ids int32) [BLOCK_T, K_PAD] for a block of rows' fp32 logits [BLOCK_T, E_PAD]."""
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(logits), 0.0)
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = tl.where(valid, shifted / tl.sum(shifted, axis=1)[:, None], 0.0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + cols, mask=cols < NUM_EXPERTS, other=0.0)[None, :]
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        keep = _group_keep(choice, cols, NUM_EXPERTS, N_GROUP, TOPK_GROUP, TOP2_SUM, BLOCK_T, G_PAD)
        choice = tl.where(keep | (cols[None, :] >= NUM_EXPERTS), choice, MASK_FILL)
    kcols = tl.arange(0, K_PAD)
    top_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        hit = cols[None, :] == best[:, None]
        top_w = tl.where(kcols[None, :] == i, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], top_w)
        top_i = tl.where(kcols[None, :] == i, best[:, None].to(tl.int32), top_i)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALISE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    if SCALE:
        top_w = top_w * routed_scaling_factor
    if NUM_SHARED > 0:
        # Always-on shared experts after the routed ones, stored as experts E .. E + S - 1.
        shared = (kcols >= TOP_K)[None, :]
        top_w = tl.where(shared, 1.0, top_w)
        top_i = tl.where(shared, (NUM_EXPERTS - TOP_K + kcols)[None, :], top_i)
    return top_w, top_i


@triton.jit
def store_selection(weights_ptr, ids_ptr, rows, num_tokens, top_w, top_i, TOP_K: tl.constexpr,
                    NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr):
    """Write a block of rows' selection into weights / ids [T, TOP_K + NUM_SHARED]."""
    kcols = tl.arange(0, K_PAD)
    width: tl.constexpr = TOP_K + NUM_SHARED
    out = rows[:, None] * width + kcols[None, :]
    mask = (rows[:, None] < num_tokens) & (kcols[None, :] < width)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_lt, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_SUM: tl.constexpr, MASK_FILL: tl.constexpr,
    NORMALISE: tl.constexpr, SCALE: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Top-k experts and their weights for BLOCK_T tokens, following the reference's rules."""
    wait_for_prior_grid(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    valid = (rows[:, None] < num_tokens) & (cols[None, :] < NUM_EXPERTS)
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :], mask=valid,
                     other=float("-inf")).to(tl.float32)
    top_w, top_i = select_rows(
        logits, valid, cols, bias_ptr, routed_scaling_factor, NUM_EXPERTS, TOP_K, SIGMOID, HAS_BIAS, N_GROUP,
        TOPK_GROUP, TOP2_SUM, MASK_FILL, NORMALISE, SCALE, NUM_SHARED, BLOCK_T, K_PAD, G_PAD,
    )
    store_selection(weights_ptr, ids_ptr, rows, num_tokens, top_w, top_i, TOP_K, NUM_SHARED, K_PAD)


def check_routing(experts: int, top_k: int, topk_method: str, scoring_func: str, n_group: int, topk_group: int,
                  correction_bias: torch.Tensor | None, num_shared: int) -> None:
    """Clear errors for routing rules the kernels cannot honour (shape-only checks, capture-safe)."""
    if topk_method not in _METHODS or scoring_func not in _SCORING:
        raise ValueError(f"unknown routing: topk_method={topk_method!r}, scoring_func={scoring_func!r}")
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, {experts}]")
    if topk_method != "greedy" and n_group > 1:
        if experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"{experts} experts cannot form {n_group} groups keeping {topk_group}")
        if topk_group * (experts // n_group) < top_k:
            raise ValueError(f"top_k={top_k} exceeds the {topk_group} kept groups' experts")
    if correction_bias is not None and correction_bias.shape != (experts,):
        raise ValueError(f"correction_bias must be [{experts}], got {tuple(correction_bias.shape)}")
    if num_shared < 0:
        raise ValueError(f"num_shared must be >= 0, got {num_shared}")


def selection_constants(
    experts: int, *, top_k: int, topk_method: str, scoring_func: str, n_group: int, topk_group: int,
    norm_topk_prob: bool, routed_scaling_factor: float, correction_bias: torch.Tensor | None,
    scale_after_norm: bool, num_shared: int = 0,
) -> dict:
    """Check one model's routing rules (select_experts' keywords) -> the compile-time arguments of `select_rows`."""
    check_routing(experts, top_k, topk_method, scoring_func, n_group, topk_group, correction_bias, num_shared)
    grouped = topk_method != "greedy" and n_group > 1
    normalise = norm_topk_prob and top_k > 1
    return dict(
        NUM_EXPERTS=experts, TOP_K=top_k, SIGMOID=scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None,
        N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
        TOP2_SUM=topk_method == "noaux_tc" and experts // max(n_group, 1) >= 2,
        # V2 masks with 0 (softmax scores are positive); a biased sigmoid score may be negative.
        MASK_FILL=float("-inf") if topk_method == "noaux_tc" else 0.0,
        NORMALISE=normalise, SCALE=scale_after_norm or not normalise, NUM_SHARED=num_shared,
        K_PAD=triton.next_power_of_2(top_k + num_shared), G_PAD=triton.next_power_of_2(max(n_group, 1)),
    )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str,
    scoring_func: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None,
    scale_after_norm: bool,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `top_k` experts per token and their weights -> (weights fp32 [T, k + S], ids int32 [T, k + S])."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    tokens, experts = router_logits.shape
    constants = selection_constants(
        experts, top_k=top_k, topk_method=topk_method, scoring_func=scoring_func, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
        correction_bias=correction_bias, scale_after_norm=scale_after_norm, num_shared=num_shared,
    )
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(tokens, top_k + num_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + num_shared, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(experts)
    block_t = 1 if tokens <= 512 else max(1, min(8, 2048 // e_pad))
    bias = correction_bias.float().contiguous() if correction_bias is not None else weights
    _routing_kernel[(triton.cdiv(tokens, block_t),)](
        logits, bias, weights, ids, tokens, logits.stride(0), float(routed_scaling_factor),
        **constants, BLOCK_T=block_t, E_PAD=e_pad, num_warps=max(1, min(4, block_t * e_pad // 256)), **pdl_launch(logits),
    )
    return weights, ids
