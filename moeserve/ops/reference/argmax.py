"""Reference row argmax: what the Triton one-launch argmax computes."""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the index of each row's first maximum of `logits` [rows, vocab] (NaN counts as the maximum)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab] with vocab > 0, got {tuple(logits.shape)}")
    return logits.argmax(dim=-1)
