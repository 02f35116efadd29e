"""Triton MLA token preparation: latent RMSNorm, rotary on q_rope and k_rope, paged-cache store.

Two programs per token read kv_a's output row once, write the normalised latent and the rotated
rotary key both to the returned tensors and to the token's cache slot (scaled and saturated when
the cache is FP8), and rotates the token's q_rope heads in place. Rotary rows move as whole
contiguous rows and are taken apart into pairs in registers. cos/sin come from
positions * inv_freq in the kernel, so no cos/sin table is needed and the launch depends only on
shapes (CUDA-graph safe). A negative slot skips the cache write (the reference would wrap it).

For decode rows the same launch can also absorb W_UK into the queries (q_nope @ W_UK per head,
the absorbed MLA form's first matmul): extra programs, one per (row block, head, latent column
block), load their W_UK slice before waiting on the previous kernel (weights are never a kernel's
output), then multiply the rows' q_nope by it. That saves the separate per-head GEMM's launch,
a few microseconds a layer at decode sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.reference.attention import FP8_MAX
from moeserve.ops.triton.mla_checks import check_key_pairs
from moeserve.ops.triton.mla_key_tiles import slot_offset
from moeserve.ops.triton.norm import normalize_row
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid
from moeserve.ops.triton.skinny_gemm import per_head_matmul

# Cody-Waite split of 2*pi: A and B have 8 significant bits, so turns * A and turns * B are exact
# for turns < 2^16 (angles up to ~400k radians, beyond any position times DeepSeek's largest
# inverse frequency, 1.0), and the reduced angle is good to ~1e-6.
_TWO_PI_A = tl.constexpr(6.28125)
_TWO_PI_B = tl.constexpr(253.0 / 131072.0)
_TWO_PI_C = tl.constexpr(5.070363180226925e-06)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
_FP8_MAX = tl.constexpr(FP8_MAX)
_HEAD_BLOCK = tl.constexpr(16)  # q_rope heads rotated per step: bounds registers at 128 heads
# Decode rows in this range get W_UK absorbed inside this kernel, others a separate GEMM. H200
# decode-graph replay, fused against apart: b8 -2.8%, b64 -1.2%, b256 -1.0%; b1 was +1.0% when
# first tried and is -2.9% since (1.995 -> 1.938 ms at 07f6265, `ab_decode.py`, three rounds).
FUSED_ABSORB_MIN_ROWS = 1
FUSED_ABSORB_MAX_ROWS = 256
ABSORB_BLOCK_C = 64  # latent columns per absorbing program
# Up to this many tokens the kernel runs on one warp: its programs are chains of dependent loads
# and small reductions, which a lone warp finishes sooner. H200 decode-graph replay at batch 1:
# 1.820 -> 1.799 ms (-1.2%, eight warps -0.9%, two +0.1%); b8 / b64 / b256 +0.3 / +0.3 / +0.8%.
ONE_WARP_MAX_TOKENS = 1

_COMPUTE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
def _absorb_rows(
    pid, q_nope_ptr, w_uk_ptr, q_lat_ptr, num_rows, stride_nt, stride_nh, stride_wh, stride_wn, stride_lt, stride_lh,
    HEADS: tl.constexpr, NOPE: tl.constexpr, RANK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """q_latent[rows, head, cols] = q_nope[rows, head] @ w_uk[head][:, cols] for one program's block."""
    col_blocks: tl.constexpr = (RANK + BLOCK_C - 1) // BLOCK_C
    cols = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    head = (pid // col_blocks) % HEADS
    rows = (pid // (col_blocks * HEADS)) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_NOPE)
    c_ok = cols < RANK
    k_ok = k < NOPE
    w = tl.load(w_uk_ptr + head * stride_wh + k[:, None] * stride_wn + cols[None, :],
                mask=k_ok[:, None] & c_ok[None, :], other=0.0)
    wait_for_prior_grid(PDL)
    r_ok = rows < num_rows
    rows = rows.to(tl.int64)
    q = tl.load(q_nope_ptr + rows[:, None] * stride_nt + head * stride_nh + k[None, :],
                mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.dot(q.to(COMPUTE), w.to(COMPUTE), input_precision=PRECISION)
    tl.store(q_lat_ptr + rows[:, None] * stride_lt + head * stride_lh + cols[None, :],
             acc.to(q_lat_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["absorb_programs", "absorb_rows"])
def _mla_prep_kernel(
    pos_ptr, q_ptr, kv_ptr, w_ptr, inv_freq_ptr, cache_ptr, slot_ptr, latent_ptr, k_rope_ptr,
    stride_qt, stride_qh, stride_kv, stride_slot, eps, magnitude, kv_scale,
    q_nope_ptr, w_uk_ptr, q_lat_ptr, absorb_programs, absorb_rows,
    stride_nt, stride_nh, stride_wh, stride_wn, stride_lt, stride_lh,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, CACHE_FP8: tl.constexpr, ABSORB: tl.constexpr, NOPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Programs 2 * token + part (part 0 the latent, part 1 the rotary key and q_rope heads), after
    the W_UK-absorbing programs when ABSORB."""
    pid = tl.program_id(0)
    if ABSORB:
        if pid < absorb_programs:
            _absorb_rows(
                pid, q_nope_ptr, w_uk_ptr, q_lat_ptr, absorb_rows, stride_nt, stride_nh, stride_wh, stride_wn,
                stride_lt, stride_lh, HEADS, NOPE, RANK, BLOCK_T, BLOCK_NOPE, BLOCK_C, COMPUTE, PRECISION, PDL,
            )
            return
        pid -= absorb_programs
    wait_for_prior_grid(PDL)
    tok = (pid // 2).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    in_cache = slot >= 0
    cache_row = cache_ptr + slot_offset(slot, stride_slot, CACHE_FP8)  # FP8: slots in key pairs
    step: tl.constexpr = 2 if CACHE_FP8 else 1
    cache_dtype = cache_ptr.dtype.element_ty
    # Two independent halves in two programs: at decode sizes each is a chain of dependent
    # memory round trips, and side by side they take the time of one.
    if pid % 2 == 0:
        # The latent: RMSNorm, then to the returned tensor and the cache.
        cols = tl.arange(0, BLOCK_RANK)
        cmask = cols < RANK
        x = tl.load(kv_ptr + tok * stride_kv + cols, mask=cmask, other=0.0)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        latent = normalize_row(x.to(tl.float32), w, RANK, eps, x.dtype)
        tl.store(latent_ptr + tok * RANK + cols, latent, mask=cmask)
        tl.store(cache_row + step * cols, _to_cache(latent, kv_scale, CACHE_FP8, cache_dtype), mask=cmask & in_cache)
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
        tl.store(cache_row + step * (RANK + offs[None, :]), _to_cache(k, kv_scale, CACHE_FP8, cache_dtype),
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
    check_key_pairs(kv_cache, "mla_rope_norm_store")
    if inv_freq.numel() != rope // 2:
        raise ValueError(f"mla_rope_norm_store: inv_freq has {inv_freq.numel()} values, expected {rope // 2}")


def _check_absorb(q_nope: torch.Tensor, w_uk: torch.Tensor | None, q_latent: torch.Tensor | None, tokens: int) -> None:
    """Raise unless q_nope [D <= T, H, nope] @ w_uk [H, nope, rank] -> q_latent [D, H, rank] can run."""
    if w_uk is None or q_latent is None:
        raise ValueError("mla_rope_norm_store: q_nope needs w_uk and q_latent too")
    if q_nope.dim() != 3 or w_uk.dim() != 3 or q_nope.shape[0] > tokens:
        raise ValueError(f"mla_rope_norm_store: q_nope {tuple(q_nope.shape)} must be [D <= {tokens}, H, nope]")
    rows, heads, nope = q_nope.shape
    if w_uk.shape[:2] != (heads, nope) or tuple(q_latent.shape) != (rows, heads, w_uk.shape[2]):
        raise ValueError(
            f"mla_rope_norm_store: q_nope {tuple(q_nope.shape)} @ w_uk {tuple(w_uk.shape)} does not give "
            f"q_latent {tuple(q_latent.shape)}"
        )
    if q_nope.stride(2) != 1 or w_uk.stride(2) != 1 or q_latent.stride(2) != 1:
        raise ValueError("mla_rope_norm_store: q_nope, w_uk and q_latent need contiguous rows")


def _absorb_launch(q_nope: torch.Tensor | None, w_uk: torch.Tensor | None, q_latent: torch.Tensor | None) -> dict:
    """The kernel's W_UK arguments: the absorbing programs' operands, or placeholders when there are none."""
    if q_nope is None or not FUSED_ABSORB_MIN_ROWS <= q_nope.shape[0] <= FUSED_ABSORB_MAX_ROWS:
        return dict(absorb=(None, None, None, 0, 0, 0, 0, 0, 0, 0, 0), ABSORB=False, NOPE=1, BLOCK_T=16,
                    BLOCK_NOPE=16, BLOCK_C=16, COMPUTE=tl.float32, PRECISION="ieee")
    assert w_uk is not None and q_latent is not None
    rows, heads, nope = q_nope.shape
    rank = w_uk.shape[2]
    # 16 rows fill the MMA's smallest M; 64 keep the W_UK re-reads of larger batches few.
    block_t = 16 if rows <= 16 else 64
    programs = triton.cdiv(rows, block_t) * heads * triton.cdiv(rank, ABSORB_BLOCK_C)
    # The interpreter's dot mishandles 16-bit floats, so CPU runs compute in float32.
    compute = _COMPUTE[q_nope.dtype] if q_nope.is_cuda else tl.float32
    return dict(
        absorb=(q_nope, w_uk, q_latent, programs, rows, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0),
                w_uk.stride(1), q_latent.stride(0), q_latent.stride(1)),
        ABSORB=True, NOPE=nope, BLOCK_T=block_t, BLOCK_NOPE=max(16, triton.next_power_of_2(nope)),
        BLOCK_C=ABSORB_BLOCK_C, COMPUTE=compute, PRECISION="ieee" if compute == tl.float32 else "tf32",
    )


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
    *,
    q_nope: torch.Tensor | None = None,
    w_uk: torch.Tensor | None = None,
    q_latent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise the latent, rotate k_rope and q_rope (in place), store both in the paged cache;
    with q_nope, w_uk and q_latent also absorb W_UK into the first rows' queries (see the reference)."""
    rank = norm_weight.shape[0]
    _check(positions, q_rope, kv, rank, kv_cache, slot_mapping, inv_freq)
    tokens, rope = kv.shape[0], kv.shape[1] - rank
    if q_nope is not None:
        _check_absorb(q_nope, w_uk, q_latent, tokens)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    latent = torch.empty(tokens, rank, dtype=kv.dtype, device=kv.device)
    k_rope = torch.empty(tokens, rope, dtype=kv.dtype, device=kv.device)
    absorb = _absorb_launch(q_nope, w_uk, q_latent)
    args = absorb.pop("absorb")
    if tokens:
        _mla_prep_kernel[(args[3] + 2 * tokens,)](
            positions, q_rope, kv, norm_weight.contiguous(), inv_freq.float().contiguous(), flat,
            slot_mapping, latent, k_rope, q_rope.stride(0), q_rope.stride(1), kv.stride(0), flat.stride(0),
            float(eps), float(magnitude), float(kv_scale), *(a if a is not None else kv for a in args),
            HEADS=q_rope.shape[1], RANK=rank, ROPE=rope, BLOCK_RANK=triton.next_power_of_2(rank),
            BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVED=bool(interleaved),
            CACHE_FP8=kv_cache.dtype == torch.float8_e4m3fn, **absorb,
            num_warps=1 if tokens <= ONE_WARP_MAX_TOKENS else 4, **pdl_launch(kv),
        )
    if q_nope is not None and q_nope.shape[0] and not absorb["ABSORB"]:
        assert w_uk is not None and q_latent is not None
        per_head_matmul(q_nope, w_uk, q_latent)  # rows outside the fused range: a GEMM of its own
    return latent, k_rope
