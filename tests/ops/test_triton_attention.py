"""The Triton attention kernels (MLA decode / extend, varlen flash attention, KV gather) match the
reference ops on fresh random inputs.

Without CUDA the kernels run in Triton's interpreter at tiny shapes, where compute is float32
and fp32 -> bf16 stores truncate instead of rounding; `gpu` tests use real shapes and dtypes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton

from moeserve.ops.reference import attention as ref
from moeserve.ops.triton import mla_decode as mla_decode_module
from moeserve.ops.triton.flash_attention import varlen_attention
from moeserve.ops.triton.gather_kv import gather_kv
from moeserve.ops.triton.mla_decode import mla_decode
from moeserve.ops.triton.mla_extend import mla_extend_absorbed
from moeserve.ops.triton.mla_tiles import Tiles

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 2e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _squeeze_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns 1-element arrays (program ids, scalar loads) into loop bounds
    with int(), which numpy >= 2.3 refuses; Triton 3.7 squeezes first. Do the same."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1" and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
    _squeeze_interpreter_scalars()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius-norm relative error, in fp64 (NaN when `got` holds NaN)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def paged_cache(seq_lens, page_size, width, dtype, gen, kv_scale=1.0, device=DEVICE):
    """A cache holding random rows for every sequence in shuffled pages, and its page table."""
    # As in a live pool: spare random pages between the used ones, and a table one page wider
    # than needed (zeros: the scratch page).
    counts = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(counts) + 4
    order = torch.randperm(num_pages, generator=gen) + 1
    cache = torch.randn(num_pages + 1, page_size, width, generator=gen)
    cache = ref.quantize_kv(cache, dtype, kv_scale) if dtype == FP8 else cache.to(dtype)
    table = torch.zeros(len(seq_lens), max(counts) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(counts):
        table[b, :n] = order[used : used + n]
        used += n
    return cache.to(device), table.to(device)


def cumsum0(lens) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEVICE)


def mla_inputs(rows, heads, rank, rope, dtype, gen, device=DEVICE):
    """q_latent [rows, H, rank] and q_rope as a strided view of a wider tensor, as the model passes it."""
    q = torch.randn(rows, heads, 16 + rope, generator=gen).to(device=device, dtype=dtype)
    q_latent = (torch.randn(rows, heads, rank, generator=gen) * rank**-0.25).to(device=device, dtype=dtype)
    return q_latent, q[..., 16:]


def check_decode(seq_lens, heads, rank, rope, page_size, q_dtype, kv_dtype, gen, num_splits=None, tol=None, tiles=None):
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    cache, table = paged_cache(seq_lens, page_size, rank + rope, kv_dtype, gen, kv_scale)
    q_latent, q_rope = mla_inputs(len(seq_lens), heads, rank, rope, q_dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, kv_scale)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, kv_scale, num_splits=num_splits, tiles=tiles)
    assert got.dtype == q_latent.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (tol or TOL[q_dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("walk", ["rising", "random"])
def test_mla_decode_running_max_that_moves(walk, kv_dtype, poisoned):
    """Scores whose maximum keeps rising (by about 18 in log2 units a 16-key tile) or wanders: the
    online softmax's rescaling of the accumulators and the sum keeps the result exact."""
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, page_size, n = 2, 32, 16, 16, 100
    direction = torch.randn(rank + rope, generator=gen)
    if walk == "rising":
        level = torch.arange(n, dtype=torch.float32) * 0.8
    else:
        level = torch.cumsum(torch.randn(n, generator=gen) * 3.0, 0)
    rows = level[:, None] * direction[None, :] / direction.norm() ** 2 + 0.05 * torch.randn(n, rank + rope, generator=gen)
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    cache = torch.zeros(-(-n // page_size) + 1, page_size, rank + rope, dtype=kv_dtype)
    ref.write_slots(cache, page_size + torch.arange(n), ref.quantize_kv(rows, kv_dtype, kv_scale))
    cache = cache.to(DEVICE)
    table = torch.arange(1, cache.shape[0] + 1, dtype=torch.int32, device=DEVICE)[None, :]
    q = direction.repeat(1, heads, 1) * torch.tensor([1.0, -0.5]).view(1, heads, 1)
    q_latent, q_rope = q[..., :rank].contiguous().to(DEVICE), q[..., rank:].contiguous().to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 1.0, kv_scale)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 1.0, kv_scale, num_splits=2)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (2e-4 if kv_dtype == torch.float32 else 1e-2)


