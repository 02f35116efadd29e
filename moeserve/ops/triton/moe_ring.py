"""One token's MoE as one persistent kernel (Gluon): expert weights stream through a TMA ring, and
no program waits for another's results.

At one token the MoE reads about 138 MB of expert weights (V2-Lite: 6 routed + 2 shared experts)
and does almost no math, so its time is how long HBM stays busy. Two launches (gate/up, then down)
drain the memory pipeline between them; a first persistent version (bd24d38) that dealt the down
rows out separately waited about 10 us a layer for the slowest program's gate/up results.

Here the down projection is split over the intermediate dimension instead (split-K): a program
owns a few *pieces*, each a run of intermediate rows of one slot's expert. For a piece it computes
those rows' gate and up dots against the token (SiLU-and-mul, the routing weight), then multiplies
the same columns of the expert's down weights by them, adding the result into its own float32
copy of the output row in shared memory. Each program then adds its row into the output with
float32 atomics, once. So a program's weight stream never stops for another program, and the
ring (refilled as each slot is read) carries it from gate/up into down without a drain.

Pieces, dealt on the host once per shape: routed experts in runs of WIDE rows (their down
columns are one 128-byte run per weight row), shared experts in runs of at most NARROW rows, one
such piece per program, to even out the bytes. The shared experts need no routing, so each
program's shared piece comes first and its copies are issued before the kernel waits for the
router (PDL): they stream while the kernel before it still runs.
"""

from __future__ import annotations

import heapq

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

COLS = 64  # a gate/up box's columns: 128 bytes of bf16, the TMA swizzle's width
SLICES = 16  # runs of 64 hidden columns a gate/up box holds: a box is [GRAIN, SLICES, 64], 16 KB
GRAIN = 8  # intermediate rows of a gate/up unit; every piece is a multiple
WIDE = 64  # rows of a routed piece; its down box is [WIDE_H, 64] (hidden rows x the piece's columns)
NARROW = 32  # most rows of a shared piece; its down box is [NARROW_H, 32]
WIDE_H, NARROW_H = 128, 256  # both down boxes are 16 KB, as a gate/up box is
MAX_SLOTS = 8  # items (two boxes, 32 KB) the ring holds at most
EARLY_ITEMS = 8  # items a program may issue before its PDL wait (the kernel before it still runs)
SHARED_BYTES = 216 * 1024  # the ring, the staged token, the output row and the activations
WARPS = 8
HEAD = 2  # table columns before a program's pieces: pieces issuable before the router, all pieces
_COLS, _GRAIN, _HEAD, _WIDE = gl.constexpr(COLS), gl.constexpr(GRAIN), gl.constexpr(HEAD), gl.constexpr(WIDE)
_NARROW, _WIDE_H, _NARROW_H = gl.constexpr(NARROW), gl.constexpr(WIDE_H), gl.constexpr(NARROW_H)


@gluon.jit
def _piece(code):
    """A piece's code -> (slot, gate/up units of GRAIN rows, first intermediate row)."""
    return code >> 24, (code >> 16) & 255, code & 65535


