"""Batch 1's MLA decode split as the Hopper (Gluon) kernel matches the reference on fresh random
inputs: ragged ends, splits of one tile or many, shuffled pages whose unused rows hold NaN, the
newest key stored by the kernel just before, the o_proj row it zeroes, and graph replays; the
decode op takes it at batch 1 (GPU). It declines what it does not tile (CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import attention as ref
from moeserve.ops.triton import mla_decode as mla_decode_module
from moeserve.ops.triton.mla_decode import mla_decode
from tests.ops.test_triton_attention import (
    DEVICE,
    RANK,
    ROPE,
    TOL,
    mla_inputs,
    paged_cache,
    rel_err,
)

hopper = pytest.importorskip("moeserve.ops.triton.mla_decode_hopper")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_the_hopper_split_declines_cpu_tensors_and_other_shapes():
    q_latent, q_rope = mla_inputs(1, 16, RANK, ROPE, torch.bfloat16, torch.Generator().manual_seed(0), device="cpu")
    cache = torch.zeros(4, 16, RANK + ROPE, dtype=torch.bfloat16)
    assert not hopper.decode_split_usable(q_latent, q_rope, cache)


def test_try_decode_split_launches_only_what_it_takes(monkeypatch):
    """The decode op's entry: the kernel's tile back when it ran the split (arguments passed through,
    out_scale 1 for 16-bit caches), 0 when switched off or declined."""
    seen = []
    monkeypatch.setattr(hopper, "decode_split_usable", lambda *a: True)
    monkeypatch.setattr(hopper, "decode_split", lambda *a: seen.append(a))
    args = ("q_lat", "q_rope", "cache", "table", "lens", 0.7, 18, "part_o", "part_lse", None)
    assert hopper.try_decode_split(*args) == hopper.BLOCK_N == 64
    assert seen == [("q_lat", "q_rope", "cache", "table", "lens", 0.7, 1.0, 18, "part_o", "part_lse", None)]
    monkeypatch.setattr(hopper, "ENABLED", False)
    assert hopper.try_decode_split(*args) == 0
    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "decode_split_usable", lambda *a: False)
    assert hopper.try_decode_split(*args) == 0 and len(seen) == 1


def nan_past_the_ends(cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int]) -> None:
    """NaN in every cache row no sequence holds (spare pages, the scratch page, rows past an end)."""
    page = cache.shape[1]
    held = torch.zeros(cache.shape[0], page, dtype=torch.bool, device=cache.device)
    for b, n in enumerate(seq_lens):
        pages = table[b, : -(-n // page)].long()
        rows = torch.arange(pages.numel() * page, device=cache.device) < n
        held[pages] |= rows.view(-1, page)
    cache[~held] = float("nan")


def check(seq_lens, page_size, gen, num_splits=None, heads=16, dtype=torch.bfloat16):
    cache, table = paged_cache(seq_lens, page_size, RANK + ROPE, dtype, gen)
    nan_past_the_ends(cache, table, seq_lens)
    q_latent, q_rope = mla_inputs(len(seq_lens), heads, RANK, ROPE, dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, num_splits=num_splits)
    want = ref.mla_decode(q_latent, q_rope, cache.nan_to_num(0.0), table, lens, 0.3)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]


@pytest.fixture
def calls(monkeypatch):
    """How many times the decode op ran the Hopper split."""
    count = [0]
    real = hopper.decode_split

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hopper, "decode_split", counted)
    return count


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 63, 64, 65, 100, 1152, 1153, 1280, 5000, 20000])
def test_gpu_hopper_split_matches_the_reference(page_size, seq_len, calls, poisoned):
    # 64 splits, as a graph whose context holds 4,096 keys has (one split: the Triton kernel's direct output)
    check([seq_len], page_size, torch.Generator().manual_seed(seq_len + page_size), num_splits=64)
    assert calls[0] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("splits", [2, 3, 7, 37, 132])
def test_gpu_hopper_split_many_tiles_a_split(splits, calls, poisoned):
    """Few splits over long contexts: each walks several tiles, two in flight, ragged last."""
    gen = torch.Generator().manual_seed(splits)
    for seq_len in (130, 1000, 3001):
        check([seq_len], 16, gen, num_splits=splits)
    assert calls[0] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch", [2, 3, 8])
def test_gpu_hopper_split_a_few_sequences(batch, calls, poisoned, monkeypatch):
    """Where the op takes it for more rows (HOPPER_SPLIT_MAX_BATCH): a program per (split, sequence),
    ragged lengths, and the merge finding each split's keys in the Hopper kernel's tiles."""
    monkeypatch.setattr(mla_decode_module, "HOPPER_SPLIT_MAX_BATCH", 8)
    gen = torch.Generator().manual_seed(batch)
    for page_size in (16, 64):
        lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        check(lens, page_size, gen, num_splits=132 // batch)
    assert calls[0] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_hopper_split_other_head_counts_and_float16(calls, poisoned):
    check([700], 16, torch.Generator().manual_seed(8), heads=8, num_splits=64)
    check([700], 16, torch.Generator().manual_seed(32), heads=32, num_splits=64)
    check([700], 16, torch.Generator().manual_seed(16), dtype=torch.float16, num_splits=64)
    assert calls[0] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_the_triton_split_stays_for_other_batches_and_when_off(calls, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    check([300, 40], 16, gen, num_splits=8)  # batch 2: the Triton kernel's tiles
    check([300], 1, gen, num_splits=8)  # pages of one row: not in TMA boxes
    check([300], 16, gen, num_splits=1)  # one split: the Triton kernel writes the output itself
    check([300], 16, gen, heads=64, num_splits=8)  # 64 heads: past the Hopper kernel's registers
    monkeypatch.setattr(hopper, "ENABLED", False)
    check([300], 16, gen, num_splits=8)
    assert calls[0] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_hopper_split_reads_the_key_stored_just_before(page_size, calls):
    """The first tile is copied before the PDL wait but for the newest key's page: with the cache
    store as the kernel before (PDL), a stale newest row must never reach the output."""
    from moeserve.ops.triton.rope_store import mla_rope_norm_store

    gen = torch.Generator().manual_seed(page_size)
    for seq_len in (1, 17, 64, 65, 1152, 1153, 3000):
        cache, table = paged_cache([seq_len], page_size, RANK + ROPE, torch.bfloat16, gen)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
        newest = lens.long() - 1
        slots = table.gather(1, (newest // page_size)[:, None])[:, 0].long() * page_size + newest % page_size
        flat = cache.view(-1, RANK + ROPE)
        flat[slots] = 50.0  # stale, and loud
        q_latent, q_rope = mla_inputs(1, 16, RANK, ROPE, torch.bfloat16, gen)
        kv = torch.randn(1, RANK + ROPE, generator=gen).to(DEVICE, torch.bfloat16)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, device=DEVICE).float() / ROPE)
        norm_w = torch.ones(RANK, dtype=torch.bfloat16, device=DEVICE)
        q_key = torch.zeros(1, 1, ROPE, dtype=torch.bfloat16, device=DEVICE)
        mla_rope_norm_store(newest.to(torch.int32), q_key, kv, norm_w, 1e-6, inv_freq, 1.0, False, cache,
                            slots.to(torch.int32))
        got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, num_splits=64)  # right behind the store
        torch.cuda.synchronize()
        assert (flat[slots].float().abs() < 50).all()
        assert rel_err(got, ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3)) < TOL[torch.bfloat16]
    assert calls[0] == 7


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_hopper_split_with_o_proj_replays_in_a_graph(calls):
    """Batch 1 as the model runs it (W_UV and o_proj in the merge, whose float32 row the split
    zeroes), captured once and replayed on fresh lengths, pages, queries and cache rows."""
    gen = torch.Generator().manual_seed(9)
    width, page_size, hidden = 80, 16, 2048
    cache, _ = paged_cache([width * page_size], page_size, RANK + ROPE, torch.bfloat16, gen)
    q_latent, q_rope = mla_inputs(1, 16, RANK, ROPE, torch.bfloat16, gen)
    table = torch.zeros(1, width, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    w_uv = (torch.randn(16, 128, RANK, generator=gen) * RANK**-0.5).to(DEVICE, torch.bfloat16)
    w_o = (torch.randn(hidden, 16 * 128, generator=gen) * (16 * 128) ** -0.5).to(DEVICE, torch.bfloat16)
    mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=w_o)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=w_o)
    assert out.shape == (1, 1, hidden) and out.dtype == torch.float32
    pages = cache.shape[0] - 1
    for seq_len in (1, 1152, 700, 1280):
        table.copy_(torch.randperm(pages, generator=gen)[:width].view(1, width).to(DEVICE) + 1)
        lens.fill_(seq_len)
        q_latent.copy_(torch.randn(q_latent.shape, generator=gen) * RANK**-0.25)
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
        out.fill_(float("nan"))  # the split kernel zeroes it each replay
        graph.replay()
        want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=w_o)
        assert rel_err(out[:, 0], want) < TOL[torch.bfloat16]
    assert calls[0] == 2
