"""Loading: sharded checkpoints, dtypes, dummy weights, MTP layers, and refusing bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.config.model_config import ModelConfig
from moeserve.models.loader import CheckpointError, load_model
from tests.tiny_checkpoints import load_reference, make_checkpoint

CPU = torch.device("cpu")


def test_sharded_checkpoint_with_index(tmp_path, checkpoints):
    ref = load_reference(checkpoints["v2"])
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    config = ModelConfig.from_path(tmp_path / "sharded")
    sharded = load_model(config, tmp_path / "sharded", torch.float32, CPU)
    single = load_model(config, checkpoints["v2"], torch.float32, CPU)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_per_expert_weights_land_in_stacked_tensors(checkpoints):
    path = checkpoints["v3"]
    model = load_model(ModelConfig.from_path(path), path, torch.float32, CPU)
    raw = load_file(str(path / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    inter = experts.intermediate_size
    for e in (0, 5):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(experts.w13_weight[e, :inter], raw[f"{p}.gate_proj.weight"])
        assert torch.equal(experts.w13_weight[e, inter:], raw[f"{p}.up_proj.weight"])
        assert torch.equal(experts.w2_weight[e], raw[f"{p}.down_proj.weight"])
    # The shared MLP (width S * I) is stored as S more experts after the E routed ones.
    e, s = experts.num_routed, experts.num_shared
    p = "model.layers.1.mlp.shared_experts"
    for j in range(s):
        rows = slice(j * inter, (j + 1) * inter)
        assert torch.equal(experts.w13_weight[e + j, :inter], raw[f"{p}.gate_proj.weight"][rows])
        assert torch.equal(experts.w13_weight[e + j, inter:], raw[f"{p}.up_proj.weight"][rows])
        assert torch.equal(experts.w2_weight[e + j], raw[f"{p}.down_proj.weight"][:, rows])
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, raw["model.layers.2.mlp.gate.e_score_correction_bias"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_choice(checkpoints, dtype):
    path = checkpoints["v3"]
    model = load_model(ModelConfig.from_path(path), path, dtype, CPU)
    assert model.lm_head.weight.dtype == dtype
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_dummy_weights_need_no_files(tmp_path, checkpoints):
    config = ModelConfig.from_path(checkpoints["v3"])
    model = load_model(config, None, torch.float32, CPU, load_format="dummy", seed=3)
    w = model.model.layers[1].mlp.experts.w13_weight
    assert 0.015 < w.std().item() < 0.025
    assert torch.all(model.model.norm.weight == 1)
    again = load_model(config, None, torch.float32, CPU, load_format="dummy", seed=3)
    assert torch.equal(w, again.model.layers[1].mlp.experts.w13_weight)


def _add_mtp_layer(path, config: ModelConfig) -> dict:
    """Write a V3 MTP layer (the layer after the last, original names) into a second shard."""
    raw = load_file(str(path / "model.safetensors"))
    last, mtp = config.num_hidden_layers - 1, config.num_hidden_layers
    extra = {k.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): torch.randn_like(v) for k, v in raw.items() if k.startswith(f"model.layers.{last}.")}
    h, v = config.hidden_size, config.vocab_size
    for name, shape in {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h), "embed_tokens.weight": (v, h)}.items():
        extra[f"model.layers.{mtp}.{name}"] = torch.randn(shape)
    save_file(extra, str(path / "mtp.safetensors"))
    shutil.move(path / "model.safetensors", path / "main.safetensors")
    keys = {k: "main.safetensors" for k in raw} | {k: "mtp.safetensors" for k in extra}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keys}))
    return extra


def test_mtp_layer_weights_are_loaded(tmp_path):
    path = make_checkpoint(tmp_path / "v3mtp", "v3")
    config = ModelConfig.from_path(path)
    assert config.num_nextn_predict_layers == 1
    plain = load_model(config, path, torch.float32, CPU)
    assert len(plain.mtp) == 0  # the config promises one, but transformers did not save it
    extra = _add_mtp_layer(path, config)
    model = load_model(config, path, torch.float32, CPU)
    assert len(model.mtp) == 1
    m = config.num_hidden_layers
    assert torch.equal(model.mtp[0].eh_proj.weight, extra[f"model.layers.{m}.eh_proj.weight"])
    assert torch.equal(model.mtp[0].shared_head.head.weight, extra[f"model.layers.{m}.shared_head.head.weight"])
    assert torch.equal(
        model.mtp[0].layer.mlp.experts.w2_weight[3], extra[f"model.layers.{m}.mlp.experts.3.down_proj.weight"]
    )
    assert torch.equal(model.mtp[0].layer.self_attn.kv_b_proj.weight, extra[f"model.layers.{m}.self_attn.kv_b_proj.weight"])


def test_missing_and_unexpected_weights_are_refused(tmp_path, checkpoints):
    path = tmp_path / "broken"
    shutil.copytree(checkpoints["v2"], path)
    raw = load_file(str(path / "model.safetensors"))
    config = ModelConfig.from_path(path)
    missing = {k: v for k, v in raw.items() if "layers.1.mlp.experts.3.up_proj" not in k}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing 1 weights: model.layers.1.mlp.experts.w13_weight"):
        load_model(config, path, torch.float32, CPU)
    save_file({**raw, "model.layers.0.self_attn.surprise.weight": torch.zeros(2)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="surprise"):
        load_model(config, path, torch.float32, CPU)
    bad = dict(raw)
    bad["model.norm.weight"] = torch.zeros(3)
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(config, path, torch.float32, CPU)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(config, path, torch.float32, CPU)