def check_extend(seq_lens, query_lens, heads, rank, rope, page_size, q_dtype, kv_dtype, gen, num_splits=None):
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    cache, table = paged_cache(seq_lens, page_size, rank + rope, kv_dtype, gen, kv_scale)
    q_latent, q_rope = mla_inputs(sum(query_lens), heads, rank, rope, q_dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = cumsum0(query_lens)
    args = (q_latent, q_rope, cache, table, lens, qsl, max(query_lens), 0.3, kv_scale)
    want = ref.mla_extend_absorbed(*args)
    got = mla_extend_absorbed(*args, num_splits=num_splits)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[q_dtype]


def check_varlen(query_lens, kv_lens, heads, dq, dv, dtype, gen, rope=0, tiles=None):
    """Triton vs reference; with `rope`, keys come as per-head k plus one shared rotary part."""
    q = torch.randn(sum(query_lens), heads, dq, generator=gen).to(device=DEVICE, dtype=dtype)
    # k and v as slices of one wider tensor, like the model's split of kv_b_proj's output.
    kv = torch.randn(sum(kv_lens), heads, dq + dv + 8, generator=gen).to(device=DEVICE, dtype=dtype)
    k, v = kv[..., : dq - rope], kv[..., dq + 8 :]
    k_rope = torch.randn(sum(kv_lens), rope + 3, generator=gen).to(device=DEVICE, dtype=dtype)[:, 3:] if rope else None
    args = (q, k, v, cumsum0(query_lens), cumsum0(kv_lens), max(query_lens), max(kv_lens), dq**-0.5)
    want = ref.varlen_attention(*args, k_rope=k_rope)
    if rope:  # the shared part really is each head's last key columns
        joined = torch.cat((k, k_rope[:, None, :].expand(-1, heads, -1)), dim=-1)
        assert torch.equal(ref.varlen_attention(q, joined, *args[2:]), want)
    # Written into a slice of a wider buffer, as the model writes extend rows after decode rows.
    buffer = torch.full((sum(query_lens) + 2, heads, dv), float("nan"), device=DEVICE, dtype=dtype)
    got = varlen_attention(*args, k_rope=k_rope, out=buffer[2:], tiles=tiles)
    assert got.data_ptr() == buffer[2:].data_ptr() and buffer[:2].isnan().all()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]


# --- CPU (interpreter) tests: tiny shapes ------------------------------------------------------
# The interpreter runs 16-wide tiles: lengths 1, < 16, a few tiles, and one tile past several splits.


@pytest.mark.parametrize(
    ("page_size", "q_dtype", "kv_dtype", "num_splits"),
    [(1, torch.float32, torch.float32, None), (16, torch.bfloat16, torch.bfloat16, 1), (64, torch.float32, FP8, 3)],
)
def test_mla_decode_matches_reference(page_size, q_dtype, kv_dtype, num_splits, poisoned):
    gen = torch.Generator().manual_seed(page_size)
    check_decode([1, 13, 70, 37], 4, 32, 8, page_size, q_dtype, kv_dtype, gen, num_splits)


def test_mla_decode_many_splits_and_head_groups(poisoned):
    # 20 heads: two head groups, the second part-filled; 7 splits: short rows leave most empty.
    gen = torch.Generator().manual_seed(1)
    check_decode([3, 150], 20, 24, 8, 16, torch.float32, torch.float32, gen, num_splits=7)


