"""Roofline model of one decode step: bytes read vs FLOPs vs EP all-to-all, with and without MTP."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeserve.planner.capacity import kv_bytes_per_token_per_gpu
from moeserve.planner.hardware import GpuSpec
from moeserve.planner.layout import DTYPE_BYTES, Layout, Precision
from moeserve.planner.model_shape import ModelShape
from moeserve.planner.weights import weights_per_gpu

UNITS = {
    "bytes_read_gb": "1e9 bytes read from HBM per GPU per step (decimal, like the TB/s bandwidths)",
    "tflop": "1e12 FLOP per GPU per step",
    "times": "milliseconds",
    "batch_size": "requests decoding on each GPU (under attention TP, the group's batch / TP)",
}


@dataclass(frozen=True)
class DecodeInputs:
    """Model, GPU, precisions, layout, context length and the efficiency knobs of the roofline."""

    shape: ModelShape
    gpu: GpuSpec
    precision: Precision
    layout: Layout
    context: int  # mean tokens of KV each request attends over during decode
    mem_efficiency: float = 1.0  # fraction of datasheet HBM bandwidth reached
    compute_efficiency: float = 1.0  # fraction of datasheet dense peak reached
    a2a_latency_us: float = 10.0  # fixed cost of one dispatch or combine, on top of its bytes
    overlap_comm: bool = False  # True: all-to-all hides under compute/memory instead of adding to it

    def __post_init__(self) -> None:
        if self.context < 0:
            raise ValueError(f"--context must be >= 0, got {self.context}")
        for name in ("mem_efficiency", "compute_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")
        if self.a2a_latency_us < 0:
            raise ValueError(f"--a2a-latency-us must be >= 0, got {self.a2a_latency_us}")


@dataclass(frozen=True)
class MtpConfig:
    """Multi-token prediction: draft tokens proposed per step and mean tokens accepted per step."""

    draft_tokens: int = 3
    accept_length: float = 2.37  # seed 000: accept length 2.37 at MTP3

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError(f"--mtp-draft-tokens must be >= 1, got {self.draft_tokens}")
        if not 1 <= self.accept_length <= self.draft_tokens + 1:
            raise ValueError(
                f"--mtp-accept-length must be in [1, draft tokens + 1 = {self.draft_tokens + 1}], "
                f"got {self.accept_length}"
            )


@dataclass(frozen=True)
class StepCost:
    """One forward pass on one GPU: bytes by kind, FLOPs, and the three roofline times in seconds."""

    weight_bytes: float
    expert_bytes: float
    kv_bytes: float
    flops: float
    memory_s: float
    compute_s: float
    comm_s: float

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def scaled(self, n: int) -> StepCost:
        """The cost of n identical passes."""
        return StepCost(*(v * n for v in asdict(self).values()))


def distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts hit by `tokens` tokens under uniform top-k routing: E(1 - (1 - k/E)^B)."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _a2a_seconds(inp: DecodeInputs, tokens_gpu: float) -> float:
    """Dispatch (FP8 when experts are quantized) + combine (BF16) of one MoE layer, one GPU."""
    ep, gpu = inp.layout.ep, inp.gpu
    if ep == 1 or inp.shape.num_moe_layers == 0:
        return 0.0
    dispatch = 1.0 if inp.precision.experts in ("fp8", "fp4") else 2.0
    payload = tokens_gpu * inp.shape.experts_per_token * inp.shape.hidden_size * (dispatch + 2.0)
    in_domain = min(ep, gpu.nvlink_domain)
    nvlink_bytes = payload * (in_domain - 1) / ep
    network_bytes = payload * (ep - in_domain) / ep
    # Datasheet NVLink figures sum both directions; a GPU sends at half of it.
    seconds = max(nvlink_bytes / (gpu.nvlink_gb_s / 2 * 1e9), network_bytes / (gpu.network_gb_s * 1e9))
    return seconds + 2 * inp.a2a_latency_us * 1e-6


def _attention_core_flops(shape: ModelShape, context: int) -> float:
    """Score and value FLOPs of one token in one layer (MLA in its weight-absorbed decode form)."""
    heads = shape.num_attention_heads
    if shape.attention == "mla":
        return 2 * heads * context * (2 * shape.kv_lora_rank + shape.qk_rope_head_dim)
    return 4 * heads * context * shape.head_dim


def forward_cost(
    inp: DecodeInputs, batch: float, q: int, attn_layers: int, dense_layers: int, moe_layers: int
) -> StepCost:
    """Cost of one pass of `batch` requests x `q` tokens over the given layers plus the lm_head."""
    shape, lay, prec, gpu = inp.shape, inp.layout, inp.precision, inp.gpu
    w = weights_per_gpu(shape, lay, prec)
    per = lambda total, n: total / n if n else 0.0  # noqa: E731 - per-layer share of a component
    weight_bytes = (
        attn_layers * per(w.attention, shape.num_layers)
        + dense_layers * per(w.dense_mlp, shape.num_dense_layers)
        + moe_layers * per(w.shared_experts + w.router, shape.num_moe_layers)
        + (w.lm_head or w.embedding)
    )
    tokens_gpu = batch * q
    hit = distinct_experts(shape.num_experts, shape.experts_per_token, tokens_gpu * lay.instance_gpus)
    expert_bytes = moe_layers * hit * shape.expert_params() * DTYPE_BYTES[prec.experts] / lay.instance_gpus
    kv_layer = kv_bytes_per_token_per_gpu(shape, prec.kv, lay) / shape.num_layers
    kv_bytes = attn_layers * batch * lay.attn_tp * inp.context * kv_layer

    h = shape.hidden_size
    dense_params = (
        attn_layers * shape.attention_params_per_layer()
        + dense_layers * 3 * h * shape.dense_intermediate_size
        + moe_layers * (3 * h * shape.shared_intermediate_size + h * shape.num_experts)
    )
    flops_by_dtype: dict[str, float] = {}
    for dtype, flops in (
        (prec.dense, 2.0 * tokens_gpu * dense_params),
        (prec.embedding, 2.0 * tokens_gpu * shape.vocab_size * h),
        (prec.experts, 2.0 * tokens_gpu * moe_layers * shape.experts_per_token * shape.expert_params()),
        # FP8 KV runs FP8 attention (seed 000); BF16 KV runs BF16 attention.
        (prec.kv, attn_layers * tokens_gpu * _attention_core_flops(shape, inp.context)),
    ):
        flops_by_dtype[dtype] = flops_by_dtype.get(dtype, 0.0) + flops
    peak = lambda d: gpu.peak_tflops(d) * 1e12 * inp.compute_efficiency  # noqa: E731
    hbm_bytes = weight_bytes + expert_bytes + kv_bytes
    return StepCost(
        weight_bytes=weight_bytes,
        expert_bytes=expert_bytes,
        kv_bytes=kv_bytes,
        flops=sum(flops_by_dtype.values()),
        memory_s=hbm_bytes / (gpu.hbm_tb_s * 1e12 * inp.mem_efficiency),
        compute_s=sum(f / peak(d) for d, f in flops_by_dtype.items()),
        comm_s=moe_layers * _a2a_seconds(inp, tokens_gpu),
    )


@dataclass(frozen=True)
class DecodePoint:
    """The roofline answer for one per-GPU batch size."""

    batch_size: int
    step_ms: float
    bound: str  # "memory", "compute" or "comm": the largest of the three times
    tps_per_gpu: float
    tps_per_user: float
    memory_ms: float
    compute_ms: float
    comm_ms: float
    bytes_read_gb: float
    weights_gb: float
    experts_gb: float
    kv_gb: float
    tflop: float
    distinct_experts_per_layer: float  # over the whole EP group, per MoE layer
    fits_kv: bool | None  # None when the KV capacity was not checked


def _step(inp: DecodeInputs, batch: int, mtp: MtpConfig | None) -> StepCost:
    """A full decode step: one pass of the model, or MTP's drafts plus the target's verify pass."""
    s = inp.shape
    if mtp is None:
        return forward_cost(inp, batch, 1, s.num_layers, s.num_dense_layers, s.num_moe_layers)
    verify = forward_cost(inp, batch, mtp.draft_tokens + 1, s.num_layers, s.num_dense_layers, s.num_moe_layers)
    # Each draft token is one pass of the MTP module: one decoder layer (MoE in DeepSeek-V3) + lm_head.
    moe = 1 if s.num_moe_layers else 0
    draft = forward_cost(inp, batch, 1, max(s.num_mtp_layers, 1), 1 - moe, moe)
    return verify + draft.scaled(mtp.draft_tokens)


def decode_point(
    inp: DecodeInputs, batch: int, mtp: MtpConfig | None = None, max_requests: float | None = None
) -> DecodePoint:
    """TPS/GPU and TPS/user of one batch size; time = max(memory, compute) + all-to-all."""
    if batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch}")
    cost = _step(inp, batch, mtp)
    times = {"memory": cost.memory_s, "compute": cost.compute_s, "comm": cost.comm_s}
    overlapped = max(times.values())
    step = overlapped if inp.overlap_comm else max(cost.memory_s, cost.compute_s) + cost.comm_s
    tokens_per_step = mtp.accept_length if mtp else 1.0
    per_user = tokens_per_step / step
    shape = inp.shape
    tokens_group = batch * inp.layout.instance_gpus * (mtp.draft_tokens + 1 if mtp else 1)
    return DecodePoint(
        batch_size=batch,
        step_ms=step * 1e3,
        bound=max(times, key=times.__getitem__),
        tps_per_gpu=batch * per_user,
        tps_per_user=per_user,
        memory_ms=cost.memory_s * 1e3,
        compute_ms=cost.compute_s * 1e3,
        comm_ms=cost.comm_s * 1e3,
        bytes_read_gb=(cost.weight_bytes + cost.expert_bytes + cost.kv_bytes) / 1e9,
        weights_gb=cost.weight_bytes / 1e9,
        experts_gb=cost.expert_bytes / 1e9,
        kv_gb=cost.kv_bytes / 1e9,
        tflop=cost.flops / 1e12,
        distinct_experts_per_layer=distinct_experts(shape.num_experts, shape.experts_per_token, tokens_group),
        fits_kv=None if max_requests is None else batch <= max_requests,
    )


@dataclass(frozen=True)
class DecodeReport:
    """A sweep over batch sizes, without MTP and (when asked) with it."""

    context: int
    max_requests_per_gpu: float | None
    rows: tuple[DecodePoint, ...]
    mtp: MtpConfig | None
    mtp_rows: tuple[DecodePoint, ...]

    def to_dict(self) -> dict:
        """JSON-ready dict; floats rounded for reading."""

        def row(p: DecodePoint) -> dict:
            return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(p).items()}

        return {
            "context_tokens": self.context,
            "max_requests_per_gpu": None if self.max_requests_per_gpu is None
            else round(self.max_requests_per_gpu, 3),
            "rows": [row(p) for p in self.rows],
            "mtp": None if self.mtp is None else asdict(self.mtp),
            "mtp_rows": [row(p) for p in self.mtp_rows],
            "units": UNITS,
        }


def sweep(
    inp: DecodeInputs,
    batch_sizes: list[int],
    mtp: MtpConfig | None = None,
    max_requests: float | None = None,
) -> DecodeReport:
    """Decode points for each batch size, plus the MTP points when `mtp` is given."""
    rows = tuple(decode_point(inp, b, None, max_requests) for b in batch_sizes)
    mtp_rows = tuple(decode_point(inp, b, mtp, max_requests) for b in batch_sizes) if mtp else ()
    return DecodeReport(inp.context, max_requests, rows, mtp, mtp_rows)
