"""Tiny random DeepSeek-V2 / V3 checkpoints written by transformers, plus a small tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Mixture-of-experts models route each token to a few experts. Latent attention caches less.",
    "héllo wörld ünïcödé 你好 世界 😀 emoji test — dash",
]

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

VARIANTS: dict[str, dict] = {
    # DeepSeek-V2 with group-limited routing, no q_lora.
    "v2": dict(
        model_type="deepseek_v2",
        q_lora_rank=None,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_parameters=YARN,
    ),
    # DeepSeek-V2-Lite's routing: plain softmax greedy, plain RoPE, q_lora on.
    "v2_greedy": dict(
        model_type="deepseek_v2",
        q_lora_rank=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V3 / R1: sigmoid + noaux_tc with a correction bias, grouped, q_lora on.
    "v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}


def write_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """Train a small byte-level BPE tokenizer and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_checkpoint(path: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `variant` with transformers (per-expert names), plus tokenizer."""
    import transformers

    spec = {**COMMON, **VARIANTS[variant], **overrides}
    model_type = spec.pop("model_type")
    if model_type == "deepseek_v2":
        config = transformers.DeepseekV2Config(**spec)
        cls = transformers.DeepseekV2ForCausalLM
    else:
        config = transformers.DeepseekV3Config(**spec)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def load_reference(path: Path):
    """The same checkpoint loaded by transformers, float32, eager attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache): the plainest possible reference."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
