"""Reference MLA attention: latent KV store/gather, absorbed decode and extend, MHA varlen.

The paged cache of one layer is [pages, page_size, kv_lora_rank + qk_rope_head_dim]. It may be
stored in FP8 (e4m3) with one per-tensor scale: stored = value / kv_scale, value = stored * kv_scale.
An FP8 cache keeps its slots in pairs (page_size even): slots 2j and 2j + 1 interleave column by
column, so column c of the pair is one 16-bit word, the even slot's byte first. Decode reads the
pair as 16-bit words (moeserve/ops/triton/mla_pairs.py says why); `slot_view` is the layout.
"""

from __future__ import annotations

import torch

from moeserve.ops.reference.linear import linear, per_head_matmul

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Cast to the cache dtype, scaling and saturating when that dtype is FP8."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def dequantize_kv(x: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """Cache values back to float32."""
    out = x.float()
    return out * kv_scale if x.dtype == torch.float8_e4m3fn else out


def slot_group(dtype: torch.dtype) -> int:
    """Slots interleaved per group in a cache of `dtype`: 2 for FP8 (key pairs), else 1."""
    return 2 if dtype == torch.float8_e4m3fn else 1


def slot_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's slots (page * page_size + slot) as [slots // g, g, dim], g = slot_group: slot s
    is [s // g, s % g]. A view: writes through it land in the cache."""
    pages, page_size, width = kv_cache.shape
    if slot_group(kv_cache.dtype) == 1:
        return kv_cache.view(-1, 1, width)
    if page_size % 2 or not kv_cache.is_contiguous():
        raise ValueError(f"KV cache {tuple(kv_cache.shape)}: an FP8 cache stores slots in pairs: it needs an even "
                         "page size and contiguous pages")
    return kv_cache.as_strided((pages * page_size // 2, 2, width), (2 * width, 1, 2), kv_cache.storage_offset())


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The stored rows (cache dtype) of the given slots: [len(slots), dim]."""
    slots, group = slots.long(), slot_group(kv_cache.dtype)
    return slot_view(kv_cache)[slots // group, slots % group]


def write_slots(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows (already in the cache dtype) into the given slots."""
    slots, group = slots.long(), slot_group(kv_cache.dtype)
    slot_view(kv_cache)[slots // group, slots % group] = rows


def store_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Write each token's latent and rotary key into its slot of one layer's paged cache."""
    rows = torch.cat((latent.float(), k_rope.float()), dim=-1)
    write_slots(kv_cache, slot_mapping, quantize_kv(rows, kv_cache.dtype, kv_scale))


def _gather_one(kv_cache: torch.Tensor, pages: torch.Tensor, seq_len: int, kv_scale: float) -> torch.Tensor:
    page_size = kv_cache.shape[1]
    positions = torch.arange(seq_len, device=kv_cache.device)
    slots = pages.long()[positions // page_size] * page_size + positions % page_size
    return dequantize_kv(read_slots(kv_cache, slots), kv_scale)


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_dtype: torch.dtype,
    kv_scale: float = 1.0,
    total: int | None = None,
) -> torch.Tensor:
    """Each sequence's cached rows in token order, packed: [sum(seq_lens), kv_cache_dim].

    `total` is sum(seq_lens) when the caller knows it on the host (it must be right).
    """
    total = int(cu_seqlens[-1]) if total is None else total
    out = torch.empty(total, kv_cache.shape[-1], dtype=out_dtype, device=kv_cache.device)
    for b, (start, seq_len) in enumerate(zip(cu_seqlens[:-1].tolist(), seq_lens.tolist(), strict=True)):
        out[start : start + seq_len] = _gather_one(kv_cache, block_table[b], seq_len, kv_scale).to(out_dtype)
    return out


def _absorbed_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, scale: float, prefix_len: int
) -> torch.Tensor:
    """Causal attention of `q` (the last rows of a sequence) over float32 latent `kv`."""
    rank = q_latent.shape[-1]
    latent, k_rope = kv[:, :rank], kv[:, rank:]
    scores = torch.einsum("qhc,kc->hqk", q_latent.float(), latent)
    scores += torch.einsum("qhr,kr->hqk", q_rope.float(), k_rope)
    scores *= scale
    q_len, k_len = q_latent.shape[0], kv.shape[0]
    q_pos = torch.arange(q_len, device=kv.device)[:, None] + prefix_len
    mask = torch.arange(k_len, device=kv.device)[None, :] > q_pos
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hqk,kc->qhc", scores.softmax(dim=-1), latent)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    *,
    w_uv: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w_o: torch.Tensor | None = None,
    w_o_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed-form decode: one query per sequence over its whole latent cache -> [B, H, rank].

    With w_uv [H, v, rank] the per-head value projection follows -> [B, H, v] (into `out` if
    given): the absorbed form's last step before o_proj, which the GPU path may fuse into its merge.
    With w_o [hidden, H * v] too, o_proj follows -> [B, hidden] (the GPU path may return it as the
    float32 one-slot part [B, 1, hidden] that the next add + RMSNorm also takes). `w_o_t`, what
    `transposed_o_proj` gave for these weights, is the same weight in another layout for the GPU
    path to read; the reference has no use for it.
    """
    if w_o is not None and w_uv is None:
        raise ValueError("mla_decode: o_proj's weight w_o needs w_uv")
    o_latent = torch.empty_like(q_latent)
    for b, seq_len in enumerate(seq_lens.tolist()):
        kv = _gather_one(kv_cache, block_table[b], seq_len, kv_scale)
        o_latent[b] = _absorbed_attention(q_latent[b : b + 1], q_rope[b : b + 1], kv, scale, seq_len - 1)[0]
    if w_uv is None:
        return o_latent
    if out is None:
        out = o_latent.new_empty(o_latent.shape[0], o_latent.shape[1], w_uv.shape[1])
    values = per_head_matmul(o_latent, w_uv.transpose(1, 2), out)
    return values if w_o is None else linear(values.flatten(1), w_o)


def transposed_o_proj(w_uv: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor | None:
    """A copy of o_proj's weight [hidden, H * v] that decode reads faster than the weight itself
    (to pass to mla_decode as w_o_t), or None where it reads the weight as it is, as here."""
    return None


def mla_extend_absorbed(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Absorbed-form prefill: each sequence's new queries (rows query_start_loc[b]:[b+1]) attend
    causally to its cached prefix and to themselves, already stored in the cache -> [T, H, rank]."""
    out = torch.empty_like(q_latent)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        kv = _gather_one(kv_cache, block_table[b], seq_len, kv_scale)
        out[rows] = _absorbed_attention(q_latent[rows], q_rope[rows], kv, scale, seq_len - q_len)
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    k_rope: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head causal attention over packed variable-length sequences.

    Sequence i's queries are rows cu_seqlens_q[i]:[i+1] of `q`, its keys/values rows
    cu_seqlens_k[i]:[i+1] of `k`/`v`; the queries are the last positions of the sequence, so the
    causal mask is aligned bottom-right. With `k_rope` [S, R], `k` holds each head's first
    Dq - R key dims and `k_rope` the last R, shared by every head (MLA's rotary key). The result
    is written into `out` when given.
    """
    if k_rope is not None:
        k = torch.cat((k, k_rope[:, None, :].expand(-1, k.shape[1], -1)), dim=-1)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    qs, ks = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(qs) - 1):
        q_len, kv_len = qs[i + 1] - qs[i], ks[i + 1] - ks[i]
        qi = q[qs[i] : qs[i + 1]].float()
        ki, vi = k[ks[i] : ks[i + 1]].float(), v[ks[i] : ks[i + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        q_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] > q_pos
        scores.masked_fill_(mask[None], float("-inf"))
        out[qs[i] : qs[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vi).to(out.dtype)
    return out
