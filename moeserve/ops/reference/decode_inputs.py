"""Unpacking one decode step's inputs from a single staged int32 buffer."""

from __future__ import annotations

import torch


def unpack_decode_inputs(
    staged: torch.Tensor,
    rows: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    future_tokens: torch.Tensor | None = None,
) -> None:
    """Copy a staged step into the decode buffers, reading the table width from the buffer.

    `staged` (int32) holds [width, ids[rows], positions[rows], slots[rows], seq_lens[rows],
    table[rows, width]]; the first `rows` entries of each output (and `width` columns of the
    table) are written, int64 outputs widened. The width is read on the device so that a CUDA
    graph captured once serves tables of every width. With `future_tokens`, an id -1 - i is a
    placeholder for entry i of that flat buffer (a token the previous step sampled) and is replaced
    by it, so the graph needs no launches of its own to resolve them.
    """
    width = int(staged[0])
    body = staged[1 : 1 + 4 * rows].view(4, rows)
    for k, out in enumerate((input_ids, positions, slot_mapping, seq_lens)):
        out[:rows].copy_(body[k])
    if future_tokens is not None:
        input_ids[:rows].copy_(resolve_placeholders(input_ids[:rows], future_tokens))
    start = 1 + 4 * rows
    block_table[:rows, :width].copy_(staged[start : start + rows * width].view(rows, width))


def resolve_placeholders(tokens: torch.Tensor, future_tokens: torch.Tensor) -> torch.Tensor:
    """Token ids with each placeholder -1 - i replaced by entry i of the flat future-token buffer."""
    picked = future_tokens.reshape(-1)[(-tokens - 1).clamp(min=0)]
    return torch.where(tokens < 0, picked, tokens)
