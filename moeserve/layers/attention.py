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
from moeserve.layers.rotary import RotaryFrequencies
from moeserve.layers.weight_copy import WeightCopy


def use_mha_for_extend(extend_lens: list[int], prefix_lens: list[int], threshold: int) -> bool:
    """Seed 002's rule: decompressed attention once sum(extend * (extend + prefix)) >= threshold."""
    work = sum(e * (e + p) for e, p in zip(extend_lens, prefix_lens, strict=True))
    return work >= threshold


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3 attention with a compressed, paged KV cache.

    The two projections that read the hidden state (the query's first projection, q_proj or
    q_a_proj, and kv_a_proj_with_mqa) are one matrix, `fused_qkv_a_proj`, so they cost one GEMM.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        hidden, heads = config.hidden_size, config.num_attention_heads
        q_out = heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.q_a_dim = q_out if config.q_lora_rank is None else config.q_lora_rank
        self.fused_qkv_a_proj = nn.Linear(hidden, self.q_a_dim + config.kv_cache_dim, bias=config.attention_bias)
        if config.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.attention_bias)
        self.rotary = RotaryFrequencies(config.rope, self.rope_dim, config.rope_interleave)
        self._o_proj_copy = WeightCopy("o_proj's decode copy")

    def build_weight_copies(self) -> None:
        """Build now the copy of o_proj that decode reads (ops.transposed_o_proj), which would
        otherwise be built at first use, so that a memory profile counts it as weights."""
        self.o_proj_copy()

    def o_proj_copy(self) -> torch.Tensor | None:
        """o_proj's weight as batch-1 decode reads it fastest (ops.transposed_o_proj), or None;
        rebuilt whenever the weight is written."""
        return self._o_proj_copy.get(self.o_proj.weight, lambda w: ops.transposed_o_proj(self._w_uk_uv()[1], w))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into its key part [H, nope, rank] and value part [H, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _project(self, qkv_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fused_qkv_a_proj's output -> (queries [T, H, qk_head_dim], kv_a output [T, rank + rope_dim])."""
        q_a, kv = qkv_a.split([self.q_a_dim, self.kv_lora_rank + self.rope_dim], dim=-1)
        q = q_a if self.q_lora_rank is None else _linear(self.q_b_proj, self.q_a_layernorm(q_a))
        return q.view(qkv_a.shape[0], self.num_heads, self.nope_dim + self.rope_dim), kv

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the already normalised hidden states [T, hidden] -> [T, hidden] (or as `attend`)."""
        return self.attend(positions, _linear(self.fused_qkv_a_proj, hidden), batch)

    def add_norm_forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual); at decode sizes on the GPU the add + norm run
        inside the first projection's kernel. x may be a MoE's per-expert parts [T, slots, hidden]."""
        proj = self.fused_qkv_a_proj
        qkv_a, residual = ops.add_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
        return self.attend(positions, qkv_a, batch), residual

    def attend(self, positions: torch.Tensor, qkv_a: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention from fused_qkv_a_proj's output [T, q_a + kv_a] (computed by the caller) -> [T, hidden],
        or for a decode-only batch possibly its float32 one-slot part [T, 1, hidden] (ops.mla_decode),
        which the next add + RMSNorm takes alike."""
        q, kv = self._project(qkv_a)
        cache = batch.kv_cache.layer(self.layer_idx)
        kv_scale = batch.kv_cache.kv_scale
        d = batch.num_decode_tokens
        w_uk, w_uv = self._w_uk_uv()
        # Decode rows' queries are absorbed (q_nope @ W_UK per head) by the same op that prepares
        # the tokens: on the GPU one launch for both.
        absorb = {}
        if d:
            q_latent = q.new_empty(d, self.num_heads, self.kv_lora_rank)
            absorb = dict(q_nope=q[:d, :, : self.nope_dim], w_uk=w_uk, q_latent=q_latent)
        latent, k_rope = ops.mla_rope_norm_store(
            positions,
            q[..., self.nope_dim :],
            kv,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            self.rotary.inv_freq(positions.device),
            self.rotary.magnitude,
            self.rotary.interleaved,
            cache,
            batch.slot_mapping,
            kv_scale,
            **absorb,
        )
        # Every path writes its rows of `out` in place: no concatenation or copy before o_proj.
        tokens = q.shape[0]
        out = q.new_empty(tokens, self.num_heads, self.v_dim)
        if tokens > d:
            if batch.extend_use_mha:
                self._extend_mha(q[d:], latent[d:], k_rope[d:], cache, batch, out[d:])
            else:
                self._extend_absorbed(q[d:], cache, batch, w_uk, w_uv, out[d:])
        if d:
            b = batch.num_decodes
            # The value projection (W_UV per head) rides along: on the GPU, fused into the merge at
            # batch 1-2, and so is o_proj when every row decodes. Decode rows go last: without
            # o_proj that merge may let o_proj launch before its own wait.
            with_o = tokens == d and self.o_proj.bias is None
            result = ops.mla_decode(
                q_latent, q[:d, :, self.nope_dim :], cache, batch.block_table[:b], batch.seq_lens_t[:b], self.scale,
                kv_scale, w_uv=w_uv, out=out[:d], w_o=self.o_proj.weight if with_o else None,
                w_o_t=self.o_proj_copy() if with_o else None,
            )
            if with_o:
                return result
        return _linear(self.o_proj, out.flatten(1))

    def _extend_absorbed(
        self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, w_uk: torch.Tensor, w_uv: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        assert batch.extend_block_table is not None and batch.extend_seq_lens_t is not None
        q_latent = per_head_matmul(q[..., : self.nope_dim], w_uk)
        o_latent = ops.mla_extend_absorbed(
            q_latent,
            q[..., self.nope_dim :],
            cache,
            batch.extend_block_table,
            batch.extend_seq_lens_t,
            batch.extend_query_start_loc,
            batch.max_extend_len,
            self.scale,
            batch.kv_cache.kv_scale,
        )
        per_head_matmul(o_latent, w_uv.transpose(1, 2), out)

    def _extend_mha(
        self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch,
        out: torch.Tensor,
    ) -> None:
        """Decompressed attention for the extend rows, reading any cached prefix back from pages."""
        cu_k = batch.extend_query_start_loc
        max_kv = batch.max_extend_len
        if batch.extend_has_prefix:
            assert batch.extend_block_table is not None and batch.extend_seq_lens_t is not None
            cu_k, max_kv = batch.extend_kv_start_loc, batch.max_extend_seq_len
            kv = ops.gather_kv(
                cache, batch.extend_block_table, batch.extend_seq_lens_t, cu_k, q.dtype, batch.kv_cache.kv_scale,
                total=batch.extend_kv_total,
            )
            latent, k_rope = kv[:, : self.kv_lora_rank], kv[:, self.kv_lora_rank :]
        kv_b = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv_b.split([self.nope_dim, self.v_dim], dim=-1)
        # The rotary key is one vector per token shared by all heads: passed once, not expanded.
        ops.varlen_attention(
            q, k_nope, v, batch.extend_query_start_loc, cu_k, batch.max_extend_len, max_kv, self.scale,
            k_rope=k_rope, out=out,
        )


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` through ops.linear (a GEMV for decode-size inputs on the GPU)."""
    return ops.linear(x, layer.weight, layer.bias)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, a] @ [H, a, b] -> [T, H, b]: one batched GEMM over heads, written token-major into `out`."""
    if out is None:
        out = x.new_empty(x.shape[0], w.shape[0], w.shape[2])
    return ops.per_head_matmul(x, w, out)
