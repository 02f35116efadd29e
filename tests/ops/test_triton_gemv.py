"""The Triton GEMV (decode-size dense projections) agrees with F.linear in float32.

Without CUDA it runs in Triton's CPU interpreter at small shapes; the `gpu` tests use
DeepSeek-V2-Lite's decode projections and router in bfloat16 on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.triton import gemv as gemv_module
from moeserve.ops.triton.gemv import MAX_ROWS, GemvConfig, fits, gemv, linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("n", "k", "block_n"), [(40, 64, 8), (37, 72, 4), (5, 24, 2)])
def test_matches_float32_linear(rows, n, k, block_n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, bias = rand(gen, rows, k), rand(gen, n, k), rand(gen, n)
    got = gemv(x, w, config=GemvConfig(block_n=block_n))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    got = gemv(x, w, bias, config=GemvConfig(block_n=block_n))
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_the_default_config():
    gen = torch.Generator().manual_seed(7)
    wide = rand(gen, 4, 100)
    x = wide[:, 10:74]  # row stride 100: a column slice, as attention's flattened heads may be
    w = rand(gen, 48, 64)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_linear_falls_back_past_the_gemv_and_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(8)
    w = rand(gen, 16, 32)
    many = rand(gen, MAX_ROWS + 1, 32)
    assert not fits(many, w)
    assert fits(rand(gen, 2, 32), rand(gen, 4096, 32)) and not fits(rand(gen, 3, 32), rand(gen, 4096, 32))
    assert fits(rand(gen, 1, 32), rand(gen, 65536, 32))  # one row streams its weights at any N
    torch.testing.assert_close(linear(many, w), F.linear(many, w))
    with pytest.raises(ValueError, match="not a supported GEMV"):
        gemv(many, w)
    with pytest.raises(ValueError, match="not a supported GEMV"):
        gemv(rand(gen, 2, 31), w)


@pytest.mark.parametrize("block_k", [16, 256])
def test_linear_takes_the_skinny_gemm_between_the_gemv_and_cublas(block_k, monkeypatch):
    """Half-precision rows past the GEMV's rows x N limit, up to SKINNY_MAX_ROWS, when it is on."""
    monkeypatch.setattr(gemv_module, "SKINNY_MAX_ROWS", 16)
    monkeypatch.setattr(gemv_module, "SKINNY_BLOCK_K", block_k)
    gen = torch.Generator().manual_seed(9 + block_k)
    w = rand(gen, 2000, 40, dtype=torch.bfloat16)  # K 40: the tile's K columns are masked
    for rows in (5, 16):
        x = rand(gen, rows, 40, dtype=torch.bfloat16)
        assert not fits(x, w) and gemv_module._skinny_fits(x, w, None, None)
        got = linear(x, w)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=1e-2, atol=2e-2)
    assert not gemv_module._skinny_fits(rand(gen, 17, 40, dtype=torch.bfloat16), w, None, None)


def test_linear_writes_into_out_on_every_path(monkeypatch):
    """`out=` (the decode graph's logits buffer): the GEMV, the skinny GEMM and cuBLAS each write the
    rows in place, and a buffer of the wrong shape or dtype is refused."""
    monkeypatch.setattr(gemv_module, "SKINNY_MAX_ROWS", 16)
    gen = torch.Generator().manual_seed(10)
    w = rand(gen, 9000, 40, dtype=torch.bfloat16)
    buffer = torch.full((20, 9000), 7.0, dtype=torch.bfloat16, device=DEVICE)
    for rows in (1, 5, 17):  # GEMV (N past MAX_ROWS_X_N: one row), skinny GEMM, cuBLAS
        x = rand(gen, rows, 40, dtype=torch.bfloat16)
        got = linear(x, w, out=buffer[:rows])
        assert got.data_ptr() == buffer.data_ptr()
        torch.testing.assert_close(buffer[:rows].float(), x.float() @ w.float().t(), rtol=1e-2, atol=2e-2)
        assert (buffer[rows:] == 7.0).all()
    with pytest.raises(ValueError, match="cannot take"):
        linear(rand(gen, 1, 40, dtype=torch.bfloat16), w, out=buffer[:2])
    with pytest.raises(ValueError, match="cannot take"):
        gemv(rand(gen, 1, 40, dtype=torch.bfloat16), w, out=buffer[:1].float())


# --- GPU: DeepSeek-V2-Lite decode shapes in bfloat16 --------------------------------------------

