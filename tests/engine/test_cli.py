"""`moeserve generate` prints the completion the offline API produces."""

from __future__ import annotations

import subprocess
import sys

from moeserve import LLM, SamplingParams


def test_generate_command(v3_checkpoint):
    cmd = [
        sys.executable, "-m", "moeserve", "generate",
        "--model", str(v3_checkpoint), "--prompt", "def fibonacci(n):",
        "--max-tokens", "10", "--ignore-eos", "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    llm = LLM(str(v3_checkpoint), dtype="float32", device="cpu")
    expected = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert result.stdout == expected.text + "\n"


def test_generate_command_reports_bad_model_path(tmp_path):
    cmd = [sys.executable, "-m", "moeserve", "generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no config.json" in result.stderr
