"""Start-up warm-ups: prefill over a cached prefix writes only the scratch page, and on GPU the
requests served after start-up (prefix hits alone or beside decodes, prompts of new lengths)
compile no Triton kernel."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_warm_up_leaves_every_allocatable_page_untouched(v3_checkpoint, kv):
    llm = LLM(str(v3_checkpoint), dtype="float32", device="cpu", max_model_len=256, num_kv_pages=32,
              kv_cache_dtype=kv)  # fmt: skip
    runner = llm.core.runner
    cache = runner.kv_cache.buffer
    cache[:, 1:] = torch.randn(cache[:, 1:].shape).to(cache.dtype)
    before = cache.clone()
    runner.warm_up_prefix_attention(256)
    assert torch.equal(cache[:, 1:].view(torch.uint8), before[:, 1:].view(torch.uint8))
    assert not torch.equal(cache[:, 0].view(torch.uint8), before[:, 0].view(torch.uint8))  # it did run


def _finish(core, rid: str, prompt: list[int]) -> int:
    """Serve one request to the end -> how many of its prompt tokens came from the prefix cache."""
    core.add_request(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    request = core.requests[rid]
    while core.has_unfinished_requests():
        core.step()
    assert len(request.output_token_ids) == 3
    return request.num_cached_tokens


@pytest.mark.gpu
def test_requests_after_start_up_compile_nothing(v3_checkpoint):
    from triton import knobs

    llm = LLM(str(v3_checkpoint), dtype="bfloat16", device="cuda", max_model_len=512, num_kv_pages=128,
              cuda_graph_max_bs=8, enable_mixed_chunk=True)  # fmt: skip
    core = llm.core
    prompt = [1, *range(100, 300)]
    compiled: list[str] = []
    saved = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(str(kw.get("repr", kw.get("key")))[:200])
    try:
        _finish(core, "first", prompt)  # a fresh prompt: the no-prefix path
        full_hit = _finish(core, "again", prompt)  # one token recomputed over the cached prefix
        # A hit and 40 new tokens joining three running decodes: a mixed batch whose extend row
        # comes after an odd number of decode rows.
        for i in range(3):
            core.add_request(f"d{i}", [1, *range(20 + i, 90 + i)], SamplingParams(max_tokens=30, ignore_eos=True))
        core.step()
        core.step()
        partial_hit = _finish(core, "longer", [*prompt, *range(10, 50)])
        fresh = _finish(core, "fresh", [1, *range(5, 290)])  # a new length: other MoE configs
    finally:
        knobs.runtime.jit_post_compile_hook = saved
    assert full_hit >= 192 and partial_hit >= 192 and fresh < 16
    assert compiled == []


@pytest.mark.gpu
def test_activation_profile_leaves_out_weight_copies_built_on_first_use(v3_checkpoint):
    """The shared experts' joined down weights persist once built: the profile builds them before
    measuring, so a first profile run (nothing built yet) peaks exactly as a later one."""
    from moeserve.layers.moe import Experts

    llm = LLM(str(v3_checkpoint), dtype="bfloat16", device="cuda", max_model_len=512, num_kv_pages=64,
              disable_cuda_graph=True)  # fmt: skip
    runner = llm.core.runner
    experts = [m for m in runner.model.modules() if isinstance(m, Experts) and m.num_shared]
    assert experts and all(m._shared_down.built for m in experts)
    for m in experts:
        m._shared_down.reset()  # as at start-up, before any prompt-size step built them
    first = runner.profile_activation_peak(1024)
    assert all(m._shared_down.built for m in experts)
    assert runner.profile_activation_peak(1024) == first
