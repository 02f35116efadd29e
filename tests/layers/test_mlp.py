"""The dense SwiGLU MLP: the plain forward against a hand-written SwiGLU, and, handed the next
layer's norm and projection at one token, the one-expert path against the plain one followed by
the next layer's add + norm + projection (CPU; on the GPU the same call is the ring kernel, checked
in tests/models/test_ring_moe_in_model.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers import mlp
from moeserve.layers.moe import NextProjection
from moeserve.layers.norm import RMSNorm


def make(hidden: int = 64, inter: int = 96, seed: int = 0) -> tuple[mlp.GatedMLP, RMSNorm, RMSNorm, nn.Linear]:
    torch.manual_seed(seed)
    layer = mlp.GatedMLP(hidden, inter)
    norms = RMSNorm(hidden, 1e-6), RMSNorm(hidden, 1e-6)
    proj = nn.Linear(hidden, 40, bias=False)
    for module in (layer, *norms, proj):
        for p in module.parameters():
            p.data.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    return layer, *norms, proj


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_forward_is_down_of_silu_gate_times_up():
    layer, *_ = make()
    x = torch.randn(3, 64)
    gate, up = (x @ layer.gate_up_proj.weight.t()).chunk(2, dim=-1)
    want = (F.silu(gate) * up) @ layer.down_proj.weight.t()
    assert torch.allclose(layer(x), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 2])
@torch.no_grad()
def test_one_token_with_the_next_projection_matches_the_plain_path(tokens):
    layer, norm, next_norm, proj = make(seed=tokens)
    x, res = torch.randn(tokens, 64), torch.randn(tokens, 64)
    out, summed = layer.add_norm_forward(x, res, norm, (next_norm, proj))
    assert isinstance(out, NextProjection) == (tokens == 1)  # AS_EXPERT_MAX_TOKENS is 1
    mlp_out = layer(rms(x + res, norm.weight))
    if tokens > mlp.AS_EXPERT_MAX_TOKENS:  # past it: the MLP's own output, the next layer adds and norms it
        assert not isinstance(out, NextProjection)
        assert torch.allclose(out, mlp_out, atol=1e-4, rtol=1e-4) and torch.allclose(summed, x + res)
        return
    # The next layer's input, already through its residual add, norm and projection, and the sum
    # (its residual) beside it, as MoE.add_norm_forward returns them.
    assert isinstance(out, NextProjection)
    assert torch.allclose(summed, mlp_out + x + res, atol=1e-4, rtol=1e-4)
    want = rms(mlp_out + x + res, next_norm.weight) @ proj.weight.t()
    assert torch.allclose(out.out, want, atol=1e-4, rtol=1e-4)
    plain, plain_sum = layer.add_norm_forward(x, res, norm)  # no next layer: the plain pair
    assert torch.allclose(plain, mlp_out, atol=1e-4, rtol=1e-4) and torch.allclose(plain_sum, x + res)
