"""Numerical ops behind one interface: a PyTorch reference everywhere, Triton on GPU.

Callers use the names exported here; which implementation runs is decided by the inputs (CUDA
tensors get the Triton kernel), never by global settings. Shapes and meanings are documented on
the reference versions in `moeserve/ops/reference/`; a Triton version takes the same arguments.

Conventions: token-major packed tensors ([T, ...]); per-sequence metadata as int32 device tensors
(`seq_lens` [B], `query_start_loc` / `cu_seqlens` [B + 1]) plus Python ints for sizes that shape a
launch grid (`max_query_len`); one layer's paged KV cache is [pages, page_size, rank + rope_dim],
page 0 being scratch; an FP8 cache stores value / kv_scale.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from moeserve.ops.reference import activation as _ref_activation
from moeserve.ops.reference import argmax as _ref_argmax
from moeserve.ops.reference import attention as _ref_attention
from moeserve.ops.reference import decode_inputs as _ref_decode_inputs
from moeserve.ops.reference import linear as _ref_linear
from moeserve.ops.reference import moe as _ref_moe
from moeserve.ops.reference import norm as _ref_norm
from moeserve.ops.reference import rope as _ref_rope


def _dispatch(name: str, reference: Callable, triton_module: str) -> Callable:
    """An op that runs `triton_module.name` on CUDA tensors and `reference` elsewhere."""
    triton_fn: Callable | None = None

    def op(first: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal triton_fn
        if not first.is_cuda:
            return reference(first, *args, **kwargs)
        if triton_fn is None:
            triton_fn = getattr(importlib.import_module(f"moeserve.ops.triton.{triton_module}"), name)
        return triton_fn(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = reference.__doc__
    return op


argmax_rows = _dispatch("argmax_rows", _ref_argmax.argmax_rows, "argmax")
store_kv = _ref_attention.store_kv  # folded into mla_rope_norm_store on the GPU path
gather_kv = _dispatch("gather_kv", _ref_attention.gather_kv, "gather_kv")
mla_decode = _dispatch("mla_decode", _ref_attention.mla_decode, "mla_decode")
transposed_o_proj = _dispatch("transposed_o_proj", _ref_attention.transposed_o_proj, "mla_reduce")
mla_extend_absorbed = _dispatch("mla_extend_absorbed", _ref_attention.mla_extend_absorbed, "mla_extend")
varlen_attention = _dispatch("varlen_attention", _ref_attention.varlen_attention, "flash_attention")
fused_moe = _dispatch("fused_moe", _ref_moe.fused_moe, "fused_moe")
fused_moe_add_norm_linear = _dispatch("fused_moe_add_norm_linear", _ref_moe.fused_moe_add_norm_linear, "fused_moe")
add_norm_route = _dispatch("add_norm_route", _ref_moe.add_norm_route, "norm_route")
routed_moe_add_norm_linear = _dispatch(
    "routed_moe_add_norm_linear", _ref_moe.routed_moe_add_norm_linear, "fused_moe"
)
select_experts = _dispatch("select_experts", _ref_moe.select_experts, "routing")
rms_norm = _dispatch("rms_norm", _ref_norm.rms_norm, "norm")
fused_add_rms_norm = _dispatch("fused_add_rms_norm", _ref_norm.fused_add_rms_norm, "norm")
mla_rope_norm_store = _dispatch("mla_rope_norm_store", _ref_rope.mla_rope_norm_store, "rope_store")
silu_and_mul = _dispatch("silu_and_mul", _ref_activation.silu_and_mul, "activation")
skinny_bmm = _dispatch("skinny_bmm", _ref_linear.skinny_bmm, "skinny_gemm")
per_head_matmul = _dispatch("per_head_matmul", _ref_linear.per_head_matmul, "skinny_gemm")
linear = _dispatch("linear", _ref_linear.linear, "gemv")
add_norm_linear = _dispatch("add_norm_linear", _ref_linear.add_norm_linear, "gemv")
embed_norm_linear = _dispatch("embed_norm_linear", _ref_linear.embed_norm_linear, "gemv")
unpack_decode_inputs = _dispatch(
    "unpack_decode_inputs", _ref_decode_inputs.unpack_decode_inputs, "decode_inputs"
)

__all__ = [
    "add_norm_linear",
    "add_norm_route",
    "argmax_rows",
    "embed_norm_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_add_norm_linear",
    "gather_kv",
    "linear",
    "per_head_matmul",
    "mla_decode",
    "mla_extend_absorbed",
    "mla_rope_norm_store",
    "rms_norm",
    "routed_moe_add_norm_linear",
    "select_experts",
    "silu_and_mul",
    "skinny_bmm",
    "store_kv",
    "transposed_o_proj",
    "unpack_decode_inputs",
    "varlen_attention",
]
