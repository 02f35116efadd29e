"""YaRN frequencies and scales match transformers' implementation of DeepSeek's YaRN."""

from __future__ import annotations

import pytest
import torch

from moeserve.config.model_config import ModelConfig
from moeserve.layers.rotary import rope_frequencies
from moeserve.ops.reference.rope import rope_cos_sin, rotate


@pytest.mark.parametrize("mscale", [(1.0, 1.0), (0.707, 0.707), (1.0, 0.0)])
@pytest.mark.parametrize("factor", [4.0, 40.0])
def test_yarn_matches_transformers(factor, mscale):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale[0],
        "mscale_all_dim": mscale[1],
        "rope_theta": 10000.0,
    }
    hf = transformers.DeepseekV3Config(rope_parameters=rope, qk_rope_head_dim=64, max_position_embeddings=163840)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = ModelConfig.from_dict({**hf.to_dict(), "model_type": "deepseek_v3"})
    freq, magnitude = rope_frequencies(ours.rope, 64)
    assert torch.allclose(freq, ref_freq.float(), rtol=1e-6)
    if mscale[1]:  # transformers departs from DeepSeek's reference when mscale_all_dim is unset
        assert magnitude == pytest.approx(ref_factor)


def test_rotation_preserves_norm_and_relative_position():
    rope = ModelConfig.from_dict(
        {
            "model_type": "deepseek_v2",
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "kv_lora_rank": 4,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 8,
            "v_head_dim": 4,
        }
    ).rope
    inv_freq, magnitude = rope_frequencies(rope, 8)
    for interleaved in (True, False):
        q, k = torch.randn(1, 8), torch.randn(1, 8)
        dots = []
        for shift in (0, 5):
            qr = rotate(q, *rope_cos_sin(torch.tensor([3 + shift]), inv_freq, magnitude), interleaved)
            kr = rotate(k, *rope_cos_sin(torch.tensor([1 + shift]), inv_freq, magnitude), interleaved)
            dots.append((qr * kr).sum())
            assert torch.allclose(qr.norm(), q.norm(), atol=1e-5)
        assert torch.allclose(dots[0], dots[1], atol=1e-5)  # depends on the distance only
