"""Sort (token, slot) pairs by expert, each expert's run padded to a multiple of the GEMM's BLOCK_M.

The result drives the grouped GEMMs: block b of `sorted_ids` holds only pairs routed to
`block_expert[b]` (flat indices token * k + slot; padding holds T * k). It is built on the GPU
with no host synchronisation, and every buffer is sized for the worst case of its shape, so it
can be captured in a CUDA graph. Three ways, by size: one program for the smallest decode
batches; one launch of many programs for larger ones, each counting every pair itself; three
kernels (count, offsets, scatter) for prompts. The order inside an expert's run is token order
(a stable sort), so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

# Pairs a program of the three kernels counts and places (in sub-blocks of CHUNK_SUB), and the
# chunks one program of the offsets kernel scans at a time. Chunk histograms are kept expert-major,
# so that a program per expert scans its column: the scan stays short however many chunks there
# are, and short chunks leave every program few serial steps. Against 512 long chunks and one
# offsets program (H100, graph replay, same output): 131,072 prompt tokens x top-6 of 64 experts
# 190 -> 101 us, 16,384 tokens 39.6 -> 16.2, 131,072 x top-8 of 256 704 -> 261.
CHUNK = 256
CHUNK_SUB = 64
OFFSET_ROWS = 1024
# Up to this many (token, slot) pairs one program sorts them all in registers: there, a chain of
# three dependent launches costs more than the work (H200, CUDA-graph replay: 4.5 against 8.4 us
# for 192 pairs, 5.6 against 8.8 for 512). Its bitonic sort grows as n log^2 n, and the three
# kernels win from about 1000 pairs (11.1 against 9.3 us at 1024, 20 against 11 at 2048).
ONE_PROGRAM_MAX_PAIRS = 512
# Up to this many pairs one launch does it all: each of its programs counts every pair (a
# histogram of a few thousand ids is quick) and places its own SUB of them, so there is no chain
# of dependent launches.
ONE_LAUNCH_MAX_PAIRS = 8192
ONE_LAUNCH_SUB = 64
_FILL = 1024


@triton.jit(do_not_specialize=["numel", "padded_len", "fill_per_program", "num_chunks"])
def _count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, numel, padded_len, fill_per_program, num_chunks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
):
    """Chunk histogram, stored as column `pid` of counts [E_PAD, num_chunks]; also fills this
    program's share of `sorted` with padding."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (raw >= 0) & (raw < NUM_EXPERTS)
    counts = tl.histogram(tl.where(valid, raw, 0), E_PAD, mask=valid)
    tl.store(counts_ptr + tl.arange(0, E_PAD) * num_chunks + pid, counts)
    start = 0
    while start < fill_per_program:  # while, not range: Triton's interpreter cannot range over a runtime int
        slots = pid * fill_per_program + start + tl.arange(0, FILL)
        keep = (slots < (pid + 1) * fill_per_program) & (slots < padded_len)
        tl.store(sorted_ptr + slots, tl.full([FILL], 0, tl.int32) + numel, mask=keep)
        start += FILL


@triton.jit
def _label_blocks(block_expert_ptr, block_ends, num_blocks, max_blocks, first, step, BLOCKS: tl.constexpr):
    """Block b belongs to the first expert whose padded run ends after it (empty runs never do).

    Labels blocks first*BLOCKS.. in strides of step*BLOCKS, so several programs can share the work.
    """
    start = first * BLOCKS
    while start < max_blocks:
        b = start + tl.arange(0, BLOCKS)
        expert = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        expert = tl.where(b < num_blocks, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < max_blocks)
        start += step * BLOCKS


@triton.jit
def _place(ids_ptr, sorted_ptr, offs, numel, cursor, cols, NUM_EXPERTS: tl.constexpr):
    """Write pairs `offs` at their expert's cursor plus their rank among its pairs here -> the cursor past them."""
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    ok = (offs < numel) & (ids >= 0) & (ids < NUM_EXPERTS)
    hit = ((ids[:, None] == cols[None, :]) & ok[:, None]).to(tl.int32)
    rank = tl.cumsum(hit, axis=0) - 1 + cursor[None, :]
    tl.store(sorted_ptr + tl.sum(tl.where(hit > 0, rank, 0), axis=1), offs.to(tl.int32), mask=ok)
    return cursor + tl.sum(hit, axis=0)


