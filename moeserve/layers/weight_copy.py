"""A weight in another layout that a kernel reads, kept beside the weight it comes from."""

from __future__ import annotations

from collections.abc import Callable

import torch


class WeightCopy:
    """A tensor derived from one weight (or None where no kernel wants one), rebuilt whenever the
    weight is written, and never built inside a CUDA graph capture: a graph would go on reading the
    copy it captured, so copies are built before (build_weight_copies, or the eager run before it)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.value: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    @property
    def built(self) -> bool:
        """Whether a copy (or the decision that none is wanted) is held."""
        return self._key is not None

    def reset(self) -> None:
        """Forget the copy, as before any was built."""
        self.value, self._key = None, None

    def get(self, weight: torch.Tensor, derive: Callable[[torch.Tensor], torch.Tensor | None]) -> torch.Tensor | None:
        """The copy of `weight`, derived now if the weight was written since (or never derived)."""
        key = (weight.data_ptr(), weight._version)
        if self._key != key:
            if weight.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.what} must be built before graph capture")
            self.value, self._key = derive(weight), key
        return self.value
