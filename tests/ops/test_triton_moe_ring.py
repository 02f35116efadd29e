"""One token's MoE as one persistent TMA-ring kernel matches the reference (GPU), also with the next
layer's add + norm + projection in its tail, and its pieces are dealt so that every intermediate
row of every slot (and every tail row) runs exactly once, with about equal bytes per program (CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve import ops
from moeserve.ops.reference import moe as ref
from moeserve.ops.reference import norm as ref_norm

ring = pytest.importorskip("moeserve.ops.triton.moe_ring")
plan = pytest.importorskip("moeserve.ops.triton.moe_ring_plan")
fused_moe_module = pytest.importorskip("moeserve.ops.triton.fused_moe")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize(
    ("programs", "hidden", "inter", "nslots", "fixed", "most"),
    # V2-Lite's 132 routed pieces fit 132 SMs; 114 SMs take them less evenly. Last: its dense layer.
    [(132, 2048, 1408, 8, 2, 1.07), (132, 7168, 2048, 8, 0, 1.04), (114, 2048, 1408, 8, 2, 1.3),
     (4, 512, 128, 3, 1, 1.01), (200, 512, 256, 2, 2, None), (132, 2048, 10944, 1, 1, 1.16)],
)
def test_pieces_cover_every_row_once_and_even_out_the_bytes(programs, hidden, inter, nslots, fixed, most):
    lists = plan.deal_pieces(programs, hidden, inter, nslots, fixed)
    covered = {slot: [] for slot in range(nslots)}
    for pieces in lists:
        shared = [slot >= nslots - fixed for slot, _, _ in pieces]
        assert shared == sorted(shared, reverse=True)  # shared pieces first: issuable before the router
        for slot, k0, rows in pieces:
            assert rows % plan.GRAIN == 0 and k0 % plan.GRAIN == 0 and rows > 0
            assert rows <= plan.NARROW if slot >= nslots - fixed else rows == plan.WIDE
            if nslots == fixed:  # no routed slot (a dense MLP): whole narrow boxes only
                assert rows == plan.NARROW
            covered[slot] += range(k0, k0 + rows)
    assert all(sorted(rows) == list(range(inter)) for rows in covered.values())
    loads = [sum(plan.piece_bytes(rows, hidden) for _, _, rows in pieces) for pieces in lists]
    if most is not None:  # the slowest program sets the kernel's time
        assert max(loads) <= most * 2 * 3 * hidden * inter * nslots / programs
    if programs * plan.NARROW >= fixed * inter:  # a shared piece per program at most, while they last
        assert all(sum(slot >= nslots - fixed for slot, _, _ in pieces) <= 1 for pieces in lists)
    table = plan.work_table(programs, hidden, inter, nslots, fixed)
    for (early, count, moe_count, *codes), pieces in zip(table.tolist(), lists, strict=True):
        assert count == moe_count == len(pieces) and early == sum(slot >= nslots - fixed for slot, _, _ in pieces)
        assert codes[:count] == [(s << 24) | (r // plan.GRAIN << 16) | k for s, k, r in pieces]


@pytest.mark.parametrize(("programs", "rows"), [(132, 3648), (132, 2112), (4, 72), (200, 64)])
def test_tail_rows_are_dealt_once_each_to_the_lightest_programs_first(programs, rows):
    hidden, inter, nslots, fixed = 2048, 1408, 8, 2
    lists = plan.deal_pieces(programs, hidden, inter, nslots, fixed)
    runs = plan.deal_tail(lists, hidden, rows)
    assert [k0 for k0, _ in runs] == [sum(n for _, n in runs[:p]) for p in range(programs)]  # contiguous
    assert sum(n for _, n in runs) == rows and all(n % plan.GRAIN == 0 for _, n in runs)
    sizes = {n for _, n in runs}
    assert max(sizes) - min(sizes) <= plan.GRAIN  # a unit more at most
    loads = [sum(plan.piece_bytes(r, hidden) for _, _, r in pieces) for pieces in lists]
    more = [loads[p] for p in range(programs) if runs[p][1] == max(sizes)]
    fewer = [loads[p] for p in range(programs) if runs[p][1] < max(sizes)]
    assert not fewer or max(more) <= min(fewer)
    table = plan.work_table(programs, hidden, inter, nslots, fixed, rows).tolist()
    for (_, count, moe_count, *codes), pieces, (k0, n) in zip(table, lists, runs, strict=True):
        assert moe_count == len(pieces) and count == moe_count + (n > 0)
        if n:
            assert codes[moe_count] == (plan.TAIL_SLOT << 24) | (n // plan.GRAIN << 16) | k0


def test_shapes_the_kernel_cannot_tile_are_refused():
    assert plan.shape_fits(2048, 1408, 8) and plan.shape_fits(7168, 2048, 9)
    assert not plan.shape_fits(256, 1408, 8)  # hidden not a multiple of two narrow down boxes
    assert not plan.shape_fits(2048, 1400, 8)  # intermediate not whole routed pieces
    assert not plan.shape_fits(2048, 1408, plan.TAIL_SLOT)  # a slot would read as the tail's
    assert plan.tail_fits(2048, 3648, 132) and plan.tail_fits(7168, 2112, 132)
    assert not plan.tail_fits(2048, 3650, 132)  # not whole units
    assert not plan.tail_fits(512, 64, 132)  # hidden not whole boxes


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


def ring_set(fn, tokens: int):
    """`fn` called with fused_moe's RING_MAX_TOKENS at `tokens` (1: the ring kernel, 0: two launches)."""

    def call(*args, **kwargs):
        saved = fused_moe_module.RING_MAX_TOKENS
        fused_moe_module.RING_MAX_TOKENS = tokens
        try:
            return fn(*args, **kwargs)
        finally:
            fused_moe_module.RING_MAX_TOKENS = saved

    return call


