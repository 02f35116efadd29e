"""Random arrivals, aborts and retractions under a small KV pool never leak or corrupt pages."""

from __future__ import annotations

import logging
import random

import pytest

from moeserve.cache.radix_cache import RadixCache
from moeserve.config.engine_config import EngineConfig
from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.engine import EngineCore


def tree_pages(radix: RadixCache) -> list[int]:
    """Every page the prefix tree owns."""
    pages, stack = [], [radix.root]
    while stack:
        node = stack.pop()
        pages.extend(node.pages)
        stack.extend(node.children.values())
    return pages


def check_live_accounting(core: EngineCore) -> None:
    """Each page is exactly one of: free, owned by the tree, or private to one running request."""
    kv = core.kv
    owned = tree_pages(kv.radix) if kv.radix else []
    owned_set = set(owned)
    assert len(owned) == len(owned_set) == kv.cached_pages
    holders = core.scheduler.running + core.scheduler.releasing
    private = [p for r in holders for p in r.page_table if p not in owned_set]
    assert len(private) == len(set(private)), "a private page is shared by two requests"
    assert kv.pool.num_free + len(owned) + len(private) == kv.num_pages
    for r in core.scheduler.waiting:
        assert not r.page_table


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_traffic_keeps_pool_whole(checkpoints, caplog, prefix_caching, page_size):
    rng = random.Random(page_size * 7 + prefix_caching)
    num_pages = 96 // page_size  # 96 tokens: a handful of requests at a time
    engine = EngineConfig(
        model=str(checkpoints["v3"]),
        dtype="float32",
        device="cpu",
        page_size=page_size,
        num_kv_pages=num_pages,
        max_num_batched_tokens=32,
        chunked_prefill_size=16,
        enable_prefix_caching=prefix_caching,
        # Optimistic reservations make admission overcommit, so decode growth forces retractions.
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.0,
    )
    core = EngineCore(engine)
    shared = [1] + [rng.randrange(3, 380) for _ in range(12)]
    finished, aborted, live = set(), set(), set()
    caplog.set_level(logging.WARNING)
    next_id = 0
    for step in range(3000):
        if step < 250 and rng.random() < 0.35:
            base = shared if rng.random() < 0.5 else [1]
            prompt = base + [rng.randrange(3, 380) for _ in range(rng.randrange(1, 24))]
            params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=rng.choice([0.0, 1.0]), seed=step)
            core.add_request(str(next_id), prompt, params)
            live.add(str(next_id))
            next_id += 1
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            core.abort_request(victim)
            live.discard(victim)
            aborted.add(victim)
        for out in core.step():
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
        check_live_accounting(core)
        if step >= 250 and not core.has_unfinished_requests():
            break
    assert not core.has_unfinished_requests()
    assert finished | aborted == {str(i) for i in range(next_id)}
    assert not finished & aborted
    assert core.scheduler.stats.num_retractions > 0, "the pool was meant to be too small"
    assert any("retracted request" in r.message for r in caplog.records)
    core.kv.check_idle_accounting()
