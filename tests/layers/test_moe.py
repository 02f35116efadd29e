"""The MoE layer: shared experts fused into the expert kernels equal the separate dense path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.config.model_config import ModelConfig
from moeserve.layers import moe
from moeserve.layers.norm import RMSNorm
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
@pytest.mark.parametrize("split_from", [10**6, 0])  # the shared down as one GEMM, or one per expert
def test_fused_and_separate_shared_experts_agree(checkpoints, monkeypatch, variant, tokens, split_from):
    path = checkpoints[variant]
    model = load_model(ModelConfig.from_path(path), path, torch.float32, torch.device("cpu"))
    layer = next(m for m in model.modules() if isinstance(m, moe.MoE))
    assert layer.experts.num_shared >= 1
    monkeypatch.setattr(moe, "SPLIT_SHARED_DOWN_MIN_TOKENS", split_from)
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    want = explicit_moe(layer, x)
    with torch.no_grad():
        monkeypatch.setattr(moe, "FUSED_SHARED_MAX_TOKENS", 10**6)
        fused = layer(x)
        monkeypatch.setattr(moe, "FUSED_SHARED_MAX_TOKENS", 0)
        separate = layer(x)
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(separate, want, rtol=1e-4, atol=1e-5)


def test_joined_shared_down_weights_follow_writes_to_the_experts(checkpoints, monkeypatch):
    """The joined copy is rebuilt after w2_weight changes in place (a reload), never served stale."""
    path = checkpoints["v2"]
    model = load_model(ModelConfig.from_path(path), path, torch.float32, torch.device("cpu"))
    layer = next(m for m in model.modules() if isinstance(m, moe.MoE))
    monkeypatch.setattr(moe, "FUSED_SHARED_MAX_TOKENS", 0)
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = layer(x)
        layer.experts.w2_weight[layer.experts.num_routed :].mul_(-2.0)
        after = layer(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, explicit_moe(layer, x), rtol=1e-4, atol=1e-5)


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


def _gpu_layer(checkpoints, variant: str) -> tuple[moe.MoE, RMSNorm]:
    path = checkpoints[variant]
    model = load_model(ModelConfig.from_path(path), path, torch.bfloat16, torch.device("cuda"))
    layer = next(m for m in model.modules() if isinstance(m, moe.MoE))
    norm = RMSNorm(model.config.hidden_size).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return layer, norm


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("tokens", [8, 64, 192])
def test_gpu_dual_stream_gives_the_next_layer_the_same_input(checkpoints, monkeypatch, variant, tokens):
    """Shared experts on the side stream, added into the residual, against them inside the fused
    kernels: the next add + norm sums the same hidden state (to bf16 rounding)."""
    layer, norm = _gpu_layer(checkpoints, variant)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, norm.weight.shape[0], device="cuda", generator=gen).bfloat16()
    res = torch.randn(tokens, norm.weight.shape[0], device="cuda", generator=gen).bfloat16()

    def next_input(dual_max: int) -> torch.Tensor:
        monkeypatch.setattr(moe, "DUAL_STREAM_MAX_TOKENS", dual_max)
        monkeypatch.setattr(moe, "DUAL_STREAM_MIN_TOKENS", 1)
        assert layer._dual_stream(x) == (dual_max > 0)
        with torch.no_grad():
            parts, residual = layer.add_norm_forward(x, res, norm)
        return parts.float().sum(dim=1) + residual.float()

    fused, dual = next_input(0), next_input(10**6)
    shared_only = layer.experts.add_shared(norm(x + res), torch.zeros_like(x), in_place=False).float()
    assert shared_only.abs().max() > 0.05  # the shared experts' part matters, so dropping it would fail
    torch.testing.assert_close(dual, fused, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_dual_stream_replays_in_a_cuda_graph(checkpoints, monkeypatch):
    monkeypatch.setattr(moe, "DUAL_STREAM_MIN_TOKENS", 1)
    monkeypatch.setattr(moe, "DUAL_STREAM_MAX_TOKENS", 10**6)
    layer, norm = _gpu_layer(checkpoints, "v3")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, norm.weight.shape[0], device="cuda", generator=gen).bfloat16()
    res = torch.randn_like(x)
    with torch.no_grad():
        layer.add_norm_forward(x, res, norm)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            parts, residual = layer.add_norm_forward(x, res, norm)
        for _ in range(2):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            res.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            graph.replay()
            want_parts, want_residual = layer.add_norm_forward(x, res, norm)
            torch.cuda.synchronize()
            assert torch.equal(parts, want_parts)
            assert torch.equal(residual, want_residual)


def test_model_builds_every_joined_copy_up_front(checkpoints):
    """build_weight_copies builds each MoE's joined shared down weights before any forward, as the
    memory profile needs; the copy is the experts' down projections side by side."""
    path = checkpoints["v3"]
    model = load_model(ModelConfig.from_path(path), path, torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, moe.MoE)]
    assert layers and all(not m.experts._shared_down.built for m in layers)
    model.build_weight_copies()
    for layer in layers:
        experts = layer.experts
        joined = experts._shared_down.value
        want = torch.cat([experts.w2_weight[e] for e in range(experts.num_routed, experts.num_routed + experts.num_shared)], dim=1)
        assert torch.equal(joined, want)
