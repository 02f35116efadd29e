"""Each row's argmax in one launch: chunk maxima, then the last program of a row merges them.

Greedy decoding takes the argmax of a [rows, vocab] logits tensor every step. PyTorch's reduce
runs it as two passes (chunk maxima, then their argmax), each a launch of a few microseconds
whose programs wait on long serial reads. Here program (chunk, row) finds its chunk's first
maximum and stores it; an atomic per-row counter tells the last of a row's programs to arrive,
which reads the row's chunk results back and keeps the first chunk holding the maximum, so the
first maximum overall, as `torch.argmax` returns it (NaN compares greater than any number there
too). The counters live in device memory and the last program resets its row's, so calls must
not overlap on one device (one compute stream, as the engine runs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeserve.ops.reference.argmax import check_out
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

MAX_ROWS = 8192  # counters kept per device; more rows fall back to torch.argmax
BLOCK = 2048  # vocabulary entries a program scans


@functools.lru_cache(maxsize=16)
def _counters(device: torch.device) -> torch.Tensor:
    """This device's per-row arrival counters (zero between calls: each row's last program resets its own)."""
    return torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)


@triton.jit
def _nan_first_max(values, indices):
    """(value, index) of the first maximum, NaN above every number, as torch.argmax orders them."""
    is_nan = values != values
    has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    hit = tl.where(has_nan, is_nan, values == best)
    first = tl.min(tl.where(hit, indices, 2147483647), axis=0)
    return tl.where(has_nan, float("nan"), best), first


@triton.jit(do_not_specialize=["vocab", "stride_row"])
def _argmax_kernel(logits_ptr, out_ptr, part_val_ptr, part_idx_ptr, counter_ptr, vocab, stride_row,
                   NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (chunk, row): its chunk's first maximum; the row's last program to arrive merges."""
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    wait_for_prior_grid(PDL)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    best, first = _nan_first_max(x, offs)
    tl.store(part_val_ptr + row * CHUNKS_PAD + chunk, best)
    tl.store(part_idx_ptr + row * CHUNKS_PAD + chunk, first)
    # The stores above are ordered before the counter's release; the last arrival acquires them.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_CHUNKS - 1:
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")
        c = tl.arange(0, CHUNKS_PAD)
        ok = c < NUM_CHUNKS
        # Other programs' stores: read from L2 (".cg"), never from this SM's incoherent L1.
        vals = tl.load(part_val_ptr + row * CHUNKS_PAD + c, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + row * CHUNKS_PAD + c, mask=ok, other=2147483647, cache_modifier=".cg")
        # Chunks are in vocabulary order, so the first chunk's first maximum is the row's.
        _, winner = _nan_first_max(vals, idx)
        tl.store(out_ptr + row, winner.to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """int64 [rows]: each row's first maximum, as logits.argmax(dim=-1), into `out` when given."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab] with vocab > 0, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    check_out(out, rows)
    if rows == 0 or rows > MAX_ROWS or logits.stride(1) != 1 or (out is not None and out.stride(0) != 1):
        result = logits.argmax(dim=-1)
        return result if out is None else out.copy_(result)
    chunks = triton.cdiv(vocab, block)
    pad = max(2, triton.next_power_of_2(chunks))
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    part_val = torch.empty(rows, pad, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, pad, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(chunks, rows)](
        logits, out, part_val, part_idx, _counters(logits.device), vocab, logits.stride(0),
        NUM_CHUNKS=chunks, CHUNKS_PAD=pad, BLOCK=block, num_warps=4, **pdl_launch(logits),
    )
    return out
