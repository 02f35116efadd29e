"""Could a persistent batch-1 layer keep HBM busy across its barriers? A TMA ring, no math.

    python benchmarks/kernels/persistent_ring_bound.py [--layers 26] [--json FILE]

`persistent_layer_bound.py` showed that streaming each phase after its grid barrier costs 1.50x
the layer's bytes: every barrier drains the memory pipeline. This skeleton, in Triton's Gluon
dialect, keeps it full instead. Each program (one per SM) walks its share of the layer's bytes
in the order it will use them and keeps a ring of S shared-memory slots loading by TMA, refilled
as soon as a slot is read, so copies issued before a barrier land while the program waits at it.
Only the routed experts' bytes wait: they are issued once the program has passed its layer's
router barrier, as a real kernel could not know them sooner. Same byte counts and barriers as
the other skeleton (one token, 1,152 keys, V2-Lite); every block is summed once and checked.
Rows:
- `ring_stream`: the layer's bytes, no barriers: the ring's streaming rate;
- `ring_layer`: eight barriers a layer, routed experts issued after the router barrier;
- `ring_layer_static`: the same, every byte issuable early (what knowing the routing sooner
  would buy);
- `ring_layer_unrotated`: each segment's chunks dealt from program 0, so the first programs get
  every segment's leftover chunks and the others wait for them at the barriers;
- `ring_layer_spin_load`: `ring_layer` with the barrier polled by acquire loads instead of
  atomic adds of 0;
- `ring_l2_stream`, `ring_l2_layer`: the same walks with every chunk folded into 264 chunks that
  stay in L2: how fast the programs consume when HBM is not the limit;
- `ring_layer_stallN`: each barrier replaced by N ns of spinning on the program alone (no
  routing wait): does any stall of that length cost its time, or only a grid-wide one?
- each at several chunk sizes (16 or 32 KB), ring depths and warp counts (`_rR_sS_wW`).
Each barrier variant is run once more with %globaltimer stamps at every arrival and departure:
how far the last program trails the median one at each of a layer's barriers, and which
programs come last. (Taking the MoE's chunks from a shared counter at run time instead, so that
slow programs take fewer, was tried: one atomic round trip per chunk on the issue path made the
layer 1.6-2.0x; not kept.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MB = 1 << 20
ROW = 64  # bf16 values a row of the buffer: 128 bytes, the TMA swizzle's width
ROW_BYTES = ROW * 2
# (box rows, ring slots, warps): 16 or 32 KB chunks, ring of 64-192 KB.
CONFIGS = ((128, 4, 4), (128, 12, 4), (256, 6, 4))
# A layer's segments in the order a program uses them: (MB, barrier after it, routed). The MoE
# phases are split into the shared experts' bytes (known early) and the routed experts' bytes.
SEGMENTS = (
    (14.94, 1, 0),  # qkv_a
    (2.10, 1, 0),  # W_UK
    (1.33, 1, 0),  # KV at 1,152 keys
    (2.10, 1, 0),  # W_UV
    (8.39, 1, 0),  # o_proj
    (0.26, 2, 0),  # router: its barrier releases the routed experts' copies
    (23.07, 0, 0),  # gate/up, 2 shared experts
    (69.20, 1, 1),  # gate/up, 6 routed experts
    (11.53, 0, 0),  # down, shared
    (34.61, 1, 1),  # down, routed
)
BARRIERS_PER_LAYER = sum(1 for _, barrier, _ in SEGMENTS if barrier)
_BARRIERS_PER_LAYER = gl.constexpr(BARRIERS_PER_LAYER)
# name: ring_us keywords
VARIANTS = {
    "ring_stream": {"barriers": False, "static_routing": True},
    "ring_layer": {},
    "ring_layer_static": {"static_routing": True},
    "ring_layer_unrotated": {"rotate": False},
    "ring_layer_spin_load": {"spin_load": True},
    "ring_l2_stream": {"barriers": False, "static_routing": True, "l2_window": 264},
    "ring_l2_layer": {"l2_window": 264},
    "ring_layer_stall700": {"static_routing": True, "stall_ns": 700},
    "ring_layer_stall1400": {"static_routing": True, "stall_ns": 1400},
}
BARRIER, ROUTER_BARRIER, PAD = -1, -2, -3
ROUTED = 1 << 30
_ROUTER_BARRIER, _PAD, _ROUTED = gl.constexpr(ROUTER_BARRIER), gl.constexpr(PAD), gl.constexpr(ROUTED)


@gluon.jit
def _load_acquire(ptr):
    """The counter by a plain acquire load: no read-modify-write queueing at the counter's L2 slice."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _now_ns(dep):
    """%globaltimer, read after `dep` is computed."""
    return gl.inline_asm_elementwise("{ .reg .u32 d; mov.u32 d, $1; mov.u64 $0, %globaltimer; }", "=l,r", [dep],
                                     dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _local_wait(ns, dep):
    """Spin `ns` nanoseconds on this program alone: a stall as long as a barrier, with no grid sync."""
    start = _now_ns(dep)
    while _now_ns(dep) - start < ns:
        pass


@gluon.jit
def _grid_barrier(counter_ptr, target, SPIN_LOAD: gl.constexpr):
    """Arrive on a monotonic counter and spin until `target` arrivals (relaxed: nothing to publish),
    polling by atomic adds of 0 or, with SPIN_LOAD, by acquire loads."""
    gl.thread_barrier()
    gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    if SPIN_LOAD:
        while _load_acquire(counter_ptr) < target:
            pass
    else:
        while gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
            pass


@gluon.jit
def _refill(desc, ring, ready, events_ptr, pid, issued, cursor, consumed, routers,
            EVENTS: gl.constexpr, TOTAL: gl.constexpr, LAYER_ROWS: gl.constexpr, SLOTS: gl.constexpr):
    """Issue copies of the next chunks in use order while a slot is free; a routed chunk waits
    until its layer's router barrier is passed. -> (issued, cursor)."""
    go = (issued - consumed < SLOTS) & (cursor < TOTAL)
    while go:
        layer = cursor // EVENTS
        ev = gl.load(events_ptr + pid * EVENTS + cursor % EVENTS)
        routed = ev >= _ROUTED
        if ev < 0:
            cursor += 1
        elif routed & (layer >= routers):
            go = False
        else:
            row = layer * LAYER_ROWS + ev - routed.to(gl.int32) * _ROUTED
            slot = issued % SLOTS
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row, 0], ready.index(slot), ring.index(slot))
            issued += 1
            cursor += 1
        go = go & (issued - consumed < SLOTS) & (cursor < TOTAL)
    return issued, cursor


