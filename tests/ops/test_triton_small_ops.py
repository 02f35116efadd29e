"""Triton RMSNorm, SiLU-and-mul and MLA rope/norm/store agree with their PyTorch references.

Without CUDA these run in Triton's CPU interpreter at tiny shapes. The interpreter truncates
float32 -> bfloat16 (the GPU rounds to nearest), so bfloat16 tolerances allow two roundings, and
its float8 conversion halves values whose rounding carries into the exponent (e.g. 7.9 -> 4
instead of 8), so on CPU the FP8 cache test forgives exactly those values.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import activation as ref_act
from moeserve.ops.reference import norm as ref_norm
from moeserve.ops.reference import rope as ref_rope
from moeserve.ops.triton import activation as tri_act
from moeserve.ops.triton import norm as tri_norm
from moeserve.ops.triton import rope_store as tri_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def tol(dtype: torch.dtype) -> dict:
    """assert_close tolerances for outputs in `dtype`."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1.6e-2, "atol": 1e-2}


def poison_allocator(nbytes: int, device: str) -> None:
    """Free a NaN-filled block so that the next allocations likely reuse (and start as) NaNs."""
    block = torch.full((nbytes // 4 + 1024,), float("nan"), device=device)
    del block


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32, device: str = DEVICE) -> torch.Tensor:
    """Standard normal values made on the CPU generator, then moved."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# --- RMSNorm -----------------------------------------------------------------------------------


def norm_inputs(gen, tokens: int, width: int, dtype, strided: bool, device: str = DEVICE):
    """(x, residual, weight); x is a column slice of a wider tensor when `strided`."""
    wide = rand(gen, tokens, width + 24, dtype=dtype, device=device)
    x = wide[:, 5 : 5 + width] if strided else wide[:, :width].contiguous()
    residual = rand(gen, tokens, width, dtype=dtype, device=device)
    weight = (torch.rand(width, generator=gen) + 0.5).to(device=device, dtype=dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,strided", [(32, False), (48, True)])
def test_rms_norm_matches_reference(dtype, width, strided):
    gen = torch.Generator().manual_seed(width)
    x, _, w = norm_inputs(gen, 5, width, dtype, strided)
    poison_allocator(x.numel() * 4, DEVICE)
    got = tri_norm.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape and not got.isnan().any()
    torch.testing.assert_close(got, ref_norm.rms_norm(x, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x, residual, w = norm_inputs(gen, 6, 40, dtype, strided=True)
    poison_allocator(x.numel() * 8, DEVICE)
    normed, summed = tri_norm.fused_add_rms_norm(x, residual, w, 1e-5)
    want_normed, want_summed = ref_norm.fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(normed, want_normed, **tol(dtype))
    torch.testing.assert_close(summed, want_summed, **tol(dtype))
    assert not (x.data_ptr() == summed.data_ptr() or residual.data_ptr() == summed.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_fused_add_rms_norm_sums_per_expert_parts_first(dtype, slots):
    """x as [T, slots, H] (a MoE's unsummed outputs): summed, added to the residual, normalised."""
    gen = torch.Generator().manual_seed(slots)
    parts = rand(gen, 5, slots, 40, dtype=dtype)
    residual = rand(gen, 5, 40, dtype=dtype)
    w = (torch.rand(40, generator=gen) + 0.5).to(device=DEVICE, dtype=dtype)
    normed, summed = tri_norm.fused_add_rms_norm(parts, residual, w, 1e-5)
    assert normed.shape == summed.shape == (5, 40)
    want_normed, want_summed = ref_norm.fused_add_rms_norm(parts, residual, w, 1e-5)
    # Sums of up to 9 unit normals reach ~4, where one bfloat16 step is 1/64.
    close = tol(dtype) if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 3.2e-2}
    torch.testing.assert_close(summed, want_summed, **close)
    torch.testing.assert_close(normed, want_normed, **close)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_takes_a_float32_sum_as_one_slot(dtype):
    """x as [T, 1, H] float32 (the one-token ring MoE's summed output) beside a half-precision
    residual: rounded to the residual's dtype, added, normalised; outputs in that dtype."""
    gen = torch.Generator().manual_seed(11)
    parts = rand(gen, 3, 1, 40)
    residual = rand(gen, 3, 40, dtype=dtype)
    w = (torch.rand(40, generator=gen) + 0.5).to(device=DEVICE, dtype=dtype)
    normed, summed = tri_norm.fused_add_rms_norm(parts, residual, w, 1e-5)
    want_normed, want_summed = ref_norm.fused_add_rms_norm(parts, residual, w, 1e-5)
    assert normed.dtype == summed.dtype == want_summed.dtype == dtype
    torch.testing.assert_close(want_summed, (parts[:, 0].to(dtype) + residual), rtol=0, atol=0)
    close = {"rtol": 1.6e-2, "atol": 3.2e-2}
    torch.testing.assert_close(summed, want_summed, **close)
    torch.testing.assert_close(normed, want_normed, **close)


def test_rms_norm_takes_leading_dims_and_empty_batches():
    gen = torch.Generator().manual_seed(4)
    x = rand(gen, 2, 3, 16)
    w = rand(gen, 16)
    torch.testing.assert_close(tri_norm.rms_norm(x, w, 1e-6), ref_norm.rms_norm(x, w, 1e-6), **tol(x.dtype))
    empty = x[:0, 0]
    assert tri_norm.rms_norm(empty, w, 1e-6).shape == (0, 16)
    assert [t.shape for t in tri_norm.fused_add_rms_norm(empty, empty, w, 1e-6)] == [(0, 16), (0, 16)]


def test_rms_norm_rejects_mismatched_inputs():
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        tri_norm.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        tri_norm.fused_add_rms_norm(x, torch.zeros(3, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)


# --- SiLU and mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_silu_and_mul_matches_reference(dtype, strided):
    gen = torch.Generator().manual_seed(5)
    wide = rand(gen, 7, 2 * 40 + 6, dtype=dtype) * 4
    x = wide[:, 3 : 3 + 80] if strided else wide[:, :80].contiguous()
    poison_allocator(x.numel() * 4, DEVICE)
    got = tri_act.silu_and_mul(x)
    assert got.shape == (7, 40) and got.dtype == dtype
    torch.testing.assert_close(got, ref_act.silu_and_mul(x), **tol(dtype))


@pytest.mark.parametrize("max_block", [16, 64])
def test_silu_and_mul_blocks_cover_ragged_columns(monkeypatch, max_block):
    """Several column blocks a row, the last past the width masked, none skipped."""
    monkeypatch.setattr(tri_act, "MAX_BLOCK", max_block)
    gen = torch.Generator().manual_seed(7)
    x = rand(gen, 7, 2 * 40, dtype=torch.float32) * 4
    poison_allocator(x.numel() * 4, DEVICE)
    torch.testing.assert_close(tri_act.silu_and_mul(x), ref_act.silu_and_mul(x), **tol(x.dtype))


def test_silu_and_mul_reference_is_the_formula():
    gen = torch.Generator().manual_seed(6)
    x = rand(gen, 3, 2, 10, device="cpu")
    gate, up = x[..., :5], x[..., 5:]
    torch.testing.assert_close(ref_act.silu_and_mul(x), gate * torch.sigmoid(gate) * up)
    torch.testing.assert_close(tri_act.silu_and_mul(x.to(DEVICE)).cpu(), ref_act.silu_and_mul(x), **tol(x.dtype))


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        tri_act.silu_and_mul(torch.zeros(2, 7, device=DEVICE))


# --- MLA rope + norm + store -------------------------------------------------------------------


def rope_inputs(gen, tokens, heads, nope, rank, rope, dtype, page_size, cache_dtype, device=DEVICE):
    """Arguments of mla_rope_norm_store with q_rope and the latent as strided views, as the model has them."""
    q = rand(gen, tokens, heads, nope + rope, dtype=dtype, device=device)
    kv = rand(gen, tokens, rank + rope + 8, dtype=dtype, device=device)[:, : rank + rope]
    weight = (torch.rand(rank, generator=gen) + 0.5).to(device=device, dtype=dtype)
    positions = torch.randint(0, 100_000, (tokens,), generator=gen).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope)).to(device)
    pages = tokens // page_size + 3
    cache = rand(gen, pages, page_size, rank + rope, device=device).to(cache_dtype)
    slots = (torch.randperm((pages - 1) * page_size, generator=gen)[:tokens] + page_size).to(device)
    return q, kv, weight, positions, inv_freq, cache, slots


