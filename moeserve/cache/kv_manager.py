"""Which KV pages each request holds: allocation, prefix reuse and release.

Pure bookkeeping (no tensors): the model runner owns the KV storage and reads the page tables
kept here. Invariant, checked by tests: with no request holding pages,
`pool.num_free + radix.cached_pages == pool.num_pages`.
"""

from __future__ import annotations

from moeserve.cache.page_pool import PagePool
from moeserve.cache.radix_cache import RadixCache
from moeserve.core.request import Request


class KVCacheManager:
    """Page tables for requests, backed by a page pool and an optional radix cache."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.radix = RadixCache(page_size, self.pool) if enable_prefix_caching else None

    @property
    def num_pages(self) -> int:
        """Allocatable pages in the pool."""
        return self.pool.num_pages

    @property
    def num_tokens(self) -> int:
        """Token capacity of the pool."""
        return self.pool.num_pages * self.page_size

    @property
    def cached_pages(self) -> int:
        """Pages held by the prefix cache."""
        return self.radix.cached_pages if self.radix else 0

    @property
    def available_pages(self) -> int:
        """Pages a new allocation could get: free ones plus unlocked cached ones."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.pool.num_free + evictable

    @property
    def used_pages(self) -> int:
        """Pages in use by requests or locked by them (the 'KV usage' users watch)."""
        return self.pool.num_pages - self.available_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def match_prefix(self, req: Request) -> int:
        """Give a fresh request the cached pages of its longest prefix; return tokens reused.

        At least one token is left uncomputed so the step that finishes the prompt has logits.
        """
        assert not req.page_table and req.num_computed_tokens == 0
        if self.radix is None:
            return 0
        pages, node = self.radix.match_prefix(req.all_token_ids[: req.num_tokens - 1])
        self.radix.lock(node)
        req.cache_node = node
        req.page_table = list(pages)
        req.num_computed_tokens = len(pages) * self.page_size
        return req.num_computed_tokens

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s pages cover its first `num_tokens` tokens, evicting cache if needed.

        Returns False, changing nothing, when the pool cannot supply them.
        """
        need = self.pages_for(num_tokens) - len(req.page_table)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.radix is not None:
            self.radix.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        req.page_table.extend(pages)
        return True

    def _insert_computed(self, req: Request) -> int:
        """Put `req`'s computed whole pages in the tree; adopt the tree's copies; lock the path.

        Returns how many leading pages are now owned by the tree.
        """
        assert self.radix is not None
        # Placeholders of in-flight samples are not tokens yet: never put them in the tree.
        ps = self.page_size
        n = min(req.num_computed_tokens, req.num_resolved_tokens) // ps
        if n == 0:
            return 0
        # The request's node spells a prefix it already shares with the tree (its page table holds
        # the tree's pages there): insert only what follows, instead of re-walking the whole prefix
        # at every prefill chunk and at release.
        # Computed and resolved counts never fall while the request holds pages (a retraction
        # releases them and clears its node), so the node is never deeper than n pages.
        start = req.cache_node
        first = self.radix.depth(start) // ps if start is not None else 0
        assert first <= n, "a request's cache node is deeper than its computed prefix"
        mine = req.page_table[first:n]
        tree_pages, node = self.radix.insert(req.token_slice(first * ps, n * ps), mine, after=start)
        duplicates = [p for p, theirs in zip(mine, tree_pages, strict=True) if p != theirs]
        # Lock the new path before unlocking the old one so shared ancestors never look evictable.
        self.radix.lock(node)
        if req.cache_node is not None:
            self.radix.unlock(req.cache_node)
        req.cache_node = node
        req.page_table[first:n] = tree_pages
        self.pool.free(duplicates)
        return n

    def cache_prefix(self, req: Request) -> None:
        """Share a running request's computed prefix with later requests (after a prefill chunk)."""
        if self.radix is not None:
            self._insert_computed(req)

    def release(self, req: Request) -> None:
        """Drop all of `req`'s pages: computed whole pages go to the cache, the rest to the pool."""
        if self.radix is not None:
            owned = self._insert_computed(req)
            if req.cache_node is not None:
                self.radix.unlock(req.cache_node)
            self.pool.free(req.page_table[owned:])
        else:
            self.pool.free(req.page_table)
        req.page_table = []
        req.cache_node = None

    def check_idle_accounting(self) -> None:
        """Raise if pages leaked: with no request holding pages, free + cached must be the pool."""
        free, cached = self.pool.num_free, self.cached_pages
        if free + cached != self.pool.num_pages:
            raise AssertionError(f"KV pages leaked: free {free} + cached {cached} != pool {self.pool.num_pages}")
        if self.radix is not None and self.radix.protected_pages:
            raise AssertionError(f"{self.radix.protected_pages} cached pages still locked with no request")
