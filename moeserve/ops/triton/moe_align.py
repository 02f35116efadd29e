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

# Chunks of pairs counted in parallel by the three kernels; the offsets kernel reads their
# histograms OFFSET_ELEMENTS counts at a time (more would spill registers at 256 experts). Serial
# steps inside a program are what take the time: at 98K pairs (16K prompt tokens, top-6) 64
# chunks of 1.5K pairs took 72.5 us on H200, 512 chunks take 44.
MAX_CHUNKS = 512
OFFSET_ELEMENTS = 8192
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


@triton.jit(do_not_specialize=["numel", "padded_len", "fill_per_program", "chunk"])
def _count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, numel, padded_len, fill_per_program, chunk,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
):
    """Per-chunk expert histogram; also fills this program's share of `sorted` with padding."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    start = 0
    while start < chunk:  # while, not range: Triton's interpreter cannot range over a runtime int
        offs = pid * chunk + start + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        ids = tl.where(ids < NUM_EXPERTS, ids, -1)
        counts += tl.sum((ids[:, None] == cols[None, :]).to(tl.int32), axis=0)
        start += SUB
    tl.store(counts_ptr + pid * E_PAD + cols, counts)
    start = 0
    while start < fill_per_program:
        offs = pid * fill_per_program + start + tl.arange(0, FILL)
        keep = (offs < (pid + 1) * fill_per_program) & (offs < padded_len)
        tl.store(sorted_ptr + offs, tl.full([FILL], 0, tl.int32) + numel, mask=keep)
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
    mine = pid * SUB + tl.arange(0, SUB)
    expert = tl.load(ids_ptr + mine, mask=mine < numel, other=-1).to(tl.int32)
    ok = (mine < numel) & (expert >= 0) & (expert < NUM_EXPERTS)
    hit = ((expert[:, None] == cols[None, :]) & ok[:, None]).to(tl.int32)
    rank = tl.cumsum(hit, axis=0) - 1 + (starts + before)[None, :]
    tl.store(sorted_ptr + tl.sum(tl.where(hit > 0, rank, 0), axis=1), mine, mask=ok)
    lanes = tl.arange(0, BLOCK_M)
    e = pid
    while e < NUM_EXPERTS:
        # Scalars of this expert's run: its first padding slot and its end.
        pad_from = tl.sum(tl.where(cols == e, starts + counts, 0), axis=0)
        pad_to = tl.sum(tl.where(cols == e, ends, 0), axis=0)
        tl.store(sorted_ptr + pad_from + lanes, tl.zeros_like(lanes) + numel, mask=pad_from + lanes < pad_to)
        e += programs
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, total)
    _label_blocks(block_expert_ptr, ends // BLOCK_M, total // BLOCK_M, max_blocks, pid, programs, BLOCKS)


@triton.jit(do_not_specialize=["num_chunks", "max_blocks"])
def _offsets_kernel(
    counts_ptr, block_expert_ptr, num_padded_ptr, num_chunks, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
):
    """Turn chunk histograms into each chunk's write offset per expert, and label every block."""
    wait_for_prior_grid(PDL)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    r0 = 0
    while r0 < num_chunks:
        ptrs = counts_ptr + (r0 + rows)[:, None] * E_PAD + cols[None, :]
        totals += tl.sum(tl.load(ptrs, mask=(r0 + rows)[:, None] < num_chunks, other=0), axis=0)
        r0 += ROWS
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded
    r0 = 0
    while r0 < num_chunks:
        ptrs = counts_ptr + (r0 + rows)[:, None] * E_PAD + cols[None, :]
        valid = (r0 + rows)[:, None] < num_chunks
        counts = tl.load(ptrs, mask=valid, other=0)
        tl.store(ptrs, cursor[None, :] + tl.cumsum(counts, axis=0) - counts, mask=valid)
        cursor += tl.sum(counts, axis=0)
        r0 += ROWS
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    _label_blocks(block_expert_ptr, ends // BLOCK_M, total // BLOCK_M, max_blocks, 0, 1, BLOCKS)


@triton.jit(do_not_specialize=["numel", "chunk"])
def _scatter_kernel(
    ids_ptr, offsets_ptr, sorted_ptr, numel, chunk,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr,
):
    """Write each pair's flat index at its expert's next free slot, in token order."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    cursor = tl.load(offsets_ptr + pid * E_PAD + cols)
    start = 0
    while start < chunk:  # while, not range: Triton's interpreter cannot range over a runtime int
        offs = pid * chunk + start + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        ids = tl.where(ids < NUM_EXPERTS, ids, -1)
        hit = (ids[:, None] == cols[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1 + cursor[None, :]
        pos = tl.sum(tl.where(hit > 0, rank, 0), axis=1)
        tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=(offs < numel) & (ids >= 0))
        cursor += tl.sum(hit, axis=0)
        start += SUB


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
    sub = max(16, min(128, 4096 // e_pad))
    chunk = triton.cdiv(triton.cdiv(numel, MAX_CHUNKS), sub) * sub
    num_chunks = triton.cdiv(numel, chunk)
    offsets = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    fill = triton.cdiv(capacity, num_chunks)
    warps = 4 if e_pad <= 64 else 8
    _count_kernel[(num_chunks,)](
        ids, offsets, sorted_ids, numel, capacity, fill, chunk,
        NUM_EXPERTS=num_experts, E_PAD=e_pad, SUB=sub, FILL=_FILL, num_warps=warps, **pdl_launch(ids),
    )
    _offsets_kernel[(1,)](
        offsets, block_expert, num_padded, num_chunks, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, ROWS=max(2, OFFSET_ELEMENTS // e_pad), BLOCKS=blocks, num_warps=warps,
        **pdl_launch(ids),
    )
    _scatter_kernel[(num_chunks,)](
        ids, offsets, sorted_ids, numel, chunk, NUM_EXPERTS=num_experts, E_PAD=e_pad, SUB=sub, num_warps=warps,
        **pdl_launch(ids),
    )
    return sorted_ids, block_expert, num_padded
