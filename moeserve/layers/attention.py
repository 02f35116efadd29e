"""Multi-head latent attention (MLA) over the paged latent cache.

Each token caches only its compressed latent (kv_lora_rank values, after kv_a_layernorm) and its
rotary key (qk_rope_head_dim values). Attention then runs in one of two equivalent forms:

- absorbed (MLA): fold kv_b_proj's key half into the query and its value half into the output,
  so attention reads the latent cache directly. Per query-key pair this costs
  heads * (2 * kv_lora_rank + qk_rope_head_dim) multiply-adds, but nothing is decompressed.
  Decode always uses it.
- decompressed (MHA): expand every cached latent to per-head keys and values with kv_b_proj and
  run ordinary attention, at heads * (qk_head_dim + v_head_dim) per pair plus the expansion of
  each key once.

For a prefill row with `e` new tokens after `p` cached ones the absorbed form pays per pair
(e * (e + p) pairs) and the MHA form mostly per key (e + p keys), so MHA wins once the batch's
`sum(e * (e + p))` is large. The rule (seed 002's): the extend rows of a batch use MHA when that
sum reaches `EngineConfig.mha_threshold`, the absorbed form below it.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve import ops
from moeserve.config.model_config import ModelConfig
from moeserve.core.batch import ForwardBatch
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding


def use_mha_for_extend(extend_lens: list[int], prefix_lens: list[int], threshold: int) -> bool:
    """Seed 002's rule: decompressed attention once sum(extend * (extend + prefix)) >= threshold."""
    work = sum(e * (e + p) for e, p in zip(extend_lens, prefix_lens, strict=True))
    return work >= threshold


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3 attention with a compressed, paged KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        q_out = heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = RotaryEmbedding(config.rope, self.rope_dim, config.rope_interleave)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into its key part [H, nope, rank] and value part [H, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.nope_dim + self.rope_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q = self._queries(hidden)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        q_rope, k_rope = self.rotary_emb(positions, q_rope, kv[:, self.kv_lora_rank :])
        cache = batch.kv_cache.layer(self.layer_idx)
        ops.store_kv(cache, batch.slot_mapping, latent, k_rope)

        out = hidden.new_empty(hidden.shape[0], self.num_heads, self.v_dim)
        d = batch.num_decode_tokens
        w_uk, w_uv = self._w_uk_uv()
        if d:
            q_latent = torch.einsum("thn,hnc->thc", q_nope[:d], w_uk)
            o_latent = ops.mla_decode(
                q_latent, q_rope[:d], cache, batch.block_table[: batch.num_decodes], batch.seq_lens[:d], self.scale
            )
            out[:d] = torch.einsum("thc,hvc->thv", o_latent, w_uv)
        if hidden.shape[0] > d:
            rows = slice(batch.num_decodes, None)
            if batch.extend_use_mha:
                out[d:] = self._extend_mha(q_nope[d:], q_rope[d:], latent[d:], k_rope[d:], cache, batch)
            else:
                q_latent = torch.einsum("thn,hnc->thc", q_nope[d:], w_uk)
                o_latent = ops.mla_extend_absorbed(
                    q_latent,
                    q_rope[d:],
                    cache,
                    batch.block_table[rows],
                    batch.seq_lens[rows],
                    batch.query_lens[rows],
                    self.scale,
                )
                out[d:] = torch.einsum("thc,hvc->thv", o_latent, w_uv)
        return self.o_proj(out.flatten(1))

    def _extend_mha(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Decompressed attention for the extend rows, reading any cached prefix back from pages."""
        rows = slice(batch.num_decodes, None)
        seq_lens, query_lens = batch.seq_lens[rows], batch.query_lens[rows]
        if any(s != q for s, q in zip(seq_lens, query_lens, strict=True)):
            tables = batch.block_table[rows]
            kv = torch.cat([ops.gather_kv(cache, tables[i], s) for i, s in enumerate(seq_lens)])
            latent, k_rope = kv[:, : self.kv_lora_rank], kv[:, self.kv_lora_rank :]
        kv_b = self.kv_b_proj(latent.to(q_nope.dtype)).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv_b.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope.to(q_nope.dtype)[:, None, :].expand(-1, self.num_heads, -1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return ops.varlen_attention(q, k, v, query_lens, seq_lens, self.scale)
