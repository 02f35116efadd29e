"""config.json reading: MLA, GQA/MHA, dense and MoE families, parameter counts."""

from __future__ import annotations

import pytest

from moeserve.planner.capacity import kv_bytes_per_token
from moeserve.planner.model_shape import SHAPES_DIR, builtin_shapes, load_model_shape, shape_from_config
from moeserve.planner.weights import active_params_per_token, count_params

LLAMA_8B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "intermediate_size": 14336, "tie_word_embeddings": False,
}


def test_builtin_shapes_are_named_without_a_path():
    assert {"deepseek-v3", "deepseek-v2-lite"} <= set(builtin_shapes())


def test_deepseek_v3_shape_and_published_sizes(v3):
    assert v3.attention == "mla" and v3.num_layers == 61
    assert v3.kv_elements_per_token_layer() == 512 + 64
    assert (v3.num_moe_layers, v3.num_dense_layers, v3.num_mtp_layers) == (58, 3, 1)
    assert count_params(v3).total / 1e9 == pytest.approx(671, rel=0.005)
    assert active_params_per_token(v3) / 1e9 == pytest.approx(37, rel=0.02)


def test_deepseek_v2_lite_published_sizes(v2_lite):
    assert count_params(v2_lite).total / 1e9 == pytest.approx(15.7, rel=0.01)
    assert active_params_per_token(v2_lite) / 1e9 == pytest.approx(2.4, rel=0.03)
    assert v2_lite.q_lora_rank == 0 and v2_lite.num_moe_layers == 26


def test_any_config_path_or_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text((SHAPES_DIR / "deepseek-v2-lite.json").read_text())
    by_folder = load_model_shape(folder)
    by_file = load_model_shape(folder / "config.json")
    assert by_folder == by_file
    assert by_folder.name == "my-model" and by_folder.num_experts == 64


def test_gqa_dense_model_kv_and_params():
    shape = shape_from_config(LLAMA_8B, "llama-8b")
    assert shape.attention == "gqa" and shape.num_experts == 0 and shape.num_moe_layers == 0
    assert shape.head_dim == 128
    assert kv_bytes_per_token(shape, "bf16") == 2 * 8 * 128 * 32 * 2
    assert count_params(shape).total / 1e9 == pytest.approx(8.03, rel=0.01)


def test_mha_model_has_as_many_kv_heads_as_query_heads():
    cfg = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    assert shape_from_config(cfg).num_kv_heads == 32


def test_moe_layer_conventions():
    mixtral = LLAMA_8B | {"num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}
    shape = shape_from_config(mixtral)
    assert shape.num_moe_layers == 32 and shape.moe_intermediate_size == 14336
    assert count_params(shape).total / 1e9 == pytest.approx(46.7, rel=0.01)
    qwen = LLAMA_8B | {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                       "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    assert shape_from_config(qwen).num_moe_layers == 15


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="built-in shape"):
        load_model_shape("no-such-model")
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        shape_from_config({"num_hidden_layers": 2})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_shape(bad)
