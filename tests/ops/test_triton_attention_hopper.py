"""The Hopper prompt-attention kernel (Gluon) matches the reference on fresh random inputs, laid out
as the model passes them; where it does not apply, `varlen_attention` keeps the Triton kernel.

The kernel needs an sm_90 GPU: every test here but the CPU one is a `gpu` test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.ops.reference import attention as ref
from moeserve.ops.triton import flash_attention, flash_attention_hopper
from moeserve.ops.triton.flash_attention_hopper import hopper_attention_usable, hopper_varlen_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOG2E = 1.4426950408889634
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def cumsum0(lens) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEVICE)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def model_layout(query_lens, kv_lens, heads, gen, dtype=torch.bfloat16, nope=128, rope=64, dv=128):
    """q [T, H, nope + rope]; k and v as slices of kv_b_proj's output [S, H, nope + dv]; the rotary
    key [S, rope] shared by the heads (what the MLA layer's MHA prefill passes)."""
    q = torch.randn(sum(query_lens), heads, nope + rope, generator=gen).to(device=DEVICE, dtype=dtype)
    kv = torch.randn(sum(kv_lens), heads, nope + dv, generator=gen).to(device=DEVICE, dtype=dtype)
    k_rope = torch.randn(sum(kv_lens), rope, generator=gen).to(device=DEVICE, dtype=dtype)
    return q, kv[..., :nope], kv[..., nope:], k_rope


def check(query_lens, kv_lens, heads, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, k_rope = model_layout(query_lens, kv_lens, heads, gen, dtype)
    scale = q.shape[-1] ** -0.5
    args = (q, k, v, cumsum0(query_lens), cumsum0(kv_lens), max(query_lens), max(kv_lens), scale)
    assert hopper_attention_usable(q, k, v, k_rope)
    want = ref.varlen_attention(*args, k_rope=k_rope)
    # Into a slice of a wider NaN buffer, as the model writes extend rows after decode rows.
    buffer = torch.full((q.shape[0] + 3, heads, v.shape[-1]), float("nan"), device=DEVICE, dtype=dtype)
    got = hopper_varlen_attention(q, k, v, args[3], args[4], max(query_lens), scale * LOG2E, k_rope, buffer[3:])
    assert buffer[:3].isnan().all() and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2
    # Rows one by one, not only overall: a wrong causal edge shows as one bad row.
    per_row = (got.double() - want.double()).norm(dim=(1, 2)) / want.double().norm(dim=(1, 2)).clamp_min(1e-30)
    assert per_row.max().item() < 3e-2
    # varlen_attention dispatches here on Hopper: the same bits.
    assert torch.equal(flash_attention.varlen_attention(*args, k_rope=k_rope), got)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize(
    ("query_lens", "kv_lens"),
    [
        ([1024] * 4, [1024] * 4),  # the b256 prompt step's shape, whole tiles
        ([1, 2, 63, 64, 65, 127, 128, 129], [1, 2, 63, 64, 65, 127, 128, 129]),  # 1-3 key tiles, odd and even
        ([300, 1, 77, 129], [2348, 900, 77, 200]),  # prefixes in cache, ragged ends, one token after 899
        ([3000], [9000]),  # many tiles a program, a prefix not a multiple of the tile
        ([2000, 1, 1, 3, 700], [2000, 5, 1, 3, 900]),  # short sequences leave most programs no queries
    ],
)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_hopper_attention_matches_reference(query_lens, kv_lens, heads):
    check(query_lens, kv_lens, heads, seed=len(query_lens) * heads)


@pytest.mark.gpu
@hopper_only
def test_gpu_hopper_attention_fp16_and_joined_key():
    """float16, and a key already joined with its rotary part (no shared rotary tensor)."""
    check([200, 70], [260, 70], 16, seed=3, dtype=torch.float16)
    gen = torch.Generator().manual_seed(4)
    q, k, v, k_rope = model_layout([150], [400], 8, gen)
    joined = torch.cat((k, k_rope[:, None, :].expand(-1, 8, -1)), dim=-1)
    args = (q, joined, v, cumsum0([150]), cumsum0([400]), 150, 400, 0.1)
    assert hopper_attention_usable(q, joined, v, None)
    got = flash_attention.varlen_attention(*args)
    assert rel_err(got, ref.varlen_attention(*args)) < 1e-2


@pytest.mark.gpu
@hopper_only
def test_gpu_hopper_attention_declines_what_it_cannot_read():
    """Other head dims, misaligned views and float32 keep the Triton kernel, which still matches."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, k_rope = model_layout([40], [40], 4, gen)
    assert not hopper_attention_usable(q[..., :96], k[..., :32], v, k_rope)  # 32-column key
    assert not hopper_attention_usable(q, k, v[..., :96], k_rope)  # value not 128 wide
    wide = torch.randn(40, 67, device=DEVICE, dtype=q.dtype)
    assert not hopper_attention_usable(q, k, v, wide[:, 3:])  # rotary key 6 bytes off alignment
    assert not hopper_attention_usable(q.float(), k.float(), v.float(), k_rope.float())
    broad = torch.randn(40, 4, 256, device=DEVICE, dtype=q.dtype)  # a 256-wide query: past shared memory
    assert not hopper_attention_usable(broad, broad[..., :192], v, k_rope)
    args = (q, k, v, cumsum0([40]), cumsum0([40]), 40, 40, 0.1)
    got = flash_attention.varlen_attention(*args, k_rope=wide[:, 3:])
    assert rel_err(got, ref.varlen_attention(*args, k_rope=wide[:, 3:])) < 1e-2


def test_shared_memory_bounds_the_head_dims():
    """DeepSeek's query (3 boxes) and values (2) fit an sm_90 block (Triton 3.6 compiles the kernel to
    213,228 bytes); a 256-wide query would not, so the check declines it."""
    assert abs(flash_attention_hopper.shared_bytes(3, 2) - 213_228) < 1024
    assert flash_attention_hopper.shared_bytes(3, 2) <= flash_attention_hopper.SHARED_LIMIT
    assert flash_attention_hopper.shared_bytes(4, 2) > flash_attention_hopper.SHARED_LIMIT


def test_cpu_tensors_are_not_for_the_hopper_kernel():
    """On the CPU (and any non-sm_90 device) the check says no, so the reference or Triton runs."""
    q = torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 256, dtype=torch.bfloat16)
    assert not hopper_attention_usable(q, kv[..., :128], kv[..., 128:], torch.zeros(4, 64, dtype=torch.bfloat16))
