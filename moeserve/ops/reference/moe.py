"""Reference MoE: expert selection for every DeepSeek routing variant, and the expert MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.reference.linear import add_norm_linear, linear
from moeserve.ops.reference.norm import fused_add_rms_norm


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, use_top2_sum: bool) -> torch.Tensor:
    """True for experts inside the `topk_group` best groups of each token."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    if use_top2_sum and grouped.shape[-1] >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)


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
    """Pick `top_k` experts per token and their weights -> (weights fp32 [T, k + S], ids int64 [T, k + S]).

    DeepSeek-V2 (`scale_after_norm=False`): weights are either renormalised or scaled by
    `routed_scaling_factor`. DeepSeek-V3 (`True`): renormalised if asked, then always scaled.
    With `num_shared` S, every token also gets experts E .. E + S - 1 (the shared experts,
    stored after the E routed ones) at weight 1, so one fused MoE call computes both.
    """
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_method != "greedy" and n_group > 1:
        keep = _group_mask(choice, n_group, topk_group, use_top2_sum=topk_method == "noaux_tc")
        # V2 masks with 0 (softmax scores are positive); a biased sigmoid score may be negative.
        fill = float("-inf") if topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep, fill)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    normalise = norm_topk_prob and top_k > 1
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale_after_norm or not normalise:
        weights = weights * routed_scaling_factor
    if num_shared:
        tokens, experts = logits.shape
        shared = torch.arange(experts, experts + num_shared, device=ids.device).expand(tokens, -1)
        ids = torch.cat((ids, shared), dim=1)
        weights = torch.cat((weights, weights.new_ones(tokens, num_shared)), dim=1)
    return weights, ids


def _weighted_outputs(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
):
    """Per expert used: (token rows, their slots, routing weight * expert output in float32)."""
    inter = w2.shape[-1]
    for expert in topk_ids.unique().tolist():
        rows, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(hidden[rows], w13[expert])
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[expert])
        yield rows, slot, y.float() * topk_weights[rows, slot, None]


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    sum_slots: bool = True,
    fixed_tail: int = 0,
) -> torch.Tensor:
    """Weighted sum over each token's experts of down(silu(gate(x)) * up(x)).

    `w13` is [E, 2*I, H] (gate rows then up rows) and `w2` is [E, H, I], one slice per expert.
    With sum_slots False the weighted per-expert outputs come back unsummed, [T, k, H].
    `fixed_tail` promises that each token's last `fixed_tail` ids are experts E - fixed_tail ..
    E - 1 in order (the shared experts), so a kernel may fetch their weights before the ids are
    written; it does not change the result.
    """
    if not sum_slots:
        parts = hidden.new_empty(*topk_ids.shape, hidden.shape[1])
        for rows, slot, y in _weighted_outputs(hidden, w13, w2, topk_weights, topk_ids):
            parts[rows, slot] = y.to(hidden.dtype)
        return parts
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for rows, _, y in _weighted_outputs(hidden, w13, w2, topk_weights, topk_ids):
        out.index_add_(0, rows, y)
    return out.to(hidden.dtype)


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
    """(linear(rms_norm(moe + residual)), moe + residual), moe being `fused_moe`'s output: a MoE
    layer's experts and then the next layer's residual add, norm and first projection (one kernel
    on the GPU at one token)."""
    parts = fused_moe(hidden, w13, w2, topk_weights, topk_ids, sum_slots=False, fixed_tail=fixed_tail)
    return add_norm_linear(parts, residual, norm_weight, eps, weight, bias)


def add_norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    **routing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's entry: (normed, summed, weights, ids) = the fused add + RMSNorm of x and
    residual, then the router's float32 logits of `normed` and `select_experts(**routing)` on them."""
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    weights, ids = select_experts(linear(normed, router_weight, out_dtype=torch.float32), **routing)
    return normed, summed, weights, ids


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
    """A MoE layer from its input through the next layer's first projection: `add_norm_route` of x
    and residual, then `fused_moe_add_norm_linear` of its experts -> (projection, the next residual,
    weights, ids); one kernel on the GPU at one token."""
    normed, summed, weights, ids = add_norm_route(x, residual, norm_weight, eps, router_weight, **routing)
    out, next_residual = fused_moe_add_norm_linear(
        normed, w13, w2, weights, ids, summed, next_norm_weight, next_eps, weight, bias, fixed_tail
    )
    return out, next_residual, weights, ids
