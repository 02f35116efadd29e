"""Scheduling policy: token budget, chunked prefill beside decodes, FCFS, admission, retraction."""

from __future__ import annotations

import logging

import pytest

from moeserve.cache.kv_manager import KVCacheManager
from moeserve.config.engine_config import EngineConfig
from moeserve.core.outputs import SampledToken
from moeserve.core.request import Request, RequestStatus
from moeserve.core.sampling_params import SamplingParams
from moeserve.scheduler import Scheduler


def make(num_pages=64, page_size=4, **kw) -> Scheduler:
    engine = EngineConfig(model="unused", page_size=page_size, **kw)
    return Scheduler(engine, KVCacheManager(num_pages, page_size))


def request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    prompt = [1] + [(7 * i + int(rid)) % 300 + 3 for i in range(prompt_len - 1)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_total_tokens=prompt_len + max_tokens)


def run_step(s: Scheduler, token: int = 5):
    batch = s.schedule()
    sampled = [SampledToken(it.request, token, None) for it in batch.items if it.samples]
    s.update(batch, sampled)
    return batch


def test_long_prompt_is_chunked_while_decodes_continue():
    s = make(max_num_batched_tokens=16, chunked_prefill_size=8, enable_mixed_chunk=True)
    s.add_request(request("1", 5))
    run_step(s)  # prefill of 1
    s.add_request(request("2", 30))
    shapes = []
    for _ in range(4):
        batch = run_step(s)
        shapes.append(sorted((it.request.request_id, it.num_new_tokens) for it in batch.items))
        assert batch.num_tokens <= 16
    assert shapes[0] == [("1", 1), ("2", 8)]
    assert shapes[1] == [("1", 1), ("2", 8)]
    assert shapes[3] == [("1", 1), ("2", 6)]  # 8 + 8 + 8 + 6 = 30
    assert s.running[1].output_token_ids == [5]  # sampled only after the last chunk


def test_without_chunking_a_prompt_runs_whole():
    s = make(max_num_batched_tokens=8, chunked_prefill_size=0)
    s.add_request(request("1", 20))
    batch = run_step(s)
    assert [(it.request.request_id, it.num_new_tokens) for it in batch.items] == [("1", 20)]


def test_fcfs_and_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(request(str(i), 6))
    batch = run_step(s)
    assert [it.request.request_id for it in batch.items] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2", "3"]


def test_admission_reserves_room_for_generation():
    # 10 pages of 4 tokens. Each request needs 2 pages of prompt and up to 4 more of output.
    s = make(num_pages=10, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    for i in range(3):
        s.add_request(request(str(i), 8, max_tokens=16))
    run_step(s)
    assert len(s.running) == 1, "a second request would overcommit the reserved pages"


def test_one_step_admits_a_burst_only_as_far_as_reservations_allow():
    # 20 pages of 4 tokens; each request reserves 2 prompt pages + 4 output pages. The pool could
    # hold all five prompts now, but the reservations of those admitted earlier in the same step
    # leave room for three.
    s = make(num_pages=20, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    for i in range(5):
        s.add_request(request(str(i), 8, max_tokens=16))
    batch = run_step(s)
    assert [it.request.request_id for it in batch.items] == ["0", "1", "2"]
    assert [r.request_id for r in s.waiting] == ["3", "4"]


def test_retraction_requeues_youngest_at_head(caplog):
    caplog.set_level(logging.WARNING)
    s = make(num_pages=6, page_size=2, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    a, b = request("1", 4, max_tokens=8), request("2", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    s.add_request(request("3", 2, max_tokens=1))
    for _ in range(6):
        run_step(s)
    assert s.stats.num_retractions >= 1
    assert b.num_retractions >= 1 and a.num_retractions == 0
    assert "retracted request 2" in caplog.text
    while s.has_unfinished():
        run_step(s)
    assert a.output_token_ids == [5] * 8 and b.output_token_ids == [5] * 8
    s.kv.check_idle_accounting()


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_abort_anywhere_frees_pages(where):
    s = make(num_pages=8)
    s.add_request(request("1", 6))
    if where == "running":
        run_step(s)
    req = s.waiting[0] if where == "waiting" else s.running[0]
    s.finish(req, "abort")
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "abort"
    assert not s.has_unfinished()
    s.kv.check_idle_accounting()


def test_without_mixed_chunks_prompt_steps_run_no_decodes():
    s = make(max_num_batched_tokens=16, chunked_prefill_size=8, enable_mixed_chunk=False)
    s.add_request(request("1", 5))
    run_step(s)  # prefill of 1; it decodes from now on
    s.add_request(request("2", 20))
    shapes = [sorted((it.request.request_id, it.num_new_tokens) for it in run_step(s).items) for _ in range(4)]
    # 2's prompt runs alone, 8 + 8 + 4 tokens (under the chunk size), then both decode together.
    assert shapes == [[("2", 8)], [("2", 8)], [("2", 4)], [("1", 1), ("2", 1)]]
    assert s.running[0].output_token_ids == [5, 5]
    assert s.running[1].output_token_ids == [5, 5]


def test_without_mixed_chunks_decodes_run_when_no_prompt_fits():
    s = make(num_pages=8, page_size=4, max_num_seqs=1, enable_mixed_chunk=False)
    s.add_request(request("1", 5))
    s.add_request(request("2", 5))
    run_step(s)
    # max_num_seqs keeps 2 waiting: the step decodes 1 rather than stalling.
    assert [(it.request.request_id, it.num_new_tokens) for it in run_step(s).items] == [("1", 1)]


def test_overlap_never_launches_a_step_past_the_length_limit():
    """With steps launched one ahead of their results, a request whose last allowed token is
    already in flight is not scheduled again (that step would only sample a token to drop)."""
    s = make()
    s.add_request(request("1", 5, max_tokens=3))
    sample = lambda b: [SampledToken(it.request, 5, None) for it in b.items if it.samples]  # noqa: E731
    in_flight = s.schedule()  # the prefill: token 1
    for _ in range(2):  # launch the next step, then collect the one before it: tokens 2 and 3
        batch = s.schedule()
        assert [it.num_new_tokens for it in batch.items] == [1]
        s.update(in_flight, sample(in_flight))
        in_flight = batch
    req = s.running[0]
    assert len(req.output_token_ids) == 3 and req.remaining_max_tokens == 0
    assert not s.schedule().items  # token 3 is in flight: nothing to launch
    s.update(in_flight, sample(in_flight))
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
    assert req.output_token_ids == [5, 5, 5] and not s.has_unfinished()
    s.kv.check_idle_accounting()