def run_both(args, nope, interleaved, kv_scale=1.0, magnitude=0.8, eps=1e-6):
    """Each implementation on its own copies of q and the cache -> ((outs, q, cache) x 2)."""
    q, kv, weight, positions, inv_freq, cache, slots = args
    results = []
    for impl in (tri_rope.mla_rope_norm_store, ref_rope.mla_rope_norm_store):
        q_i, cache_i = q.clone(), cache.clone()
        poison_allocator(kv.numel() * 8, kv.device.type)
        outs = impl(positions, q_i[..., nope:], kv, weight, eps, inv_freq, magnitude, interleaved, cache_i, slots, kv_scale)
        results.append((outs, q_i, cache_i))
    return results


def assert_cache_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """FP8 caches may differ by one FP8 step where the bf16 inputs differ by one bf16 step."""
    if got.dtype != FP8:
        torch.testing.assert_close(got, want, **tol(dtype))
        return
    g, w = got.float(), want.float()
    assert (g == w).float().mean() > 0.99
    torch.testing.assert_close(g, w, rtol=0.13, atol=2**-9)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rope_norm_store_matches_reference(interleaved, page_size, dtype):
    gen = torch.Generator().manual_seed(page_size + interleaved)
    nope = 16
    args = rope_inputs(gen, 5, 3, nope, 32, 8, dtype, page_size, dtype)
    (got, got_q, got_cache), (want, want_q, want_cache) = run_both(args, nope, interleaved)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, **tol(dtype))
    torch.testing.assert_close(got_q, want_q, **tol(dtype))
    assert torch.equal(got_q[..., :nope], args[0][..., :nope])
    assert_cache_close(got_cache, want_cache, dtype)