@triton.jit
def _finish(padded, ends, block_expert_ptr, num_padded_ptr, max_blocks, pid, programs, BLOCK_M: tl.constexpr,
            BLOCKS: tl.constexpr):
    """Program 0 stores the padded total; every program labels its share of the blocks."""
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, total)
    _label_blocks(block_expert_ptr, ends // BLOCK_M, total // BLOCK_M, max_blocks, pid, programs, BLOCKS)


@triton.jit(do_not_specialize=["numel", "max_blocks"])
def _align_one_program_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, numel, max_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCKS: tl.constexpr, PDL: tl.constexpr,
):
    """The whole align in one program, for decode-size batches: all pairs fit in its registers."""
    wait_for_prior_grid(PDL)
    offs = tl.arange(0, N_PAD)
    raw = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (raw >= 0) & (raw < NUM_EXPERTS)
    ids = tl.where(valid, raw, 0)
    counts = tl.histogram(ids, E_PAD, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # Sorting (expert, index) keys groups the pairs by expert in token order (stable); the p-th
    # sorted pair then goes to p plus its expert's padding so far.
    keys = tl.sort(tl.where(valid, ids * N_PAD + offs, E_PAD * N_PAD))
    sorted_ok = keys < E_PAD * N_PAD
    expert = tl.where(sorted_ok, keys // N_PAD, 0)
    shift = starts - (tl.cumsum(counts, axis=0) - counts)
    dest = offs + tl.gather(shift, expert, 0)
    tl.store(sorted_ptr + dest, keys % N_PAD, mask=sorted_ok)
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, tl.zeros_like(pad) + numel, mask=pad < ends[:, None])
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    _label_blocks(block_expert_ptr, ends // BLOCK_M, total // BLOCK_M, max_blocks, 0, 1, BLOCKS)


@triton.jit(do_not_specialize=["numel", "max_blocks"])
def _align_one_launch_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, numel, max_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    SUB: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
):
    """Program p places pairs p*SUB .. (p+1)*SUB - 1, pads experts p, p + P, ... and labels a
    share of the blocks; each learns the run offsets by counting all pairs itself."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, N_PAD)
    raw = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (raw >= 0) & (raw < NUM_EXPERTS)
    ids = tl.where(valid, raw, 0)
    counts = tl.histogram(ids, E_PAD, mask=valid)
    before = tl.histogram(ids, E_PAD, mask=valid & (offs < pid * SUB))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    cols = tl.arange(0, E_PAD)
    _place(ids_ptr, sorted_ptr, pid * SUB + tl.arange(0, SUB), numel, starts + before, cols, NUM_EXPERTS)
    lanes = tl.arange(0, BLOCK_M)
    e = pid
    while e < NUM_EXPERTS:
        # Scalars of this expert's run: its first padding slot and its end.
        pad_from = tl.sum(tl.where(cols == e, starts + counts, 0), axis=0)
        pad_to = tl.sum(tl.where(cols == e, ends, 0), axis=0)
        tl.store(sorted_ptr + pad_from + lanes, tl.zeros_like(lanes) + numel, mask=pad_from + lanes < pad_to)
        e += programs
    _finish(padded, ends, block_expert_ptr, num_padded_ptr, max_blocks, pid, programs, BLOCK_M, BLOCKS)


@triton.jit(do_not_specialize=["num_chunks"])
def _offsets_kernel(counts_ptr, totals_ptr, num_chunks, ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program e: expert e's count in each chunk -> the pairs of e in the chunks before it, and e's total."""
    wait_for_prior_grid(PDL)
    column = counts_ptr + tl.program_id(0) * num_chunks
    before = 0
    r0 = 0
    while r0 < num_chunks:
        rows = r0 + tl.arange(0, ROWS)
        counts = tl.load(column + rows, mask=rows < num_chunks, other=0)
        tl.store(column + rows, before + tl.cumsum(counts, axis=0) - counts, mask=rows < num_chunks)
        before += tl.sum(counts, axis=0)
        r0 += ROWS
    tl.store(totals_ptr + tl.program_id(0), before)


@triton.jit(do_not_specialize=["numel", "num_chunks", "max_blocks"])
def _scatter_kernel(
    ids_ptr, counts_ptr, totals_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, numel, num_chunks, max_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    SUB: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
):
    """Write each pair of chunk `pid` at its expert's run start plus the pairs of that expert
    before it (earlier chunks, then earlier in this chunk); label a share of the blocks."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    padded = (tl.load(totals_ptr + cols) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded + tl.load(counts_ptr + cols * num_chunks + pid)
    for start in tl.static_range(0, CHUNK, SUB):
        cursor = _place(ids_ptr, sorted_ptr, pid * CHUNK + start + tl.arange(0, SUB), numel, cursor, cols, NUM_EXPERTS)
    _finish(padded, ends, block_expert_ptr, num_padded_ptr, max_blocks, pid, tl.num_programs(0), BLOCK_M, BLOCKS)


def padded_capacity(numel: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of the padded sorted buffer: at most min(numel, E) experts get padding."""
    capacity = numel + min(numel, num_experts) * (block_m - 1)
    return triton.cdiv(capacity, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (sorted_ids int32 [capacity], block_expert int32 [capacity / BLOCK_M], num_padded int32 [1]).

    Unused blocks have expert -1. Ids must lie in [0, num_experts); others are dropped.
    """
    numel = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    e_pad = triton.next_power_of_2(num_experts)
    capacity = padded_capacity(numel, num_experts, block_m)
    max_blocks = capacity // block_m
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    blocks = max(16, 4096 // e_pad)
    if numel <= ONE_PROGRAM_MAX_PAIRS:
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, block_expert, num_padded, numel, max_blocks,
            NUM_EXPERTS=num_experts, E_PAD=e_pad, N_PAD=triton.next_power_of_2(max(numel, 1)), BLOCK_M=block_m,
            BLOCKS=blocks, num_warps=4, **pdl_launch(ids),
        )
        return sorted_ids, block_expert, num_padded
    if numel <= ONE_LAUNCH_MAX_PAIRS:
        _align_one_launch_kernel[(triton.cdiv(numel, ONE_LAUNCH_SUB),)](
            ids, sorted_ids, block_expert, num_padded, numel, max_blocks,
            NUM_EXPERTS=num_experts, E_PAD=e_pad, N_PAD=triton.next_power_of_2(numel), BLOCK_M=block_m,
            SUB=ONE_LAUNCH_SUB, BLOCKS=blocks, num_warps=4, **pdl_launch(ids),
        )
        return sorted_ids, block_expert, num_padded
    sub = min(CHUNK_SUB, CHUNK)
    assert CHUNK % sub == 0, "the scatter places a chunk in whole sub-blocks"
    num_chunks = triton.cdiv(numel, CHUNK)
    counts = torch.empty(e_pad, num_chunks, dtype=torch.int32, device=device)
    totals = torch.empty(e_pad, dtype=torch.int32, device=device)
    fill = triton.cdiv(capacity, num_chunks)
    _count_kernel[(num_chunks,)](
        ids, counts, sorted_ids, numel, capacity, fill, num_chunks,
        NUM_EXPERTS=num_experts, E_PAD=e_pad, CHUNK=CHUNK, FILL=_FILL, num_warps=4, **pdl_launch(ids),
    )
    _offsets_kernel[(e_pad,)](counts, totals, num_chunks, ROWS=OFFSET_ROWS, num_warps=4, **pdl_launch(ids))
    _scatter_kernel[(num_chunks,)](
        ids, counts, totals, sorted_ids, block_expert, num_padded, numel, num_chunks, max_blocks,
        NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=CHUNK, SUB=sub,
        BLOCKS=blocks, num_warps=4 if e_pad <= 64 else 8, **pdl_launch(ids),
    )
    return sorted_ids, block_expert, num_padded
