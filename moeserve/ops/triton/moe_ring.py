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

The tail (`then`): the next layer's residual add + RMSNorm + first projection (fused_qkv_a) in the
same launch. Each program's run of that projection's rows is its last piece, so those weights
stream into the ring while the MoE's last programs finish; after the atomics a grid barrier
replaces the kernel boundary, and every program normalises the summed row itself.

The entry (`entry`): the MoE's own residual add + RMSNorm, router and expert selection, done by the
programs after their PDL wait instead of by a kernel before this one (moe_ring_entry.py). The
host side (tile sizes, dealing, what fits) is in moe_ring_plan.py; the programs' meeting points (the
output they add into, the grid barrier, the counters' reset) in moe_ring_sync.py.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from moeserve.ops.triton.device import sm_count
from moeserve.ops.triton.moe_ring_entry import (
    Entry,
    entry_arguments,
    entry_usable,
    load_gain,
    load_router_row,
    route_in_ring,
    row_offsets,
    stage_next_input,
)
from moeserve.ops.triton.moe_ring_plan import (
    COLS,
    GRAIN,
    HEAD,
    NARROW,
    NARROW_H,
    TAIL_SLOT,
    WIDE,
    WIDE_H,
    Tail,
    acc_rows,
    descriptors,
    ring_slots,
    ring_usable,
    table_and_sync,
    tail_items,
    tail_usable,
    x_pad,
)
from moeserve.ops.triton.moe_ring_sync import add_into_output, grid_barrier, release, zero_output
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid

__all__ = ["Entry", "Tail", "entry_usable", "moe_ring", "ring_usable", "tail_usable"]

EARLY_ITEMS = 8  # items a program may issue before its PDL wait (the kernel before it still runs)
WARPS = 8
# With the tail, read the out-zeroed flag after the first piece rather than at the end, off the
# barrier's path (b1 decode replay on H200: 1.866 -> 1.856 ms; without the tail it is 2% slower).
CHECK_EARLY = True
_COLS, _GRAIN, _HEAD, _WIDE = gl.constexpr(COLS), gl.constexpr(GRAIN), gl.constexpr(HEAD), gl.constexpr(WIDE)
_NARROW, _WIDE_H, _NARROW_H = gl.constexpr(NARROW), gl.constexpr(WIDE_H), gl.constexpr(NARROW_H)
_TAIL_SLOT = gl.constexpr(TAIL_SLOT)


@gluon.jit
def _piece(code):
    """A piece's code -> (slot, units of GRAIN rows, first row)."""
    return code >> 24, (code >> 16) & 255, code & 65535


