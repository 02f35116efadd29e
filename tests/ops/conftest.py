"""Fixtures the op tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """New tensors start as NaN (floats) or garbage (ints), so elements a kernel skips fail the check."""
    real_empty, real_like, real_new = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.element_size() > 1:
            return t.fill_(float("nan"))
        return t if t.is_floating_point() else t.fill_(-123456)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new(self, *a, **k)))
