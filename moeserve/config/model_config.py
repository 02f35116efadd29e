"""The model's shape and math, parsed and validated from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A config.json that moeserve cannot run faithfully."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (plain RoPE or YaRN as DeepSeek uses it)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know; models read nothing else."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-position part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: MLA's latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention scale, with YaRN's mscale folded in as DeepSeek does."""
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` uses routed experts rather than a dense MLP."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """KV cache bytes per token over all layers."""
        return self.kv_cache_dim * self.num_hidden_layers * element_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict, refusing anything that would change the math silently."""
        return _parse(raw)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no config.json found at {path}")
        with open(file) as f:
            return cls.from_dict(json.load(f))


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); original checkpoints write
    # `rope_scaling` plus a top-level `rope_theta`. Accept both.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = params.get("factor")
    orig = int(params.get("original_max_position_embeddings", 4096))
    if factor is None:
        factor = raw.get("max_position_embeddings", orig) / orig
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
    )


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_unsupported(raw: dict[str, Any]) -> None:
    _require(
        raw.get("model_type") in SUPPORTED_MODEL_TYPES,
        f"model_type {raw.get('model_type')!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})",
    )
    _require(
        raw.get("quantization_config") is None,
        "quantized checkpoints (quantization_config) are not supported yet; use a bf16 checkpoint",
    )
    _require(raw.get("hidden_act", "silu") == "silu", f"hidden_act {raw.get('hidden_act')!r} is not supported")
    _require(not raw.get("mlp_bias", False), "mlp_bias=true is not supported")
    _require(raw.get("pretraining_tp", 1) in (1, None), "pretraining_tp != 1 is not supported")
    _require(raw.get("sliding_window") is None, "sliding_window attention is not supported")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    _require(
        kv_heads in (None, heads),
        f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; MLA needs them equal",
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _routing_fields(raw: dict[str, Any]) -> dict[str, Any]:
    is_v3 = raw["model_type"] == "deepseek_v3"
    topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
    scoring = raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")
    _require(topk_method in TOPK_METHODS, f"topk_method {topk_method!r} is not supported ({TOPK_METHODS})")
    _require(scoring in SCORING_FUNCS, f"scoring_func {scoring!r} is not supported ({SCORING_FUNCS})")
    _require(
        topk_method != "noaux_tc" or scoring == "sigmoid",
        "topk_method 'noaux_tc' needs scoring_func 'sigmoid'",
    )
    experts = raw.get("n_routed_experts")
    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or n_group)
    if experts is not None:
        _require(experts % n_group == 0, f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
        _require(1 <= topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        k = int(raw.get("num_experts_per_tok") or 1)
        _require(1 <= k <= experts, f"num_experts_per_tok={k} must be in [1, n_routed_experts={experts}]")
        _require(
            topk_method == "greedy" or k <= topk_group * experts // n_group,
            "num_experts_per_tok exceeds the experts in the selected groups",
        )
    norm_default = is_v3
    return {
        "n_routed_experts": experts,
        "n_shared_experts": int(raw.get("n_shared_experts") or 0),
        "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 1),
        "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
        "topk_method": topk_method,
        "scoring_func": scoring,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": bool(raw.get("norm_topk_prob", norm_default)),
        "moe_layer_freq": int(raw.get("moe_layer_freq") or 1),
        "first_k_dense_replace": int(raw.get("first_k_dense_replace") or 0),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
    }


def _parse(raw: dict[str, Any]) -> ModelConfig:
    _check_unsupported(raw)
    try:
        cfg = ModelConfig(
            model_type=raw["model_type"],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            q_lora_rank=raw.get("q_lora_rank"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_parse_rope(raw),
            # DeepSeek-V2 checkpoints always rotate interleaved pairs; V3 makes it a flag.
            rope_interleave=bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            **_routing_fields(raw),
        )
    except KeyError as e:
        raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
    _require(cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
    return cfg
