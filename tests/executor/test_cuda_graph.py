"""Decode CUDA graphs: batch-size sets (seed 003 arithmetic) and graph-vs-eager parity on GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.core.batch import ScheduledRequest
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


# A fixed small pool: parallel test workers share the GPU, so no test may size its pool from
# free memory.
PROMPTS = [[1, 17, 42, 99, 7], [1, *range(30, 70)], [1, 200], [1, 5, 5, 9, 250, 251]]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_graph_replay_matches_eager_logits(v3_checkpoint, kv):
    """A padded graph replay gives the logits an eager forward of the same decode batch gives."""
    llm = LLM(str(v3_checkpoint), dtype="bfloat16", device="cuda", kv_cache_dtype=kv, max_model_len=256,
              cuda_graph_bs="1,2,3,8", cuda_graph_max_bs=8, disable_overlap_schedule=True,
              num_kv_pages=256)  # fmt: skip
    core = llm.core
    assert core.describe()["cuda_graphs"] == 4
    for i, p in enumerate(PROMPTS):
        core.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    core.step()  # prefill all four; each now has one sampled token to feed
    runner = core.runner
    items = [ScheduledRequest(r, 1) for r in core.scheduler.running]
    for it in items:
        assert core.kv.allocate(it.request, it.start + 1)
        it.output_index = len(it.request.output_token_ids)  # as if sampling again (not committed)
    with torch.inference_mode():
        fb = runner.prepare(items)
        assert fb.graph_size == 8 and fb.num_decodes == 4  # 4 rows padded to the size-8 graph
        graph, greedy = (t.clone() for t in runner.graphs.replay(fb))
        graphs, runner.graphs = runner.graphs, None
        plain = runner.prepare(items)  # the same step unpadded, placeholders resolved on the way
        runner.graphs = graphs
        eager = runner.model.compute_logits(runner.model(plain.input_ids, plain.positions, plain))
    assert greedy.tolist() == graph.argmax(-1).tolist()  # the in-graph two-pass argmax
    err = (graph - eager).norm() / eager.norm()
    assert err < 2e-2, err
    assert (graph.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75
    while core.has_unfinished_requests():
        core.step()
    core.kv.check_idle_accounting()


@pytest.mark.gpu
def test_generation_with_graphs_finishes_and_frees_pages(v3_checkpoint):
    llm = LLM(str(v3_checkpoint), device="cuda", max_model_len=256, cuda_graph_bs="x2", cuda_graph_max_bs=16,
              enable_prefix_caching=False, num_kv_pages=256)  # fmt: skip
    outs = llm.generate(PROMPTS * 3, SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    again = llm.generate(PROMPTS * 3, SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: same tokens
    llm.core.kv.check_idle_accounting()