def interpreter_fp8_carries(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where Triton's CPU interpreter gave half of a power of two that rounding should have reached."""
    if got.is_cuda:
        return torch.zeros(got.shape, dtype=torch.bool, device=got.device)
    g, w = got.float(), want.float()
    return (g * 2 == w) & (torch.frexp(w).mantissa.abs() == 0.5)


@pytest.mark.parametrize("kv_scale", [1.0, 0.005])
def test_mla_rope_norm_store_fp8_cache(kv_scale):
    """float32 inputs, so the FP8 rounding sees the same values in both implementations."""
    gen = torch.Generator().manual_seed(9)
    args = rope_inputs(gen, 6, 2, 4, 32, 8, torch.float32, 4, FP8)
    (_, _, got), (_, _, want) = run_both(args, 4, True, kv_scale=kv_scale)
    ok = interpreter_fp8_carries(got, want)
    assert ok.float().mean() < 0.1
    assert_cache_close(got.float()[~ok].to(FP8), want.float()[~ok].to(FP8), torch.float32)
    if kv_scale < 1:
        assert want.float().abs().max() == 448  # the clamp was exercised


def test_mla_rope_norm_store_refuses_an_odd_fp8_page():
    """An FP8 cache stores slots in pairs (reference.attention.slot_view): an odd page size cannot."""
    q, kv, weight, positions, inv_freq, cache, slots = rope_inputs(
        torch.Generator().manual_seed(1), 3, 2, 4, 32, 8, torch.float32, 3, FP8
    )
    with pytest.raises(ValueError, match="even page size"):
        tri_rope.mla_rope_norm_store(positions, q[..., 4:], kv, weight, 1e-6, inv_freq, 1.0, True, cache, slots)


@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_rope_norm_store_odd_sizes(interleaved):
    """Widths that are not powers of two and more heads than one head block."""
    gen = torch.Generator().manual_seed(10)
    args = rope_inputs(gen, 3, 20, 4, 24, 12, torch.float32, 2, torch.float32)
    (got, got_q, got_cache), (want, want_q, want_cache) = run_both(args, 4, interleaved)
    for g, w in zip((*got, got_q, got_cache), (*want, want_q, want_cache), strict=True):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_mla_rope_norm_store_mixed_dtypes_and_negative_slots():
    gen = torch.Generator().manual_seed(11)
    q, kv, weight, positions, inv_freq, cache, slots = rope_inputs(gen, 4, 2, 8, 16, 8, torch.bfloat16, 4, torch.float32)
    slots[1] = -1
    before = cache.clone()
    q_rope = q[..., 8:]
    latent, k_rope = tri_rope.mla_rope_norm_store(
        positions, q_rope, kv, weight.float(), 1e-6, inv_freq, 1.0, True, cache, slots
    )
    want_latent = ref_rope.mla_rope_norm_store(
        positions, q.clone()[..., 8:], kv, weight.float(), 1e-6, inv_freq, 1.0, True, before.clone(), slots.clamp(min=0)
    )[0]
    assert latent.dtype == torch.bfloat16
    torch.testing.assert_close(latent, want_latent.to(torch.bfloat16), **tol(torch.bfloat16))
    written = cache.view(-1, 24)[slots[[0, 2, 3]]]
    torch.testing.assert_close(written, torch.cat((latent, k_rope), -1)[[0, 2, 3]].float())
    untouched = torch.ones(cache.view(-1, 24).shape[0], dtype=torch.bool, device=cache.device)
    untouched[slots[[0, 2, 3]]] = False
    assert torch.equal(cache.view(-1, 24)[untouched], before.view(-1, 24)[untouched])


def test_mla_rope_norm_store_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(12)
    q, kv, weight, positions, inv_freq, cache, slots = rope_inputs(gen, 2, 2, 8, 16, 8, torch.float32, 4, torch.float32)
    with pytest.raises(ValueError, match="q_rope"):
        tri_rope.mla_rope_norm_store(positions, q, kv, weight, 1e-6, inv_freq, 1.0, True, cache, slots)
    with pytest.raises(ValueError, match="inv_freq"):
        tri_rope.mla_rope_norm_store(positions, q[..., 8:], kv, weight, 1e-6, inv_freq[:2], 1.0, True, cache, slots)
    with pytest.raises(ValueError, match="cache width"):
        tri_rope.mla_rope_norm_store(positions, q[..., 8:], kv, weight, 1e-6, inv_freq, 1.0, True, cache[..., :-2], slots)


def run_absorbing(args, nope, rows, v_dim, gen):
    """run_both with the first `rows` tokens' queries absorbed by a per-head W_UK, as the model asks:
    W_UK a strided view of kv_b_proj's weight, q_latent the leading rows of a NaN-filled buffer."""
    q, kv, weight, positions, inv_freq, cache, slots = args
    heads, rank = q.shape[1], weight.shape[0]
    kv_b = (torch.randn(heads, nope + v_dim, rank, generator=gen) * nope**-0.5).to(q)
    results = []
    for impl in (tri_rope.mla_rope_norm_store, ref_rope.mla_rope_norm_store):
        q_i, cache_i = q.clone(), cache.clone()
        buffer = torch.full((rows + 2, heads, rank), float("nan"), dtype=q.dtype, device=q.device)
        outs = impl(positions, q_i[..., nope:], kv, weight, 1e-6, inv_freq, 0.8, True, cache_i, slots,
                    q_nope=q_i[:rows, :, :nope], w_uk=kv_b[:, :nope], q_latent=buffer[:rows])
        assert torch.isnan(buffer[rows:]).all()
        results.append((outs, q_i, cache_i, buffer[:rows]))
    return results


@pytest.mark.parametrize("fused_max", [tri_rope.FUSED_ABSORB_MAX_ROWS, 2])
@pytest.mark.parametrize("tokens,rows", [(5, 3), (22, 20), (3, 1)])
def test_mla_rope_norm_store_absorbs_w_uk(fused_max, tokens, rows, monkeypatch):
    """Absorbed queries in the same launch (or apart outside FUSED_ABSORB_MIN/MAX_ROWS), prepared tokens unchanged."""
    monkeypatch.setattr(tri_rope, "FUSED_ABSORB_MAX_ROWS", fused_max)
    monkeypatch.setattr(tri_rope, "FUSED_ABSORB_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(tokens + fused_max)
    nope = 12  # not a power of two: the absorbing programs mask their K
    args = rope_inputs(gen, tokens, 3, nope, 80, 8, torch.float32, 4, torch.float32)
    (got, got_q, got_cache, got_lat), (want, want_q, want_cache, want_lat) = run_absorbing(args, nope, rows, 8, gen)
    torch.testing.assert_close(got_lat, want_lat, rtol=1e-4, atol=1e-4)
    for g, w in zip((*got, got_q, got_cache), (*want, want_q, want_cache), strict=True):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_mla_rope_norm_store_absorb_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(14)
    q, kv, weight, positions, inv_freq, cache, slots = rope_inputs(gen, 3, 2, 8, 16, 8, torch.float32, 4, torch.float32)
    args = (positions, q[..., 8:], kv, weight, 1e-6, inv_freq, 1.0, True, cache, slots)
    w_uk = torch.zeros(2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs w_uk"):
        tri_rope.mla_rope_norm_store(*args, q_nope=q[:2, :, :8])
    with pytest.raises(ValueError, match="does not give"):
        tri_rope.mla_rope_norm_store(*args, q_nope=q[:2, :, :8], w_uk=w_uk, q_latent=torch.zeros(2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        tri_rope.mla_rope_norm_store(*args, q_nope=torch.zeros(4, 2, 8, device=DEVICE), w_uk=w_uk,
                                     q_latent=torch.zeros(4, 2, 16, device=DEVICE))


# --- GPU: real shapes, FP8 caches, CUDA graphs ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("width", [512, 1536, 2048, 7168])
@pytest.mark.parametrize("tokens", [1, 257])
def test_gpu_norms_at_model_widths(width, tokens):
    gen = torch.Generator().manual_seed(width + tokens)
    x, residual, w = norm_inputs(gen, tokens, width, torch.bfloat16, strided=True, device="cuda")
    torch.testing.assert_close(tri_norm.rms_norm(x, w, 1e-6), ref_norm.rms_norm(x, w, 1e-6), **tol(x.dtype))
    normed, summed = tri_norm.fused_add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_summed = ref_norm.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(normed, want_normed, **tol(x.dtype))
    assert torch.equal(summed, want_summed)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [1408, 10944])
def test_gpu_silu_and_mul_at_model_widths(inter):
    gen = torch.Generator().manual_seed(inter)
    x = rand(gen, 300, 2 * inter, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(tri_act.silu_and_mul(x), ref_act.silu_and_mul(x), **tol(x.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,kv_scale", [(torch.bfloat16, 1.0), (FP8, 1.0), (FP8, 0.05)])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,page_size", [(16, 2), (16, 64), (128, 16)])
def test_gpu_mla_rope_norm_store_at_model_shapes(cache_dtype, kv_scale, interleaved, heads, page_size):
    gen = torch.Generator().manual_seed(heads + page_size)
    args = rope_inputs(gen, 133, heads, 128, 512, 64, torch.bfloat16, page_size, cache_dtype, device="cuda")
    (got, got_q, got_cache), (want, want_q, want_cache) = run_both(args, 128, interleaved, kv_scale=kv_scale)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol(torch.bfloat16))
    torch.testing.assert_close(got_q, want_q, **tol(torch.bfloat16))
    assert_cache_close(got_cache, want_cache, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 17, 64, 256, 300])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_mla_rope_norm_store_absorbs_w_uk_at_model_shapes(rows, heads):
    """Decode batches up to FUSED_ABSORB_MAX_ROWS absorb in the launch; 300 rows take cuBLAS."""
    gen = torch.Generator().manual_seed(rows + heads)
    args = rope_inputs(gen, rows + 3, heads, 128, 512, 64, torch.bfloat16, 16, torch.bfloat16, device="cuda")
    (got, got_q, got_cache, got_lat), (want, want_q, want_cache, want_lat) = run_absorbing(args, 128, rows, 128, gen)
    # bf16 outputs of float32 sums taken in another order: within a bf16 step.
    torch.testing.assert_close(got_lat, want_lat, **tol(torch.bfloat16))
    assert (got_lat - want_lat).norm() / want_lat.norm() < 4e-3
    for g, w in zip((*got, got_q, got_cache), (*want, want_q, want_cache), strict=True):
        torch.testing.assert_close(g, w, **tol(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,kv_scale", [(torch.bfloat16, 1.0), (FP8, 0.05)])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_mla_rope_norm_store_one_token(cache_dtype, kv_scale, heads):
    """Batch-1 decode: the kernel runs on one warp (ONE_WARP_MAX_TOKENS), with and without W_UK."""
    assert tri_rope.ONE_WARP_MAX_TOKENS >= 1
    gen = torch.Generator().manual_seed(heads + int(kv_scale * 100))
    for interleaved in (True, False):
        args = rope_inputs(gen, 1, heads, 128, 512, 64, torch.bfloat16, 64, cache_dtype, device="cuda")
        (got, got_q, got_cache), (want, want_q, want_cache) = run_both(args, 128, interleaved, kv_scale=kv_scale)
        for g, w in zip((*got, got_q), (*want, want_q), strict=True):
            torch.testing.assert_close(g, w, **tol(torch.bfloat16))
        assert_cache_close(got_cache, want_cache, torch.bfloat16)
    args = rope_inputs(gen, 1, heads, 128, 512, 64, torch.bfloat16, 16, torch.bfloat16, device="cuda")
    (got, got_q, got_cache, got_lat), (want, want_q, want_cache, want_lat) = run_absorbing(args, 128, 1, 128, gen)
    torch.testing.assert_close(got_lat, want_lat, **tol(torch.bfloat16))
    assert (got_lat - want_lat).norm() / want_lat.norm() < 4e-3
    for g, w in zip((*got, got_q, got_cache), (*want, want_q, want_cache), strict=True):
        torch.testing.assert_close(g, w, **tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_small_ops_replay_in_cuda_graphs():
    gen = torch.Generator().manual_seed(13)
    x, residual, w = norm_inputs(gen, 8, 2048, torch.bfloat16, strided=False, device="cuda")
    gate_up = rand(gen, 8, 2 * 1408, dtype=torch.bfloat16, device="cuda")
    q, kv, weight, positions, inv_freq, cache, slots = rope_inputs(gen, 8, 16, 128, 512, 64, torch.bfloat16, 16, FP8, "cuda")

    def step():
        outs = tri_norm.fused_add_rms_norm(x, residual, w, 1e-6)
        act = tri_act.silu_and_mul(gate_up)
        latent, k_rope = tri_rope.mla_rope_norm_store(
            positions, q[..., 128:], kv, weight, 1e-6, inv_freq, 1.0, True, cache, slots, 0.5
        )
        return outs[0], act, latent, k_rope

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, residual, gate_up, kv):
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    positions.copy_(torch.randint(0, 4096, positions.shape, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step(), strict=True):
        torch.testing.assert_close(got, want, **tol(torch.bfloat16))
