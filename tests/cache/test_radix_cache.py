"""Radix cache: page-aligned matching, splitting, locking and LRU eviction."""

from __future__ import annotations

import random

import pytest

from moeserve.cache.kv_manager import KVCacheManager
from moeserve.cache.page_pool import PagePool
from moeserve.cache.radix_cache import RadixCache
from moeserve.core.request import Request
from moeserve.core.sampling_params import SamplingParams


def make(page_size: int = 2, pages: int = 16) -> RadixCache:
    return RadixCache(page_size, PagePool(pages))


def test_match_is_page_aligned_and_splits_edges():
    radix = make(page_size=2)
    pages = radix.pool.alloc(3)
    radix.insert([1, 2, 3, 4, 5, 6], pages)
    assert radix.match_prefix([1, 2, 3, 4, 9, 9])[0] == pages[:2]
    assert radix.match_prefix([1, 2, 3])[0] == pages[:1]  # a partial page never matches
    assert radix.match_prefix([1, 9])[0] == []
    # The first lookup split the edge; the whole path still matches.
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 7])[0] == pages
    assert radix.cached_pages == 3


def test_insert_returns_existing_pages_for_shared_prefix():
    radix = make(page_size=1)
    a = radix.pool.alloc(3)
    radix.insert([5, 6, 7], a)
    b = radix.pool.alloc(4)
    tree_pages, _ = radix.insert([5, 6, 8, 9], b)
    assert tree_pages == a[:2] + b[2:]
    assert radix.cached_pages == 5  # b[0], b[1] are duplicates the caller must free


def test_locked_nodes_survive_eviction_and_lru_order():
    radix = make(page_size=1, pages=8)
    old = radix.pool.alloc(2)
    _, old_node = radix.insert([1, 2], old)
    new = radix.pool.alloc(2)
    _, new_node = radix.insert([3, 4], new)
    radix.lock(new_node)
    assert radix.evictable_pages == 2 and radix.protected_pages == 2
    assert radix.evict(1) == 2  # whole oldest leaf
    assert radix.match_prefix([1, 2])[0] == []
    assert radix.evict(10) == 0  # the rest is locked
    radix.unlock(new_node)
    assert radix.evict(10) == 2
    assert radix.pool.num_free == 8 and radix.cached_pages == 0


def test_unlock_more_than_lock_is_caught():
    radix = make()
    _, node = radix.insert([1, 2], radix.pool.alloc(1))
    with pytest.raises(AssertionError):
        radix.unlock(node)


def test_double_free_is_caught():
    pool = PagePool(4)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])


def test_manager_shares_prefix_and_frees_duplicates():
    kv = KVCacheManager(num_pages=20, page_size=2)
    params = SamplingParams(max_tokens=4)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], params)
    b = Request("b", [1, 2, 3, 4, 5, 6, 8], params)
    for r in (a, b):
        assert kv.match_prefix(r) == 0
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    kv.cache_prefix(a)
    kv.cache_prefix(b)  # b computed the same 3 pages in parallel: it must adopt a's
    assert b.page_table[:3] == a.page_table[:3]
    used = set(a.page_table) | set(b.page_table)
    assert kv.pool.num_free == 20 - len(used)
    kv.release(a)
    kv.release(b)
    kv.check_idle_accounting()
    c = Request("c", [1, 2, 3, 4, 5, 6, 9, 9], params)
    assert kv.match_prefix(c) == 6
    kv.release(c)
    kv.check_idle_accounting()


def test_insert_after_a_node_continues_its_path():
    radix = make(page_size=2)
    head = radix.pool.alloc(2)
    _, node = radix.insert([1, 2, 3, 4], head)
    assert radix.depth(node) == 4
    tail = radix.pool.alloc(1)
    tree_pages, last = radix.insert([5, 6], tail, after=node)
    assert tree_pages == tail  # only the continuation's pages come back
    assert radix.depth(last) == 6
    assert radix.match_prefix([1, 2, 3, 4, 5, 6])[0] == head + tail
    # Another path splits `node`'s edge: `node` keeps its tail half and still ends at depth 4.
    other = radix.pool.alloc(2)
    radix.insert([1, 2, 9, 9], other)
    assert node.key == [3, 4] and radix.depth(node) == 4
    mine = radix.pool.alloc(1)
    tree_pages, _ = radix.insert([5, 6], mine, after=node)
    assert tree_pages == tail  # the tree's copy wins; `mine` is the caller's to free
    assert radix.cached_pages == 4


def test_manager_caches_chunked_prefixes_like_whole_ones():
    """Prefill in chunks, each chunk's pages shared at once: every request's table keeps the tree's
    pages for its computed prefix, and no page is lost or owned twice."""
    rng = random.Random(7)
    ps = 2
    kv = KVCacheManager(num_pages=400, page_size=ps)
    params = SamplingParams(max_tokens=4)
    stems = [[rng.randrange(50) for _ in range(rng.choice((4, 6, 10)))] for _ in range(3)]
    live = []
    for i in range(12):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        req = Request(f"r{i}", prompt, params)
        kv.match_prefix(req)
        live.append(req)
    for _ in range(60):
        req = rng.choice(live)
        if req.num_computed_tokens < req.num_tokens:
            chunk = min(rng.randrange(1, 6), req.num_tokens - req.num_computed_tokens)
            assert kv.allocate(req, req.num_computed_tokens + chunk)
            req.num_computed_tokens += chunk
            kv.cache_prefix(req)
            n = req.num_computed_tokens // ps
            assert req.page_table[:n] == kv.radix.match_prefix(req.all_token_ids[: n * ps])[0]
        owned, stack = [], [kv.radix.root]
        while stack:
            node = stack.pop()
            owned.extend(node.pages)
            stack.extend(node.children.values())
        private = [p for r in live for p in r.page_table if p not in set(owned)]
        assert len(owned) == len(set(owned)) == kv.cached_pages
        assert len(private) == len(set(private)), "a private page is held by two requests"
        assert kv.pool.num_free + len(owned) + len(private) == kv.num_pages
    for req in live:
        kv.release(req)
    kv.check_idle_accounting()
