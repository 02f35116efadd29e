"""DeepSeek MoE: a router, routed experts stored stacked, and always-on shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve import ops
from moeserve.config.model_config import ModelConfig
from moeserve.layers.mlp import GatedMLP


class Router(nn.Module):
    """Scores experts per token (in float32, as the reference models do) and picks the top-k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        self.config = config
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights fp32 [T, k], expert ids [T, k])."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())  # no copy: the loader keeps it float32
        return ops.select_experts(
            logits,
            top_k=c.num_experts_per_tok,
            topk_method=c.topk_method,
            scoring_func=c.scoring_func,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            correction_bias=self.e_score_correction_bias,
            scale_after_norm=c.model_type == "deepseek_v3",
        )


class RoutedExperts(nn.Module):
    """All routed experts' weights as two stacked tensors, the layout fused kernels want."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)


class MoE(nn.Module):
    """Routed experts weighted by the router, plus the shared experts every token uses."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        self.gate = Router(config)
        self.experts = RoutedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