@gluon.jit
def _items(units, HIDDEN: gl.constexpr, UPH: gl.constexpr):
    """A piece's items: UPH per gate/up unit, then its down items (two boxes of hidden rows each)."""
    down = gl.where(units * _GRAIN <= _NARROW, HIDDEN // (2 * _NARROW_H), HIDDEN // (2 * _WIDE_H))
    return units * UPH + down


@gluon.jit
def _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, limit, known,
           HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
           SLOTS: gl.constexpr, UPH: gl.constexpr):
    """Copy the next items, in use order, into free ring slots, up to piece `limit`. Until `known`
    (the router's ids are readable) only fixed-expert pieces may be in range. descs: the w13, wide
    and narrow w2 descriptors; rings: the ring viewed as their boxes. -> (issued, piece, item)."""
    w13_desc, w2w_desc, w2n_desc = descs
    ring, ring_w, ring_n = rings
    go = (issued - consumed < SLOTS) & (piece < limit)
    while go:
        slot, units, k0 = _piece(gl.load(pieces_ptr + piece))
        expert = EXPERTS - NSLOTS + slot
        if known:
            expert = gl.load(ids_ptr + slot).to(gl.int32)
        stage = issued % SLOTS
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * w13_desc.block_type.nbytes)
        ups = units * UPH
        if item < ups:  # GRAIN gate rows and the same up rows, SLICES runs of the hidden width
            row = expert * 2 * INTER + k0 + (item // UPH) * _GRAIN
            col = (item % UPH) * w13_desc.block_type.shape[1]
            tma.async_copy_global_to_shared(w13_desc, [row, col, 0], bar, ring.index(2 * stage))
            tma.async_copy_global_to_shared(w13_desc, [row + INTER, col, 0], bar, ring.index(2 * stage + 1))
        elif units * _GRAIN <= _NARROW:  # the piece's down columns for 2 * NARROW_H hidden rows
            row = expert * HIDDEN + (item - ups) * 2 * _NARROW_H
            tma.async_copy_global_to_shared(w2n_desc, [row, k0], bar, ring_n.index(2 * stage))
            tma.async_copy_global_to_shared(w2n_desc, [row + _NARROW_H, k0], bar, ring_n.index(2 * stage + 1))
        else:
            row = expert * HIDDEN + (item - ups) * 2 * _WIDE_H
            tma.async_copy_global_to_shared(w2w_desc, [row, k0], bar, ring_w.index(2 * stage))
            tma.async_copy_global_to_shared(w2w_desc, [row + _WIDE_H, k0], bar, ring_w.index(2 * stage + 1))
        issued += 1
        item += 1
        if item == _items(units, HIDDEN, UPH):
            item = item * 0
            piece += 1
        go = (issued - consumed < SLOTS) & (piece < limit)
    return issued, piece, item


@gluon.jit
def _free(consumed):
    """Every thread's read of the oldest slot is done: a copy may overwrite it. -> consumed + 1."""
    gl.thread_barrier()
    fence_async_shared()
    return consumed + 1


@gluon.jit
def _consume_up(ring, ready, consumed, x_smem, half, acc0, acc1, SLOTS: gl.constexpr, layout: gl.constexpr):
    """Add the oldest item's gate and up boxes times the token's slices `half` to the accumulators."""
    stage = consumed % SLOTS
    mbarrier.wait(ready.index(stage), (consumed // SLOTS) & 1)
    vec = gl.expand_dims(x_smem.index(half).load(gl.SliceLayout(0, layout)).to(gl.float32), 0)
    acc0 += ring.index(2 * stage).load(layout).to(gl.float32) * vec
    acc1 += ring.index(2 * stage + 1).load(layout).to(gl.float32) * vec
    return _free(consumed), acc0, acc1


@gluon.jit
def _consume_down(ring, ready, consumed, act, out_rows, first, SLOTS: gl.constexpr, layout: gl.constexpr):
    """The oldest item's two down boxes [BH, K] times the piece's activations [K], added into the
    program's output rows `first` and `first + 1` (BH hidden rows each)."""
    stage = consumed % SLOTS
    mbarrier.wait(ready.index(stage), (consumed // SLOTS) & 1)
    part0 = gl.sum(ring.index(2 * stage).load(layout).to(gl.float32) * act, axis=1)
    part1 = gl.sum(ring.index(2 * stage + 1).load(layout).to(gl.float32) * act, axis=1)
    consumed = _free(consumed)
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    row0 = out_rows.index(first)
    row0.store(row0.load(rows) + part0)
    row1 = out_rows.index(first + 1)
    row1.store(row1.load(rows) + part1)
    return consumed


@gluon.jit
def _gate_up(stream, x_smem, act, weight, units, issued, consumed, piece, item, HIDDEN: gl.constexpr,
             INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr, SLOTS: gl.constexpr,
             UPH: gl.constexpr, layout: gl.constexpr):
    """A piece's gate/up units: act[u] = weight * silu(gate) * up for each GRAIN rows, zeros past
    the piece up to NARROW rows. stream: (descs, rings, ready, pieces, ids, pieces in all).
    -> (issued, consumed, piece, item) of the ring."""
    descs, rings, ready, pieces_ptr, ids_ptr, count = stream
    S: gl.constexpr = descs[0].block_type.shape[1]
    for u in range(units):
        acc0 = gl.zeros([_GRAIN, S, _COLS], gl.float32, layout)
        acc1 = gl.zeros([_GRAIN, S, _COLS], gl.float32, layout)
        for half in range(UPH):
            consumed, acc0, acc1 = _consume_up(rings[0], ready, consumed, x_smem, half, acc0, acc1, SLOTS, layout)
            issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item,
                                         count, True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH)
        gate = gl.sum(gl.sum(acc0, axis=2), axis=1)
        up = gl.sum(gl.sum(acc1, axis=2), axis=1)
        # Rounded where the two-launch path stores its activations, then weighted.
        act.index(u).store((gate / (1.0 + gl.exp(-gate)) * up).to(descs[0].dtype).to(gl.float32) * weight)
    for u in range(units, _NARROW // _GRAIN):  # a narrow box's columns past the piece meet zeros
        act.index(u).store(gl.zeros([_GRAIN], gl.float32, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    return issued, consumed, piece, item


@gluon.jit
def _down(stream, ring, act, out_rows, issued, consumed, piece, item, ITEMS: gl.constexpr, HIDDEN: gl.constexpr,
          INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr, SLOTS: gl.constexpr,
          UPH: gl.constexpr, layout: gl.constexpr):
    """A piece's down columns (ITEMS items of two [BH, K] boxes, `ring` viewed so) times its
    activations (act.index(0), [K]), added into the program's output rows (BH each).
    -> (issued, consumed, piece, item) of the ring."""
    descs, rings, ready, pieces_ptr, ids_ptr, count = stream
    a = gl.expand_dims(act.index(0).load(gl.SliceLayout(0, layout)), 0)
    for d in range(ITEMS):
        consumed = _consume_down(ring, ready, consumed, a, out_rows, 2 * d, SLOTS, layout)
        issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, count,
                                     True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH)
    return issued, consumed, piece, item


@gluon.jit
def _moe_ring_kernel(x_ptr, w13_desc, w2w_desc, w2n_desc, weights_ptr, ids_ptr, out_ptr, table_ptr, sync_ptr,
                     HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
                     WIDTH: gl.constexpr, SLOTS: gl.constexpr, EARLY: gl.constexpr, H_PAD: gl.constexpr,
                     ACC_ROWS: gl.constexpr):
    """Program p: for each of its pieces, the gate/up units (act = weight * silu(gate) * up, kept in
    shared memory), then the piece's down columns times act, summed into the program's float32
    output row; at the end that row is added into out by atomics (program 0 zeroes out first).
    sync: [programs out, out zeroed]."""
    pid = gl.program_id(0)
    n = gl.num_programs(0)
    S: gl.constexpr = w13_desc.block_type.shape[1]
    UPH: gl.constexpr = (HIDDEN // _COLS + S - 1) // S
    nw: gl.constexpr = gl.num_warps()
    # A gate/up box is [GRAIN, S, 64]: warps split its slices, a thread takes 8 columns of every
    # fourth row. A down box [BH, K]: a thread takes 8 of a row's K columns.
    up_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 1, 8], [1, nw, 1], [2, 1, 0])
    wide_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0])
    narrow_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [nw, 1], [1, 0])
    flat: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0])
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [nw, 1], [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows_of: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # for buffers indexed by row
    dtype: gl.constexpr = w13_desc.dtype

    ring = gl.allocate_shared_memory(dtype, [2 * SLOTS, _GRAIN, S, _COLS], w13_desc.layout)
    ring_w = ring._reinterpret(dtype, [2 * SLOTS, _WIDE_H, w2w_desc.block_type.shape[1]], w2w_desc.layout)
    ring_n = ring._reinterpret(dtype, [2 * SLOTS, _NARROW_H, _NARROW], w2n_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    x_rows = gl.allocate_shared_memory(dtype, [H_PAD, _COLS], plain)
    x_smem = x_rows._reinterpret(dtype, [H_PAD // S, S, _COLS], plain)  # S rows at a time, as a box needs
    acc = gl.allocate_shared_memory(gl.float32, [ACC_ROWS, _WIDE_H], rows_of)  # the output row (padded)
    acc_n = acc._reinterpret(gl.float32, [ACC_ROWS // 2, _NARROW_H], rows_of)
    acc_all = acc._reinterpret(gl.float32, [ACC_ROWS, _WIDE_H], plain)
    act = gl.allocate_shared_memory(gl.float32, [_WIDE // _GRAIN, _GRAIN], rows_of)  # the piece's, GRAIN at a time
    act_w = act._reinterpret(gl.float32, [1, _WIDE], rows_of)
    act_n = act._reinterpret(gl.float32, [_WIDE // _NARROW, _NARROW], rows_of)
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
    descs = (w13_desc, w2w_desc, w2n_desc)
    rings = (ring, ring_w, ring_n)
    head = table_ptr + pid * WIDTH
    pieces_ptr = head + _HEAD
    early = gl.load(head)
    count = gl.load(head + 1)
    zero = pid * 0  # loop-carried counters must start as tensors
    # The shared experts' weights need no routing: issue them before waiting for the router.
    # (As if SLOTS - EARLY items were already in use, so at most EARLY are issued.)
    issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, zero, zero + EARLY - SLOTS, zero, zero,
                                 early, False, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH)
    acc_all.store(gl.zeros([ACC_ROWS, _WIDE_H], gl.float32, out_l))
    o_rows = gl.arange(0, ACC_ROWS, layout=gl.SliceLayout(1, out_l))[:, None]
    o_cols = gl.arange(0, _WIDE_H, layout=gl.SliceLayout(0, out_l))[None, :]
    wait_for_prior_grid(True)  # the shared PDL wait (always on: a no-op without a PDL launch)
    if pid == 0:
        gl.store(out_ptr + o_rows * _WIDE_H + o_cols, gl.zeros([ACC_ROWS, _WIDE_H], gl.float32, out_l),
                 mask=o_rows < HIDDEN // _WIDE_H)
        gl.thread_barrier()
        gl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    consumed = zero
    issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, count, True,
                                 HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH)
    r = gl.arange(0, H_PAD, layout=gl.SliceLayout(1, flat))[:, None]
    c = gl.arange(0, _COLS, layout=gl.SliceLayout(0, flat))[None, :]
    x_rows.store(gl.load(x_ptr + r * _COLS + c, mask=r < HIDDEN // _COLS, other=0.0, cache_modifier=".cg"))
    gl.thread_barrier()
    stream = (descs, rings, ready, pieces_ptr, ids_ptr, count)
    for p in range(count):
        slot, units, _ = _piece(gl.load(pieces_ptr + p))
        issued, consumed, piece, item = _gate_up(stream, x_smem, act, gl.load(weights_ptr + slot), units, issued,
                                                 consumed, piece, item, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH,
                                                 up_l)
        gl.thread_barrier()  # the piece's activations are in
        if units * _GRAIN <= _NARROW:
            issued, consumed, piece, item = _down(stream, ring_n, act_n, acc_n, issued, consumed, piece, item,
                                                  HIDDEN // (2 * _NARROW_H), HIDDEN, INTER, NSLOTS, EXPERTS,
                                                  SLOTS, UPH, narrow_l)
        else:
            issued, consumed, piece, item = _down(stream, ring_w, act_w, acc, issued, consumed, piece, item,
                                                  HIDDEN // (2 * _WIDE_H), HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS,
                                                  UPH, wide_l)
        # The next piece's activations and output rows belong to other threads.
        gl.thread_barrier()
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))
    while gl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu") < 1:  # out is zeroed
        pass
    gl.atomic_add(out_ptr + o_rows * _WIDE_H + o_cols, acc_all.load(out_l), mask=o_rows < HIDDEN // _WIDE_H,
                  sem="relaxed", scope="gpu")
    # The last program out resets the counters for the next launch.
    if gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == n - 1:
        gl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")


def piece_bytes(rows: int, hidden: int) -> int:
    """Weight bytes (bf16) a piece of `rows` intermediate rows reads: gate, up and its down box columns."""
    return 2 * (2 * rows * hidden + (NARROW if rows <= NARROW else rows) * hidden)


def deal_pieces(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int) -> list[list[tuple[int, int, int]]]:
    """Per program, its pieces (slot, first intermediate row, rows), shared ones first: the routed
    slots' WIDE-row runs to whichever program has the fewest bytes, then the shared slots' rows in
    runs of at most NARROW, one run per program while any program has none, sized to even out the bytes."""
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
            rows = min(inter - k0, NARROW, max(GRAIN, want))
            lists[p].insert(0, (slot, k0, rows))
            heapq.heappush(load, (total + piece_bytes(rows, hidden), p))
            k0 += rows
    return lists


def work_table(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int) -> torch.Tensor:
    """int32 [programs, HEAD + most pieces]: per program (pieces issuable before the router, all
    pieces) and its piece codes (slot << 24 | units << 16 | first row)."""
    lists = deal_pieces(programs, hidden, inter, nslots, fixed_tail)
    width = HEAD + max(len(pieces) for pieces in lists)
    rows = []
    for pieces in lists:
        early = 0
        while early < len(pieces) and pieces[early][0] >= nslots - fixed_tail:
            early += 1
        codes = [(slot << 24) | (rows // GRAIN << 16) | k0 for slot, k0, rows in pieces]
        rows.append([early, len(codes), *codes] + [0] * (width - HEAD - len(codes)))
    return torch.tensor(rows, dtype=torch.int32)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _table_and_sync(device: torch.device, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The work table of this shape and the device's counters (programs out, out zeroed; each
    launch leaves them at zero), built on first use, which must not be inside a graph capture."""
    key = (device, *shape)
    if key not in _TABLES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_ring's work table must be built before graph capture: run it once eagerly")
        sync = next((s for (d, *_), (_, s) in _TABLES.items() if d == device), None)
        if sync is None:
            sync = torch.zeros(2, dtype=torch.int32, device=device)
        _TABLES[key] = (work_table(*shape).to(device), sync)
    return _TABLES[key]


def shape_fits(hidden: int, inter: int, nslots: int) -> bool:
    """Whether the kernel tiles these widths: whole pieces and down boxes, and room for the ring."""
    return (
        hidden % (2 * NARROW_H) == 0 and inter % WIDE == 0 and inter < 65536 and nslots <= 255
        and ring_slots(hidden) >= 3
    )


def ring_usable(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether this kernel can run the call: one token, Hopper or newer, 16-bit weights TMA can read."""
    if not hidden.is_cuda or hidden.shape[0] != 1 or torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return False
    experts, two_inter, width = w13.shape
    return (
        hidden.dtype in (torch.bfloat16, torch.float16)
        and w13.is_contiguous()
        and shape_fits(width, two_inter // 2, topk_ids.shape[1])
        and experts * max(two_inter, width) < 2**31
    )


def _x_pad(hidden: int) -> int:
    """Rows of 64 the staged token takes: a power of two, at least SLICES."""
    return max(SLICES, triton.next_power_of_2(hidden // COLS))


def _acc_rows(hidden: int) -> int:
    """Rows of WIDE_H the program's float32 output row takes: a power of two."""
    return triton.next_power_of_2(hidden // WIDE_H)


def ring_slots(hidden: int, itemsize: int = 2) -> int:
    """Items the ring holds for this width: as many as fit beside the staged token, the output row
    and the activations, up to MAX_SLOTS."""
    beside = _x_pad(hidden) * COLS * itemsize + 4 * (_acc_rows(hidden) * WIDE_H + WIDE)
    return min(MAX_SLOTS, (SHARED_BYTES - beside) // (2 * GRAIN * SLICES * COLS * itemsize))


def _descriptors(w13: torch.Tensor, w2: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """w13 [E, 2I, H] as [E * 2I, H / 64, 64] in [GRAIN, SLICES, 64] boxes; w2 [E, H, I] as
    [E * H, I] in [WIDE_H, WIDE] and [NARROW_H, NARROW] boxes."""
    gl_dtype = gl.bfloat16 if w13.dtype == torch.bfloat16 else gl.float16
    descs = []
    for w, box in ((w13, [GRAIN, SLICES, COLS]), (w2, [WIDE_H, WIDE]), (w2, [NARROW_H, NARROW])):
        rows, width = w.shape[0] * w.shape[1], w.shape[2]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
        if len(box) == 3:
            descs.append(TensorDescriptor(w, [rows, width // COLS, COLS], [width, COLS, 1], box, layout))
        else:
            descs.append(TensorDescriptor(w, [rows, width], [width, 1], box, layout))
    return tuple(descs)


def moe_ring(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, fixed_tail: int = 0) -> torch.Tensor:
    """[1, 1, H] float32: one token's weighted sum over its k experts of down(silu(gate) * up).

    `fixed_tail`: the last `fixed_tail` of the token's ids are known to be experts E - fixed_tail
    .. E - 1 in order (the shared experts), so their weights are fetched before the ids are read.
    The sum's order varies from launch to launch (float32 atomics), within float32 rounding.
    """
    experts, two_inter, width = w13.shape
    inter, nslots = two_inter // 2, topk_ids.shape[1]
    if not ring_usable(hidden, w13, topk_ids) or not w2.is_contiguous() or w2.dtype != w13.dtype:
        raise ValueError("moe_ring wants one token and contiguous 16-bit weights whose widths it tiles")
    programs = sm_count(hidden.device)
    table, sync = _table_and_sync(hidden.device, programs, width, inter, nslots, fixed_tail)
    out = torch.empty(1, 1, width, dtype=torch.float32, device=hidden.device)
    slots = ring_slots(width, hidden.element_size())
    _moe_ring_kernel[(programs,)](
        hidden, *_descriptors(w13, w2), topk_weights.reshape(-1).float(), topk_ids.reshape(-1), out, table, sync,
        HIDDEN=width, INTER=inter, NSLOTS=nslots, EXPERTS=experts, WIDTH=table.shape[1], SLOTS=slots,
        EARLY=min(EARLY_ITEMS, slots), H_PAD=_x_pad(width),
        ACC_ROWS=_acc_rows(width), num_warps=WARPS,
        launch_pdl=bool(pdl_launch(hidden).get("launch_pdl")),
    )
    return out
