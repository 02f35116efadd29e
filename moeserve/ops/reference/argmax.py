"""Reference row argmax: what the Triton one-launch argmax computes."""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: the index of each row's first maximum of `logits` [rows, vocab] (NaN counts as
    the maximum), written into `out` when given."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab] with vocab > 0, got {tuple(logits.shape)}")
    check_out(out, logits.shape[0])
    result = logits.argmax(dim=-1)
    return result if out is None else out.copy_(result)


def check_out(out: torch.Tensor | None, rows: int) -> None:
    """Raise unless `out` is None or an int64 [rows] tensor."""
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64):
        raise ValueError(f"argmax_rows: out must be int64 [{rows}], got {out.dtype} {tuple(out.shape)}")