SHAPES = {"fused_qkv_a": (3648, 2048), "o_proj": (2048, 2048), "router": (64, 2048), "odd": (1000, 1500)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gpu_projections_match_cublas(name, rows):
    n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000 + rows)
    x = rand(gen, rows, k, dtype=torch.bfloat16)
    w = (rand(gen, n, k) * 0.02).bfloat16()
    want = x.float() @ w.float().t()
    got = linear(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    got32 = linear(x, w, out_dtype=torch.float32)  # the router's exact-product float32 logits
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 32])
def test_gpu_lm_head_into_the_logits_buffer(rows):
    """V2-Lite's LM head (102,400 x 2,048) as the decode graph runs it, into a wider logits buffer:
    a GEMV at one row, the skinny GEMM to 16, cuBLAS past them."""
    gen = torch.Generator().manual_seed(rows)
    w = (rand(gen, 102400, 2048) * 0.02).bfloat16()
    x = rand(gen, rows, 2048, dtype=torch.bfloat16)
    logits = torch.full((64, 102400), 3.0, dtype=torch.bfloat16, device=DEVICE)
    linear(x, w, out=logits[:rows])
    want = x.float() @ w.float().t()
    torch.testing.assert_close(logits[:rows].float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert (logits[rows:] == 3.0).all()


@pytest.mark.gpu
def test_gpu_gemv_in_a_cuda_graph_reads_new_inputs():
    """Captured once, replayed on new activations: the result follows x (weights are prefetched)."""
    gen = torch.Generator().manual_seed(11)
    w = (rand(gen, 3648, 2048) * 0.02).bfloat16()
    x = rand(gen, 1, 2048, dtype=torch.bfloat16)
    norm_w = torch.ones(2048, device=DEVICE, dtype=torch.bfloat16)
    from moeserve.ops.triton.norm import rms_norm

    rms_norm(x, norm_w, 1e-6), linear(x, w)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(rms_norm(x, norm_w, 1e-6), w)  # a PDL kernel right before the GEMV
    for seed in range(3):
        x.copy_(torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16))
        graph.replay()
        want = F.linear(rms_norm(x, norm_w, 1e-6).float(), w.float())
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


# --- add + RMSNorm + projection in one kernel (a decode layer's first projection) ---------------


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("rows", [1, 2])
def test_add_norm_linear_matches_the_reference(slots, rows, monkeypatch):
    """Summed parts + residual, normalised and projected, against the reference op; the summed
    rows come back too. Two rows run the kernel's row loop (with the limit raised) and the fallback."""
    from moeserve.ops.reference.linear import add_norm_linear as reference

    gen = torch.Generator().manual_seed(7 * slots + rows)
    x = rand(gen, rows, slots, 64) if slots > 1 else rand(gen, rows, 64)
    residual, gain, w, bias = rand(gen, rows, 64), rand(gen, 64), rand(gen, 40, 64), rand(gen, 40)
    want, want_sum = reference(x, residual, gain, 1e-6, w, bias)
    for limit in (rows, rows - 1):  # the one-kernel path, then (for rows - 1 < rows) the fallback
        monkeypatch.setattr(gemv_module, "ADD_NORM_MAX_ROWS", limit)
        got, got_sum = gemv_module.add_norm_linear(x, residual, gain, 1e-6, w, bias)
        torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_add_norm_linear_takes_a_float32_sum_as_one_slot():
    """[1, 1, H] float32 (the one-token ring MoE's output) beside a half-precision residual and
    weight: the one-kernel path rounds the sum to the residual's dtype, as the reference does."""
    from moeserve.ops.reference.linear import add_norm_linear as reference

    gen = torch.Generator().manual_seed(12)
    x = rand(gen, 1, 1, 64)
    residual, gain, w = (rand(gen, 1, 64, dtype=torch.float16), rand(gen, 64, dtype=torch.float16),
                         rand(gen, 40, 64, dtype=torch.float16))
    want, want_sum = reference(x, residual, gain, 1e-6, w)
    got, got_sum = gemv_module.add_norm_linear(x, residual, gain, 1e-6, w)
    assert got.dtype == got_sum.dtype == torch.float16
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=1e-3)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_add_norm_linear_rejects_parts_that_do_not_match_the_residual():
    gen = torch.Generator().manual_seed(3)
    w, gain = rand(gen, 8, 64), rand(gen, 64)
    with pytest.raises(ValueError, match="does not match"):
        gemv_module.add_norm_linear(rand(gen, 1, 3, 64), rand(gen, 2, 64), gain, 1e-6, w)  # rows differ
    with pytest.raises(ValueError, match="does not match"):
        gemv_module.add_norm_linear(rand(gen, 1, 3, 32), rand(gen, 1, 64), gain, 1e-6, w)  # widths differ


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1, 8])
def test_gpu_add_norm_linear_in_a_cuda_graph(slots):
    """V2-Lite's fused_qkv_a behind a MoE's eight parts (or a dense MLP's one row), bfloat16, captured
    once and replayed on fresh inputs: the projection and the next residual follow the reference."""
    from moeserve.ops.reference.linear import add_norm_linear as reference

    gen = torch.Generator().manual_seed(100 + slots)
    w = (rand(gen, 3648, 2048) * 0.02).bfloat16()
    gain = (1 + 0.1 * rand(gen, 2048)).bfloat16()
    x = rand(gen, 1, slots, 2048, dtype=torch.bfloat16) if slots > 1 else rand(gen, 1, 2048, dtype=torch.bfloat16)
    residual = rand(gen, 1, 2048, dtype=torch.bfloat16)
    gemv_module.add_norm_linear(x, residual, gain, 1e-6, w)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = gemv_module.add_norm_linear(x, residual, gain, 1e-6, w)
    for seed in range(3):
        fresh = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=fresh).to(DEVICE, torch.bfloat16))
        residual.copy_(torch.randn(residual.shape, generator=fresh).to(DEVICE, torch.bfloat16))
        graph.replay()
        want, want_sum = reference(x, residual, gain, 1e-6, w)  # PyTorch in bfloat16, cuBLAS's projection
        torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