def v2_lite_layers(seed: int, count: int = 3) -> tuple[list[tuple], list[torch.Tensor], torch.Tensor, dict]:
    """`count` V2-Lite MoE layers (case()'s tensors), a router each, one norm weight, and the routing rules."""
    experts, hidden, inter, topk, shared = 66, 2048, 1408, 6, 2
    layers = [case(experts, hidden, inter, topk, shared, s) for s in range(count)]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    routers = [torch.randn(experts - shared, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in layers]
    norm = torch.rand(hidden, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5
    rules = dict(top_k=topk, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                 norm_topk_prob=False, routed_scaling_factor=1.0, correction_bias=None, scale_after_norm=False,
                 num_shared=shared)
    return layers, routers, norm, rules


def replays(forward, x: torch.Tensor, residual: torch.Tensor):
    """Capture forward(x, residual) in a CUDA graph (after one eager run, which compiles and builds
    the work tables), then replay it on two fresh inputs, yielding its recorded outputs after each."""
    forward(x, residual)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen = forward(x, residual)
    for seed in (1, 2):
        fresh = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=fresh, device="cuda"))
        residual.copy_(torch.randn(residual.shape, generator=fresh, device="cuda"))
        graph.replay()
        yield seen


def ring_on(fn):
    return ring_set(fn, 1)


