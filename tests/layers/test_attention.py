"""per_head_matmul: the absorbed-MLA per-head products, written token-major in place."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention import per_head_matmul
from moeserve.ops.triton.skinny_gemm import PER_HEAD_MAX_ROWS as SKINNY_MAX_TOKENS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cuda: the skinny kernel up to 16 tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, SKINNY_MAX_TOKENS, SKINNY_MAX_TOKENS + 7])
def test_per_head_matmul_fills_rows_of_a_larger_buffer(device, tokens):
    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(tokens, 16, 192, generator=gen).to(device, dtype)
    w = (torch.randn(16, 128, 512, generator=gen) * 0.1).to(device, dtype)
    out = torch.full((tokens + 3, 16, 512), float("nan"), device=device, dtype=dtype)
    per_head_matmul(q[..., :128], w, out[:tokens])
    want = torch.einsum("thn,hnr->thr", q[..., :128].float(), w.float())
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(out[:tokens].float(), want, **tol)
    assert out[tokens:].isnan().all()
