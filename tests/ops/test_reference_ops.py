"""The reference ops agree with each other and with naive formulas on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from moeserve import ops
from moeserve.ops.reference import attention as ref_attention


def paged(kv: torch.Tensor, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows of `kv` [S, D] into shuffled pages; return (cache, page table)."""
    num_pages = -(-kv.shape[0] // page_size)
    order = torch.randperm(num_pages + 3, generator=gen)[:num_pages] + 1
    cache = torch.randn(num_pages + 4, page_size, kv.shape[1], generator=gen)
    slots = order.repeat_interleave(page_size)[: kv.shape[0]] * page_size + torch.arange(kv.shape[0]) % page_size
    ops.store_kv(cache, slots, kv[:, :-8], kv[:, -8:])
    return cache, order.to(torch.int32)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_store_then_gather_round_trips(page_size):
    gen = torch.Generator().manual_seed(page_size)
    kv = torch.randn(37, 40, generator=gen)
    cache, table = paged(kv, page_size, gen)
    got = ops.gather_kv(cache, table[None], torch.tensor([37]), torch.tensor([0, 37]), torch.float32)
    assert torch.equal(got, kv)


def decompress(latent: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    k_nope = torch.einsum("sc,hnc->shn", latent, w_uk)
    v = torch.einsum("sc,hvc->shv", latent, w_uv)
    k = torch.cat((k_nope, k_rope[:, None].expand(-1, w_uk.shape[0], -1)), dim=-1)
    return k, v


@pytest.mark.parametrize("page_size", [1, 16])
def test_absorbed_forms_equal_decompressed_attention(page_size):
    gen = torch.Generator().manual_seed(7)
    heads, nope, rope, v_dim, rank = 4, 16, 8, 12, 32
    seq_lens, query_lens = [9, 33, 5], [9, 4, 1]
    w_uk = torch.randn(heads, nope, rank, generator=gen) / math.sqrt(rank)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / math.sqrt(rank)
    caches, tables, ks, vs, qs = [], [], [], [], []
    for s, q in zip(seq_lens, query_lens, strict=True):
        kv = torch.randn(s, rank + rope, generator=gen)
        cache, table = paged(kv, page_size, gen)
        caches.append(cache)
        tables.append(table)
        k, v = decompress(kv[:, :rank], kv[:, rank:], w_uk, w_uv)
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q, heads, nope + rope, generator=gen))
    scale = 0.3
    # Put all sequences' pages into one cache, as the engine does.
    cache = torch.cat(caches)
    offsets = torch.tensor([0] + [c.shape[0] for c in caches[:-1]]).cumsum(0)
    width = max(t.numel() for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : t.numel()] = t + offsets[i]
    q = torch.cat(qs)
    cu_q = torch.tensor([0, *query_lens]).cumsum(0).int()
    cu_k = torch.tensor([0, *seq_lens]).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = ops.varlen_attention(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, max(query_lens), max(seq_lens), scale)
    q_latent = torch.einsum("thn,hnc->thc", q[..., :nope], w_uk)
    latent_out = ops.mla_extend_absorbed(q_latent, q[..., nope:], cache, table, lens, cu_q, max(query_lens), scale)
    got = torch.einsum("thc,hvc->thv", latent_out, w_uv)
    assert torch.allclose(got, expected, atol=1e-5)
    # Decode: the last query of each sequence alone.
    last = torch.tensor(query_lens).cumsum(0) - 1
    dec = ops.mla_decode(q_latent[last], q[last, :, nope:], cache, table, lens, scale)
    assert torch.allclose(torch.einsum("thc,hvc->thv", dec, w_uv), expected[last], atol=1e-5)


def test_varlen_attention_matches_dense_causal():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 10], dtype=torch.int32)
    out = ops.varlen_attention(q, k, v, cu, cu, 10, 10, 0.5)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    scores.masked_fill_(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(out, torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), atol=1e-6)


def naive_route(logits, k, method, scoring, n_group, topk_group, norm, scale, bias, v3):
    """Token-by-token routing written out plainly."""
    weights, ids = [], []
    for row in logits:
        scores = row.sigmoid() if scoring == "sigmoid" else row.softmax(-1)
        choice = scores + (bias if bias is not None else 0)
        per = len(row) // n_group
        allowed = list(range(len(row)))
        if method != "greedy" and n_group > 1:
            groups = [choice[g * per : (g + 1) * per] for g in range(n_group)]
            gscore = [g.topk(2).values.sum() if method == "noaux_tc" else g.max() for g in groups]
            best = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            allowed = [e for e in allowed if e // per in best]
        picked = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = scores[picked]
        if norm and k > 1:
            w = w / w.sum()
            w = w * scale if v3 else w
        else:
            w = w * scale
        weights.append(dict(zip(picked, w.tolist(), strict=True)))
        ids.append(set(picked))
    return weights, ids


@pytest.mark.parametrize(
    ("method", "scoring", "n_group", "topk_group", "norm", "bias", "v3"),
    [
        ("greedy", "softmax", 1, 1, False, False, False),
        ("group_limited_greedy", "softmax", 4, 2, False, False, False),
        ("group_limited_greedy", "softmax", 4, 2, True, False, False),
        ("noaux_tc", "sigmoid", 4, 2, True, True, True),
        ("noaux_tc", "sigmoid", 1, 1, True, True, True),
        ("noaux_tc", "sigmoid", 4, 1, False, True, True),
    ],
)
def test_select_experts_matches_naive(method, scoring, n_group, topk_group, norm, bias, v3):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 16, generator=gen)
    corr = torch.randn(16, generator=gen) * 0.3 if bias else None
    w, ids = ops.select_experts(logits, 3, method, scoring, n_group, topk_group, norm, 2.5, corr, v3)
    ref_w, ref_ids = naive_route(logits, 3, method, scoring, n_group, topk_group, norm, 2.5, corr, v3)
    for t in range(20):
        assert set(ids[t].tolist()) == ref_ids[t]
        for e, weight in zip(ids[t].tolist(), w[t].tolist(), strict=True):
            assert weight == pytest.approx(ref_w[t][e], rel=1e-5)


