"""The MoE layer: shared experts fused into the expert kernels equal the separate dense path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.config.model_config import ModelConfig
from moeserve.layers import moe
from moeserve.models.loader import load_model


def explicit_moe(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Routed experts one token at a time, plus the shared MLP rebuilt at its checkpoint width."""
    experts = layer.experts
    weights, ids = layer.gate(x)
    out = torch.zeros_like(x)
    inter = experts.intermediate_size

    def mlp(w13: torch.Tensor, w2: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gate_up = v @ w13.t()
        return (F.silu(gate_up[..., : w13.shape[0] // 2]) * gate_up[..., w13.shape[0] // 2 :]) @ w2.t()

    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            out[t] += w * mlp(experts.w13_weight[e], experts.w2_weight[e], x[t])
    shared = range(experts.num_routed, experts.num_routed + experts.num_shared)
    gate = torch.cat([experts.w13_weight[e, :inter] for e in shared])
    up = torch.cat([experts.w13_weight[e, inter:] for e in shared])
    down = torch.cat([experts.w2_weight[e] for e in shared], dim=1)
    return out + mlp(torch.cat((gate, up)), down, x)


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_and_separate_shared_experts_agree(checkpoints, monkeypatch, variant, tokens):
    path = checkpoints[variant]
    model = load_model(ModelConfig.from_path(path), path, torch.float32, torch.device("cpu"))
    layer = next(m for m in model.modules() if isinstance(m, moe.MoE))
    assert layer.experts.num_shared >= 1
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    want = explicit_moe(layer, x)
    with torch.no_grad():
        monkeypatch.setattr(moe, "FUSED_SHARED_MAX_TOKENS", 10**6)
        fused = layer(x)
        monkeypatch.setattr(moe, "FUSED_SHARED_MAX_TOKENS", 0)
        separate = layer(x)
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(separate, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])  # the skinny kernel's path, then cuBLAS's
def test_gpu_router_logits_in_half_precision_match_float32(tokens):
    """bf16 operands, float32 accumulation and output: the reference's float32 product."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(64, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    got = moe.router_logits(x, w)
    want = x.float() @ w.float().t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
