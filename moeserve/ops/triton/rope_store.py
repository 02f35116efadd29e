"""Triton MLA token preparation: latent RMSNorm, rotary on q_rope and k_rope, paged-cache store.

Two programs per token read kv_a's output row once, write the normalised latent and the rotated
rotary key both to the returned tensors and to the token's cache slot (scaled and saturated when
the cache is FP8), and rotates the token's q_rope heads in place. Rotary rows move as whole
contiguous rows and are taken apart into pairs in registers. cos/sin come from
positions * inv_freq in the kernel, so no cos/sin table is needed and the launch depends only on
shapes (CUDA-graph safe). A negative slot skips the cache write (the reference would wrap it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.reference.attention import FP8_MAX
from moeserve.ops.triton.norm import normalize_row
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

# Cody-Waite split of 2*pi: A and B have 8 significant bits, so turns * A and turns * B are exact
# for turns < 2^16 (angles up to ~400k radians, beyond any position times DeepSeek's largest
# inverse frequency, 1.0), and the reduced angle is good to ~1e-6.
_TWO_PI_A = tl.constexpr(6.28125)
_TWO_PI_B = tl.constexpr(253.0 / 131072.0)
_TWO_PI_C = tl.constexpr(5.070363180226925e-06)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
_FP8_MAX = tl.constexpr(FP8_MAX)
_HEAD_BLOCK = tl.constexpr(16)  # q_rope heads rotated per step: bounds registers at 128 heads


@triton.jit
def _cos_sin(pos, inv_freq_ptr, magnitude, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin (times the YaRN magnitude) of pos * inv_freq, one per rotated pair."""
    i = tl.arange(0, BLOCK_HALF)
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
    # Reduce to [-pi, pi] first: keeps cos/sin off their slow large-argument path, and accurate
    # on backends that approximate them.
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    reduced = angle - turns * _TWO_PI_A
    reduced = reduced - turns * _TWO_PI_B
    reduced = reduced - turns * _TWO_PI_C
    return tl.cos(reduced) * magnitude, tl.sin(reduced) * magnitude


