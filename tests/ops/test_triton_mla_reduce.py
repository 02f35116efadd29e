"""MLA decode with the value projection: the split merge fused with W_UV (batch 1-2) and the separate
path (larger batches) both match the reference decode followed by the per-head matmul; with o_proj
too, fused (its float32 sum added by atomics into a row the split kernel zeroes) or after."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import attention as ref
from moeserve.ops.triton import mla_reduce
from moeserve.ops.triton.mla_decode import mla_decode
from moeserve.ops.triton.mla_tiles import Tiles
from tests.ops.test_triton_attention import (
    DEVICE,
    FP8,
    RANK,
    ROPE,
    TOL,
    mla_inputs,
    paged_cache,
    rel_err,
)


def decode_inputs(seq_lens, heads, rank, rope, v_dim, page_size, dtype, kv_dtype, gen):
    """(the decode op's positional arguments, W_UV as the model holds it: a slice of kv_b_proj's
    weight viewed [H, nope + v, rank])."""
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    cache, table = paged_cache(seq_lens, page_size, rank + rope, kv_dtype, gen, kv_scale)
    q_latent, q_rope = mla_inputs(len(seq_lens), heads, rank, rope, dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kv_b = (torch.randn(heads, 8 + v_dim, rank, generator=gen) * rank**-0.5).to(DEVICE, dtype)
    return (q_latent, q_rope, cache, table, lens, 0.3, kv_scale), kv_b[:, 8:]


def check(seq_lens, heads, rank, rope, v_dim, page_size, dtype, kv_dtype, gen, num_splits=None, tiles=None, tol=None):
    args, w_uv = decode_inputs(seq_lens, heads, rank, rope, v_dim, page_size, dtype, kv_dtype, gen)
    want = ref.mla_decode(*args, w_uv=w_uv)
    out = torch.full((len(seq_lens), heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_decode(*args, w_uv=w_uv, out=out, num_splits=num_splits, tiles=tiles)
    assert got.data_ptr() == out.data_ptr() and got.shape == want.shape == (len(seq_lens), heads, v_dim)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (tol or TOL[dtype])


def check_output(seq_lens, heads, rank, v_dim, hidden, dtype, kv_dtype, gen, num_splits=None, tiles=None,
                 transposed=False) -> bool:
    """o_proj's output against the reference (read from a transposed copy if `transposed`); -> whether
    it came fused (a float32 one-slot part)."""
    rope = 8 if rank < 64 else ROPE
    args, w_uv = decode_inputs(seq_lens, heads, rank, rope, v_dim, 16, dtype, kv_dtype, gen)
    w_o = (torch.randn(hidden, heads * v_dim, generator=gen) * (heads * v_dim) ** -0.5).to(DEVICE, dtype)
    want = ref.mla_decode(*args, w_uv=w_uv, w_o=w_o)
    w_o_t = w_o.t().contiguous() if transposed else None
    got = mla_decode(*args, w_uv=w_uv, w_o=w_o, w_o_t=w_o_t, num_splits=num_splits, tiles=tiles)
    fused = got.dim() == 3
    if fused:
        assert got.dtype == torch.float32 and got.shape == (len(seq_lens), 1, hidden)
        got = got[:, 0]
    assert got.shape == want.shape == (len(seq_lens), hidden) and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]
    return fused


# --- CPU (interpreter) tests: tiny shapes ------------------------------------------------------


@pytest.mark.parametrize(("lens", "splits"), [([1], 3), ([70], 5), ([150], 7), ([70, 5], 4)])
@pytest.mark.parametrize("transposed", [False, True], ids=["o_proj", "o_proj_transposed"])
def test_batch_1_fuses_o_proj_into_the_merge(lens, splits, transposed, poisoned, monkeypatch):
    monkeypatch.setattr(mla_reduce, "OUTPUT_BLOCK_R", 16)  # three row blocks of 40, the last one partial
    monkeypatch.setattr(mla_reduce, "OUTPUT_MAX_ROWS", 2)  # the kernel takes any batch; the op picks 1
    gen = torch.Generator().manual_seed(splits)
    tiles = Tiles(block_q=1, block_h=16, block_n=16, num_warps=1, num_stages=1, early_tile=True)
    assert check_output(lens, 4, 32, 24, 40, torch.float32, torch.float32, gen, num_splits=splits, tiles=tiles,
                        transposed=transposed)


def test_o_proj_follows_the_merge_past_the_fused_sizes(poisoned, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    assert not check_output([3, 70, 150], 4, 32, 24, 40, torch.float32, FP8, gen, num_splits=4)
    assert not check_output([70, 5], 4, 32, 24, 40, torch.float32, torch.float32, gen, num_splits=4)
    assert not check_output([70], 4, 32, 24, 40, torch.float32, torch.float32, gen, num_splits=1)
    monkeypatch.setattr(mla_reduce, "PROJECT_OUTPUT", False)
    assert not check_output([70], 4, 32, 24, 40, torch.float32, torch.float32, gen, num_splits=3)


def test_o_proj_fuses_at_batch_1_only(monkeypatch):
    cpu = torch.device("cpu")
    assert mla_reduce.fuses_output(1, 16, 128, 2048, cpu)
    assert not mla_reduce.fuses_output(2, 16, 128, 2048, cpu)
    monkeypatch.setattr(mla_reduce, "PROJECT_OUTPUT", False)
    assert not mla_reduce.fuses_output(1, 16, 128, 2048, cpu)


def test_o_proj_weight_is_checked():
    gen = torch.Generator().manual_seed(9)
    cache, table = paged_cache([20], 16, 40, torch.float32, gen)
    q_latent, q_rope = mla_inputs(1, 4, 32, 8, torch.float32, gen)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    w_uv = torch.zeros(4, 24, 32, device=DEVICE)
    for impl in (mla_decode, ref.mla_decode):
        with pytest.raises(ValueError, match="needs w_uv"):
            impl(q_latent, q_rope, cache, table, lens, 0.3, w_o=torch.zeros(40, 96, device=DEVICE))
    with pytest.raises(ValueError, match="w_o"):
        mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=torch.zeros(40, 95, device=DEVICE))
    w_o = torch.zeros(40, 96, device=DEVICE)
    for w_o_t in (w_o, w_o.t(), torch.zeros(96, 41, device=DEVICE)):  # not transposed, not contiguous, wrong size
        with pytest.raises(ValueError, match="w_o_t"):
            mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=w_o, w_o_t=w_o_t)
    assert ref.transposed_o_proj(w_uv, w_o) is None  # the reference reads o_proj as it is


@pytest.mark.parametrize(("lens", "splits"), [([1], 3), ([16], 2), ([70], 5), ([150], 7), ([40], 1), ([70, 5], 4)])
def test_small_batches_merge_and_project_in_one_kernel(lens, splits, poisoned):
    gen = torch.Generator().manual_seed(splits)
    tiles = Tiles(block_q=1, block_h=16, block_n=16, num_warps=1, num_stages=1, early_tile=True)
    check(lens, 4, 32, 8, 40, 16, torch.float32, torch.float32, gen, num_splits=splits, tiles=tiles)


def test_larger_batches_project_after_the_merge(poisoned):
    gen = torch.Generator().manual_seed(5)
    check([3, 70, 150], 4, 32, 8, 24, 2, torch.float32, FP8, gen, num_splits=4)


def test_the_fused_path_is_taken_up_to_its_batch_limit(monkeypatch):
    calls = []
    real = mla_reduce.reduce_and_project
    monkeypatch.setattr("moeserve.ops.triton.mla_decode.reduce_and_project",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(0)
    check([50], 4, 32, 8, 16, 16, torch.float32, torch.float32, gen, num_splits=3)
    check([50, 9], 4, 32, 8, 16, 16, torch.float32, torch.float32, gen, num_splits=3)
    check([50, 9, 20], 4, 32, 8, 16, 16, torch.float32, torch.float32, gen, num_splits=3)
    assert len(calls) == mla_reduce.PROJECT_MAX_ROWS == 2


# --- GPU tests: real shapes ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("seq_len", [1, 100, 1280, 20000])
def test_gpu_fused_projection_real_shapes(kv_dtype, seq_len, poisoned):
    gen = torch.Generator().manual_seed(seq_len)
    check([seq_len], 16, RANK, ROPE, 128, 64, torch.bfloat16, kv_dtype, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 3, 8, 64])
def test_gpu_projection_at_larger_batches(batch, poisoned):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    check(lens, 16, RANK, ROPE, 128, 16, torch.bfloat16, torch.bfloat16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize(("lens", "fused"), [([1], False), ([100], True), ([1280], True), ([20000], True),
                                             ([1500, 37], False)])
@pytest.mark.parametrize("transposed", [False, True], ids=["o_proj", "o_proj_transposed"])
def test_gpu_fused_o_proj_real_shapes(kv_dtype, lens, fused, transposed, poisoned):
    """Fused at batch 1 wherever the page table's 64-key tiles make two splits or more; o_proj read
    as it is or from its transposed copy (mla_reduce.transposed_o_proj)."""
    gen = torch.Generator().manual_seed(sum(lens))
    assert check_output(lens, 16, RANK, 128, 2048, torch.bfloat16, kv_dtype, gen, transposed=transposed) == fused


@pytest.mark.gpu
@pytest.mark.parametrize("with_o", [False, True])
def test_gpu_fused_projections_replay_in_cuda_graph(with_o):
    """Captured once, replayed over new queries and lengths: the graph reads them, not the capture's.
    With o_proj, each replay zeroes the row the atomics add into: one that did not would double it."""
    gen = torch.Generator().manual_seed(3)
    cache, table = paged_cache([4000], 64, RANK + ROPE, torch.bfloat16, gen)
    q_latent, q_rope = mla_inputs(1, 16, RANK, ROPE, torch.bfloat16, gen)
    w_uv = (torch.randn(16, 128, RANK, generator=gen) * RANK**-0.5).to(DEVICE, torch.bfloat16)
    w_o = (torch.randn(2048, 16 * 128, generator=gen) * 2048**-0.5).to(DEVICE, torch.bfloat16) if with_o else None
    lens = torch.tensor([1000], dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, out=out, w_o=w_o)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, out=out, w_o=w_o)
    assert result.shape == ((1, 1, 2048) if with_o else (1, 16, 128))
    for n in (1, 700, 700, 4000):
        lens.fill_(n)
        q_latent.copy_(torch.randn(q_latent.shape, generator=gen).to(DEVICE, torch.bfloat16) * RANK**-0.25)
        graph.replay()
        want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, w_o=w_o)
        assert rel_err(result[:, 0] if with_o else result, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_fuses_o_proj_only_where_its_programs_fit_beside_the_split_kernel():
    """V2-Lite's 64 programs fit an H100's or H200's SMs; DeepSeek-V3's 128 heads (2,048) do not."""
    dev = torch.device(DEVICE)
    assert mla_reduce.fuses_output(1, 16, 128, 2048, dev)
    assert not mla_reduce.fuses_output(1, 128, 128, 7168, dev)
    # The transposed copy exists only where batch 1 fuses o_proj.
    w_o = torch.randn(2048, 16 * 128, device=DEVICE, dtype=torch.bfloat16)
    copy = mla_reduce.transposed_o_proj(torch.empty(16, 128, RANK, device=DEVICE), w_o)
    assert copy is not None and copy.is_contiguous() and torch.equal(copy, w_o.t())
    v3_o_proj = torch.empty(1, device=DEVICE).expand(7168, 128 * 128)  # V3's shape, no memory
    assert mla_reduce.transposed_o_proj(torch.empty(128, 128, RANK, device=DEVICE), v3_o_proj) is None
