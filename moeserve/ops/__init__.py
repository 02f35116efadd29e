"""Numerical ops behind one interface: a PyTorch reference everywhere, Triton where it pays.

Callers use the names exported here; which implementation runs is decided by the inputs
(device), never by global settings. Shapes and meanings are documented on the reference
versions in `moeserve/ops/reference/`; a Triton version takes the same arguments.

Conventions: token-major packed tensors ([T, ...]); per-sequence metadata as int32 device tensors
(`seq_lens` [B], `query_start_loc` / `cu_seqlens` [B + 1]) plus Python ints for sizes that shape a
launch grid (`max_query_len`); one layer's paged KV cache is [pages, page_size, rank + rope_dim],
page 0 being scratch; an FP8 cache stores value / kv_scale.
"""

from moeserve.ops.reference.attention import (
    gather_kv,
    mla_decode,
    mla_extend_absorbed,
    store_kv,
    varlen_attention,
)
from moeserve.ops.reference.moe import fused_moe, select_experts
from moeserve.ops.reference.norm import fused_add_rms_norm, rms_norm
from moeserve.ops.reference.rope import mla_rope_norm_store

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "gather_kv",
    "mla_decode",
    "mla_extend_absorbed",
    "mla_rope_norm_store",
    "rms_norm",
    "select_experts",
    "store_kv",
    "varlen_attention",
]
