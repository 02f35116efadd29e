"""Prefill CUDA graphs: which steps replay one, and graph-vs-eager parity of logits and KV on GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config.engine_config import EngineConfig
from moeserve.core.batch import ScheduledRequest
from moeserve.core.request import Request
from moeserve.executor.prefill_graph import prefill_graph_sizes


def test_sizes_are_sorted_and_cut_at_the_step_budget():
    assert prefill_graph_sizes("1024, 64,256", 512) == [64, 256]
    assert prefill_graph_sizes("", 8192) == []


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="cuda_graph_prefill_tokens"):
        EngineConfig(model="m", cuda_graph_prefill_tokens="64,abc")
    with pytest.raises(ValueError, match="cuda_graph_prefill_tokens"):
        EngineConfig(model="m", cuda_graph_prefill_tokens="0")


def _engine(checkpoint, **kw):
    # A fixed small pool: parallel test workers share the GPU. float32, so that parity is tight.
    return LLM(str(checkpoint), dtype="float32", device="cuda", max_model_len=256, num_kv_pages=64,
               cuda_graph_max_bs=4, cuda_graph_prefill_tokens="16,64", disable_overlap_schedule=True,
               **kw).core  # fmt: skip


def _fresh(core, rid: str, length: int) -> ScheduledRequest:
    g = torch.Generator().manual_seed(hash(rid) % 2**31)
    prompt = torch.randint(1, core.model_config.vocab_size, (length,), generator=g).tolist()
    req = Request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), max_total_tokens=length + 4)
    assert core.kv.allocate(req, length)
    return ScheduledRequest(req, length, output_index=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_padded_prefill_graph_matches_eager(v3_checkpoint, kv):
    """A 40-token prompt replays the 64-token graph: the logits and KV rows eager gives, and the
    padding writes nothing outside the scratch page."""
    core = _engine(v3_checkpoint, kv_cache_dtype=kv)
    runner = core.runner
    assert runner.prefill_graphs is not None and runner.prefill_graphs.sizes == [16, 64]
    item = _fresh(core, "p", 40)
    cache = runner.kv_cache.buffer
    with torch.inference_mode():
        fb = runner.prepare([item])
        assert fb.prefill_graph_size == 64
        fb.extend_use_mha = True  # 40 tokens alone take the absorbed form; the graphs use MHA
        eager = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb)[fb.logits_indices])
        after_eager = cache.clone()
        cache[:, 1:].zero_()  # the graph must write the real rows again by itself
        graph = runner.prefill_graphs.replay(fb, fb.prefill_graph_size).clone()
    err = (graph - eager).norm() / eager.norm()
    assert err < 1e-4, err
    assert graph.argmax(-1).item() == eager.argmax(-1).item()
    # Real pages hold what the eager pass wrote; the rest of the pool was never touched.
    pages = item.request.page_table
    # The real rows match to rounding (a 64-row GEMM may take another kernel than 40 rows, and
    # in FP8 a last-bit difference can move a value to the next of its coarse steps).
    real, again = after_eager[:, pages].float(), cache[:, pages].float()
    assert (again - real).norm() / real.norm() < (2e-2 if kv == "fp8_e4m3" else 1e-4)
    other = cache[:, 1:].clone()
    other[:, [p - 1 for p in pages]] = 0
    assert torch.equal(other.float(), torch.zeros_like(other, dtype=torch.float32))
    core.kv.release(item.request)
    core.kv.check_idle_accounting()


@pytest.mark.gpu
def test_which_steps_replay_a_prefill_graph(v3_checkpoint):
    core = _engine(v3_checkpoint)
    runner = core.runner
    with torch.inference_mode():
        one, two = _fresh(core, "a", 10), _fresh(core, "b", 20)
        assert runner.prepare([one]).prefill_graph_size == 16
        assert runner.prepare([one, two]).prefill_graph_size is None  # two prompts: eager
        big = _fresh(core, "c", 65)
        assert runner.prepare([big]).prefill_graph_size is None  # above the largest graph
        quiet = ScheduledRequest(two.request, 20)  # a chunk that samples nothing
        assert runner.prepare([quiet]).prefill_graph_size is None
        tail = ScheduledRequest(big.request, 5, start=60, output_index=0)  # cached prefix
        assert runner.prepare([tail]).prefill_graph_size is None
    for it in (one, two, big):
        core.kv.release(it.request)
    core.kv.check_idle_accounting()


@pytest.mark.gpu
def test_generation_through_prefill_graphs_matches_eager_prefill(v3_checkpoint):
    """Greedy continuations of prompts that replay prefill graphs match those prefilled eagerly."""
    prompts = [[1, *range(7, 7 + n)] for n in (3, 15, 40, 63)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", max_model_len=256, num_kv_pages=64, cuda_graph_max_bs=4,
              enable_prefix_caching=False)  # fmt: skip
    graphed = LLM(str(v3_checkpoint), cuda_graph_prefill_tokens="16,64", **kw)
    assert graphed.core.runner.prefill_graphs is not None
    plain = LLM(str(v3_checkpoint), cuda_graph_prefill_tokens="", **kw)
    assert plain.core.runner.prefill_graphs is None
    # One prompt at a time, so each prefill step holds one prompt and replays a graph.
    got = [graphed.generate([p], params)[0].token_ids for p in prompts]
    want = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert got == want
    assert graphed.core.scheduler.stats.cuda_graph_padded_tokens > 0
    graphed.core.kv.check_idle_accounting()
