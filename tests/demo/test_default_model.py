"""The shipped default model loads offline, generates Python, and matches transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve import SamplingParams
from moeserve.assets import DEMO_MODEL_DIR, default_model_path
from moeserve.cli import main
from tests.tiny_checkpoints import load_reference

CODE = '''import os


def read_lines(path):
    """Return the lines of a text file."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


def test_default_model_is_a_small_deepseek_v3_with_mtp():
    path = Path(default_model_path())
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    assert config["num_nextn_predict_layers"] == 1
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert weights <= 15 * 2**20
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file()


def test_missing_default_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("moeserve.assets.DEMO_MODEL_DIR", tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="default model is missing"):
        default_model_path()


def test_default_model_generates_python_offline(no_network, demo_llm):
    out = demo_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=24, temperature=0.0))[0]
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) > 0
    assert "return" in text or "if " in text, text


def test_generate_command_uses_the_default_model(no_network, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "generate",
                "--prompt",
                "import os\n",
                "--max-tokens",
                "8",
                "--device",
                "cpu",
                "--kv-cache-memory-gb",
                "0.05",
            ]
        )
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip()


def test_logits_match_transformers(demo_llm):
    ref = load_reference(DEMO_MODEL_DIR)
    ids = demo_llm.tokenizer.encode(CODE)
    ours = demo_llm.core.score(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 2e-4
    # A trained model, not a random one: it predicts most of this ordinary code.
    accuracy = (ours[:-1].argmax(-1) == torch.tensor(ids[1:])).float().mean().item()
    assert accuracy > 0.5