@pytest.mark.parametrize(("page_size", "kv_dtype"), [(1, torch.float32), (16, FP8)])
def test_mla_decode_first_tile_before_the_wait(page_size, kv_dtype, poisoned):
    """Batch 1's layout: each split's first tile loaded apart (newest key after the wait), the rest
    in the loop; lengths inside one tile, at a tile edge and over several splits."""
    gen = torch.Generator().manual_seed(2)
    tiles = Tiles(block_q=1, block_h=16, block_n=16, num_warps=1, num_stages=1, early_tile=True)
    for lens, splits in (([1], 1), ([16], 2), ([17], 1), ([70], 3), ([150], 4)):
        check_decode(lens, 4, 32, 8, page_size, torch.float32, kv_dtype, gen, num_splits=splits, tiles=tiles)


def nan_past_the_end(cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int]) -> None:
    """Fill every slot of each sequence's pages past its length with NaN's bit pattern (FP8 cache):
    the odd slot next to a sequence's last key is read with it (key pairs) and must not leak."""
    page_size = cache.shape[1]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, -(-n // page_size) * page_size, device=cache.device)
        slots = table[b].long()[pos // page_size] * page_size + pos % page_size
        rows = torch.full((len(pos), cache.shape[-1]), 0x7F, dtype=torch.uint8, device=cache.device)
        ref.write_slots(cache, slots, rows.view(FP8))


def check_past_the_end(seq_lens, query_lens, heads, rank, rope, q_dtype, gen, tiles=None):
    """FP8 decode and extend with NaN bytes in every unused slot of the sequences' pages."""
    cache, table = paged_cache(seq_lens, 16, rank + rope, FP8, gen, 0.5)
    nan_past_the_end(cache, table, seq_lens)
    q_latent, q_rope = mla_inputs(len(seq_lens), heads, rank, rope, q_dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3, 0.5, tiles=tiles)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3, 0.5)) < TOL[q_dtype]
    q_latent, q_rope = mla_inputs(sum(query_lens), heads, rank, rope, q_dtype, gen)
    args = (q_latent, q_rope, cache, table, lens, cumsum0(query_lens), max(query_lens), 0.3, 0.5)
    got = mla_extend_absorbed(*args)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref.mla_extend_absorbed(*args)) < TOL[q_dtype]


def test_mla_fp8_ignores_nan_past_the_end(poisoned):
    gen = torch.Generator().manual_seed(4)
    check_past_the_end([1, 17, 30, 33], [1, 5, 2, 33], 4, 32, 8, torch.float32, gen)


@pytest.mark.parametrize(("page_size", "kv_dtype", "num_splits"), [(1, torch.float32, 1), (16, FP8, None), (64, torch.float32, 3)])
def test_mla_extend_matches_reference(page_size, kv_dtype, num_splits, poisoned):
    # Prefixes of 0, 30 and 56 cached tokens before 9, 3 and 8 new ones; one decode-like row.
    gen = torch.Generator().manual_seed(10 + page_size)
    check_extend([9, 33, 64, 20], [9, 3, 8, 1], 4, 32, 8, page_size, torch.float32, kv_dtype, gen, num_splits)


@pytest.mark.parametrize(
    ("dq", "dv", "dtype", "rope"),
    [(24, 16, torch.float32, 0), (24, 16, torch.bfloat16, 8), (10, 7, torch.float32, 0), (192, 128, torch.float32, 64),
     (24, 16, torch.float32, 5)],
)
def test_varlen_attention_matches_reference(dq, dv, dtype, rope, poisoned):
    # A fresh prompt, prompts after a prefix, a one-token query, and kv shorter than a tile.
    # rope=5 does not split on the kernel's power-of-two boundary, so the keys are joined first.
    gen = torch.Generator().manual_seed(dq + dv)
    check_varlen([20, 7, 1, 5], [20, 40, 18, 5], 2, dq, dv, dtype, gen, rope)


