"""The Triton skinny GEMM agrees with its float32 reference, for nn.Linear weights and per-head views.

Without CUDA the kernel runs in Triton's CPU interpreter at small shapes (float32 compute); the
`gpu` tests use DeepSeek-V2-Lite's decode projections in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference.linear import skinny_bmm as ref_skinny
from moeserve.ops.triton.skinny_gemm import SkinnyConfig, skinny_bmm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def check(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, config: SkinnyConfig | None = None) -> None:
    got = torch.full((x.shape[0], x.shape[1], w.shape[1]), float("nan"), device=DEVICE, dtype=out_dtype)
    skinny_bmm(x, w, got, config=config)
    want = ref_skinny(x, w, torch.empty_like(got, dtype=torch.float32))
    tol = {"rtol": 1e-5, "atol": 1e-4} if out_dtype == torch.float32 and x.dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2 * want.abs().max().item()}
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize(("k", "split"), [(64, 1), (72, 1), (96, 3)])
def test_linear_shapes_and_k_splits(rows, k, split):
    gen = torch.Generator().manual_seed(rows * 100 + k)
    x, w = rand(gen, 1, rows, k), rand(gen, 1, 40, k)
    out_dtype = torch.float32
    config = SkinnyConfig(block_n=16, block_k=16, split_k=split, num_warps=1, num_stages=1)
    check(x, w, out_dtype, config)


@pytest.mark.parametrize(("rows", "split"), [(17, 1), (50, 2)])
def test_rows_past_one_block_take_more_programs(rows, split):
    """Rows beyond block_m go to further programs, each with its own rows (and every K split)."""
    gen = torch.Generator().manual_seed(rows)
    x, w = rand(gen, 2, rows, 48), rand(gen, 2, 24, 48)
    config = SkinnyConfig(block_n=16, block_k=16, split_k=split, num_warps=1, num_stages=1, block_m=16)
    check(x, w, torch.float32, config)


def test_default_config_with_float32_output_splits_k():
    gen = torch.Generator().manual_seed(1)
    check(rand(gen, 1, 3, 128), rand(gen, 1, 24, 128), torch.float32)


def test_per_head_strided_views():
    """The absorbed-MLA layout: x and w are head-major views of token-major tensors."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, nope, rope, rank = 3, 4, 16, 8, 32
    q = rand(gen, tokens, heads, nope + rope)
    kv_b = rand(gen, heads, nope + 24, rank)  # [H, nope + v, rank], as kv_b_proj's weight view
    w_uk = kv_b[:, :nope]  # [H, nope, rank]: per head x @ w_uk, i.e. w = w_uk^T as [H, rank, nope]
    out = torch.empty(tokens, heads, rank, device=DEVICE)
    skinny_bmm(q[..., :nope].transpose(0, 1), w_uk.transpose(1, 2), out.transpose(0, 1))
    torch.testing.assert_close(out, torch.einsum("thn,hnr->thr", q[..., :nope], w_uk), rtol=1e-5, atol=1e-4)
    o_latent = rand(gen, tokens, heads, rank)
    w_uv = kv_b[:, nope:]  # [H, v, rank]: per head o_latent @ w_uv^T
    out_v = torch.full((tokens + 2, heads, 24), float("nan"), device=DEVICE)
    skinny_bmm(o_latent.transpose(0, 1), w_uv, out_v[:tokens].transpose(0, 1))
    torch.testing.assert_close(out_v[:tokens], torch.einsum("thr,hvr->thv", o_latent, w_uv), rtol=1e-5, atol=1e-4)
    assert out_v[tokens:].isnan().all()  # rows past the view are untouched


def test_rejects_bad_shapes():
    x, w = torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_bmm(x, w, torch.zeros(1, 2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="float32 output"):
        skinny_bmm(x, w, torch.zeros(1, 2, 4, device=DEVICE, dtype=torch.bfloat16),
                   config=SkinnyConfig(16, 16, split_k=2))
    assert skinny_bmm(x[:, :0], w, torch.zeros(1, 0, 4, device=DEVICE)).shape == (1, 0, 4)


# --- GPU: DeepSeek-V2-Lite decode projections in bfloat16 -----------------------------------------

PROJECTIONS = {  # name: (batch, N, K, out dtype)
    "fused_qkv_a": (1, 3648, 2048, torch.bfloat16),
    "o_proj": (1, 2048, 2048, torch.bfloat16),
    "router": (1, 64, 2048, torch.float32),
    "w_uk": (16, 512, 128, torch.bfloat16),
    "w_uv": (16, 128, 512, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16, 64, 100, 256])
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_gpu_decode_projections(name, rows):
    batch, n, k, out_dtype = PROJECTIONS[name]
    gen = torch.Generator().manual_seed(rows)
    x = rand(gen, batch, rows, k, dtype=torch.bfloat16)
    w = (rand(gen, batch, n, k) * k**-0.5).to(torch.bfloat16)
    check(x, w, out_dtype)
