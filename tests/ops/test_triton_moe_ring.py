"""One token's MoE as one persistent TMA-ring kernel matches the reference (GPU), and its work is
dealt so that every unit runs exactly once with about equal bytes per program (CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve import ops
from moeserve.ops.reference import moe as ref

ring = pytest.importorskip("moeserve.ops.triton.moe_ring")
fused_moe_module = pytest.importorskip("moeserve.ops.triton.fused_moe")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize(
    ("programs", "hidden", "inter", "nslots", "fixed"),
    [(132, 2048, 1408, 8, 2), (132, 7168, 2048, 8, 0), (7, 256, 128, 3, 1), (200, 256, 128, 2, 0)],
)
def test_work_table_deals_every_unit_once_and_evenly(programs, hidden, inter, nslots, fixed):
    table = ring.work_table(programs, hidden, inter, nslots, fixed)
    up_bytes, down_bytes = 2 * ring.ROWS * hidden, 2 * ring.ROWS * inter
    seen, loads = [], []
    for early, ups, total, *codes in table.tolist():
        units = codes[:total]
        assert all(code >> 24 == ring.UP for code in units[:ups])
        assert all(code >> 24 == ring.DOWN for code in units[ups:])
        # The units issued before the router are exactly the leading fixed-expert gate/up units.
        fixed_up = [code >> 24 == ring.UP and (code >> 16 & 255) >= nslots - fixed for code in units]
        assert all(fixed_up[:early]) and (early == len(units) or not fixed_up[early])
        seen += units
        loads.append(ups * up_bytes + (total - ups) * down_bytes)
    want = [(ring.UP << 24) | (s << 16) | b for s in range(nslots) for b in range(inter // ring.ROWS)]
    want += [(ring.DOWN << 24) | (s << 16) | b for s in range(nslots) for b in range(hidden // (2 * ring.ROWS))]
    assert sorted(seen) == sorted(want)
    assert max(loads) - min(loads) <= up_bytes + down_bytes


def case(experts: int, hidden: int, inter: int, topk: int, shared: int, seed: int, dtype=torch.bfloat16):
    """Random weights and one token routed to `topk` distinct experts plus the `shared` last ones."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda", dtype=dtype) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda", dtype=dtype) * inter**-0.5
    x = torch.randn(1, hidden, generator=gen, device="cuda", dtype=dtype)
    ids = torch.randperm(experts - shared, generator=gen, device="cuda")[:topk]
    ids = torch.cat([ids, torch.arange(experts - shared, experts, device="cuda")])[None]
    weights = torch.cat([torch.rand(1, topk, generator=gen, device="cuda"), torch.ones(1, shared, device="cuda")], 1)
    return x, w13, w2, weights, ids


def ring_on(fn):
    """`fn` called with fused_moe's one-token path set to the ring kernel."""

    def call(*args, **kwargs):
        saved = fused_moe_module.RING_MAX_TOKENS
        fused_moe_module.RING_MAX_TOKENS = 1
        try:
            return fn(*args, **kwargs)
        finally:
            fused_moe_module.RING_MAX_TOKENS = saved

    return call


def slot_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per slot, the relative error of [1, k, H] parts."""
    diff = (got.double() - want.double()).norm(dim=-1)
    return (diff / want.double().norm(dim=-1).clamp_min(1e-30)).flatten()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "topk", "shared", "dtype"),
    [(66, 2048, 1408, 6, 2, torch.bfloat16), (256, 7168, 2048, 8, 0, torch.bfloat16),
     (9, 256, 128, 3, 1, torch.float16), (4, 128, 256, 2, 2, torch.bfloat16)],
    ids=["v2-lite", "v3", "small-fp16", "all-fixed"],
)
def test_gpu_moe_ring_matches_reference(experts, hidden, inter, topk, shared, dtype):
    for seed, id_dtype in ((0, torch.int32), (1, torch.int64)):
        x, w13, w2, weights, ids = case(experts, hidden, inter, topk, shared, seed, dtype)
        got = ring.moe_ring(x, w13, w2, weights, ids.to(id_dtype), fixed_tail=shared)
        want = ref.fused_moe(x, w13, w2, weights, ids, sum_slots=False)
        assert got.shape == want.shape
        assert slot_errors(got, want).max() < 1e-2
        # Through the op, summed, and again at once: the slots' counters reset each launch.
        summed = ring_on(ops.fused_moe)(x, w13, w2, weights, ids, fixed_tail=shared)
        assert ring.ring_usable(x, w13, ids)
        torch.testing.assert_close(summed.float(), got.float().sum(1), rtol=2e-2, atol=2e-2 * got.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_gpu_moe_ring_in_a_graph_after_the_router(monkeypatch):
    """As the model would run it: the add + norm + route kernel (PDL) writes the token and its ids,
    the ring reads them; replayed with fresh inputs, many layers in one graph."""
    monkeypatch.setattr(fused_moe_module, "RING_MAX_TOKENS", 1)
    experts, hidden, inter, topk, shared = 66, 2048, 1408, 6, 2
    layers = [case(experts, hidden, inter, topk, shared, seed) for seed in range(3)]
    gen = torch.Generator(device="cuda").manual_seed(7)
    routers = [torch.randn(experts - shared, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in layers]
    norm = torch.rand(hidden, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5
    rules = dict(top_k=topk, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                 norm_topk_prob=False, routed_scaling_factor=1.0, correction_bias=None, scale_after_norm=False,
                 num_shared=shared)
    x, residual = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16), torch.zeros_like(layers[0][0])

    def forward(h, res):
        seen = []
        for (_, w13, w2, _, _), router in zip(layers, routers, strict=True):
            normed, res, weights, ids = ops.add_norm_route(h, res, norm, 1e-6, router, **rules)
            h = ops.fused_moe(normed, w13, w2, weights, ids, fixed_tail=shared)
            seen.append((normed, weights, ids, h))
        return seen

    forward(x, residual)  # compile and build the work table outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen = forward(x, residual)
    for seed in (1, 2):
        fresh = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(1, hidden, generator=fresh, device="cuda"))
        residual.copy_(torch.randn(1, hidden, generator=fresh, device="cuda"))
        graph.replay()
        for (_, w13, w2, _, _), (normed, weights, ids, h) in zip(layers, seen, strict=True):
            # Each layer's output is the MoE of exactly the token and routing the kernel before it
            # wrote in this replay (a read before that kernel finished would see the last replay's).
            assert ids[0, -shared:].tolist() == list(range(experts - shared, experts))
            want = ref.fused_moe(normed, w13, w2, weights, ids)
            assert ((h.double() - want.double()).norm() / want.double().norm()).item() < 1e-2