def test_varlen_attention_tiles_override(poisoned):
    # Tiles other than the device's (taller query blocks, wider key tiles) over the same ragged rows.
    gen = torch.Generator().manual_seed(3)
    check_varlen([40, 7, 1, 5], [40, 60, 18, 5], 2, 24, 16, torch.float32, gen, tiles=(32, 16, 1, 1))
    check_varlen([40, 7, 1, 5], [40, 60, 18, 5], 2, 24, 16, torch.float32, gen, tiles=(16, 32, 1, 1))
    q = torch.randn(5, 2, 24, device=DEVICE)
    with pytest.raises(Exception, match="power of 2"):  # the override reaches the launch: 24 rows cannot tile
        varlen_attention(q, q, q[..., :16], cumsum0([5]), cumsum0([5]), 5, 5, 1.0, tiles=(24, 16, 1, 1))


@pytest.mark.parametrize(("page_size", "kv_dtype"), [(1, torch.bfloat16), (16, FP8), (64, torch.float32)])
def test_gather_kv_matches_reference(page_size, kv_dtype, poisoned):
    gen = torch.Generator().manual_seed(page_size)
    seq_lens = [5, 70, 1, 33]
    cache, table = paged_cache(seq_lens, page_size, 40, kv_dtype, gen, kv_scale=0.5)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = ref.gather_kv(cache, table, lens, cumsum0(seq_lens), out_dtype, 0.5)
        got = gather_kv(cache, table, lens, cumsum0(seq_lens), out_dtype, 0.5)
        # Exact but for the interpreter's truncating fp32 -> bf16 (one bf16 ulp).
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)


def test_empty_inputs_and_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    cache, table = paged_cache([4], 16, 40, torch.float32, gen)
    q_latent, q_rope = mla_inputs(1, 2, 32, 8, torch.float32, gen)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cache"):
        mla_decode(q_latent, q_rope[..., :4], cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="w_uv"):  # the value projection's [H, v, rank] weight
        mla_decode(q_latent, q_rope, cache, table, lens, 1.0, w_uv=torch.zeros(2, 16, 31, device=DEVICE))
    w_uv = torch.zeros(2, 16, 32, device=DEVICE)
    assert mla_decode(q_latent[:0], q_rope[:0], cache, table[:0], lens[:0], 1.0, w_uv=w_uv).shape == (0, 2, 16)
    empty = mla_extend_absorbed(q_latent[:0], q_rope[:0], cache, table[:0], lens[:0], cumsum0([]), 0, 1.0)
    assert empty.shape == (0, 2, 32)
    q = torch.randn(0, 2, 24, device=DEVICE)
    assert varlen_attention(q, q, q[..., :16], cumsum0([0]), cumsum0([0]), 0, 0, 1.0).shape == (0, 2, 16)
    with pytest.raises(ValueError, match="scale must be positive"):
        varlen_attention(q, q, q[..., :16], cumsum0([0]), cumsum0([0]), 0, 0, -1.0)


# --- GPU tests: real shapes (DeepSeek-V2-Lite: H = 16; V3: H = 128) -------------------------------

RANK, ROPE = 512, 64


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_gpu_mla_decode_real_shapes(heads, page_size, kv_dtype, poisoned):
    gen = torch.Generator().manual_seed(heads + page_size)
    # Ragged: one token, shorter than a split, a few splits, and a long row.
    lens = [1, 100, 777, 4096, 20000]
    if kv_dtype == FP8 and page_size == 1:  # an FP8 cache stores slots in pairs
        cache, table = paged_cache(lens[:2], page_size, RANK + ROPE, kv_dtype, gen)
        q_latent, q_rope = mla_inputs(2, heads, RANK, ROPE, torch.bfloat16, gen)
        with pytest.raises(ValueError, match="even page size"):
            mla_decode(q_latent, q_rope, cache, table, torch.tensor(lens[:2], dtype=torch.int32, device=DEVICE), 0.3)
        return
    check_decode(lens, heads, RANK, ROPE, page_size, torch.bfloat16, kv_dtype, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("batch", [1, 2, 6, 20, 40, 60, 100, 200])
def test_gpu_mla_decode_every_tile_rule(batch, kv_dtype, poisoned):
    """Each batch range that decode_tiles gives a shape of its own (bf16: 1, 2-32, 33-128, past 128;
    FP8: 1, 2-8, 9-32, 33-128, past 128), on ragged contexts."""
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 1500, (batch,), generator=gen).tolist()
    check_decode(lens, 16, RANK, ROPE, 64, torch.bfloat16, kv_dtype, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 8, 40, 200])
