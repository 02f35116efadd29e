"""Prefill logits match transformers' DeepSeek-V2/V3 on the same checkpoint (float32)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM
from tests.tiny_checkpoints import load_reference

PROMPTS = [[1, 17, 42, 99, 7], [1, *range(3, 160, 3)], [1, 300, 301, 2, 5, 5, 5, 5]]


@pytest.mark.parametrize("variant", ["v2", "v2_greedy", "v3"])
@pytest.mark.parametrize("mha_threshold", [0, 10**12], ids=["mha", "absorbed"])
def test_prefill_logits_match_transformers(checkpoints, variant, mha_threshold):
    ref = load_reference(checkpoints[variant])
    llm = LLM(str(checkpoints[variant]), dtype="float32", device="cpu", mha_threshold=mha_threshold)
    for prompt in PROMPTS:
        ours = llm.core.score(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("mha_threshold", [0, 10**12], ids=["mha", "absorbed"])
def test_gpu_prefill_logits_match_transformers(checkpoints, variant, mha_threshold):
    """The Triton path end to end (float32 kernels) against transformers on the CPU."""
    ref = load_reference(checkpoints[variant])
    llm = LLM(str(checkpoints[variant]), dtype="float32", device="cuda", mha_threshold=mha_threshold,
              num_kv_pages=256, disable_cuda_graph=True)  # fmt: skip
    for prompt in PROMPTS:
        ours = llm.core.score(prompt).cpu()
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max().item() < 1e-3
