"""The SwiGLU MLP used by dense layers and shared experts."""

from __future__ import annotations

import functools

import torch
from torch import nn

from moeserve import ops
from moeserve.layers.moe import NextProjection
from moeserve.layers.norm import RMSNorm

# Up to this many tokens, a dense layer handed the next layer's norm and first projection runs as a
# one-expert MoE (fused_moe_add_norm_linear): at one token on the GPU the experts' kernel streams the
# MLP's weights as it does a MoE's and runs the next layer's add + norm + projection in its tail.
AS_EXPERT_MAX_TOKENS = 1


@functools.lru_cache(maxsize=8)
def _one_expert_route(device: torch.device, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (1.0) and ids (expert 0) for `tokens` tokens of a one-expert MoE; built on
    first use, which the decode graphs' uncaptured warm-up run makes before any capture."""
    return torch.ones(tokens, 1, device=device), torch.zeros(tokens, 1, dtype=torch.int32, device=device)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up stored as one [2 * inter, hidden] matrix.

    One matrix means one GEMM per call; the loader fills its halves from the checkpoint's
    `gate_proj` and `up_proj`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight))
        return ops.linear(act, self.down_proj.weight)

    def add_norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, then: tuple[RMSNorm, nn.Linear] | None = None
    ) -> tuple[torch.Tensor | NextProjection, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual); given `then` (the next layer's norm and first
        projection) at up to AS_EXPERT_MAX_TOKENS tokens, (NextProjection(proj(next_norm(out +
        residual))), out + residual) as MoE.add_norm_forward gives it."""
        normed, residual = norm.add_and_norm(x, residual)
        if then is None or normed.shape[0] > AS_EXPERT_MAX_TOKENS:
            return self(normed), residual
        next_norm, proj = then
        weights, ids = _one_expert_route(normed.device, normed.shape[0])
        out, residual = ops.fused_moe_add_norm_linear(
            normed, self.gate_up_proj.weight[None], self.down_proj.weight[None], weights, ids, residual,
            next_norm.weight, next_norm.eps, proj.weight, proj.bias, fixed_tail=1,
        )
        return NextProjection(out), residual