def test_gpu_mla_fp8_ignores_nan_past_the_end(batch, poisoned):
    """Odd lengths (an odd slot of NaN bytes shares the last key's words) at each FP8 tile rule."""
    gen = torch.Generator().manual_seed(batch)
    lens = (torch.randint(0, 700, (batch,), generator=gen) * 2 + 1).tolist()
    check_past_the_end(lens, [min(n, 9) for n in lens], 16, RANK, ROPE, torch.bfloat16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("f16", [True, False])
def test_gpu_mla_decode_fp8_matmul_dtypes(f16, monkeypatch, poisoned):
    """FP8 tiles widened to float16 (the default) or bfloat16 both match the reference."""
    monkeypatch.setattr(mla_decode_module, "FP8_F16_MATMULS", f16)
    gen = torch.Generator().manual_seed(11)
    for batch in (1, 40, 200):
        lens = torch.randint(1, 1500, (batch,), generator=gen).tolist()
        check_decode(lens, 16, RANK, ROPE, 16, torch.bfloat16, FP8, gen)


@pytest.mark.gpu
def test_gpu_mla_decode_fp8_saturates_a_huge_query(poisoned):
    """Float16 matmuls clamp a query value past float16's range instead of turning scores to NaN."""
    gen = torch.Generator().manual_seed(5)
    cache, table = paged_cache([300, 40], 16, RANK + ROPE, FP8, gen, 0.5)
    q_latent, q_rope = mla_inputs(2, 16, RANK, ROPE, torch.bfloat16, gen)
    q_latent[0, 0, 0] = 1e6
    lens = torch.tensor([300, 40], dtype=torch.int32, device=DEVICE)
    got = mla_decode(q_latent, q_rope, cache, table, lens, 1e-6, 0.5)
    want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 1e-6, 0.5)
    assert torch.isfinite(got).all()
    assert rel_err(got[1], want[1]) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_mla_decode_split_counts(batch, poisoned):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    for splits in (1, 2, 37):
        check_decode(lens, 16, RANK, ROPE, 64, torch.bfloat16, torch.bfloat16, gen, num_splits=splits)
    check_decode(lens[:4], 16, RANK, ROPE, 16, torch.float32, torch.float32, gen, num_splits=5, tol=3e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("page_size", "kv_dtype"), [(1, torch.bfloat16), (16, FP8), (64, torch.bfloat16)])
def test_gpu_mla_extend_real_shapes(heads, page_size, kv_dtype, poisoned):
    gen = torch.Generator().manual_seed(heads * page_size)
    # Fresh chunks, chunks after long prefixes, and a single-token row: one split per program.
    check_extend([300, 2100, 7000, 5], [300, 100, 17, 1], heads, RANK, ROPE, page_size, torch.bfloat16, kv_dtype, gen)
    # A few queries after long prefixes: too few programs, so the keys are split.
    check_extend([8000, 3000], [3, 1], heads, RANK, ROPE, page_size, torch.bfloat16, kv_dtype, gen)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dq", "dv", "heads", "rope"), [(192, 128, 16, 64), (192, 128, 128, 64), (192, 128, 16, 0), (24, 16, 4, 0), (64, 64, 8, 0)]
)
def test_gpu_varlen_attention_real_shapes(dq, dv, heads, rope, poisoned):
    gen = torch.Generator().manual_seed(dq)
    check_varlen([1024, 300, 1, 77], [1024, 2348, 900, 77], heads, dq, dv, torch.bfloat16, gen, rope)


