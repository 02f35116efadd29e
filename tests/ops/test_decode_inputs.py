"""Unpacking a staged decode step: the Triton kernel agrees with the PyTorch reference.

Without CUDA the kernel runs in Triton's CPU interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.ops.reference.decode_inputs import unpack_decode_inputs as reference
from moeserve.ops.triton.decode_inputs import unpack_decode_inputs as kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def staged_step(rng: np.random.Generator, rows: int, width: int) -> tuple[torch.Tensor, list[np.ndarray]]:
    """A packed step of random values (negative ids: placeholders) -> (buffer, its parts)."""
    parts = [rng.integers(-50, 10**6, rows), rng.integers(0, 10**5, rows), rng.integers(0, 10**7, rows),
             rng.integers(1, 10**5, rows), rng.integers(0, 10**4, (rows, width))]  # fmt: skip
    flat = np.concatenate([[width], *parts[:4], parts[4].ravel()]).astype(np.int32)
    return torch.from_numpy(flat).to(DEVICE), parts


def outputs(max_rows: int, max_width: int) -> list[torch.Tensor]:
    """Decode buffers filled with a sentinel, so untouched entries show."""
    longs = [torch.full((max_rows,), -7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
    lens = torch.full((max_rows,), -7, dtype=torch.int32, device=DEVICE)
    table = torch.full((max_rows, max_width), -7, dtype=torch.int32, device=DEVICE)
    return [*longs, lens, table]


@pytest.mark.parametrize("rows,width", [(1, 1), (5, 3), (9, 300)])
def test_kernel_matches_reference_and_touches_only_staged_entries(rows, width):
    staged, parts = staged_step(np.random.default_rng(rows * 1000 + width), rows, width)
    want, got = outputs(12, 320), outputs(12, 320)
    reference(staged, rows, *want)
    kernel(staged, rows, *got)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    ids, positions, slots, lens, table = (t.cpu().numpy() for t in want)
    for value, part in zip((ids, positions, slots, lens), parts, strict=False):
        assert (value[:rows] == part).all() and (value[rows:] == -7).all()
    assert (table[:rows, :width] == parts[4]).all() and (table[rows:] == -7).all() and (table[:, width:] == -7).all()


@pytest.mark.parametrize("rows", [1, 7])
def test_placeholders_are_resolved_from_the_future_tokens(rows):
    rng = np.random.default_rng(rows)
    _, parts = staged_step(rng, rows, 4)
    # 2 parities x 30 rows, as the runner keeps them; placeholders -1 - i pick flat entry i.
    future = torch.from_numpy(rng.integers(0, 10**6, (2, 30))).to(DEVICE)
    ids = parts[0].copy()
    ids[::2] = -1 - rng.integers(0, 60, len(ids[::2]))
    flat = np.concatenate([[4], ids, *parts[1:4], parts[4].ravel()]).astype(np.int32)
    staged = torch.from_numpy(flat).to(DEVICE)
    want, got = outputs(8, 8), outputs(8, 8)
    reference(staged, rows, *want, future_tokens=future)
    kernel(staged, rows, *got, future_tokens=future)
    expected = np.where(ids < 0, future.cpu().numpy().ravel()[np.clip(-ids - 1, 0, None)], ids)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert (want[0][:rows].cpu().numpy() == expected).all() and (want[0][rows:] == -7).all()


def test_kernel_rejects_wrong_dtypes():
    staged, _ = staged_step(np.random.default_rng(0), 2, 2)
    bufs = outputs(4, 4)
    bufs[0] = bufs[0].int()
    with pytest.raises(ValueError, match="unpack_decode_inputs"):
        kernel(staged, 2, *bufs)