@gluon.jit
def _consume(ring, ready, consumed, acc, SLOTS: gl.constexpr, layout: gl.constexpr):
    """Wait for the oldest slot, add it to acc and hand the slot back. -> (consumed, acc)."""
    slot = consumed % SLOTS
    mbarrier.wait(ready.index(slot), (consumed // SLOTS) & 1)
    acc += ring.index(slot).load(layout).to(gl.float32)
    # Every thread's read of the slot is done before a copy may overwrite it.
    gl.thread_barrier()
    fence_async_shared()
    return consumed + 1, acc


@gluon.jit
def _ring_kernel(desc, events_ptr, counter_ptr, out_ptr, stamps_ptr, LAYERS: gl.constexpr, EVENTS: gl.constexpr,
                 LAYER_ROWS: gl.constexpr, SLOTS: gl.constexpr, STATIC_ROUTING: gl.constexpr, BOX_R: gl.constexpr,
                 BOX_C: gl.constexpr, SPIN_LOAD: gl.constexpr, STALL_NS: gl.constexpr, STAMPS: gl.constexpr):
    """Each program sums its chunks in use order from a ring of TMA-filled slots, meeting the
    others at every barrier event; out[pid] = its sum."""
    pid = gl.program_id(0)
    n = gl.num_programs(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    ring = gl.allocate_shared_memory(desc.dtype, [SLOTS, BOX_R, BOX_C], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
    TOTAL: gl.constexpr = LAYERS * EVENTS
    zero = pid * 0  # loop-carried counters must start as tensors, not constants
    routers = zero + LAYERS * STATIC_ROUTING
    issued, cursor = _refill(desc, ring, ready, events_ptr, pid, zero, zero, zero, routers, EVENTS, TOTAL, LAYER_ROWS,
                             SLOTS)
    consumed = zero
    barriers = zero
    acc = gl.zeros([BOX_R, BOX_C], gl.float32, layout)
    for e in range(TOTAL):
        ev = gl.load(events_ptr + pid * EVENTS + e % EVENTS)
        if ev >= 0:
            consumed, acc = _consume(ring, ready, consumed, acc, SLOTS, layout)
        elif ev != _PAD:
            barriers += 1
            if STAMPS:
                gl.store(stamps_ptr + (pid * LAYERS * _BARRIERS_PER_LAYER + barriers - 1) * 2, _now_ns(barriers))
            if STALL_NS:
                _local_wait(STALL_NS, barriers)
            else:
                _grid_barrier(counter_ptr, barriers * n, SPIN_LOAD)
            if STAMPS:
                gl.store(stamps_ptr + (pid * LAYERS * _BARRIERS_PER_LAYER + barriers - 1) * 2 + 1, _now_ns(barriers))
            if not STATIC_ROUTING and ev == _ROUTER_BARRIER:
                routers += 1
        issued, cursor = _refill(desc, ring, ready, events_ptr, pid, issued, cursor, consumed, routers,
                                 EVENTS, TOTAL, LAYER_ROWS, SLOTS)
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


def chunk_counts(segments: tuple, box_rows: int) -> list[int]:
    """Chunks of `box_rows` rows in each segment (at least one)."""
    return [max(1, round(mb * MB / (box_rows * ROW_BYTES))) for mb, _, _ in segments]


def event_table(segments: tuple, programs: int, barriers: bool, box_rows: int = 128,
                rotate: bool = True) -> tuple[torch.Tensor, int]:
    """Per program, one layer's events in use order: its chunks' row offsets (+ ROUTED for the
    routed experts'), a barrier after each segment that has one; padded to one width. Chunks go
    round-robin; with `rotate` each segment starts where the last one stopped, so a layer's
    leftover chunks spread over the programs instead of all landing on the first ones.
    -> (int32 [programs, width], rows a layer)."""
    counts = chunk_counts(segments, box_rows)
    lists: list[list[int]] = [[] for _ in range(programs)]
    start = 0
    first = 0
    for (_, barrier, routed), count in zip(segments, counts, strict=True):
        for c in range(count):
            lists[(first + c) % programs].append(start + c * box_rows + (ROUTED if routed else 0))
        start += count * box_rows
        first = (first + count) % programs if rotate else 0
        if barriers and barrier:
            for events in lists:
                events.append(ROUTER_BARRIER if barrier == 2 else BARRIER)
    width = max(len(events) for events in lists)
    table = [events + [PAD] * (width - len(events)) for events in lists]
    return torch.tensor(table, dtype=torch.int32), start


def in_window(table: torch.Tensor, box_rows: int, window: int) -> torch.Tensor:
    """The table with every chunk moved into the first `window` chunks (flags kept): an L2-resident run."""
    chunk = table >= 0
    routed = table >= ROUTED
    rows = (table - routed.int() * ROUTED) // box_rows % window * box_rows + routed.int() * ROUTED
    return torch.where(chunk, rows, table)


def expected_sum(buf: torch.Tensor, table: torch.Tensor, layers: int, layer_rows: int, box_rows: int) -> float:
    """What the programs' sums must add up to: every chunk the table names, once per layer."""
    chunk_sums = buf.view(-1, box_rows * ROW).sum(dim=1, dtype=torch.float32)
    rows = table[table >= 0].long().cuda() % ROUTED
    layer_starts = torch.arange(layers, device="cuda")[:, None] * layer_rows
    return chunk_sums[(layer_starts + rows[None, :]) // box_rows].sum().item()


def ring_us(layers: int, config: tuple[int, int, int], barriers: bool = True, static_routing: bool = False,
            rotate: bool = True, spin_load: bool = False, l2_window: int = 0,
            stall_ns: int = 0) -> tuple[float, float, dict]:
    """(us per layer, MB per layer, barrier_stats or {}) of the ring skeleton over `layers` layers of distinct buffers
    (or, with `l2_window`, every layer's chunks folded into that many chunks, which L2 holds)."""
    from check_attention import best_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    box_rows, slots, warps = config
    table, layer_rows = event_table(SEGMENTS, sms, barriers, box_rows, rotate)
    layer_bytes = layer_rows * ROW_BYTES
    if l2_window:
        table, layer_rows = in_window(table, box_rows, l2_window), 0
    events = table.cuda()
    buf = torch.randn(max(layers * layer_rows, l2_window * box_rows), ROW, dtype=torch.bfloat16, device="cuda")
    layout = gl.NVMMASharedLayout.get_default_for([box_rows, ROW], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(buf, [box_rows, ROW], layout)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(sms, dtype=torch.float32, device="cuda")
    stamps = torch.zeros(sms, layers * BARRIERS_PER_LAYER, 2, dtype=torch.int64, device="cuda")

    def run(stamp: bool = False) -> None:
        counter.zero_()
        _ring_kernel[(sms,)](desc, events, counter, out, stamps, LAYERS=layers, EVENTS=table.shape[1],
                             LAYER_ROWS=layer_rows, SLOTS=slots, STATIC_ROUTING=static_routing, BOX_R=box_rows,
                             BOX_C=ROW, SPIN_LOAD=spin_load, STALL_NS=stall_ns, STAMPS=stamp, num_warps=warps)

    run()
    torch.cuda.synchronize()
    want = expected_sum(buf, table, layers, layer_rows, box_rows)
    got = out.sum().item()
    if abs(got - want) > 1e-3 * buf.numel() ** 0.5 + 1e-4 * abs(want):
        raise AssertionError(f"ring skeleton read {got} against {want}: a chunk was skipped or read twice")
    empty = best_us(lambda: counter.zero_())
    us = (best_us(run, iters=5) - empty) / layers
    stats = {}
    if barriers and not stall_ns:
        run(stamp=True)
        stats = barrier_stats(stamps.cpu())
    return us, layer_bytes / MB, stats


def barrier_stats(stamps: torch.Tensor) -> dict:
    """Per barrier (stamps [programs, barriers, arrive / leave] in ns, %globaltimer ticks of about
    0.26 us): how far the last arrival trails the median one, how long after it the programs
    leave, and which programs come last most often."""
    arrive, leave = stamps[..., 0].double() / 1e3, stamps[..., 1].double() / 1e3
    trail = arrive.max(0).values - arrive.median(0).values
    release = leave.median(0).values - arrive.max(0).values
    top = torch.bincount(arrive.argmax(0), minlength=stamps.shape[0]).topk(4)
    by_barrier = trail.view(-1, BARRIERS_PER_LAYER).median(0).values
    stats = {"last_after_median_us": [round(t, 2) for t in by_barrier.tolist()],
             "release_after_last_us": round(release.median().item(), 2),
             "last_programs": dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}
    return stats


def main() -> None:
    from persistent_layer_bound import layer_row, skeleton_args

    from moeserve.bench.common import record, write_results

    a, gbs = skeleton_args(__doc__)
    rows = []
    for config in CONFIGS:
        tag = "_r{}_s{}_w{}".format(*config)
        for name, flags in VARIANTS.items():
            us, mb, stats = ring_us(a.layers, config, **flags)
            rows.append(layer_row(name + tag, us, mb, gbs, chunk_kb=config[0] * ROW_BYTES // 1024, slots=config[1],
                                  warps=config[2], **stats))
            if stats:
                print(f"    last arrival after the median, per barrier of a layer: {stats['last_after_median_us']} us "
                      f"(sum {sum(stats['last_after_median_us']):.1f}); release after it "
                      f"{stats['release_after_last_us']} us; programs last most often {stats['last_programs']}")
    if a.json:
        write_results(a.json, [record("persistent_ring_bound", "cuda", workload={"layers": a.layers, "segments": SEGMENTS},
                                      read_gbs=round(gbs, 1), rows=rows)])  # fmt: skip


if __name__ == "__main__":
    main()