@pytest.mark.gpu
@pytest.mark.parametrize(("page_size", "kv_dtype"), [(1, torch.bfloat16), (64, FP8)])
def test_gpu_gather_kv_real_shapes(page_size, kv_dtype, poisoned):
    gen = torch.Generator().manual_seed(3)
    seq_lens = [1, 1000, 7000]
    cache, table = paged_cache(seq_lens, page_size, RANK + ROPE, kv_dtype, gen, kv_scale=0.25)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = ref.gather_kv(cache, table, lens, cumsum0(seq_lens), torch.bfloat16, 0.25)
    assert torch.equal(gather_kv(cache, table, lens, cumsum0(seq_lens), torch.bfloat16, 0.25), want)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_gpu_mla_decode_replays_in_cuda_graph(kv_dtype):
    gen = torch.Generator().manual_seed(7)
    batch, width, page_size = 4, 80, 64  # room for 5120 tokens per row
    cache, _ = paged_cache([width * page_size] * batch, page_size, RANK + ROPE, kv_dtype, gen)
    q_latent, q_rope = mla_inputs(batch, 16, RANK, ROPE, torch.bfloat16, gen)
    table = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    mla_decode(q_latent, q_rope, cache, table, lens, 0.3)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_latent, q_rope, cache, table, lens, 0.3)
    pages = cache.shape[0] - 1
    for seq_lens in ([1, 2, 3, 4], [5120, 17, 640, 3000], [64, 4097, 1, 999]):
        table.copy_(torch.randperm(pages, generator=gen)[: batch * width].view(batch, width).to(DEVICE) + 1)
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        q_latent.copy_(torch.randn(q_latent.shape, generator=gen) * RANK**-0.25)
        graph.replay()
        want = ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3)
        assert rel_err(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_mla_decode_reads_the_key_stored_just_before(kv_dtype, batch):
    """At batch 1 decode loads its first tile before waiting on the previous kernel, all but the
    newest key: with the store as that kernel (PDL), a stale newest row must never reach the output."""
    from moeserve.ops.triton.rope_store import mla_rope_norm_store

    gen = torch.Generator().manual_seed(batch)
    page_size = 64
    for _ in range(5):
        seq_lens = torch.randint(1, 1500, (batch,), generator=gen).tolist()
        cache, table = paged_cache(seq_lens, page_size, RANK + ROPE, kv_dtype, gen)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        newest = lens.long() - 1
        slots = table.gather(1, (newest // page_size)[:, None])[:, 0].long() * page_size + newest % page_size
        ref.write_slots(cache, slots, torch.full((batch, RANK + ROPE), 50.0, device=DEVICE).to(kv_dtype))  # stale, loud
        q_latent, q_rope = mla_inputs(batch, 16, RANK, ROPE, torch.bfloat16, gen)
        kv = torch.randn(batch, RANK + ROPE, generator=gen).to(DEVICE, torch.bfloat16)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, device=DEVICE).float() / ROPE)
        positions = newest.to(torch.int32)
        norm_w = torch.ones(RANK, dtype=torch.bfloat16, device=DEVICE)
        q_key = torch.zeros(batch, 1, ROPE, dtype=torch.bfloat16, device=DEVICE)
        mla_rope_norm_store(positions, q_key, kv, norm_w, 1e-6, inv_freq, 1.0, False, cache, slots.to(torch.int32))
        got = mla_decode(q_latent, q_rope, cache, table, lens, 0.3)  # launched right behind the store
        torch.cuda.synchronize()
        assert (ref.read_slots(cache, slots).float().abs() < 50).all()
        assert rel_err(got, ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.3)) < TOL[torch.bfloat16]
