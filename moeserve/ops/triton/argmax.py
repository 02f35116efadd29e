"""Each row's argmax in one launch: chunk maxima, then the last program of a row merges them.

Greedy decoding takes the argmax of a [rows, vocab] logits tensor every step. PyTorch's reduce
runs it as two passes (chunk maxima, then their argmax), each a launch of a few microseconds
whose programs wait on long serial reads. Here program (chunk, row) finds its chunk's first
maximum and stores it; an atomic per-row counter tells the last of a row's programs to arrive,
which reads the row's chunk results back and keeps the first chunk holding the maximum, so the
first maximum overall, as `torch.argmax` returns it (NaN compares greater than any number there
too). The counters live in device memory and the last program resets its row's, so calls must
not overlap on one device (one compute stream, as the engine runs).

A program scans STEPS blocks of BLOCK entries, keeping each lane's first maximum, and reduces its
lanes once. Few rows want many short chunks (programs enough to fill the GPU), more rows longer
pipelined chunks, and from WHOLE_ROW_MIN_ROWS rows a program a row, which needs no merge. H200,
bf16 [rows, 102,400] in a CUDA graph (benchmarks/kernels/check_argmax.py), one-block chunks of
2,048 against the pick: 64 rows 10.5 -> 8.2 us (seven blocks of 4,096), 128 rows 18.0 -> 13.0,
256 rows 33.3 -> 18.5 (whole rows); at 1-8 rows the one-block chunks stay within 0.3 us of the best.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.ops.reference.argmax import check_out
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

MAX_ROWS = 8192  # counters kept per device; more rows fall back to torch.argmax


@dataclass(frozen=True)
class ArgmaxConfig:
    """Launch shape: each program scans `steps` blocks of `block` entries with `num_warps` warps."""

    block: int
    steps: int = 1
    num_warps: int = 4


LONG_CHUNK_MIN_ROWS = 64
WHOLE_ROW_MIN_ROWS = 192


def pick_config(rows: int, vocab: int) -> ArgmaxConfig:
    """The launch shape for `rows` rows of `vocab` entries (see the module docstring)."""
    if rows < LONG_CHUNK_MIN_ROWS:
        return ArgmaxConfig(block=2048)
    if rows < WHOLE_ROW_MIN_ROWS:
        return ArgmaxConfig(block=4096, steps=7, num_warps=8)
    return ArgmaxConfig(block=4096, steps=triton.cdiv(vocab, 4096), num_warps=8)


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
                   NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (chunk, row): its chunk's first maximum; the row's last program to arrive merges."""
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    wait_for_prior_grid(PDL)
    lanes = tl.arange(0, BLOCK)
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_index = tl.full([BLOCK], 2147483647, tl.int32)
    for step in tl.range(0, STEPS, num_stages=3):
        offs = (chunk * STEPS + step) * BLOCK + lanes
        x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        # Strictly greater keeps a lane's earliest maximum; a lane's first NaN beats any number.
        take = (x > lane_best) | ((x != x) & (lane_best == lane_best))
        lane_best = tl.where(take, x, lane_best)
        lane_index = tl.where(take, offs, lane_index)
    best, first = _nan_first_max(lane_best, lane_index)
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row, first.to(tl.int64))
        return
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


def argmax_rows(
    logits: torch.Tensor, out: torch.Tensor | None = None, config: ArgmaxConfig | None = None
) -> torch.Tensor:
    """int64 [rows]: each row's first maximum, as logits.argmax(dim=-1), into `out` when given."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab] with vocab > 0, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    check_out(out, rows)
    if rows == 0 or rows > MAX_ROWS or logits.stride(1) != 1 or (out is not None and out.stride(0) != 1):
        result = logits.argmax(dim=-1)
        return result if out is None else out.copy_(result)
    config = config or pick_config(rows, vocab)
    chunks = triton.cdiv(vocab, config.block * config.steps)
    pad = max(2, triton.next_power_of_2(chunks))
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    part_val = torch.empty(rows, pad, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, pad, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(chunks, rows)](
        logits, out, part_val, part_idx, _counters(logits.device), vocab, logits.stride(0),
        NUM_CHUNKS=chunks, CHUNKS_PAD=pad, BLOCK=config.block, STEPS=config.steps,
        num_warps=config.num_warps, **pdl_launch(logits),
    )
    return out
