"""One token's MoE as one persistent kernel (Gluon): the expert weights stream through a ring.

At one token the MoE reads about 138 MB of expert weights (V2-Lite: 6 routed + 2 shared experts)
and does almost no math, so its time is how long HBM stays busy. Two launches (gate/up, then down)
drain the memory pipeline between them, and so does every program that finishes its tile. Here one
program per SM walks its share of both GEMMs' weights in the order it uses them, keeping a ring of
shared-memory slots loading by TMA: a slot is refilled as soon as it has been read, so the down
weights are already arriving while a program waits for the activations its down rows read (a
slot's down rows start once every program has written that slot's SiLU-and-mul, counted per
slot). The shared experts' weights need no
routing, so their copies are issued before the kernel waits for the router (PDL): they stream
while the kernel before it still runs. `benchmarks/kernels/persistent_ring_bound.py` measured the
ring's design without math.

Work is dealt on the host, once per shape: gate/up units of ROWS gate rows (and their up rows)
over the whole hidden width, and down units of 2 * ROWS output rows over the whole intermediate
width, so no partial sums cross programs. Each program gets about the same bytes; its gate/up
units come first (the shared experts' first), then its down units.
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

COLS = 64  # a box's columns: 128 bytes of bf16, the TMA swizzle's width
ROWS = 16  # a box's rows; a gate/up unit has ROWS gate and ROWS up rows, a down unit 2 * ROWS rows
SLICES = 8  # runs of 64 columns a box holds per row: a box is [ROWS, SLICES, 64], 16 KB in bf16
MAX_SLOTS = 8  # items (two boxes) the ring holds at most
SHARED_BYTES = 216 * 1024  # the ring and the staged token / activations; the rest is reduction scratch
WARPS = 8  # one per slice of a box
HEAD = 3  # table columns before a program's units: issuable before the router, gate/up, all
UP, DOWN = 0, 1
_UP, _COLS, _HEAD = gl.constexpr(UP), gl.constexpr(COLS), gl.constexpr(HEAD)


@gluon.jit
def _issue(w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item, limit, known,
           HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
           SLOTS: gl.constexpr, S: gl.constexpr, R: gl.constexpr):
    """Copy the next items, in use order, into free ring slots, up to unit `limit`. Until `known`
    (the router's ids are readable) only trailing-slot units, whose expert is fixed, may be in
    range. -> (issued, unit, item)."""
    UP_ITEMS: gl.constexpr = (HIDDEN // _COLS + S - 1) // S
    DOWN_ITEMS: gl.constexpr = (INTER // _COLS + S - 1) // S
    go = (issued - consumed < SLOTS) & (unit < limit)
    while go:
        code = gl.load(units_ptr + unit)
        kind = code >> 24
        slot = (code >> 16) & 255
        block = code & 65535
        expert = EXPERTS - NSLOTS + slot
        if known:
            expert = gl.load(ids_ptr + slot).to(gl.int32)
        stage = issued % SLOTS
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * w13_desc.block_type.nbytes)
        if kind == _UP:  # ROWS gate rows and the same up rows
            row = expert * 2 * INTER + block * R
            tma.async_copy_global_to_shared(w13_desc, [row, item * S, 0], bar, ring.index(2 * stage))
            tma.async_copy_global_to_shared(w13_desc, [row + INTER, item * S, 0], bar, ring.index(2 * stage + 1))
        else:  # 2 * ROWS down rows
            row = expert * HIDDEN + block * 2 * R
            tma.async_copy_global_to_shared(w2_desc, [row, item * S, 0], bar, ring.index(2 * stage))
            tma.async_copy_global_to_shared(w2_desc, [row + R, item * S, 0], bar, ring.index(2 * stage + 1))
        issued += 1
        item += 1
        if item == DOWN_ITEMS + (UP_ITEMS - DOWN_ITEMS) * (kind == _UP).to(gl.int32):
            item = item * 0
            unit += 1
        go = (issued - consumed < SLOTS) & (unit < limit)
    return issued, unit, item


@gluon.jit
def _consume(ring, ready, consumed, vec_smem, vec_index, acc0, acc1, SLOTS: gl.constexpr, layout: gl.constexpr):
    """Wait for the oldest item, add its two boxes ([ROWS, S, 64]) times the vector's S slices
    (vec_smem.index(vec_index)) to the accumulators and hand the slot back. -> (consumed, acc0, acc1)."""
    stage = consumed % SLOTS
    mbarrier.wait(ready.index(stage), (consumed // SLOTS) & 1)
    vec = gl.expand_dims(vec_smem.index(vec_index).load(gl.SliceLayout(0, layout)).to(gl.float32), 0)
    acc0 += ring.index(2 * stage).load(layout).to(gl.float32) * vec
    acc1 += ring.index(2 * stage + 1).load(layout).to(gl.float32) * vec
    # Every thread's read of the slot is done before a copy may overwrite it.
    gl.thread_barrier()
    fence_async_shared()
    return consumed + 1, acc0, acc1


@gluon.jit
def _stage_rows(vec_smem, src_ptr, N: gl.constexpr, PAD: gl.constexpr, layout: gl.constexpr):
    """src[0:N] into vec_smem as PAD rows of 64 (zeros past N), read from L2."""
    r = gl.arange(0, PAD, layout=gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, _COLS, layout=gl.SliceLayout(0, layout))[None, :]
    vec_smem.store(gl.load(src_ptr + r * _COLS + c, mask=r < N // _COLS, other=0.0, cache_modifier=".cg"))


@gluon.jit
def _rows_sum(acc):
    """[ROWS, S, 64] -> [ROWS]: a unit's dot products."""
    return gl.sum(gl.sum(acc, axis=2), axis=1)


@gluon.jit
def _unit(w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item, limit, vec_smem,
          ITEMS: gl.constexpr, HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr,
          EXPERTS: gl.constexpr, SLOTS: gl.constexpr, S: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
    """One unit: its ITEMS items against vec_smem's rows, the ring topped up after each.
    -> (first box rows' dots [R], second's, issued, consumed, unit, item)."""
    acc0 = gl.zeros([R, S, _COLS], gl.float32, layout)
    acc1 = gl.zeros([R, S, _COLS], gl.float32, layout)
    for it in range(ITEMS):
        consumed, acc0, acc1 = _consume(ring, ready, consumed, vec_smem, it, acc0, acc1, SLOTS, layout)
        issued, unit, item = _issue(w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item,
                                    limit, True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, S, R)
    return _rows_sum(acc0), _rows_sum(acc1), issued, consumed, unit, item


@gluon.jit
def _moe_ring_kernel(x_ptr, w13_desc, w2_desc, weights_ptr, ids_ptr, act_ptr, out_ptr, table_ptr, sync_ptr,
                     HIDDEN: gl.constexpr, INTER: gl.constexpr, NSLOTS: gl.constexpr, EXPERTS: gl.constexpr,
                     WIDTH: gl.constexpr, SLOTS: gl.constexpr, S: gl.constexpr, H_PAD: gl.constexpr,
                     I_PAD: gl.constexpr, WARP_ROWS: gl.constexpr, R: gl.constexpr):
    """Program p: its gate/up units (act = silu(gate) * up, each counted done on its slot), then
    its down units (out[slot] = routing weight * down rows, each after its slot's count is full),
    reading every weight byte from the TMA ring and the token's row (then a slot's activations)
    from shared memory. sync: [exits, done units per slot...]."""
    pid = gl.program_id(0)
    n = gl.num_programs(0)
    # A ring box is [ROWS, S, 64]: the warps split its slices (and its rows, past S warps); a
    # thread takes 8 columns of every fourth row.
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 1, 8], [WARP_ROWS, gl.num_warps() // WARP_ROWS, 1],
                                            [2, 1, 0])
    flat: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    UP_ITEMS: gl.constexpr = (HIDDEN // _COLS + S - 1) // S
    DOWN_ITEMS: gl.constexpr = (INTER // _COLS + S - 1) // S
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    ring = gl.allocate_shared_memory(w13_desc.dtype, [2 * SLOTS, R, S, _COLS], w13_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    x_rows = gl.allocate_shared_memory(w13_desc.dtype, [H_PAD, _COLS], plain)
    act_rows = gl.allocate_shared_memory(w13_desc.dtype, [I_PAD, _COLS], plain)  # one slot's
    # The same rows S at a time, as an item's box needs them.
    x_smem = x_rows._reinterpret(w13_desc.dtype, [H_PAD // S, S, _COLS], plain)
    act_smem = act_rows._reinterpret(w13_desc.dtype, [I_PAD // S, S, _COLS], plain)
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
    head = table_ptr + pid * WIDTH
    units_ptr = head + _HEAD
    early = gl.load(head)
    up_units = gl.load(head + 1)
    all_units = gl.load(head + 2)
    zero = pid * 0  # loop-carried counters must start as tensors
    # The shared experts' weights need no routing: issue them before waiting for the router.
    issued, unit, item = _issue(w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, zero, zero, zero, zero, early,
                                False, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, S, R)
    wait_for_prior_grid(True)  # the shared PDL wait (always on: a no-op without a PDL launch)
    consumed = zero
    issued, unit, item = _issue(w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item,
                                all_units, True, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, S, R)
    _stage_rows(x_rows, x_ptr, HIDDEN, H_PAD, flat)
    gl.thread_barrier()
    for u in range(up_units):
        code = gl.load(units_ptr + u)
        slot = (code >> 16) & 255
        gate, up, issued, consumed, unit, item = _unit(
            w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item, all_units, x_smem,
            UP_ITEMS, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, S, R, layout)
        act = gate / (1.0 + gl.exp(-gate)) * up
        gl.store(act_ptr + slot * INTER + (code & 65535) * R + rows, act.to(act_ptr.dtype.element_ty))
        # Publish: the slot's down rows may start once all its INTER / R gate/up units are in.
        gl.thread_barrier()
        gl.atomic_add(sync_ptr + 1 + slot, 1, sem="release", scope="gpu")
    staged = zero - 1
    for u in range(up_units, all_units):
        code = gl.load(units_ptr + u)
        slot = (code >> 16) & 255
        if slot != staged:
            while gl.atomic_add(sync_ptr + 1 + slot, 0, sem="acquire", scope="gpu") < INTER // R:
                pass
            gl.thread_barrier()
            _stage_rows(act_rows, act_ptr + slot * INTER, INTER, I_PAD, flat)
            gl.thread_barrier()
            staged = slot
        first, second, issued, consumed, unit, item = _unit(
            w13_desc, w2_desc, ring, ready, units_ptr, ids_ptr, issued, consumed, unit, item, all_units, act_smem,
            DOWN_ITEMS, HIDDEN, INTER, NSLOTS, EXPERTS, SLOTS, S, R, layout)
        weight = gl.load(weights_ptr + slot)
        dst = out_ptr + slot * HIDDEN + (code & 65535) * 2 * R + rows
        gl.store(dst, (first * weight).to(out_ptr.dtype.element_ty))
        gl.store(dst + R, (second * weight).to(out_ptr.dtype.element_ty))
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))
    # The last program out resets the slots' counters for the next launch.
    if gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == n - 1:
        for s in gl.static_range(NSLOTS):
            gl.atomic_xchg(sync_ptr + 1 + s, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")


def deal_units(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int) -> list[list[int]]:
    """Per program, its units as codes (kind << 24 | slot << 16 | block), about equal bytes each:
    gate/up units dealt round-robin (the fixed-expert slots' first, so they can be issued before
    the router is done), then down units to whichever program has the fewest bytes."""
    up_bytes, down_bytes = 2 * ROWS * hidden, 2 * ROWS * inter
    order = list(range(nslots - fixed_tail, nslots)) + list(range(nslots - fixed_tail))
    up = [(UP << 24) | (slot << 16) | block for slot in order for block in range(inter // ROWS)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for i, code in enumerate(up):
        lists[i % programs].append(code)
    load = [(len(units) * up_bytes, p) for p, units in enumerate(lists)]
    heapq.heapify(load)
    for slot in order:
        for block in range(hidden // (2 * ROWS)):
            total, p = heapq.heappop(load)
            lists[p].append((DOWN << 24) | (slot << 16) | block)
            heapq.heappush(load, (total + down_bytes, p))
    return lists


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _table_and_sync(device: torch.device, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The work table of this shape and the device's counters (programs out, then units done per
    slot; each launch leaves them at zero), built on first use, which must not be inside a graph
    capture (a host-to-device copy)."""
    key = (device, ROWS, *shape)  # the table depends on ROWS too
    if key not in _TABLES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_ring's work table must be built before graph capture: run it once eagerly")
        sync = next((s for (d, *_), (_, s) in _TABLES.items() if d == device), None)
        if sync is None:
            sync = torch.zeros(1 + 255, dtype=torch.int32, device=device)
        _TABLES[key] = (work_table(*shape).to(device), sync)
    return _TABLES[key]


def work_table(programs: int, hidden: int, inter: int, nslots: int, fixed_tail: int) -> torch.Tensor:
    """int32 [programs, HEAD + most units]: per program (units issuable before the router, gate/up
    units, all units) and its unit codes."""
    lists = deal_units(programs, hidden, inter, nslots, fixed_tail)
    fixed = {(UP << 24) | (slot << 16) for slot in range(nslots - fixed_tail, nslots)}
    width = HEAD + max(len(units) for units in lists)
    rows = []
    for units in lists:
        early = 0
        while early < len(units) and (units[early] & ~0xFFFF) in fixed:
            early += 1
        ups = sum(1 for code in units if code >> 24 == UP)
        rows.append([early, ups, len(units), *units] + [0] * (width - HEAD - len(units)))
    return torch.tensor(rows, dtype=torch.int32)


def ring_usable(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether this kernel can run the call: one token, Hopper or newer, 16-bit weights TMA can read."""
    if not hidden.is_cuda or hidden.shape[0] != 1 or torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return False
    experts, two_inter, width = w13.shape
    inter = two_inter // 2
    return (
        hidden.dtype in (torch.bfloat16, torch.float16)
        and w13.is_contiguous()
        and width % COLS == 0
        and inter % COLS == 0
        and inter % ROWS == 0
        and width % (2 * ROWS) == 0
        and topk_ids.shape[1] <= 255
        and experts * max(two_inter, width) < 2**31
        and ring_slots(width, inter, topk_ids.shape[1], hidden.element_size()) >= 3
    )


def _pads(width: int, inter: int) -> tuple[int, int]:
    """Rows of 64 the staged token and each slot's activations take: a power of two, at least SLICES."""
    return max(SLICES, triton.next_power_of_2(width // COLS)), max(SLICES, triton.next_power_of_2(inter // COLS))


def ring_slots(width: int, inter: int, nslots: int, itemsize: int) -> int:
    """Items the ring holds for this shape: as many as fit beside the staged vectors, up to MAX_SLOTS."""
    h_pad, i_pad = _pads(width, inter)
    vec_bytes = (h_pad + i_pad) * COLS * itemsize
    return min(MAX_SLOTS, (SHARED_BYTES - vec_bytes) // (2 * ROWS * SLICES * COLS * itemsize))


def _descriptor(w: torch.Tensor, layout) -> TensorDescriptor:
    """Expert weights [E, N, K] as [E * N, K / 64, 64]: a box is ROWS rows by SLICES runs of 64."""
    rows, width = w.shape[0] * w.shape[1], w.shape[2]
    return TensorDescriptor(w, [rows, width // COLS, COLS], [width, COLS, 1], [ROWS, SLICES, COLS], layout)


def moe_ring(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, fixed_tail: int = 0) -> torch.Tensor:
    """[1, k, H] routing weight * expert output per slot for one token (see `fused_moe`).

    `fixed_tail`: the last `fixed_tail` of the token's ids are known to be experts E - fixed_tail
    .. E - 1 in order (the shared experts), so their weights are fetched before the ids are read.
    """
    experts, two_inter, width = w13.shape
    inter, nslots = two_inter // 2, topk_ids.shape[1]
    if not ring_usable(hidden, w13, topk_ids) or not w2.is_contiguous() or w2.dtype != w13.dtype:
        raise ValueError("moe_ring wants one token and contiguous 16-bit weights whose widths it tiles")
    programs = sm_count(hidden.device)
    table, sync = _table_and_sync(hidden.device, programs, width, inter, nslots, fixed_tail)
    gl_dtype = gl.bfloat16 if w13.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, SLICES, COLS], gl_dtype)
    act = torch.empty(nslots, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(1, nslots, width, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float()
    h_pad, i_pad = _pads(width, inter)
    slots = ring_slots(width, inter, nslots, hidden.element_size())
    _moe_ring_kernel[(programs,)](
        hidden, _descriptor(w13, layout), _descriptor(w2, layout), weights, topk_ids.reshape(-1), act, out, table, sync,
        HIDDEN=width, INTER=inter, NSLOTS=nslots, EXPERTS=experts, WIDTH=table.shape[1], SLOTS=slots,
        S=SLICES, H_PAD=h_pad, I_PAD=i_pad, WARP_ROWS=max(1, WARPS // SLICES), R=ROWS, num_warps=WARPS,
        launch_pdl=bool(pdl_launch(hidden).get("launch_pdl")),
    )
    return out
