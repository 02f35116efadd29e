"""The one-launch add + RMSNorm + router + expert selection matches the three reference ops."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import moe as ref
from moeserve.ops.triton import norm_route
from moeserve.ops.triton.norm_route import MAX_TOKENS, PER_TOKEN_MAX_TOKENS, add_norm_route
from tests.ops.test_triton_routing import REAL, VARIANTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(
    experts: int, rules: dict, tokens: int, hidden: int, dtype: torch.dtype, seed: int, num_shared: int = 0,
    part: bool = False,
):
    """`part`: x is a float32 one-slot part [T, 1, H] (attention with o_proj fused in), not [T, H]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x, residual = rand(tokens, hidden), rand(tokens, hidden)
    if part:
        x = torch.randn(tokens, 1, hidden, generator=gen).to(DEVICE)
    norm_w, router = rand(hidden, scale=0.2) + 1, rand(experts, hidden, scale=hidden**-0.5 * 4)
    bias = (torch.randn(experts, generator=gen) * 0.5).to(DEVICE) if rules["topk_method"] == "noaux_tc" else None
    args = (x, residual, norm_w, 1e-6, router)
    kwargs = dict(rules, correction_bias=bias, num_shared=num_shared)
    normed, summed, weights, ids = add_norm_route(*args, **kwargs)
    want_normed, want_summed, want_w, want_ids = ref.add_norm_route(*args, **kwargs)
    if DEVICE == "cuda":
        assert torch.equal(summed, want_summed)
    else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds: one bf16 ulp (a part's two)
        torch.testing.assert_close(summed, want_summed, rtol=2**-7, atol=2**-5 if part else 0)
    # Two bf16 roundings (the normalised row, then the weight product) and the row's mean square
    # summed in another order: a bf16 step or two.
    torch.testing.assert_close(normed, want_normed, rtol=1.6e-2, atol=1.6e-2)
    assert ids.dtype == torch.int32 and weights.shape == ids.shape == (tokens, rules["top_k"] + num_shared)
    # The selection is exact on the reference's logits of the kernel's own normed rows.
    logits = ref.linear(normed, router, out_dtype=torch.float32)
    sel_w, sel_ids = ref.select_experts(logits, **kwargs)
    got_ids, got_order = ids.long().sort(dim=1)
    sel_sorted, sel_order = sel_ids.sort(dim=1)
    assert torch.equal(got_ids, sel_sorted)
    torch.testing.assert_close(weights.gather(1, got_order), sel_w.gather(1, sel_order), rtol=1e-4, atol=1e-6)
    # And agrees with the whole reference chain wherever the normed rows came out equal.
    same = (normed == want_normed).all(dim=1)
    assert torch.equal(got_ids[same], want_ids.sort(dim=1)[0][same])


@pytest.mark.parametrize("variant", ["v2-lite", "v3", "v2-grouped"])
@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS, MAX_TOKENS + 1, PER_TOKEN_MAX_TOKENS])
def test_matches_the_three_reference_ops(variant, tokens):
    experts, rules = VARIANTS[variant]
    check(experts, rules, tokens, 48, torch.bfloat16, seed=tokens, num_shared=2 if variant == "v2-lite" else 0)


@pytest.mark.parametrize("tokens", [1, 2, 13])
def test_takes_a_float32_one_slot_part(tokens, monkeypatch):
    calls = []
    real = norm_route._norm_route_kernel
    monkeypatch.setattr(norm_route, "_norm_route_kernel", _Counted(real, calls))
    experts, rules = VARIANTS["v2-lite"]
    check(experts, rules, tokens, 48, torch.bfloat16, seed=20 + tokens, num_shared=2, part=True)
    assert calls, "the one-launch kernel took the part"


class _Counted:
    """A kernel wrapper that records its launches."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("tokens", [2, 13])
def test_the_counters_are_reset_for_the_next_call(tokens):
    experts, rules = VARIANTS["v3"]
    for seed in range(3):
        check(experts, rules, tokens, 32, torch.bfloat16, seed=seed)
    assert not norm_route._counters(torch.device(DEVICE)).any()


def test_falls_back_past_its_sizes_and_rejects_bad_shapes():
    experts, rules = VARIANTS["v2-lite"]
    # Three kernels (bf16 only on the GPU: CPU torch has no bf16 matmul into float32).
    check(experts, rules, PER_TOKEN_MAX_TOKENS + 3, 40, torch.bfloat16 if DEVICE == "cuda" else torch.float32, seed=5)
    check(experts, rules, 2, 40, torch.float32, seed=6)  # float32: three kernels
    x = torch.zeros(2, 40, device=DEVICE, dtype=torch.bfloat16)
    rules = dict(rules, correction_bias=None)
    with pytest.raises(ValueError, match="disagree"):
        add_norm_route(x, x, torch.ones(40, device=DEVICE), 1e-6, torch.zeros(8, 32, device=DEVICE), **rules)
    with pytest.raises(ValueError, match="top_k"):
        add_norm_route(x, x, torch.ones(40, device=DEVICE), 1e-6, torch.zeros(4, 40, device=DEVICE, dtype=x.dtype),
                       **rules)
    assert not norm_route._counters(torch.device(DEVICE)).any()


# --- GPU: real widths and expert counts -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 9, 13, PER_TOKEN_MAX_TOKENS, 64])
def test_gpu_real_shapes(model, tokens):
    experts, rules = REAL[model]
    hidden = {"v2-lite": 2048, "v2": 5120, "v3": 7168}[model]
    for seed in range(3):
        check(experts, rules, tokens, hidden, torch.bfloat16, seed=seed + 10 * tokens, num_shared=2 if model == "v2-lite" else 0)
        check(experts, rules, tokens, hidden, torch.bfloat16, seed=seed + 10 * tokens + 5, part=True)
    assert not norm_route._counters(torch.device(DEVICE)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_gpu_replays_in_a_cuda_graph(tokens):
    experts, rules = REAL["v2-lite"]
    rules = dict(rules, correction_bias=None, num_shared=2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
    res = torch.randn(tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    router = (torch.randn(experts, 2048, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    add_norm_route(x, res, norm_w, 1e-6, router, **rules)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [add_norm_route(x, res, norm_w, 1e-6, router, **rules) for _ in range(3)]
    for _ in range(2):
        x.copy_(torch.randn(tokens, 2048, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        want = ref.add_norm_route(x, res, norm_w, 1e-6, router, **rules)
        for got in outs:
            assert torch.equal(got[1], want[1])
            assert torch.equal(got[3].long().sort(dim=1)[0], want[3].sort(dim=1)[0])
    torch.cuda.synchronize()
    assert not norm_route._counters(torch.device("cuda")).any()