@gluon.jit
def _items(slot, units, HIDDEN: gl.constexpr, UPH: gl.constexpr, TI: gl.constexpr):
    """A piece's items: UPH per gate/up unit, then its down items (two boxes of hidden rows each);
    a tail piece's, TI per unit."""
    down = gl.where(units * _GRAIN <= _NARROW, HIDDEN // (2 * _NARROW_H), HIDDEN // (2 * _WIDE_H))
    return gl.where(slot == _TAIL_SLOT, units * TI, units * UPH + down)


@gluon.jit
def _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, limit, known,
           HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
           SLOTS: gl.constexpr, UPH: gl.constexpr, TI: gl.constexpr):
    """Copy the next items, in use order, into free ring slots, up to piece `limit`. Until `known`
    (the router's ids are readable) only fixed-expert pieces may be in range. descs: the w13, wide
    and narrow w2, and tail descriptors; rings: the ring viewed as their boxes. -> (issued, piece, item)."""
    w13_desc, w2w_desc, w2n_desc, tail_desc = descs
    ring, ring_w, ring_n = rings
    S: gl.constexpr = w13_desc.block_type.shape[1]
    go = (issued - consumed < SLOTS) & (piece < limit)
    while go:
        slot, units, k0 = _piece(gl.load(pieces_ptr + piece))
        expert = EXPERTS - NSLOTS + slot
        if known:  # noqa: SIM102 (a constexpr, then a tensor: Gluon takes no `and` across them)
            if slot < NSLOTS:
                expert = gl.load(ids_ptr + slot).to(gl.int32)
        stage = issued % SLOTS
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * w13_desc.block_type.nbytes)
        ups = units * UPH
        if slot == _TAIL_SLOT:  # GRAIN rows of the tail projection, two runs of S slices
            row = k0 + (item // TI) * _GRAIN
            col = (item % TI) * 2 * S
            tma.async_copy_global_to_shared(tail_desc, [row, col, 0], bar, ring.index(2 * stage))
            tma.async_copy_global_to_shared(tail_desc, [row, col + S, 0], bar, ring.index(2 * stage + 1))
        elif item < ups:  # GRAIN gate rows and the same up rows, S slices of the hidden width
            row = expert * 2 * INTER + k0 + (item // UPH) * _GRAIN
            col = (item % UPH) * S
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
        if item == _items(slot, units, HIDDEN, UPH, TI):
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
def _multiply_item(ring, ready, consumed, x_smem, half0, half1, acc0, acc1, SLOTS: gl.constexpr,
                   layout: gl.constexpr):
    """Add the oldest item's two boxes times the token's slices half0 and half1 to the accumulators
    (a gate/up item: gate and up rows, the same slices; a tail item: the same rows, two runs)."""
    stage = consumed % SLOTS
    mbarrier.wait(ready.index(stage), (consumed // SLOTS) & 1)
    vec_l: gl.constexpr = gl.SliceLayout(0, layout)
    vec0 = gl.expand_dims(x_smem.index(half0).load(vec_l).to(gl.float32), 0)
    vec1 = gl.expand_dims(x_smem.index(half1).load(vec_l).to(gl.float32), 0)
    acc0 += ring.index(2 * stage).load(layout).to(gl.float32) * vec0
    acc1 += ring.index(2 * stage + 1).load(layout).to(gl.float32) * vec1
    return acc0, acc1


@gluon.jit
def _consume_up(ring, ready, consumed, x_smem, half, acc0, acc1, SLOTS: gl.constexpr, layout: gl.constexpr):
    """A gate/up item into the accumulators, its slot then freed."""
    acc0, acc1 = _multiply_item(ring, ready, consumed, x_smem, half, half, acc0, acc1, SLOTS, layout)
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
             UPH: gl.constexpr, TI: gl.constexpr, layout: gl.constexpr):
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
                                         count, True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI)
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
          UPH: gl.constexpr, TI: gl.constexpr, layout: gl.constexpr):
    """A piece's down columns (ITEMS items of two [BH, K] boxes, `ring` viewed so) times its
    activations (act.index(0), [K]), added into the program's output rows (BH each).
    -> (issued, consumed, piece, item) of the ring."""
    descs, rings, ready, pieces_ptr, ids_ptr, count = stream
    a = gl.expand_dims(act.index(0).load(gl.SliceLayout(0, layout)), 0)
    for d in range(ITEMS):
        consumed = _consume_down(ring, ready, consumed, a, out_rows, 2 * d, SLOTS, layout)
        issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, count,
                                     True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI)
    return issued, consumed, piece, item


@gluon.jit
def _tail(stream, x_smem, bias_ptr, proj_ptr, issued, consumed, piece, item, moe_count, tail_code, HIDDEN: gl.constexpr,
          INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr, SLOTS: gl.constexpr,
          UPH: gl.constexpr, TI: gl.constexpr, HAS_BIAS: gl.constexpr, layout: gl.constexpr):
    """The program's run of the tail projection's rows (its last piece, if any) times the staged
    next input, stored rounded to the weights' dtype (+ bias). `layout` gives each warp whole rows,
    so a row's sum stays inside its warp; slots are freed only while items remain to be issued."""
    descs, rings, ready, pieces_ptr, ids_ptr, count = stream
    S: gl.constexpr = descs[0].block_type.shape[1]
    if moe_count < count:
        _, units, k0 = _piece(tail_code)
        rows_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, layout))
        for u in range(units):
            acc0 = gl.zeros([_GRAIN, S, _COLS], gl.float32, layout)
            acc1 = gl.zeros([_GRAIN, S, _COLS], gl.float32, layout)
            for i in range(TI):
                acc0, acc1 = _multiply_item(rings[0], ready, consumed, x_smem, 2 * i, 2 * i + 1, acc0, acc1, SLOTS,
                                            layout)
                if piece < count:
                    consumed = _free(consumed)
                    issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece,
                                                 item, count, True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI)
                else:
                    consumed += 1
            y = gl.sum(gl.sum(acc0 + acc1, axis=2), axis=1)
            rows = k0 + u * _GRAIN + gl.arange(0, _GRAIN, layout=rows_l)
            if HAS_BIAS:
                y += gl.load(bias_ptr + rows).to(gl.float32)
            gl.store(proj_ptr + rows, y.to(descs[0].dtype))


