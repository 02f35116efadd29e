"""FP8 (e4m3) latent cache: twice the tokens in the same memory, close logits, whole pool."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config.engine_config import EngineConfig
from moeserve.engine.engine import EngineCore

PROMPTS = [[1, 17, 42, 99, 7, 8, 9, 10, 11, 12], [1, *range(30, 90)], [1, 5, 250, 251, 252]]


def test_fp8_doubles_kv_tokens(v3_checkpoint):
    common = dict(model=str(v3_checkpoint), dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.001)
    bf16 = EngineCore(EngineConfig(kv_cache_dtype="bf16", **common))
    fp8 = EngineCore(EngineConfig(kv_cache_dtype="fp8_e4m3", **common))
    assert fp8.runner.kv_cache.buffer.element_size() == 1
    assert fp8.kv.num_tokens >= 2 * bf16.kv.num_tokens - common.get("page_size", 16)


def test_fp8_cache_stays_close_to_full_precision(v3_checkpoint):
    # Absorbed prefill reads the new tokens back from the cache, so quantisation shows in the logits.
    full = LLM(str(v3_checkpoint), dtype="float32", device="cpu", mha_threshold=10**9)
    fp8 = LLM(str(v3_checkpoint), dtype="float32", device="cpu", mha_threshold=10**9, kv_cache_dtype="fp8_e4m3")
    agree = total = 0
    for prompt in PROMPTS:
        a, b = full.core.score(prompt), fp8.core.score(prompt)
        assert 0 < (a - b).abs().max() < 3.0  # it differs (really FP8) but not wildly
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(prompt)
    assert agree / total > 0.8
    outs = fp8.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    fp8.core.kv.check_idle_accounting()


def test_fp8_needs_an_even_page_size():
    """An FP8 cache stores its slots in pairs: an odd page size is refused before anything loads."""
    with pytest.raises(ValueError, match="page_size must be even"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e4m3", page_size=5)
    assert EngineConfig(model="m", kv_cache_dtype="bf16", page_size=5).page_size == 5
