"""Decode CUDA graphs: batch-size sets (seed 003 arithmetic) and graph-vs-eager parity on GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.executor.cuda_graph import batch_size_set


def max_padding_above(sizes: list[int], floor: int) -> int:
    """Worst padding of a batch just above a captured size, for sizes above `floor`."""
    return max(b - a - 1 for a, b in zip(sizes, sizes[1:], strict=False) if a >= floor)


def test_presets_match_seed_003():
    x2, p64, p8 = (batch_size_set(s, 2048) for s in ("x2", "+64", "+8"))
    assert (len(x2), len(p64), len(p8)) == (23, 49, 259)
    assert (max_padding_above(x2, 128), max_padding_above(p64, 128), max_padding_above(p8, 128)) == (1023, 63, 7)
    assert x2[:6] == [1, 2, 4, 8, 16, 24]


def test_sets_are_cut_at_max_and_include_it():
    assert batch_size_set("x2", 100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]
    assert batch_size_set("3,7,12", 10) == [3, 7, 10]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_graph_replay_matches_eager(v3_checkpoint, kv):
    prompts = [[1, 17, 42, 99, 7], [1, *range(30, 70)], [1, 200], [1, 5, 5, 9, 250, 251]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", kv_cache_dtype=kv, page_size=16, max_model_len=256)
    eager = LLM(str(v3_checkpoint), disable_cuda_graph=True, **common)
    graphs = LLM(str(v3_checkpoint), cuda_graph_bs="1,2,3,8", **common)
    assert graphs.core.describe()["cuda_graphs"] == 4
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want  # batch 4 pads to 8, batch 3 runs exactly, and so on as requests finish
    graphs.core.kv.check_idle_accounting()
    assert torch.cuda.is_available()