@triton.jit
def _rope_columns(INTERLEAVED: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(memory offset, valid) of each column of a [*, 2 * BLOCK_HALF] tile of rotary values.

    Loaded whole, a row is one contiguous read (not two strided ones), and _split_pairs takes the
    pairs apart in registers: interleaved pairs are (2i, 2i+1), the others (i, i + rope_dim / 2).
    """
    j = tl.arange(0, 2 * BLOCK_HALF)
    if INTERLEAVED:
        return j, j < 2 * HALF
    return (j // BLOCK_HALF) * HALF + j % BLOCK_HALF, (j % BLOCK_HALF) < HALF


@triton.jit
def _split_pairs(x, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The pairs' first and second members, [ROWS, BLOCK_HALF] each, of a tile _rope_columns read."""
    if INTERLEAVED:
        x1, x2 = tl.split(tl.reshape(x, [ROWS, BLOCK_HALF, 2]))
    else:
        x1, x2 = tl.split(tl.permute(tl.reshape(x, [ROWS, 2, BLOCK_HALF]), (0, 2, 1)))
    return x1, x2


@triton.jit
def _join_pairs(x1, x2, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Inverse of _split_pairs: the [ROWS, 2 * BLOCK_HALF] tile in _rope_columns order."""
    y = tl.join(x1, x2)
    if not INTERLEAVED:
        y = tl.permute(y, (0, 2, 1))
    return tl.reshape(y, [ROWS, 2 * BLOCK_HALF])


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The rotated pair (x1 cos - x2 sin, x2 cos + x1 sin) in float32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _to_cache(x, kv_scale, CACHE_FP8: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """Values as the cache stores them: value / kv_scale saturated to +-448 when FP8."""
    if CACHE_FP8:
        scaled = tl.math.div_rn(x.to(tl.float32), kv_scale)
        x = tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)
    return x.to(CACHE_DTYPE)


@triton.jit
def _rotate_q(q_ptr, stride_qh, HEADS: tl.constexpr, cos, sin, offs, ok,
              BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate one token's q_rope heads in place, _HEAD_BLOCK heads at a time."""
    for h0 in tl.static_range(0, HEADS, _HEAD_BLOCK):
        h = h0 + tl.arange(0, _HEAD_BLOCK)
        mask = (h < HEADS)[:, None] & ok[None, :]
        ptr = q_ptr + h.to(tl.int64)[:, None] * stride_qh + offs[None, :]
        q = tl.load(ptr, mask=mask, other=0.0)
        q1, q2 = _split_pairs(q, _HEAD_BLOCK, BLOCK_HALF, INTERLEAVED)
        o1, o2 = _rotate(q1, q2, cos[None, :], sin[None, :])
        tl.store(ptr, _join_pairs(o1.to(q.dtype), o2.to(q.dtype), _HEAD_BLOCK, BLOCK_HALF, INTERLEAVED), mask=mask)


@triton.jit
def _mla_prep_kernel(
    pos_ptr, q_ptr, kv_ptr, w_ptr, inv_freq_ptr, cache_ptr, slot_ptr, latent_ptr, k_rope_ptr,
    stride_qt, stride_qh, stride_kv, stride_slot, eps, magnitude, kv_scale,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, CACHE_FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, part): part 0 the latent, part 1 the rotary key and q_rope heads."""
    wait_for_prior_grid(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    in_cache = slot >= 0
    cache_row = cache_ptr + slot * stride_slot
    cache_dtype = cache_ptr.dtype.element_ty
    # Two independent halves in two programs: at decode sizes each is a chain of dependent
    # memory round trips, and side by side they take the time of one.
    if tl.program_id(1) == 0:
        # The latent: RMSNorm, then to the returned tensor and the cache.
        cols = tl.arange(0, BLOCK_RANK)
        cmask = cols < RANK
        x = tl.load(kv_ptr + tok * stride_kv + cols, mask=cmask, other=0.0)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        latent = normalize_row(x.to(tl.float32), w, RANK, eps, x.dtype)
        tl.store(latent_ptr + tok * RANK + cols, latent, mask=cmask)
        tl.store(cache_row + cols, _to_cache(latent, kv_scale, CACHE_FP8, cache_dtype), mask=cmask & in_cache)
    else:
        # The rotary key, then q_rope with the same angles.
        half: tl.constexpr = ROPE // 2
        cos, sin = _cos_sin(tl.load(pos_ptr + tok), inv_freq_ptr, magnitude, half, BLOCK_HALF)
        offs, ok = _rope_columns(INTERLEAVED, half, BLOCK_HALF)
        k = tl.load(kv_ptr + tok * stride_kv + RANK + offs[None, :], mask=ok[None, :], other=0.0)
        k1, k2 = _split_pairs(k, 1, BLOCK_HALF, INTERLEAVED)
        r1, r2 = _rotate(k1, k2, cos[None, :], sin[None, :])
        k = _join_pairs(r1.to(k.dtype), r2.to(k.dtype), 1, BLOCK_HALF, INTERLEAVED)
        tl.store(k_rope_ptr + tok * ROPE + offs[None, :], k, mask=ok[None, :])
        tl.store(cache_row + RANK + offs[None, :], _to_cache(k, kv_scale, CACHE_FP8, cache_dtype),
                 mask=ok[None, :] & in_cache)
        _rotate_q(q_ptr + tok * stride_qt, stride_qh, HEADS, cos, sin, offs, ok, BLOCK_HALF, INTERLEAVED)


def _check(
    positions: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, rank: int, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, inv_freq: torch.Tensor,
) -> None:
    """Raise on shapes or layouts the kernel cannot take."""
    if kv.dim() != 2 or kv.stride(1) != 1:
        raise ValueError(f"mla_rope_norm_store: kv must be [T, rank + rope] with contiguous rows, got {tuple(kv.shape)}")
    tokens, rope = kv.shape[0], kv.shape[1] - rank
    if rope <= 0 or rope % 2:
        raise ValueError(f"mla_rope_norm_store: rotary width {rope} (kv width - rank) must be positive and even")
    if q_rope.dim() != 3 or q_rope.shape[0] != tokens or q_rope.shape[2] != rope or q_rope.stride(2) != 1:
        raise ValueError(f"mla_rope_norm_store: q_rope must be [{tokens}, H, {rope}] with unit last stride")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(
            f"mla_rope_norm_store: positions {tuple(positions.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must both be [{tokens}]"
        )
    if kv_cache.shape[-1] != rank + rope:
        raise ValueError(f"mla_rope_norm_store: cache width {kv_cache.shape[-1]} != {rank + rope}")
    if inv_freq.numel() != rope // 2:
        raise ValueError(f"mla_rope_norm_store: inv_freq has {inv_freq.numel()} values, expected {rope // 2}")


def mla_rope_norm_store(
    positions: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    magnitude: float,
    interleaved: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise the latent, rotate k_rope and q_rope (in place), store both in the paged cache."""
    rank = norm_weight.shape[0]
    _check(positions, q_rope, kv, rank, kv_cache, slot_mapping, inv_freq)
    tokens, rope = kv.shape[0], kv.shape[1] - rank
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    latent = torch.empty(tokens, rank, dtype=kv.dtype, device=kv.device)
    k_rope = torch.empty(tokens, rope, dtype=kv.dtype, device=kv.device)
    if tokens:
        _mla_prep_kernel[(tokens, 2)](
            positions, q_rope, kv, norm_weight.contiguous(), inv_freq.float().contiguous(), flat,
            slot_mapping, latent, k_rope, q_rope.stride(0), q_rope.stride(1), kv.stride(0), flat.stride(0),
            float(eps), float(magnitude), float(kv_scale),
            HEADS=q_rope.shape[1], RANK=rank, ROPE=rope, BLOCK_RANK=triton.next_power_of_2(rank),
            BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVED=bool(interleaved),
            CACHE_FP8=kv_cache.dtype == torch.float8_e4m3fn, num_warps=4, **pdl_launch(kv),
        )
    return latent, k_rope
