"""Numerical ops behind one interface: a PyTorch reference everywhere, Triton where it pays.

Callers use the names exported here; which implementation runs is decided by the inputs
(device, dtype), never by global settings.
"""

from moeserve.ops.reference.attention import (
    gather_kv,
    mla_decode,
    mla_extend_absorbed,
    store_kv,
    varlen_attention,
)
from moeserve.ops.reference.moe import fused_moe, select_experts
from moeserve.ops.reference.norm import rms_norm

__all__ = [
    "fused_moe",
    "gather_kv",
    "mla_decode",
    "mla_extend_absorbed",
    "rms_norm",
    "select_experts",
    "store_kv",
    "varlen_attention",
]
