"""Triton unpacking of a staged decode step: one program per row, the first node of a decode graph.

One host-to-device copy of a packed int32 buffer plus this kernel (inside the graph) replace the
ten small copies a step's separate input tensors cost, each a few microseconds of GPU time that
the next step's graph waited behind. It also swaps placeholders for last step's sampled tokens,
which as PyTorch ops were six launches of about 2 us each at the head of every decode graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_W = 256  # table entries per loop step


@triton.jit
def _unpack_kernel(staged_ptr, ids_ptr, pos_ptr, slots_ptr, lens_ptr, table_ptr, future_ptr, rows, stride_table,
                   MAX_WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, RESOLVE: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    width = tl.load(staged_ptr)
    body = staged_ptr + 1 + r
    token = tl.load(body).to(tl.int64)
    if RESOLVE:
        token = tl.where(token < 0, tl.load(future_ptr + (-1 - token), mask=token < 0, other=0), token)
    tl.store(ids_ptr + r, token)
    tl.store(pos_ptr + r, tl.load(body + rows).to(tl.int64))
    tl.store(slots_ptr + r, tl.load(body + 2 * rows).to(tl.int64))
    tl.store(lens_ptr + r, tl.load(body + 3 * rows))
    src = staged_ptr + 1 + 4 * rows + r.to(tl.int64) * width
    dst = table_ptr + r.to(tl.int64) * stride_table
    # Bounded by the table's capacity (one value per engine), not `width`: the interpreter cannot
    # range over a runtime value, and masked-off steps cost next to nothing.
    for c0 in range(0, MAX_WIDTH, BLOCK_W):
        offs = c0 + tl.arange(0, BLOCK_W)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < width), mask=offs < width)


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
    """See moeserve.ops.reference.decode_inputs."""
    for t, dtype in ((input_ids, torch.int64), (positions, torch.int64), (slot_mapping, torch.int64),
                     (seq_lens, torch.int32), (block_table, torch.int32), (staged, torch.int32)):  # fmt: skip
        if t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"unpack_decode_inputs: expected contiguous {dtype} rows, got {t.dtype}")
    if future_tokens is not None and (future_tokens.dtype != torch.int64 or not future_tokens.is_contiguous()):
        raise ValueError(f"unpack_decode_inputs: future_tokens must be contiguous int64, got {future_tokens.dtype}")
    if rows:
        _unpack_kernel[(rows,)](
            staged, input_ids, positions, slot_mapping, seq_lens, block_table,
            input_ids if future_tokens is None else future_tokens, rows, block_table.stride(0),
            MAX_WIDTH=block_table.shape[1], BLOCK_W=BLOCK_W, RESOLVE=future_tokens is not None, num_warps=1,
        )
