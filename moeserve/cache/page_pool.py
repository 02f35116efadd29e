"""A free list of KV pages with double-free detection."""

from __future__ import annotations


class PagePool:
    """Hands out page ids 1..num_pages; page 0 is a scratch page that is never allocated.

    The scratch page gives padded rows (CUDA-graph padding, dummy slots) somewhere harmless to
    write, so no real request's KV can be clobbered by padding.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a KV pool needs at least one page")
        self.num_pages = num_pages
        # Pop from the end, so low page ids go out first (easier to read in tests and dumps).
        self._free = list(range(num_pages, 0, -1))
        self._allocated = bytearray(num_pages + 1)

    @property
    def num_free(self) -> int:
        """Pages not held by any request or by the prefix cache."""
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (taking nothing) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._allocated[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; freeing a page twice is a bug and raises."""
        for p in pages:
            if not self._allocated[p]:
                raise RuntimeError(f"KV page {p} freed twice")
            self._allocated[p] = 0
            self._free.append(p)