def reference_on_touched(x, w13, w2, weights, ids) -> torch.Tensor:
    """The float32 reference on the experts `ids` touches only: V3's 256 experts widened whole take
    30 GB beside the kernel's 22 GB, past an 80 GB card shared by test workers."""
    used, local = ids.unique(return_inverse=True)
    return ref.fused_moe(x.float(), w13[used].float(), w2[used].float(), weights, local.to(ids.dtype))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "topk", "shared", "dtype"),
    [(66, 2048, 1408, 6, 2, torch.bfloat16), (256, 7168, 2048, 8, 0, torch.bfloat16),
     (10, 512, 256, 3, 1, torch.float16), (4, 1024, 128, 2, 2, torch.bfloat16)],
    ids=["v2-lite", "v3", "small-fp16", "all-fixed"],
)
def test_gpu_moe_ring_matches_reference(experts, hidden, inter, topk, shared, dtype):
    for seed, id_dtype in ((0, torch.int32), (1, torch.int64)):
        x, w13, w2, weights, ids = case(experts, hidden, inter, topk, shared, seed, dtype)
        assert ring.ring_usable(x, w13, w2, ids)
        got = ring.moe_ring(x, w13, w2, weights, ids.to(id_dtype), fixed_tail=shared)
        assert got.shape == (1, 1, hidden) and got.dtype == torch.float32
        # The reference in float32 throughout (the kernel rounds its activations to the weights' dtype).
        want = reference_on_touched(x, w13, w2, weights, ids)
        assert rel_error(got[0], want) < 1e-2
        # Again at once (the counters reset each launch), through the op, summed and unsummed.
        summed = ring_on(ops.fused_moe)(x, w13, w2, weights, ids, fixed_tail=shared)
        assert summed.dtype == dtype and rel_error(summed, want) < 1e-2
        parts = ring_on(ops.fused_moe)(x, w13, w2, weights, ids, sum_slots=False, fixed_tail=shared)
        assert parts.shape == (1, 1, hidden) and rel_error(parts[0], want) < 1e-2
        del x, w13, w2  # before the next seed's weights exist beside them


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_gpu_moe_ring_sum_feeds_the_next_add_and_norm():
    """The float32 sum [1, 1, H] through the next layer's add + norm (+ projection) kernels, as the
    model hands it over, against the same ops on the two-launch path's per-expert parts."""
    x, w13, w2, weights, ids = case(66, 2048, 1408, 6, 2, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    residual = torch.randn(1, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    gain = torch.rand(2048, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5
    proj = torch.randn(576, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    got = ring_on(ops.fused_moe)(x, w13, w2, weights, ids, sum_slots=False, fixed_tail=2)
    parts = ring_set(ops.fused_moe, 0)(x, w13, w2, weights, ids, sum_slots=False, fixed_tail=2)
    assert parts.shape == (1, 8, 2048)
    for op in (ops.fused_add_rms_norm, lambda *a: ops.add_norm_linear(*a, proj)):
        args = (residual, gain, 1e-6)
        (out, summed), (want_out, want_summed) = op(got, *args), op(parts, *args)
        assert out.dtype == summed.dtype == torch.bfloat16
        assert rel_error(summed, want_summed) < 1e-2 and rel_error(out, want_out) < 2e-2
    want_normed, _ = ref_norm.fused_add_rms_norm(got.cpu(), residual.cpu(), gain.cpu(), 1e-6)
    assert rel_error(ops.fused_add_rms_norm(got, residual, gain, 1e-6)[0].cpu(), want_normed) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_gpu_moe_ring_in_a_graph_after_the_router(monkeypatch):
    """As the model would run it: the add + norm + route kernel (PDL) writes the token and its ids,
    the ring reads them; replayed with fresh inputs, many layers in one graph."""
    monkeypatch.setattr(fused_moe_module, "RING_MAX_TOKENS", 1)
    experts, hidden, shared = 66, 2048, 2
    layers, routers, norm, rules = v2_lite_layers(seed=7)
    x, residual = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16), torch.zeros_like(layers[0][0])

    def forward(h, res):
        seen = []
        for (_, w13, w2, _, _), router in zip(layers, routers, strict=True):
            normed, res, weights, ids = ops.add_norm_route(h, res, norm, 1e-6, router, **rules)
            h = ops.fused_moe(normed, w13, w2, weights, ids, fixed_tail=shared)
            seen.append((normed, weights, ids, h))
        return seen

    for seen in replays(forward, x, residual):
        for (_, w13, w2, _, _), (normed, weights, ids, h) in zip(layers, seen, strict=True):
            # Each layer's output is the MoE of exactly the token and routing the kernel before it
            # wrote in this replay (a read before that kernel finished would see the last replay's).
            assert ids[0, -shared:].tolist() == list(range(experts - shared, experts))
            assert rel_error(h, ref.fused_moe(normed, w13, w2, weights, ids)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "topk", "shared", "rows", "bias", "dtype"),
    [(66, 2048, 1408, 6, 2, 3648, False, torch.bfloat16), (16, 7168, 2048, 8, 0, 2112, False, torch.bfloat16),
     (10, 1024, 256, 3, 1, 72, True, torch.float16)],
    ids=["v2-lite", "v3-shape", "small-fp16-bias"],
)
def test_gpu_moe_ring_tail_matches_the_two_steps(experts, hidden, inter, topk, shared, rows, bias, dtype):
    """The ring with the next layer's add + norm + projection in its tail, against the ring's sum
    through the add + norm + GEMV kernel and against the CPU reference of the whole op."""
    x, w13, w2, weights, ids = case(experts, hidden, inter, topk, shared, seed=5, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(6)
    residual = torch.randn(1, hidden, generator=gen, device="cuda", dtype=dtype)
    gain = torch.rand(hidden, generator=gen, device="cuda", dtype=dtype) + 0.5
    proj = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=dtype) * hidden**-0.5
    b = torch.randn(rows, generator=gen, device="cuda", dtype=dtype) if bias else None
    assert ring.tail_usable(x, w13, ring.Tail(residual, gain, 1e-6, proj, b))
    args = (residual, gain, 1e-6, proj, b)
    want_proj, want_sum = ref.fused_moe_add_norm_linear(
        x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(), *(a.cpu() if torch.is_tensor(a) else a for a in args)
    )
    for _ in range(2):  # twice, around a launch without the tail: the counters reset each launch
        got_proj, got_sum = ring_on(ops.fused_moe_add_norm_linear)(x, w13, w2, weights, ids, *args, fixed_tail=shared)
        assert got_proj.shape == (1, rows) and got_sum.shape == (1, hidden)
        assert got_proj.dtype == got_sum.dtype == dtype
        two_proj, two_sum = ops.add_norm_linear(ring.moe_ring(x, w13, w2, weights, ids, shared), *args)
        assert rel_error(got_sum, two_sum) < 1e-2 and rel_error(got_proj, two_proj) < 2e-2
        assert rel_error(got_sum.cpu(), want_sum) < 1e-2 and rel_error(got_proj.cpu(), want_proj) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_gpu_moe_ring_tail_in_a_graph_between_routers(monkeypatch):
    """Layers chained as the model runs them at one token: the add + norm + route kernel (PDL), then
    the ring whose tail writes the next layer's projection and residual, which the next entry reads
    (its first H columns standing in for the attention's output); replayed on fresh inputs."""
    monkeypatch.setattr(fused_moe_module, "RING_MAX_TOKENS", 1)
    hidden, shared, rows = 2048, 2, 3648
    layers, routers, norm, rules = v2_lite_layers(seed=8)
    gen = torch.Generator(device="cuda").manual_seed(9)
    projs = [torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in layers]
    x, residual = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16), torch.zeros_like(layers[0][0])

    def forward(h, res):
        seen = []
        for (_, w13, w2, _, _), router, proj in zip(layers, routers, projs, strict=True):
            normed, res, weights, ids = ops.add_norm_route(h, res, norm, 1e-6, router, **rules)
            out, summed = ops.fused_moe_add_norm_linear(normed, w13, w2, weights, ids, res, norm, 1e-6, proj,
                                                        fixed_tail=shared)
            seen.append((normed, weights, ids, res, out, summed))
            h, res = out[:, :hidden], summed
        return seen

    for seen in replays(forward, x, residual):
        for (_, w13, w2, _, _), proj, (normed, weights, ids, res, out, summed) in zip(layers, projs, seen, strict=True):
            moe = ref.fused_moe(normed, w13, w2, weights, ids)  # the unfused ops on this replay's own inputs
            want_out, want_sum = ops.add_norm_linear(moe, res, norm, 1e-6, proj)
            assert rel_error(summed, want_sum) < 1e-2 and rel_error(out, want_out) < 2e-2
