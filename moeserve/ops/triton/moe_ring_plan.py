"""The host side of `moe_ring`: tile sizes, which program reads which weights, and what fits.

Work is dealt once per shape as a table of *pieces* per program (see moe_ring.py): runs of one
slot's intermediate rows, and, when the kernel also runs the next layer's first projection
(its "tail"), one run of that projection's rows. Pieces are dealt so every program reads about
the same bytes, since the slowest program sets the kernel's time.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeserve.ops.triton.device import sm_count

COLS = 64  # a gate/up box's columns: 128 bytes of bf16, the TMA swizzle's width
SLICES = 16  # runs of 64 hidden columns a gate/up box holds: a box is [GRAIN, SLICES, 64], 16 KB
GRAIN = 8  # intermediate rows of a gate/up unit; every piece is a multiple
WIDE = 64  # rows of a routed piece; its down box is [WIDE_H, 64] (hidden rows x the piece's columns)
NARROW = 32  # most rows of a shared piece; its down box is [NARROW_H, 32]
WIDE_H, NARROW_H = 128, 256  # both down boxes are 16 KB, as a gate/up box is
MAX_SLOTS = 8  # items (two boxes, 32 KB) the ring holds at most
SHARED_BYTES = 216 * 1024  # the ring, the staged token, the output row and the activations
HEAD = 3  # table columns before a program's pieces: pieces issuable before the router, all, the MoE's
TAIL_SLOT = 127  # a piece code's slot for the tail's rows (codes are int32: slot < 128)


def piece_bytes(rows: int, hidden: int) -> int:
    """Weight bytes (bf16) a piece of `rows` intermediate rows reads: gate, up and its down box columns."""
    return 2 * (2 * rows * hidden + (NARROW if rows <= NARROW else rows) * hidden)


def deal_pieces(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int) -> list[list[tuple[int, int, int]]]:
    """Per program, its pieces (slot, first intermediate row, rows), shared ones first: the routed
    slots' WIDE-row runs to whichever program has the fewest bytes, then the shared slots' rows in
    runs of at most NARROW, one run per program while any program has none, sized to even out the
    bytes (of NARROW rows where no slot is routed)."""
    routed = nslots - fixed_tail
    lists: list[list[tuple[int, int, int]]] = [[] for _ in range(programs)]
    load = [(0, p) for p in range(programs)]
    for slot in range(routed):
        for k0 in range(0, inter, WIDE):
            total, p = heapq.heappop(load)
            lists[p].append((slot, k0, WIDE))
            heapq.heappush(load, (total + piece_bytes(WIDE, hidden), p))
    row_bytes = piece_bytes(WIDE, hidden) // WIDE
    target = (sum(total for total, _ in load) + fixed_tail * inter * row_bytes) / programs
    fresh = list(load)  # programs without a shared piece, by load
    heapq.heapify(fresh)
    for slot in range(routed, nslots):
        k0 = 0
        while k0 < inter:
            heap = fresh if fresh else load
            total, p = heapq.heappop(heap)
            if heap is fresh:
                load.remove((total, p))
                heapq.heapify(load)
            want = round((target - total) / row_bytes / GRAIN) * GRAIN
            # With no routed slot (a dense MLP as one fixed expert) every run is a whole narrow box:
            # H200 b1 decode replay 1.825 -> 1.820 ms against runs sized to even out the bytes,
            # whose narrower runs carry unused box columns. With routed slots (V2-Lite's MoE) that
            # sizing is the faster by 1.2%.
            rows = min(inter - k0, NARROW) if not routed else min(inter - k0, NARROW, max(GRAIN, want))
            lists[p].insert(0, (slot, k0, rows))
            heapq.heappush(load, (total + piece_bytes(rows, hidden), p))
            k0 += rows
    return lists


def deal_tail(lists: list[list[tuple[int, int, int]]], hidden: int, rows: int) -> list[tuple[int, int]]:
    """Per program, its run of the tail projection's rows (first row, rows; rows may be 0): GRAIN-row
    units, one more to each of the programs with the fewest MoE bytes, runs contiguous in program order."""
    programs = len(lists)
    units, extra = divmod(rows // GRAIN, programs)
    loads = [sum(piece_bytes(r, hidden) for _, _, r in pieces) for pieces in lists]
    lightest = set(sorted(range(programs), key=lambda p: (loads[p], p))[:extra])
    runs, k0 = [], 0
    for p in range(programs):
        count = (units + (p in lightest)) * GRAIN
        runs.append((k0, count))
        k0 += count
    return runs


def work_table(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int, tail_rows: int = 0) -> torch.Tensor:
    """int32 [programs, HEAD + most pieces]: per program (pieces issuable before the router, all
    pieces, the MoE's pieces) and its piece codes (slot << 24 | units << 16 | first row), the tail's
    run (slot TAIL_SLOT) last."""
    lists = deal_pieces(programs, hidden, inter, nslots, fixed_tail)
    runs = deal_tail(lists, hidden, tail_rows) if tail_rows else [(0, 0)] * programs
    width = HEAD + max(len(pieces) for pieces in lists) + bool(tail_rows)
    table = []
    for pieces, (k0, rows) in zip(lists, runs, strict=True):
        early = 0
        while early < len(pieces) and pieces[early][0] >= nslots - fixed_tail:
            early += 1
        codes = [(slot << 24) | (n // GRAIN << 16) | first for slot, first, n in pieces]
        if rows:
            codes.append((TAIL_SLOT << 24) | (rows // GRAIN << 16) | k0)
        table.append([early, len(codes), len(pieces), *codes] + [0] * (width - HEAD - len(codes)))
    return torch.tensor(table, dtype=torch.int32)


def x_pad(hidden: int) -> int:
    """Rows of 64 the staged token takes: a power of two, at least the slices the tail's items
    cover (two boxes of SLICES each, past the width too)."""
    return triton.next_power_of_2(max(hidden // COLS, 2 * SLICES * tail_items(hidden)))


def acc_rows(hidden: int) -> int:
    """Rows of WIDE_H the program's float32 output row takes: a power of two."""
    return triton.next_power_of_2(hidden // WIDE_H)


def ring_slots(hidden: int, itemsize: int = 2) -> int:
    """Items the ring holds for this width: as many as fit beside the staged token, the output row
    and the activations, up to MAX_SLOTS."""
    beside = x_pad(hidden) * COLS * itemsize + 4 * (acc_rows(hidden) * WIDE_H + WIDE)
    return min(MAX_SLOTS, (SHARED_BYTES - beside) // (2 * GRAIN * SLICES * COLS * itemsize))


def tail_items(hidden: int) -> int:
    """Ring items a tail unit takes: two [GRAIN, SLICES, 64] boxes of its rows' columns an item (at
    least 1: the kernel divides by it, tail or not)."""
    return max(1, triton.cdiv(hidden // (COLS * SLICES), 2))


def shape_fits(hidden: int, inter: int, nslots: int) -> bool:
    """Whether the kernel tiles these widths: whole pieces and down boxes, and room for the ring."""
    return (
        hidden % (2 * NARROW_H) == 0 and inter % WIDE == 0 and inter < 65536 and nslots < TAIL_SLOT
        and ring_slots(hidden) >= 3
    )


def tail_fits(hidden: int, rows: int, programs: int) -> bool:
    """Whether the tail takes a projection of `rows` outputs: whole units, and at most 255 a program."""
    return (
        rows % GRAIN == 0 and 0 < rows < 65536 and rows // GRAIN // programs < 255 and hidden % (COLS * SLICES) == 0
    )


class Tail(NamedTuple):
    """The next layer's input after the MoE, for the kernel to finish: norm(out + residual) @ weight^T (+ bias)."""

    residual: torch.Tensor  # [1, H], the residual stream before the MoE's output is added
    norm_weight: torch.Tensor  # [H]
    eps: float
    weight: torch.Tensor  # [N, H]
    bias: torch.Tensor | None = None


def ring_usable(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether the ring kernel can run the call: one token, Hopper or newer, contiguous 16-bit
    weights (w13 and w2 of one dtype) that TMA can read."""
    if not hidden.is_cuda or hidden.shape[0] != 1 or torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return False
    experts, two_inter, width = w13.shape
    return (
        hidden.dtype in (torch.bfloat16, torch.float16)
        and w13.is_contiguous() and w2.is_contiguous() and w2.dtype == w13.dtype
        and shape_fits(width, two_inter // 2, topk_ids.shape[1])
        and experts * max(two_inter, width) < 2**31
    )


def tail_usable(hidden: torch.Tensor, w13: torch.Tensor, tail: Tail) -> bool:
    """Whether the ring kernel can also run this next projection (given ring_usable): contiguous weights of
    the experts' dtype, a residual row of it, rows it deals in whole units."""
    rows, width = tail.weight.shape
    return (
        width == w13.shape[2] and tail.weight.dtype == w13.dtype and tail.weight.is_contiguous()
        and tail.residual.shape == (1, width) and tail.residual.dtype == w13.dtype and tail.residual.is_contiguous()
        and tail.norm_weight.shape == (width,) and (tail.bias is None or tail.bias.shape == (rows,))
        and tail_fits(width, rows, sm_count(hidden.device))
    )


def descriptors(w13: torch.Tensor, w2: torch.Tensor, tail: torch.Tensor | None) -> tuple[TensorDescriptor, ...]:
    """w13 [E, 2I, H] as [E * 2I, H / 64, 64] in [GRAIN, SLICES, 64] boxes; w2 [E, H, I] as
    [E * H, I] in [WIDE_H, WIDE] and [NARROW_H, NARROW] boxes; the tail's weight [N, H] as w13
    (w13 again without one)."""
    gl_dtype = gl.bfloat16 if w13.dtype == torch.bfloat16 else gl.float16
    descs = []
    for w, box in ((w13, [GRAIN, SLICES, COLS]), (w2, [WIDE_H, WIDE]), (w2, [NARROW_H, NARROW]),
                   (w13 if tail is None else tail[None], [GRAIN, SLICES, COLS])):
        rows, width = w.shape[0] * w.shape[1], w.shape[2]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
        if len(box) == 3:
            descs.append(TensorDescriptor(w, [rows, width // COLS, COLS], [width, COLS, 1], box, layout))
        else:
            descs.append(TensorDescriptor(w, [rows, width], [width, 1], box, layout))
    return tuple(descs)


_TABLES: dict[tuple, torch.Tensor] = {}
_SYNC: dict[torch.device, torch.Tensor] = {}


def table_and_sync(device: torch.device, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The work table of this shape and the device's counters (programs out, out zeroed, programs
    done, logits in; each launch leaves them at zero), built on first use, which must not be inside a graph capture."""
    key = (device, *shape)
    if key not in _TABLES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_ring's work table must be built before graph capture: run it once eagerly")
        if device not in _SYNC:
            _SYNC[device] = torch.zeros(4, dtype=torch.int32, device=device)
        _TABLES[key] = work_table(*shape).to(device)
    return _TABLES[key], _SYNC[device]
