"""MLA decode with the value projection: the split merge fused with W_UV (batch 1-2) and the separate
path (larger batches) both match the reference decode followed by the per-head matmul."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import attention as ref
from moeserve.ops.triton import mla_reduce
from moeserve.ops.triton.mla_decode import Tiles, mla_decode
from tests.ops.test_triton_attention import (
    DEVICE,
    FP8,
    RANK,
    ROPE,
    TOL,
    mla_inputs,
    paged_cache,
    poisoned,
    rel_err,
)

__all__ = ["poisoned"]  # the fixture, used by name below


def check(seq_lens, heads, rank, rope, v_dim, page_size, dtype, kv_dtype, gen, num_splits=None, tiles=None, tol=None):
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    cache, table = paged_cache(seq_lens, page_size, rank + rope, kv_dtype, gen, kv_scale)
    q_latent, q_rope = mla_inputs(len(seq_lens), heads, rank, rope, dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    # W_UV as the model holds it: a slice of kv_b_proj's weight viewed [H, nope + v, rank].
    kv_b = (torch.randn(heads, 8 + v_dim, rank, generator=gen) * rank**-0.5).to(DEVICE, dtype)
    w_uv = kv_b[:, 8:]
    want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, kv_scale, w_uv=w_uv)
    out = torch.full((len(seq_lens), heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, kv_scale, w_uv=w_uv, out=out,
                     num_splits=num_splits, tiles=tiles)
    assert got.data_ptr() == out.data_ptr() and got.shape == want.shape == (len(seq_lens), heads, v_dim)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (tol or TOL[dtype])


# --- CPU (interpreter) tests: tiny shapes ------------------------------------------------------


@pytest.mark.parametrize(("lens", "splits"), [([1], 3), ([16], 2), ([70], 5), ([150], 7), ([40], 1), ([70, 5], 4)])
def test_small_batches_merge_and_project_in_one_kernel(lens, splits, poisoned):
    gen = torch.Generator().manual_seed(splits)
    tiles = Tiles(block_q=1, block_h=16, block_n=16, num_warps=1, num_stages=1, early_tile=True)
    check(lens, 4, 32, 8, 40, 16, torch.float32, torch.float32, gen, num_splits=splits, tiles=tiles)


def test_larger_batches_project_after_the_merge(poisoned):
    gen = torch.Generator().manual_seed(5)
    check([3, 70, 150], 4, 32, 8, 24, 1, torch.float32, FP8, gen, num_splits=4)


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
def test_gpu_fused_projection_replays_in_cuda_graph():
    """Captured once, replayed over new queries and lengths: the graph reads them, not the capture's."""
    gen = torch.Generator().manual_seed(3)
    cache, table = paged_cache([4000], 64, RANK + ROPE, torch.bfloat16, gen)
    q_latent, q_rope = mla_inputs(1, 16, RANK, ROPE, torch.bfloat16, gen)
    w_uv = (torch.randn(16, 128, RANK, generator=gen) * RANK**-0.5).to(DEVICE, torch.bfloat16)
    lens = torch.tensor([1000], dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv, out=out)
    for n in (1, 700, 4000):
        lens.fill_(n)
        q_latent.copy_(torch.randn(q_latent.shape, generator=gen).to(DEVICE, torch.bfloat16) * RANK**-0.25)
        graph.replay()
        want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, w_uv=w_uv)
        assert rel_err(out, want) < TOL[torch.bfloat16]
