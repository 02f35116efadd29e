"""Greedy generations match transformers token for token under every batching configuration."""

from __future__ import annotations

import random

import pytest

from moeserve import LLM, SamplingParams
from tests.tiny_checkpoints import load_reference, reference_greedy

MAX_NEW = 24
PROMPTS = [
    [1, 17, 42, 99, 7],
    [1, *range(30, 77)],  # 48 tokens: spans several pages and prefill chunks
    [1, 200],
    [1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 9, 250, 251, 252, 253],
    [1, 17, 42, 99, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300, 301, 302],  # shares a prefix with the first
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """Reference continuations per variant, computed once."""
    out = {}
    for variant in ("v2", "v3"):
        model = load_reference(checkpoints[variant])
        out[variant] = [reference_greedy(model, p, MAX_NEW) for p in PROMPTS]
    return out


CONFIGS = {
    "page1-chunked": dict(page_size=1, max_num_batched_tokens=16, chunked_prefill_size=8),
    "page16-chunked": dict(page_size=16, max_num_batched_tokens=20, chunked_prefill_size=12),
    "page1-whole": dict(page_size=1, chunked_prefill_size=0),
    "page16-whole": dict(page_size=16, chunked_prefill_size=0),
    "page16-mha": dict(page_size=16, mha_threshold=0, chunked_prefill_size=12, max_num_batched_tokens=24),
    "page4-absorbed": dict(page_size=4, mha_threshold=10**12, chunked_prefill_size=12),
    "no-prefix-cache": dict(page_size=4, enable_prefix_caching=False, chunked_prefill_size=12),
    "idle-step-cap": dict(page_size=4, max_num_batched_tokens=64, chunked_prefill_size=32, idle_step_tokens=8),
    "no-overlap": dict(page_size=4, chunked_prefill_size=12, disable_overlap_schedule=True),
    "no-mixed-chunk": dict(page_size=4, max_num_batched_tokens=16, chunked_prefill_size=8, enable_mixed_chunk=False),
}


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_matches_reference(checkpoints, references, variant, name):
    llm = LLM(str(checkpoints[variant]), dtype="float32", device="cpu", **CONFIGS[name])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == references[variant]
    assert all(o.finish_reason == "length" for o in outs)
    # Second pass: every prompt is now in the prefix cache (hit path), same tokens.
    again = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == references[variant]
    if llm.engine_config.enable_prefix_caching:
        page = llm.engine_config.page_size
        assert all(o.num_cached_tokens >= (len(p) - 1) // page * page for o, p in zip(again, PROMPTS, strict=True))
        assert any(o.num_cached_tokens > 0 for o in again)
    else:
        assert all(o.num_cached_tokens == 0 for o in again)
    llm.core.kv.check_idle_accounting()


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_requests_joining_and_leaving_mid_flight(checkpoints, references, variant, mixed):
    """Requests arrive at different steps and others are aborted; survivors are unaffected."""
    llm = LLM(
        str(checkpoints[variant]), dtype="float32", device="cpu", page_size=4, chunked_prefill_size=8,
        enable_mixed_chunk=mixed,
    )
    core = llm.core
    rng = random.Random(0)
    arrivals = {0: [0, 1], 3: [2, 100], 7: [3], 12: [101, 4]}  # 100+ are victims, aborted later
    aborts = {5: "100", 15: "101"}
    got: dict[str, list[int]] = {}
    step = 0
    while step < 200 and (step <= max(arrivals) or core.has_unfinished_requests()):
        for i in arrivals.get(step, []):
            prompt = PROMPTS[i] if i < 100 else [1] + [rng.randrange(3, 380) for _ in range(20)]
            core.add_request(str(i), prompt, GREEDY)
        if step in aborts:
            out = core.abort_request(aborts[step])
            assert out is not None and out.finish_reason == "abort"
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i in range(5):
        assert got[str(i)] == references[variant][i], f"request {i} differs"
    assert len(got.get("100", [])) < MAX_NEW and len(got.get("101", [])) < MAX_NEW
    core.kv.check_idle_accounting()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_gpu_batch_with_cuda_graphs_matches_reference(checkpoints, references, variant):
    """Decode through captured graphs (float32 kernels, padded batches) reproduces transformers."""
    llm = LLM(str(checkpoints[variant]), dtype="float32", device="cuda", num_kv_pages=256, cuda_graph_bs="1,2,8",
              chunked_prefill_size=12)  # fmt: skip
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == references[variant]
    llm.core.kv.check_idle_accounting()
