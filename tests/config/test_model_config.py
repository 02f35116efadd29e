"""config.json parsing: public shapes, both rope spellings, derived quantities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig, yarn_mscale

SHAPES = Path(__file__).resolve().parents[2] / "moeserve" / "planner" / "shapes"


def test_deepseek_v3_shape():
    c = ModelConfig.from_path(SHAPES / "deepseek-v3.json")
    assert (c.topk_method, c.scoring_func, c.n_group, c.topk_group) == ("noaux_tc", "sigmoid", 8, 4)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5 and c.num_nextn_predict_layers == 1
    assert c.kv_bytes_per_token(1) == 35_136  # seed 000: FP8 latent cache of R1
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert c.rope.type == "yarn" and c.rope.factor == 40
    m = yarn_mscale(40, 1.0)
    assert c.softmax_scale == pytest.approx(192**-0.5 * m * m)


def test_deepseek_v2_lite_shape():
    c = ModelConfig.from_path(SHAPES / "deepseek-v2-lite.json")
    assert c.q_lora_rank is None and c.topk_method == "greedy" and c.scoring_func == "softmax"
    assert not c.norm_topk_prob and c.n_routed_experts == 64 and c.num_experts_per_tok == 6
    assert c.kv_cache_dim == 576
    assert c.rope.mscale == pytest.approx(0.707) and c.rope.theta == 10000


def test_rope_scaling_and_rope_parameters_spellings_agree():
    raw = json.loads((SHAPES / "deepseek-v3.json").read_text())
    new_style = dict(raw)
    new_style["rope_parameters"] = {**new_style.pop("rope_scaling"), "rope_theta": new_style.pop("rope_theta")}
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(new_style)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(model="m", page_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="m", dtype="int8")
    assert not EngineConfig(model="m", chunked_prefill_size=0).chunked_prefill
