"""A radix tree over token ids whose edges own KV pages, for prefix reuse across requests.

Keys are whole pages of tokens: a node's key length is a multiple of `page_size` and it owns
one KV page per `page_size` tokens. A node is locked while a running request reads its pages
(`lock_ref` counts the requests whose path passes through it); unlocked leaves are evicted in
least-recently-used order when the pool runs dry.
"""

from __future__ import annotations

import heapq
import itertools

from moeserve.cache.page_pool import PagePool


class RadixNode:
    """An edge of the tree: a run of tokens and the pages that hold their KV."""

    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: RadixNode | None, key: list[int], pages: list[int]) -> None:
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    """Prefix cache: match, insert, lock, and evict page-aligned token prefixes."""

    def __init__(self, page_size: int, pool: PagePool) -> None:
        self.page_size = page_size
        self.pool = pool
        self.root = RadixNode(None, [], [])
        self.root.lock_ref = 1  # never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        self._clock = itertools.count(1)

    @property
    def cached_pages(self) -> int:
        """Pages owned by the tree, locked or not."""
        return self.evictable_pages + self.protected_pages

    def _first_page(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _matched_pages(self, node: RadixNode, tokens: list[int], start: int) -> int:
        """How many whole pages of `node.key` equal `tokens[start:]`."""
        ps, n = self.page_size, 0
        limit = min(len(node.key), len(tokens) - start) // ps
        if node.key[: limit * ps] == tokens[start : start + limit * ps]:
            return limit  # the usual case, one C-level comparison: a finishing request re-walks its prompt
        while n < limit and node.key[n * ps : (n + 1) * ps] == tokens[start + n * ps : start + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; return the new upper half."""
        cut = num_pages * self.page_size
        upper = RadixNode(node.parent, node.key[:cut], node.pages[:num_pages])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        assert node.parent is not None
        node.parent.children[self._first_page(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[self._first_page(node.key, 0)] = node
        return upper

    def depth(self, node: RadixNode) -> int:
        """Tokens on the path from the root to `node`."""
        tokens = 0
        while node is not self.root:
            tokens += len(node.key)
            assert node.parent is not None
            node = node.parent
        return tokens

    def _walk(self, tokens: list[int], start: RadixNode | None = None) -> tuple[list[int], RadixNode, int]:
        """Follow `tokens` down from `start` (the root if None) as far as whole pages match, splitting
        the last edge if needed. Every node on the path from the root counts as used now."""
        node, pos, pages = start or self.root, 0, []
        now = next(self._clock)
        above = node
        while above is not None:
            above.last_access = now
            above = above.parent
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            n = self._matched_pages(child, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += n * self.page_size
            node = child
        return pages, node, pos

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], RadixNode]:
        """Pages of the longest cached page-aligned prefix of `tokens`, and its last node."""
        pages, node, _ = self._walk(tokens)
        return pages, node

    def insert(
        self, tokens: list[int], pages: list[int], after: RadixNode | None = None
    ) -> tuple[list[int], RadixNode]:
        """Add a page-aligned prefix; return the pages the tree holds for it and its last node.

        With `after`, `tokens` continue the path that ends at that node (a prefix already in the
        tree, such as a request's locked node), and the pages returned are those of `tokens` only:
        the walk starts there instead of re-matching the prefix. Where the tree already had some
        of the tokens, its pages win: the caller frees its own copies.
        """
        assert len(tokens) == len(pages) * self.page_size, "insert needs whole pages"
        tree_pages, node, pos = self._walk(tokens, after)
        if pos < len(tokens):
            first_new = pos // self.page_size
            leaf = RadixNode(node, tokens[pos:], pages[first_new:])
            leaf.last_access = node.last_access
            node.children[self._first_page(tokens, pos)] = leaf
            self.evictable_pages += len(leaf.pages)
            tree_pages = tree_pages + leaf.pages
            node = leaf
        return tree_pages, node

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`."""
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix node unlocked more often than locked"
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
                self.evictable_pages += len(node.pages)
            assert node.parent is not None
            node = node.parent

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, oldest first; return pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            self.pool.free(node.pages)
            freed += len(node.pages)
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[self._first_page(node.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry (e.g. after weights change)."""
        self.evict(self.cached_pages)
