"""The demo model's shape and its Hugging Face DeepSeek-V3 config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class DemoConfig:
    """A DeepSeek-V3-shaped model, scaled down (field names follow config.json)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 48
    qk_rope_head_dim: int = 16
    v_head_dim: int = 64
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: no-position part plus rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def with_vocab(self, vocab_size: int) -> DemoConfig:
        """The same shape with another vocabulary size."""
        return replace(self, vocab_size=vocab_size)


PRESETS: dict[str, DemoConfig] = {
    # The shipped model: ~6.9M parameters with the MTP module, ~14 MB in bf16.
    "demo": DemoConfig(),
    # CPU smoke tests: every architectural feature, almost no weights.
    "tiny": DemoConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        max_position_embeddings=128,
    ),
}


def hf_config(cfg: DemoConfig) -> dict[str, Any]:
    """config.json in the original DeepSeek-V3 form (one MTP layer, noaux_tc sigmoid routing)."""
    fields = asdict(cfg)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **{k: v for k, v in fields.items() if k not in ("rope_theta",)},
        "num_key_value_heads": cfg.num_attention_heads,
        "num_nextn_predict_layers": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def generation_config(cfg: DemoConfig) -> dict[str, Any]:
    """generation_config.json: greedy by default, stop at EOS."""
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}