# --- embedding + RMSNorm + projection (a model's first kernel) -----------------------------------


@pytest.mark.parametrize("one_kernel", [True, False])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_embed_norm_linear_matches_the_reference(one_kernel, id_dtype, monkeypatch):
    """The id's table row, normalised and projected, against the reference op, in the kernel and
    in the fallback (embedding, norm kernel, GEMV); the row itself comes back as the residual."""
    from moeserve.ops.reference.linear import embed_norm_linear as reference

    gen = torch.Generator().manual_seed(21 + one_kernel)
    table, gain, w, bias = rand(gen, 50, 64), rand(gen, 64), rand(gen, 40, 64), rand(gen, 40)
    ids = torch.tensor([37], dtype=id_dtype, device=DEVICE)
    monkeypatch.setattr(gemv_module, "EMBED_IN_GEMV", one_kernel)
    want, want_row = reference(ids, table, gain, 1e-6, w, bias)
    got, got_row = gemv_module.embed_norm_linear(ids, table, gain, 1e-6, w, bias)
    torch.testing.assert_close(got_row, table[37:38], rtol=0, atol=0)
    torch.testing.assert_close(got_row, want_row, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_embed_norm_linear_past_one_row_and_a_stray_id():
    """Three ids take the fallback; an id past the table in the kernel reads a zero row (the
    projection is then the bias) rather than memory beyond the table."""
    from moeserve.ops.reference.linear import embed_norm_linear as reference

    gen = torch.Generator().manual_seed(5)
    table, gain, w, bias = rand(gen, 50, 64), rand(gen, 64), rand(gen, 40, 64), rand(gen, 40)
    ids = torch.tensor([3, 49, 0], device=DEVICE)
    want, want_rows = reference(ids, table, gain, 1e-6, w, bias)
    got, got_rows = gemv_module.embed_norm_linear(ids, table, gain, 1e-6, w, bias)
    torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    got, got_row = gemv_module.embed_norm_linear(torch.tensor([50], device=DEVICE), table, gain, 1e-6, w, bias)
    assert not got_row.any()
    torch.testing.assert_close(got, bias[None], rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_gpu_embed_norm_linear_in_a_cuda_graph():
    """V2-Lite's embedding table and first fused_qkv_a in bfloat16, captured once and replayed on
    fresh token ids: the projection and the embedded row follow the reference."""
    from moeserve.ops.reference.linear import embed_norm_linear as reference

    gen = torch.Generator().manual_seed(300)
    table = (rand(gen, 102400, 2048) * 0.02).bfloat16()
    w = (rand(gen, 3648, 2048) * 0.02).bfloat16()
    gain = (1 + 0.1 * rand(gen, 2048)).bfloat16()
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    gemv_module.embed_norm_linear(ids, table, gain, 1e-6, w)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, row = gemv_module.embed_norm_linear(ids, table, gain, 1e-6, w)
    for seed in range(3):
        ids.fill_(int(torch.randint(0, 102400, (1,), generator=torch.Generator().manual_seed(seed))))
        graph.replay()
        want, want_row = reference(ids, table, gain, 1e-6, w)  # PyTorch in bfloat16, cuBLAS's projection
        torch.testing.assert_close(row, want_row, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
