"""Deployment layout (TP / EP / DP attention) and weight / KV precisions."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30

# Bytes per element. FP4 is NVFP4: 4-bit values plus one FP8 scale per 16 elements = 4.5 bits.
# FP8's block scales (one fp32 per 128x128 block) add 0.02% and are left out.
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5625}
KV_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Precision:
    """Storage precision of routed experts, of the other linear layers, and of the KV cache."""

    experts: str = "fp8"
    dense: str = "fp8"
    kv: str = "bf16"
    embedding: str = "bf16"  # embeddings and lm_head stay in BF16 in every public checkpoint

    def __post_init__(self) -> None:
        for field, value in (("experts", self.experts), ("dense", self.dense), ("embedding", self.embedding)):
            if value not in DTYPE_BYTES:
                raise ValueError(f"{field} precision {value!r} not one of {sorted(DTYPE_BYTES)}")
        if self.kv not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.kv!r} not one of {KV_DTYPES}")

    @classmethod
    def for_weights(cls, weight_dtype: str, kv: str, dense: str | None = None) -> Precision:
        """Experts at weight_dtype; other linears at `dense`, by default FP8 when experts are FP4."""
        if dense is None:
            # NVFP4 checkpoints (e.g. DeepSeek-R1-FP4) quantize the experts and keep the rest in FP8/BF16.
            dense = "fp8" if weight_dtype == "fp4" else weight_dtype
        return cls(experts=weight_dtype, dense=dense, kv=kv)


@dataclass(frozen=True)
class Layout:
    """How one model instance is spread over GPUs, and how many instances there are."""

    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    gpus: int = 0  # all GPUs of the deployment; 0 means one instance

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"--tp and --ep must be >= 1, got tp={self.tp} ep={self.ep}")
        size = self.instance_gpus
        if size % self.tp or size % self.ep:
            raise ValueError(f"--tp {self.tp} and --ep {self.ep} must divide each other")
        if self.gpus < 0 or self.gpus % size:
            raise ValueError(f"--gpus {self.gpus} must be a multiple of the instance size {size}")

    @property
    def instance_gpus(self) -> int:
        """GPUs of one model instance: the larger of TP and EP."""
        return max(self.tp, self.ep)

    @property
    def total_gpus(self) -> int:
        """GPUs of the whole deployment."""
        return self.gpus or self.instance_gpus

    @property
    def attn_tp(self) -> int:
        """GPUs sharing one attention computation: 1 under DP attention, else TP."""
        return 1 if self.dp_attention else self.tp

    @property
    def attention_groups(self) -> int:
        """Independent attention groups (each with its own requests and KV) in the deployment."""
        return self.total_gpus // self.attn_tp

    @property
    def moe_tp(self) -> int:
        """How many ways each expert is split when the instance is wider than EP."""
        return self.instance_gpus // self.ep

    def describe(self) -> str:
        """Short human label, e.g. `TP16 EP16 DP-attention, 16 GPUs`."""
        attn = "DP-attention" if self.dp_attention else f"attention TP{self.attn_tp}"
        replicas = self.total_gpus // self.instance_gpus
        scale = f"{self.total_gpus} GPUs" if replicas == 1 else f"{replicas} x {self.instance_gpus} GPUs"
        return f"TP{self.tp} EP{self.ep} {attn}, {scale}"


def auto_dp_attention(flag: bool | None, ep: int) -> bool:
    """DP attention unless told otherwise when EP > 1 (wide-EP decode, as in seed 000's DEP16)."""
    return flag if flag is not None else ep > 1