@gluon.jit
def _moe_pieces(stream, x_smem, act, acts, accs, weights_ptr, sync_ptr, moe_count, issued, consumed, piece, item,
                HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
                SLOTS: gl.constexpr, UPH: gl.constexpr, TI: gl.constexpr, CHECK_EARLY: gl.constexpr,
                up_l: gl.constexpr, narrow_l: gl.constexpr, wide_l: gl.constexpr):
    """The program's MoE pieces, each its gate/up units then its down columns into the output row
    (acts, accs: the activations and output row viewed as narrow and wide boxes).
    -> (issued, consumed, piece, item) of the ring, and whether out was seen zeroed (CHECK_EARLY)."""
    act_n, act_w = acts
    acc_n, acc = accs
    rings = stream[1]
    zeroed = issued * 0  # checked after the first piece, off the end's path
    for p in range(moe_count):
        slot, units, _ = _piece(gl.load(stream[3] + p))
        issued, consumed, piece, item = _gate_up(stream, x_smem, act, gl.load(weights_ptr + slot), units, issued,
                                                 consumed, piece, item, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH,
                                                 TI, up_l)
        gl.thread_barrier()  # the piece's activations are in
        if units * _GRAIN <= _NARROW:
            issued, consumed, piece, item = _down(stream, rings[2], act_n, acc_n, issued, consumed, piece, item,
                                                  HIDDEN // (2 * _NARROW_H), HIDDEN, INTER, NSLOTS, EXPERTS,
                                                  SLOTS, UPH, TI, narrow_l)
        else:
            issued, consumed, piece, item = _down(stream, rings[1], act_w, acc, issued, consumed, piece, item,
                                                  HIDDEN // (2 * _WIDE_H), HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS,
                                                  UPH, TI, wide_l)
        # The next piece's activations and output rows belong to other threads.
        gl.thread_barrier()
        if CHECK_EARLY:  # noqa: SIM102 (a constexpr, then a tensor: Gluon takes no `and` across them)
            if p == 0:
                zeroed = gl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
    return issued, consumed, piece, item, zeroed


