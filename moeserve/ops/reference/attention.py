"""Reference MLA attention: latent KV store/gather, absorbed decode and extend, MHA varlen."""

from __future__ import annotations

import torch


def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Write each token's latent and rotary key into its slot of one layer's paged cache."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rank = latent.shape[-1]
    flat[slot_mapping, :rank] = latent.to(flat.dtype)
    flat[slot_mapping, rank:] = k_rope.to(flat.dtype)


def gather_kv(kv_cache: torch.Tensor, page_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first `seq_len` cached rows, in token order: [seq_len, kv_cache_dim]."""
    page_size = kv_cache.shape[1]
    num_pages = -(-seq_len // page_size)
    return kv_cache[page_table[:num_pages].long()].reshape(-1, kv_cache.shape[-1])[:seq_len]


def _absorbed_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, scale: float, prefix_len: int
) -> torch.Tensor:
    """Causal attention of `q` (the last rows of a sequence) over latent `kv`, in the latent space."""
    rank = q_latent.shape[-1]
    latent, k_rope = kv[:, :rank].float(), kv[:, rank:].float()
    scores = torch.einsum("qhc,kc->hqk", q_latent.float(), latent)
    scores += torch.einsum("qhr,kr->hqk", q_rope.float(), k_rope)
    scores *= scale
    q_len, k_len = q_latent.shape[0], kv.shape[0]
    q_pos = torch.arange(q_len, device=kv.device)[:, None] + prefix_len
    mask = torch.arange(k_len, device=kv.device)[None, :] > q_pos
    scores.masked_fill_(mask[None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,kc->qhc", probs, latent)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Absorbed-form decode: one query per sequence over its whole latent cache -> [B, H, rank]."""
    out = torch.empty_like(q_latent)
    for b, seq_len in enumerate(seq_lens):
        kv = gather_kv(kv_cache, block_table[b], seq_len)
        out[b] = _absorbed_attention(q_latent[b : b + 1], q_rope[b : b + 1], kv, scale, seq_len - 1)[0]
    return out


def mla_extend_absorbed(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Absorbed-form prefill: each sequence's new queries attend causally to its cached prefix and
    to themselves (already stored in the cache) -> [T, H, rank]."""
    out = torch.empty_like(q_latent)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        kv = gather_kv(kv_cache, block_table[b], seq_len)
        rows = slice(start, start + q_len)
        out[rows] = _absorbed_attention(q_latent[rows], q_rope[rows], kv, scale, seq_len - q_len)
        start += q_len
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Multi-head causal attention over packed variable-length sequences.

    Queries are the last `query_lens[i]` positions of sequence i, whose keys/values are packed in
    `k`/`v` (`kv_lens[i]` rows each): the causal mask is aligned bottom-right.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    qs = ks = 0
    for q_len, kv_len in zip(query_lens, kv_lens, strict=True):
        qi, ki, vi = q[qs : qs + q_len].float(), k[ks : ks + kv_len].float(), v[ks : ks + kv_len].float()
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        q_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] > q_pos
        scores.masked_fill_(mask[None], float("-inf"))
        out[qs : qs + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vi).to(out.dtype)
        qs += q_len
        ks += kv_len
    return out
