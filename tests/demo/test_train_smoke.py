"""The training script runs end to end on CPU and writes a checkpoint moeserve loads and matches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeserve import LLM, SamplingParams
from moeserve.eval.evaluate import mtp_logits

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_demo_model.py"


@pytest.fixture(scope="module")
def train_demo():
    """The script's training-time package (scripts/train_demo), imported from the repo."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_demo.export
        import train_demo.model

        yield train_demo
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_smoke_run_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    cmd = [
        sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu", "--out", str(out),
        "--corpus-roots", "stdlib", "--max-train-bytes", "150000", "--tokenizer-bytes", "150000",
        "--eval-bytes", "20000", "--eval-windows", "2", "--seq-len", "64", "--batch-size", "4",
        "--max-steps", "3", "--warmup-steps", "1", "--log-every", "1", "--summary-file", str(tmp_path / "summary.json"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 3" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 4 * 64

    config = json.loads((out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert f"model.layers.{layers}.eh_proj.weight" in keys
    assert f"model.layers.{layers}.mlp.experts.0.gate_proj.weight" in keys
    # The aux-loss-free balancing rule moved the routing bias; it stays float32 as in V3.
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0

    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_pages=32)
    assert len(llm.core.runner.model.mtp) == 1
    text = llm.generate("def f(x):", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(text.outputs[0].token_ids) == 4


def test_training_model_matches_the_engine_after_export(tmp_path, train_demo):
    """Main and MTP logits of the training-time modules equal moeserve's on the saved checkpoint."""
    from train_demo.config import PRESETS
    from train_demo.data import save_tokenizer, train_tokenizer

    torch.manual_seed(0)
    model = train_demo.model.DemoModel(PRESETS["tiny"])
    with torch.no_grad():
        for buf in model.buffers():
            buf.copy_(torch.randn_like(buf) * 0.3)  # routing biases that change expert choice
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # what the bf16 checkpoint will hold
    train_demo.export.save_checkpoint(model, tmp_path)
    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"] * 4, 300), tmp_path)

    ids = torch.randint(3, model.cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, mtp, _ = model.logits(ids)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_pages=32)
    assert (llm.core.score(ids[0].tolist()) - logits[0]).abs().max().item() < 1e-4
    assert (mtp_logits(llm.core, ids[0].tolist()) - mtp[0, :-1]).abs().max().item() < 1e-4
