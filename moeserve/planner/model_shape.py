"""Model shapes read from a Hugging Face config.json: MLA (DeepSeek) or GQA/MHA, dense or MoE."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHAPES_DIR = Path(__file__).parent / "shapes"


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs from a config.json; parameter counts are derived from them."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dense_intermediate_size: int  # MLP width of the layers that are not MoE
    attention: str  # "mla" or "gqa" (MHA is GQA with as many KV heads as query heads)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0  # routed experts; 0 for a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # all shared experts of one MoE layer together
    num_moe_layers: int = 0
    num_mtp_layers: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ("mla", "gqa"):
            raise ValueError(f"attention must be 'mla' or 'gqa', got {self.attention!r}")
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"{self.name}: num_moe_layers {self.num_moe_layers} outside 0..{self.num_layers}")
        if self.num_moe_layers and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..num_experts ({self.num_experts})")

    @property
    def num_dense_layers(self) -> int:
        """Layers whose MLP is a plain dense MLP."""
        return self.num_layers - self.num_moe_layers

    def kv_elements_per_token_layer(self) -> int:
        """Cached elements per token per layer: the MLA latent + rope key, or K and V of every KV head."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def attention_params_per_layer(self) -> int:
        """Projection weights of one attention layer (norms left out: they are tiny)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.attention == "gqa":
            return h * heads * self.head_dim * 2 + 2 * h * self.num_kv_heads * self.head_dim
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        out = heads * self.v_head_dim * h
        return q + kv_a + kv_b + out

    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size


def _moe_layer_count(cfg: dict, num_layers: int) -> int:
    """Which layers are MoE, following each family's config convention."""
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:  # DeepSeek-V2/V3
        first = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return sum(1 for i in range(first, num_layers) if i % freq == 0)
    if "decoder_sparse_step" in cfg:  # Qwen2-MoE / Qwen3-MoE
        step = int(cfg["decoder_sparse_step"] or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return num_layers  # Mixtral-style: every layer is MoE


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    """Build a ModelShape from a parsed config.json."""
    try:
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"config {name!r} lacks {exc.args[0]!r}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    mla = bool(cfg.get("kv_lora_rank"))
    if mla:  # the query/key head width; MLA caches no per-head K or V
        head_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
    num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe_layers = _moe_layer_count(cfg, layers) if num_experts else 0
    moe_inter = int(cfg.get("moe_intermediate_size") or 0)
    dense_inter = int(cfg.get("intermediate_size") or 0)
    if num_experts and not moe_inter:  # Mixtral names the expert width intermediate_size
        moe_inter = dense_inter
    shared = int(cfg.get("n_shared_experts") or 0) * moe_inter
    shared = shared or int(cfg.get("shared_expert_intermediate_size") or 0)
    return ModelShape(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=1 if mla else kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        dense_intermediate_size=dense_inter,
        attention="mla" if mla else "gqa",
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        num_experts=num_experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=shared,
        num_moe_layers=moe_layers,
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def builtin_shapes() -> list[str]:
    """Names of the shapes shipped with the planner."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_model_shape(name_or_path: str | Path) -> ModelShape:
    """A built-in shape by name (`deepseek-v3`, `deepseek-v2-lite`), a config.json, or a folder holding one."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        builtin = SHAPES_DIR / f"{name_or_path}.json"
        if not builtin.is_file():
            raise ValueError(
                f"--model-config {str(name_or_path)!r} is neither a file nor a built-in shape "
                f"({', '.join(builtin_shapes())})"
            )
        path = builtin
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object")
    name = path.stem if path.name != "config.json" else path.parent.name or "model"
    return shape_from_config(cfg, name=name)
