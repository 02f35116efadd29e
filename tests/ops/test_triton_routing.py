"""The Triton expert selection matches the reference for every DeepSeek routing variant."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import moe as ref
from moeserve.ops.triton.routing import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (experts, routing kwargs); small expert counts keep the interpreter quick.
VARIANTS = {
    "v2-lite": (64, dict(top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                         norm_topk_prob=False, routed_scaling_factor=1.0, scale_after_norm=False)),
    "v2-grouped": (40, dict(top_k=6, topk_method="group_limited_greedy", scoring_func="softmax", n_group=8,
                            topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0, scale_after_norm=False)),
    "v2-norm": (16, dict(top_k=4, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                         norm_topk_prob=True, routed_scaling_factor=3.0, scale_after_norm=False)),
    "v3": (64, dict(top_k=8, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
                    norm_topk_prob=True, routed_scaling_factor=2.5, scale_after_norm=True)),
    "v3-ungrouped-top1": (16, dict(top_k=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
                                   topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0,
                                   scale_after_norm=True)),
    "sigmoid-no-norm": (32, dict(top_k=3, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4,
                                 topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                                 scale_after_norm=False)),
}
REAL = {
    "v2-lite": (64, VARIANTS["v2-lite"][1]),
    "v2": (160, VARIANTS["v2-grouped"][1]),
    "v3": (256, VARIANTS["v3"][1]),
}


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN / garbage-filled tensors, so elements a kernel skips fail the check."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-123456)

    monkeypatch.setattr(torch, "empty", empty)


def check(experts: int, kwargs: dict, tokens: int, seed: int, logits_dtype=torch.float32, num_shared: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE, logits_dtype)
    bias = None
    if kwargs["topk_method"] == "noaux_tc":
        bias = (torch.randn(experts, generator=gen) * 0.5).to(DEVICE)
    weights, ids = select_experts(logits, correction_bias=bias, num_shared=num_shared, **kwargs)
    want_w, want_ids = ref.select_experts(logits, correction_bias=bias, num_shared=num_shared, **kwargs)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert weights.shape == ids.shape == (tokens, kwargs["top_k"] + num_shared)
    if num_shared:  # the shared experts come last, at weight 1, after the routed ones
        shared = torch.arange(experts, experts + num_shared, device=ids.device)
        assert torch.equal(ids[:, kwargs["top_k"] :].long(), shared.expand(tokens, -1))
        assert torch.equal(weights[:, kwargs["top_k"] :], torch.ones(tokens, num_shared, device=ids.device))
        assert (ids[:, : kwargs["top_k"]] < experts).all()
    # Order within a row may differ: compare experts as sorted sets, weights in the same order.
    got_ids, got_order = ids.long().sort(dim=1)
    ref_ids, ref_order = want_ids.sort(dim=1)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(weights.gather(1, got_order), want_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tokens", [1, 13])
def test_select_experts_matches_reference(variant, tokens, poisoned):
    experts, kwargs = VARIANTS[variant]
    check(experts, kwargs, tokens, seed=tokens)


@pytest.mark.parametrize(("variant", "num_shared"), [("v2-lite", 2), ("v3", 1), ("v2-norm", 3)])
def test_select_experts_appends_shared_experts(variant, num_shared, poisoned):
    experts, kwargs = VARIANTS[variant]
    check(experts, kwargs, 5, seed=7, num_shared=num_shared)


def test_select_experts_bf16_logits_and_empty_batch(poisoned):
    experts, kwargs = VARIANTS["v3"]
    check(experts, kwargs, 9, seed=4, logits_dtype=torch.bfloat16)
    weights, ids = select_experts(torch.zeros(0, experts, device=DEVICE), correction_bias=None,
                                  **VARIANTS["v2-lite"][1])
    assert weights.shape == ids.shape == (0, 6)


def test_select_experts_rejects_bad_arguments():
    experts, kwargs = VARIANTS["v3"]
    logits = torch.randn(2, experts, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        select_experts(logits, correction_bias=None, **{**kwargs, "n_group": 7})
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, correction_bias=None, **{**kwargs, "top_k": experts + 1})
    with pytest.raises(ValueError, match="unknown routing"):
        select_experts(logits, correction_bias=None, **{**kwargs, "topk_method": "random"})


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(REAL))
@pytest.mark.parametrize("tokens", [1, 7, 256, 1000, 4096])
def test_gpu_select_experts_real_shapes(variant, tokens, poisoned):
    experts, kwargs = REAL[variant]
    check(experts, kwargs, tokens, seed=tokens)
    check(experts, kwargs, tokens, seed=tokens, num_shared=2)


@pytest.mark.gpu
def test_gpu_select_experts_is_graph_capturable():
    experts, kwargs = REAL["v3"]
    bias = torch.randn(experts, device="cuda") * 0.5
    logits = torch.randn(64, experts, device="cuda")
    select_experts(logits, correction_bias=bias, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = select_experts(logits, correction_bias=bias, **kwargs)
    for _ in range(2):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        want_w, want_ids = ref.select_experts(logits, correction_bias=bias, **kwargs)
        assert torch.equal(ids.long().sort(dim=1).values, want_ids.sort(dim=1).values)
        torch.testing.assert_close(weights.sum(dim=1), want_w.sum(dim=1), rtol=1e-5, atol=1e-6)