@gluon.jit
def _shared_buffers(w13_desc, w2w_desc, w2n_desc, SLOTS: gl.constexpr, H_PAD: gl.constexpr, ACC_ROWS: gl.constexpr):
    """The kernel's shared memory: the ring (as gate/up, wide and narrow down boxes) and its ready
    barriers, the staged token (as rows and as S-row boxes), the float32 output row (narrow and wide
    views, and whole) and the piece's activations (by GRAIN rows, and narrow and wide views)."""
    S: gl.constexpr = w13_desc.block_type.shape[1]
    dtype: gl.constexpr = w13_desc.dtype
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows_of: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # for buffers indexed by row
    ring = gl.allocate_shared_memory(dtype, [2 * SLOTS, _GRAIN, S, _COLS], w13_desc.layout)
    ring_w = ring._reinterpret(dtype, [2 * SLOTS, _WIDE_H, w2w_desc.block_type.shape[1]], w2w_desc.layout)
    ring_n = ring._reinterpret(dtype, [2 * SLOTS, _NARROW_H, _NARROW], w2n_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
    x_rows = gl.allocate_shared_memory(dtype, [H_PAD, _COLS], plain)
    x_smem = x_rows._reinterpret(dtype, [H_PAD // S, S, _COLS], plain)  # S rows at a time, as a box needs
    acc = gl.allocate_shared_memory(gl.float32, [ACC_ROWS, _WIDE_H], rows_of)  # the output row (padded)
    acc_n = acc._reinterpret(gl.float32, [ACC_ROWS // 2, _NARROW_H], rows_of)
    acc_all = acc._reinterpret(gl.float32, [ACC_ROWS, _WIDE_H], plain)
    act = gl.allocate_shared_memory(gl.float32, [_WIDE // _GRAIN, _GRAIN], rows_of)  # the piece's, GRAIN at a time
    act_w = act._reinterpret(gl.float32, [1, _WIDE], rows_of)
    act_n = act._reinterpret(gl.float32, [_WIDE // _NARROW, _NARROW], rows_of)
    return (ring, ring_w, ring_n), ready, x_rows, x_smem, (acc_n, acc), acc_all, act, (act_n, act_w)


@gluon.jit
def _work(table_ptr, pid, WIDTH: gl.constexpr):
    """The program's row of the host's work table -> (its piece codes, how many of its items may go
    out before the PDL wait, its piece count, its MoE piece count: the tail's piece, if any, is last)."""
    head = table_ptr + pid * WIDTH
    return head + _HEAD, gl.load(head), gl.load(head + 1), gl.load(head + 2)


@gluon.jit
def _reads_before_wait(router_ptr, entry_gain_ptr, gain_ptr, pieces_ptr, count, moe_count, ROUTED: gl.constexpr,
                       HIDDEN: gl.constexpr, H_PAD: gl.constexpr, ENTRY: gl.constexpr, TAIL: gl.constexpr,
                       flat: gl.constexpr):
    """What needs no earlier kernel's output: the router's row, the norms' gains, the tail's piece code.
    Read before the waits, where each was a round trip on the path (H200 b1 replay 1.710 -> 1.674 ms)."""
    w_row = load_router_row(router_ptr, ROUTED, HIDDEN, H_PAD, flat) if ENTRY else 0.0
    entry_gain = load_gain(entry_gain_ptr, HIDDEN, H_PAD, flat) if ENTRY else 0.0
    gain = load_gain(gain_ptr, HIDDEN, H_PAD, flat) if TAIL else 0.0
    tail_code = gl.load(pieces_ptr + moe_count, mask=moe_count < count, other=0) if TAIL else 0
    return w_row, entry_gain, gain, tail_code


@gluon.jit
def _stage_token(x_rows, x_ptr, HIDDEN: gl.constexpr, H_PAD: gl.constexpr, flat: gl.constexpr):
    """The token's row, already normalised by the kernel before, into shared memory for every warp."""
    offs, inside = row_offsets(HIDDEN, H_PAD, flat)
    x_rows.store(gl.load(x_ptr + offs, mask=inside, other=0.0, cache_modifier=".cg"))
    gl.thread_barrier()


@gluon.jit
def _next_layer(stream, x_rows, x_smem, rows, sync_ptr, n, issued, consumed, piece, item, moe_count, tail_code,
                HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
                SLOTS: gl.constexpr, UPH: gl.constexpr, TI: gl.constexpr, HAS_BIAS: gl.constexpr,
                H_PAD: gl.constexpr, flat: gl.constexpr, tail_l: gl.constexpr):
    """The tail: once every program's output is in (a grid barrier), the next layer's add + norm of
    it and the program's rows of the next projection. `rows`: (out, res, gain, sum, eps, bias, proj).
    -> whether this program, of the n, is the last one past the barrier."""
    out_ptr, res_ptr, gain, sum_ptr, eps, bias_ptr, proj_ptr = rows
    grid_barrier(sync_ptr)
    # Past the barrier, so the counters may be reset once every program is: the last one to
    # count itself does it, at the end (the count's round trip overlaps the tail's work).
    last = gl.atomic_add(sync_ptr + 2, 1, sem="relaxed", scope="gpu") == n - 1
    stage_next_input(x_rows, out_ptr, res_ptr, gain, sum_ptr, eps, HIDDEN, H_PAD, flat)
    _tail(stream, x_smem, bias_ptr, proj_ptr, issued, consumed, piece, item, moe_count, tail_code, HIDDEN, INTER,
          NSLOTS, EXPERTS, SLOTS, UPH, TI, HAS_BIAS, tail_l)
    return last


@gluon.jit
def _moe_ring_kernel(x_ptr, w13_desc, w2w_desc, w2n_desc, tail_desc, weights_ptr, ids_ptr, out_ptr, table_ptr,
                     sync_ptr, res_ptr, gain_ptr, bias_ptr, proj_ptr, sum_ptr, eps,
                     router_ptr, logits_ptr, cbias_ptr, entry_res_ptr, entry_gain_ptr, entry_sum_ptr, out_w_ptr,
                     out_ids_ptr, entry_eps, scaling,
                     HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
                     WIDTH: gl.constexpr, SLOTS: gl.constexpr, EARLY: gl.constexpr, H_PAD: gl.constexpr,
                     ACC_ROWS: gl.constexpr, TAIL: gl.constexpr, TI: gl.constexpr, HAS_BIAS: gl.constexpr,
                     CHECK_EARLY: gl.constexpr, ENTRY: gl.constexpr, ROUTED: gl.constexpr, TOP_K: gl.constexpr,
                     SIGMOID: gl.constexpr, HAS_CBIAS: gl.constexpr, NORMALISE: gl.constexpr, SCALE: gl.constexpr,
                     K_PAD: gl.constexpr, E_PAD: gl.constexpr):
    """Program p: for each of its pieces, the gate/up units (act = weight * silu(gate) * up, kept in
    shared memory), then the piece's down columns times act, summed into the program's float32
    output row; at the end that row is added into out by atomics (program 0 zeroes out first).
    With TAIL, after a grid barrier, the next layer's add + norm of out and its rows of the next
    projection (res, gain, tail_desc, bias -> sum, proj). With ENTRY, x is the row before the MoE's
    add + norm, which the programs do and route themselves (moe_ring_entry.py); weights and ids are
    then per-program scratch rows. sync: [programs out, out zeroed, programs done, logits in]."""
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
    tail_l: gl.constexpr = gl.BlockedLayout([1, 4, 8], [1, 4, 8], [nw, 1, 1], [2, 1, 0])  # a warp a row
    rings, ready, x_rows, x_smem, accs, acc_all, act, acts = _shared_buffers(w13_desc, w2w_desc, w2n_desc, SLOTS,
                                                                             H_PAD, ACC_ROWS)
    descs = (w13_desc, w2w_desc, w2n_desc, tail_desc)
    pieces_ptr, early, count, moe_count = _work(table_ptr, pid, WIDTH)
    zero = pid * 0  # loop-carried counters must start as tensors
    # The shared experts' weights need no routing: issue them before waiting for the router.
    # (As if SLOTS - EARLY items were already in use, so at most EARLY are issued.)
    issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, zero, zero + EARLY - SLOTS, zero, zero,
                                 early, False, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI)
    acc_all.store(gl.zeros([ACC_ROWS, _WIDE_H], gl.float32, out_l))
    w_row, entry_gain, gain, tail_code = _reads_before_wait(router_ptr, entry_gain_ptr, gain_ptr, pieces_ptr, count,
                                                            moe_count, ROUTED, HIDDEN, H_PAD, ENTRY, TAIL, flat)
    o_rows = gl.arange(0, ACC_ROWS, layout=gl.SliceLayout(1, out_l))[:, None]
    o_cols = gl.arange(0, _WIDE_H, layout=gl.SliceLayout(0, out_l))[None, :]
    wait_for_prior_grid(True)  # the shared PDL wait (always on: a no-op without a PDL launch)
    zero_output(out_ptr, sync_ptr, pid, o_rows, o_cols, ACC_ROWS, HIDDEN, out_l)
    consumed = zero
    if ENTRY:  # the MoE's add + norm and routing first; the selection is then this program's scratch row
        weights_ptr += pid * K_PAD
        ids_ptr += pid * K_PAD
        stage_next_input(x_rows, x_ptr, entry_res_ptr, entry_gain, entry_sum_ptr, entry_eps, HIDDEN, H_PAD, flat)
        route_in_ring(x_rows, w_row, logits_ptr, sync_ptr + 3, cbias_ptr, weights_ptr, ids_ptr, out_w_ptr,
                      out_ids_ptr, scaling, ROUTED, TOP_K, SIGMOID, HAS_CBIAS, NORMALISE, SCALE, NSLOTS - TOP_K,
                      K_PAD, E_PAD, flat)
    issued, piece, item = _issue(descs, rings, ready, pieces_ptr, ids_ptr, issued, consumed, piece, item, count, True,
                                 HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI)
    if not ENTRY:  # the token, normalised by the kernel before (after the copies above are issued)
        _stage_token(x_rows, x_ptr, HIDDEN, H_PAD, flat)
    stream = (descs, rings, ready, pieces_ptr, ids_ptr, count)
    issued, consumed, piece, item, zeroed = _moe_pieces(
        stream, x_smem, act, acts, accs, weights_ptr, sync_ptr, moe_count, issued, consumed, piece,
        item, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, UPH, TI, CHECK_EARLY, up_l, narrow_l, wide_l,
    )
    add_into_output(out_ptr, acc_all, sync_ptr, zeroed, o_rows, o_cols, HIDDEN, out_l)
    if TAIL:
        last = _next_layer(stream, x_rows, x_smem, (out_ptr, res_ptr, gain, sum_ptr, eps, bias_ptr, proj_ptr), sync_ptr,
                           n, issued, consumed, piece, item, moe_count, tail_code, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS,
                           UPH, TI, HAS_BIAS, H_PAD, flat, tail_l)
    else:
        last = gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    release(ready, sync_ptr, last, SLOTS)


def moe_ring(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, fixed_tail: int = 0, then: Tail | None = None,
             entry: Entry | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[1, 1, H] float32: one token's weighted sum over its k experts of down(silu(gate) * up).

    `fixed_tail`: the last `fixed_tail` of the token's ids are known to be experts E - fixed_tail
    .. E - 1 in order (the shared experts), so their weights are fetched before the ids are read.
    The sum's order varies from launch to launch (float32 atomics), within float32 rounding.
    With `then` (see tail_usable): (norm(sum + residual) @ weight^T (+ bias) [1, N], sum + residual
    [1, H]), both in the weights' dtype, as `add_norm_linear` on the sum gives them.
    With `entry` (and `then`; see entry_usable), `hidden` is the row before the MoE's add + norm
    ([1, H], or a float32 [1, 1, H] part), which the kernel adds to entry.residual, normalises and
    routes itself, writing the selection into topk_weights / topk_ids (float32 / int32 [1, k + S])
    as `add_norm_route` gives it; the tail then adds to that sum, not to then.residual.
    """
    experts, two_inter, width = w13.shape
    inter, nslots = two_inter // 2, topk_ids.shape[1]
    token = hidden if entry is None else entry.residual
    programs = sm_count(hidden.device)
    if not ring_usable(token, w13, w2, topk_ids):
        raise ValueError("moe_ring wants one token and contiguous 16-bit weights whose widths it tiles")
    if then is not None and not tail_usable(token, w13, then):
        raise ValueError("moe_ring's tail wants a [1, H] residual and an [N, H] weight of the experts' dtype")
    route = entry_arguments(hidden, w13, topk_weights, topk_ids, then, entry, programs)
    if entry is not None:  # the tail adds to the entry's sum
        then = then._replace(residual=route.pop("entry_sum"))
    tail_rows = 0 if then is None else then.weight.shape[0]
    table, sync = table_and_sync(hidden.device, programs, width, inter, nslots, fixed_tail, tail_rows)
    out = torch.empty(1, 1, width, dtype=torch.float32, device=hidden.device)
    slots = ring_slots(width, token.element_size())
    if then is None:
        res = gain = bias = proj = summed = out
        eps = 0.0
    else:
        res, gain, eps, bias = then.residual, then.norm_weight.contiguous(), float(then.eps), then.bias
        proj = torch.empty(1, tail_rows, dtype=w13.dtype, device=hidden.device)
        summed = torch.empty(1, width, dtype=w13.dtype, device=hidden.device)
    selection = route.pop("selection", (topk_weights.reshape(-1).float(), topk_ids.reshape(-1)))
    _moe_ring_kernel[(programs,)](
        hidden, *descriptors(w13, w2, None if then is None else then.weight), *selection, out, table, sync, res, gain,
        bias if bias is not None else out, proj, summed, eps, *route.pop("args"),
        HIDDEN=width, INTER=inter, NSLOTS=nslots, EXPERTS=experts, WIDTH=table.shape[1], SLOTS=slots,
        EARLY=min(EARLY_ITEMS, slots), H_PAD=x_pad(width), ACC_ROWS=acc_rows(width), TAIL=then is not None,
        TI=tail_items(width), HAS_BIAS=bias is not None, CHECK_EARLY=CHECK_EARLY and then is not None, **route,
        num_warps=WARPS, launch_pdl=bool(pdl_launch(hidden).get("launch_pdl")),
    )
    return out if then is None else (proj, summed)
