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


def test_engine_flags_default_to_engine_config():
    import argparse
    import dataclasses

    from moeserve.config.engine_config import EngineConfig
    from moeserve.engine.generate_cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parsed = engine_config(parser.parse_args(["--model", "m"]))
    assert parsed == EngineConfig(model="m")
    # Every field but the model is reachable from a flag.
    flags = {a.dest for a in parser._actions}
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    inverted = {"enable_prefix_caching": "disable_prefix_caching"}
    missing = {n for n in names if inverted.get(n, n) not in flags}
    assert missing <= {"num_kv_pages", "init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay"}
    changed = engine_config(parser.parse_args(["--model", "m", "--max-num-seqs", "7", "--kv-cache-dtype", "fp8_e4m3"]))
    assert (changed.max_num_seqs, changed.kv_cache_dtype) == (7, "fp8_e4m3")
