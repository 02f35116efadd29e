"""KV capacity: bytes per token, KV pool per GPU, and how many requests fit (seed 000's table)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moeserve.planner.hardware import GpuSpec
from moeserve.planner.layout import DTYPE_BYTES, GIB, Layout, Precision
from moeserve.planner.model_shape import ModelShape
from moeserve.planner.weights import WeightsPerGpu, weights_per_gpu

UNITS = {
    "memory": "GiB (2**30 bytes); HBM 'GB' from datasheets is read as GiB, as SGLang's logs and seed 000 do",
    "kv_bytes_per_token": "bytes",
}


@dataclass(frozen=True)
class CapacityInputs:
    """Everything `plan capacity` needs: model, GPU, precisions, layout, memory setting and workload."""

    shape: ModelShape
    gpu: GpuSpec
    precision: Precision
    layout: Layout
    mem_fraction_static: float = 0.75
    isl: int = 128_000
    osl: int = 8_000
    headroom: float = 0.85
    weights_gb_per_gpu: float | None = None  # GiB; replaces the computed weights when set

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"--headroom must be in (0, 1], got {self.headroom}")
        if self.isl < 0 or self.osl < 0 or self.isl + self.osl == 0:
            raise ValueError(f"--isl and --osl must be >= 0 with a positive sum, got {self.isl} and {self.osl}")
        if self.weights_gb_per_gpu is not None and self.weights_gb_per_gpu < 0:
            raise ValueError(f"--weights-gb-per-gpu must be >= 0, got {self.weights_gb_per_gpu}")


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """Per-token KV bytes over all layers: MLA (kv_lora_rank + qk_rope_head_dim) x layers x element bytes."""
    return int(shape.kv_elements_per_token_layer() * shape.num_layers * DTYPE_BYTES[kv_dtype])


def kv_bytes_per_token_per_gpu(shape: ModelShape, kv_dtype: str, layout: Layout) -> int:
    """What one GPU stores per token: MLA's latent is replicated over attention TP, GQA's KV heads are split."""
    if shape.attention == "mla":
        return kv_bytes_per_token(shape, kv_dtype)
    heads = math.ceil(shape.num_kv_heads / layout.attn_tp)  # heads replicate once TP exceeds them
    return int(2 * heads * shape.head_dim * shape.num_layers * DTYPE_BYTES[kv_dtype])


@dataclass(frozen=True)
class CapacityPlan:
    """The answer of `plan capacity`; memory fields in GiB, per GPU unless named otherwise."""

    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    hbm_gb: float
    static_budget_gb: float
    weights_gb_per_gpu: float
    weights_source: str  # "given" (--weights-gb-per-gpu) or "computed"
    kv_pool_gb: float
    kv_pool_tokens: int
    tokens_per_request: int
    kv_per_request_gib: float
    max_requests_per_gpu: float  # KV pool / KV per request, unrounded: the seed's "theoretical cap"
    max_whole_requests_per_gpu: int  # requests that actually fit
    practical_requests_per_gpu: float
    total_concurrent_requests: int
    headroom: float
    total_gpus: int

    def to_dict(self) -> dict:
        """JSON-ready dict, rounded for reading."""
        out = asdict(self)
        for key in ("hbm_gb", "static_budget_gb", "weights_gb_per_gpu", "kv_pool_gb"):
            out[key] = round(out[key], 3)
        out["kv_per_request_gib"] = round(out["kv_per_request_gib"], 4)
        out["max_requests_per_gpu"] = round(out["max_requests_per_gpu"], 3)
        out["practical_requests_per_gpu"] = round(out["practical_requests_per_gpu"], 3)
        return out


def weights_bytes(inp: CapacityInputs) -> tuple[float, str, WeightsPerGpu]:
    """Weight bytes per GPU: the override when given, else computed from the shape and layout."""
    computed = weights_per_gpu(inp.shape, inp.layout, inp.precision)
    if inp.weights_gb_per_gpu is not None:
        return inp.weights_gb_per_gpu * GIB, "given", computed
    return computed.total, "computed", computed


def plan_capacity(inp: CapacityInputs) -> CapacityPlan:
    """KV pool = HBM x mem_fraction_static - weights; requests = pool / (tokens x KV bytes per token)."""
    hbm = inp.gpu.hbm_gb * GIB
    static = hbm * inp.mem_fraction_static
    weights, source, _ = weights_bytes(inp)
    pool = static - weights
    if pool <= 0:
        raise ValueError(
            f"weights ({weights / GIB:.1f} GiB per GPU) do not fit in the static budget "
            f"({static / GIB:.1f} GiB = {inp.gpu.hbm_gb} x {inp.mem_fraction_static}); "
            "use more GPUs (--ep/--tp), a smaller --weight-dtype or a larger --mem-fraction-static"
        )
    per_token_gpu = kv_bytes_per_token_per_gpu(inp.shape, inp.precision.kv, inp.layout)
    tokens = inp.isl + inp.osl
    per_request = tokens * per_token_gpu
    # A request's KV lives on every GPU of its attention group, so the group's cap is the per-GPU cap.
    group_cap = pool / per_request
    attn_tp = inp.layout.attn_tp
    practical_group = math.floor(inp.headroom * group_cap + 1e-9)
    return CapacityPlan(
        kv_bytes_per_token=kv_bytes_per_token(inp.shape, inp.precision.kv),
        kv_bytes_per_token_per_gpu=per_token_gpu,
        hbm_gb=inp.gpu.hbm_gb,
        static_budget_gb=static / GIB,
        weights_gb_per_gpu=weights / GIB,
        weights_source=source,
        kv_pool_gb=pool / GIB,
        kv_pool_tokens=int(pool // per_token_gpu),
        tokens_per_request=tokens,
        kv_per_request_gib=per_request / GIB,
        max_requests_per_gpu=group_cap / attn_tp,
        max_whole_requests_per_gpu=math.floor(group_cap + 1e-9) // attn_tp,
        practical_requests_per_gpu=practical_group / attn_tp,
        total_concurrent_requests=practical_group * inp.layout.attention_groups,
        headroom=inp.headroom,
        total_gpus=inp.layout.total_gpus,
    )