def test_fused_moe_matches_per_token_loop():
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens, k = 6, 16, 8, 11, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    out = ops.fused_moe(x, w13, w2, weights, ids)
    for t in range(tokens):
        expected = torch.zeros(hidden)
        for j in range(k):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).split(inter)
            expected += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out[t], expected, atol=1e-4)


def test_rms_norm():
    x = torch.randn(4, 32)
    w = torch.rand(32)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), expected, atol=1e-6)


def test_fp8_cache_round_trip_within_e4m3_precision():
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn(20, 40, generator=gen)
    cache = torch.zeros(4, 8, 40, dtype=torch.float8_e4m3fn)
    slots = torch.arange(20) + 8
    ops.store_kv(cache, slots, kv[:, :-8], kv[:, -8:], kv_scale=0.5)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    back = ops.gather_kv(cache, table, torch.tensor([20]), torch.tensor([0, 20]), torch.float32, kv_scale=0.5)
    rel = (back - kv).abs() / kv.abs().clamp(min=0.05)
    assert rel.max() < 0.07  # e4m3 keeps 3 mantissa bits: at most 1/16 relative error


def test_fp8_cache_stores_slots_in_interleaved_pairs():
    """FP8: slots 2j and 2j + 1 share 16-bit words column by column, the even slot's byte first
    (what decode's word reads assume); other dtypes keep a row a slot."""
    gen = torch.Generator().manual_seed(12)
    kv = torch.randn(6, 10, generator=gen)
    slots = torch.tensor([4, 5, 6, 7, 9, 10])
    cache = torch.zeros(3, 4, 10, dtype=torch.float8_e4m3fn)
    ops.store_kv(cache, slots, kv[:, :8], kv[:, 8:])
    stored = ref_attention.quantize_kv(kv, cache.dtype, 1.0).view(torch.uint8)
    raw = cache.view(torch.uint8).view(3, 2, 10, 2)  # [page, pair, column, slot in the pair]
    for i, slot in enumerate(slots.tolist()):
        page, at = divmod(slot, 4)
        assert torch.equal(raw[page, at // 2, :, at % 2], stored[i])
    assert raw[0].eq(0).all() and raw[2, 0, :, 0].eq(0).all() and raw[2, 1, :, 1].eq(0).all()  # slots 8, 11
    assert torch.equal(ref_attention.read_slots(cache, slots), stored.view(cache.dtype))
    wide = torch.zeros(3, 4, 10, dtype=torch.bfloat16)
    ops.store_kv(wide, slots, kv[:, :8], kv[:, 8:])
    assert torch.equal(wide.view(-1, 10)[slots], kv.bfloat16())
    with pytest.raises(ValueError, match="even"):
        ops.store_kv(torch.zeros(3, 5, 10, dtype=torch.float8_e4m3fn), slots, kv[:, :8], kv[:, 8:])


def test_fused_add_rms_norm_and_rope_store_compose():
    gen = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen), torch.rand(16, generator=gen)
    normed, summed = ops.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r) and torch.allclose(normed, ops.rms_norm(x + r, w, 1e-6))
    from moeserve.ops.reference.rope import rope_cos_sin, rotate

    pos = torch.tensor([0, 3, 7, 100, 5])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    q = torch.randn(5, 2, 24, generator=gen)
    q_before = q.clone()
    kv = torch.randn(5, 40, generator=gen)
    cache = torch.zeros(3, 4, 40)
    slots = torch.tensor([4, 5, 6, 7, 8])
    latent, k_rope = ops.mla_rope_norm_store(pos, q[..., 16:], kv, w[:8].repeat(4), 1e-6, inv_freq, 1.0, True, cache, slots)
    cos, sin = rope_cos_sin(pos, inv_freq, 1.0)
    assert torch.allclose(q[..., 16:], rotate(q_before[..., 16:], cos[:, None], sin[:, None], True))
    assert torch.equal(q[..., :16], q_before[..., :16])
    assert torch.allclose(latent, ops.rms_norm(kv[:, :32], w[:8].repeat(4), 1e-6))
    assert torch.allclose(cache.view(-1, 40)[slots], torch.cat((latent, k_rope), dim=-1))
