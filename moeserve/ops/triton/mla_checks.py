"""Argument checks of the MLA decode ops (mla_decode.py): shapes and strides, as ValueErrors."""

from __future__ import annotations

import torch


def check_key_pairs(kv_cache: torch.Tensor, op: str) -> None:
    """Raise ValueError unless an FP8 cache can hold its slots in pairs (reference.attention.slot_view):
    an even page size, a page's rows contiguous."""
    if kv_cache.dtype == torch.float8_e4m3fn and (kv_cache.shape[1] % 2 or kv_cache.stride(1) != kv_cache.shape[-1]):
        raise ValueError(f"{op}: an FP8 cache {tuple(kv_cache.shape)} stores slots in pairs: it needs an even page "
                         "size and contiguous rows in a page")


def check_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    """Raise ValueError unless the query parts, the cache and the block table have the shapes and strides the
    kernels take."""
    rank, rope = q_latent.shape[-1], q_rope.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != rank + rope or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"MLA attention: cache {tuple(kv_cache.shape)} is not a [pages, page_size, {rank + rope}] tensor "
            "with contiguous rows"
        )
    check_key_pairs(kv_cache, "MLA attention")
    if q_rope.shape[:-1] != q_latent.shape[:-1] or q_latent.dim() != 3:
        raise ValueError(f"MLA attention: q_rope {tuple(q_rope.shape)} does not match q_latent {tuple(q_latent.shape)}")
    if block_table.dim() != 2 or block_table.stride(-1) != 1:
        raise ValueError(f"MLA attention: block table {tuple(block_table.shape)} must be [B, max_pages], rows contiguous")


def check_projections(q_latent: torch.Tensor, w_uv: torch.Tensor, w_o: torch.Tensor | None,
                       w_o_t: torch.Tensor | None) -> None:
    """Raise ValueError unless W_UV (and o_proj's w_o, and its transposed copy) fit the query's heads and rank."""
    heads, rank = q_latent.shape[1], q_latent.shape[2]
    if w_uv.dim() != 3 or w_uv.shape[0] != heads or w_uv.shape[2] != rank:
        raise ValueError(f"mla_decode: w_uv {tuple(w_uv.shape)} is not [{heads}, v, {rank}]")
    if w_o is not None and (w_o.dim() != 2 or w_o.shape[1] != heads * w_uv.shape[1]):
        raise ValueError(f"mla_decode: w_o {tuple(w_o.shape)} is not [hidden, {heads * w_uv.shape[1]}]")
    if w_o_t is not None and (w_o is None or w_o_t.shape != w_o.shape[::-1] or not w_o_t.is_contiguous()):
        raise ValueError("mla_decode: w_o_t must be w_o transposed, contiguous")
