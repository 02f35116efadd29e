"""per_head_matmul: the absorbed-MLA per-head products, written token-major in place; the
attention layer's decode copy of o_proj."""

from __future__ import annotations

import pytest
import torch

from moeserve.config.model_config import ModelConfig
from moeserve.layers.attention import MLAAttention, per_head_matmul
from moeserve.models.loader import load_model
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


@pytest.mark.parametrize("device", DEVICES)
def test_o_proj_decode_copy_is_built_once_and_follows_the_weight(checkpoints, device, monkeypatch):
    """On the GPU (batch 1 fuses o_proj for the tiny shapes) the copy is o_proj transposed, built by
    build_weight_copies, reused, rebuilt after the weight is written, and never inside a capture;
    on the CPU there is none."""
    path = checkpoints["v2"]
    model = load_model(ModelConfig.from_path(path), path, torch.bfloat16, torch.device(device))
    attn = next(m for m in model.modules() if isinstance(m, MLAAttention))
    model.build_weight_copies()
    copy = attn.o_proj_copy()
    if device == "cpu":
        assert copy is None
        return
    assert copy is not None and copy.is_contiguous() and torch.equal(copy, attn.o_proj.weight.t())
    assert attn.o_proj_copy() is copy
    with torch.no_grad():
        attn.o_proj.weight.mul_(-1.0)
    with monkeypatch.context() as capturing:  # a stale copy is not rebuilt inside a capture
        capturing.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="before graph capture"):
            attn.o_proj_copy()
    rebuilt = attn.o_proj_copy()
    assert rebuilt is not copy and torch.equal(rebuilt, attn.o_proj.weight.t())
