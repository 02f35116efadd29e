"""How fast could a persistent batch-1 decode layer be? Grid barriers and phase streams, no math.

    python benchmarks/kernels/persistent_layer_bound.py [--layers 26] [--json FILE]

The batch-1 floor asks for a V2-Lite layer in about 1.25 x its bytes' time. A kernel per phase
pays a launch hop per dependency (pdl_hops.py); a persistent kernel, one program per SM, pays a
grid barrier instead. This times the skeleton of such a kernel: one launch, every program
streaming its share of each phase's bytes (the engine's real byte counts at one token and 1,152
keys) and meeting the others at a barrier wherever the layer has a dependency, 26 layers of
distinct buffers (more than L2 holds). No attention or GEMV math is done, so its time is a lower
bound for a kernel that streams each phase's bytes after that phase's barrier. Rows (`_rowsR_wW`:
each program keeps two tiles of R 8 KB blocks in flight, on W warps):
- `barrier`: the barrier alone (arrive by an atomic add, spin on an acquire load), and with one
  dependent L2 read after it (a phase's first input, written by another SM before the barrier);
- `moe_stream`: the MoE's two phases (gate/up, then down) with their two barriers;
- `one_phase`: a layer's bytes as one phase, one barrier: the stream alone;
- `layer_plain`: all eight phases, each streamed after its barrier;
- `layer_early`: the same, but each program issues the loads of the next static phase (weights,
  old KV) before it waits at the barrier, as far as registers hold (64 KB a program): what PDL's
  weight preload does between kernels. Holding more of later phases' static bytes (the shared
  experts) would take asynchronous copies into shared memory kept across barriers, which this
  Triton skeleton cannot express.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import best_us  # noqa: E402

from moeserve.bench.common import record, write_results  # noqa: E402
from moeserve.bench.roofline import read_bandwidth_gbs  # noqa: E402

MB = 1 << 20
# One token's bytes per phase, V2-Lite (hidden 2048, 16 heads, latent 512 + rope 64, 6 routed +
# 2 shared experts of 1408): qkv_a, W_UK, KV at 1,152 keys, W_UV, o_proj, router, gate/up, down.
PHASES = (14.94, 2.10, 1.33, 2.10, 8.39, 0.26, 92.27, 46.14)
MOE = (0, 0, 0, 0, 0, 0, 92.27, 46.14)
# Which phases' bytes are known before their barrier (everything but the routed experts; the
# two shared experts are a quarter of the MoE's bytes).
STATIC = (1, 1, 1, 1, 1, 1, 0, 0)
BLOCK = 4096  # bf16 values a program loads per step
EARLY_BLOCKS = 8  # 8 x 4096 bf16 = 64 KB a program loaded before a barrier


@triton.jit
def _grid_barrier(counter_ptr, target, RELEASE: tl.constexpr):
    """Every program arrives; returns once `target` arrivals are counted (a monotonic counter).

    RELEASE publishes this program's earlier stores; the skeleton has none to publish, and a
    release fence would also wait for the loads issued early, which an asynchronous copy (TMA)
    into shared memory would not.
    """
    tl.debug_barrier()
    if RELEASE:
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    else:
        tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass


@triton.jit
def _barriers_kernel(counter_ptr, data_ptr, out_ptr, ROUNDS: tl.constexpr, DEPENDENT: tl.constexpr):
    """ROUNDS barriers; with DEPENDENT, each followed by a read of what another program wrote."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = 0.0
    for r in range(ROUNDS):
        if DEPENDENT:
            tl.store(data_ptr + pid, acc + r)
        _grid_barrier(counter_ptr, (r + 1) * n, DEPENDENT)
        if DEPENDENT:
            acc += tl.load(data_ptr + (pid + 1) % n, cache_modifier=".cg")
    tl.store(out_ptr + pid, acc)


@triton.jit
def _phase_base(layer, p, phase_start_ptr, LAYER_BLOCKS: tl.constexpr):
    """Element offset of phase p of `layer` in the buffer."""
    return layer.to(tl.int64) * LAYER_BLOCKS * 4096 + tl.load(phase_start_ptr + p).to(tl.int64) * 4096


@triton.jit
def _share_tile(buf_ptr, base, pid, n, b, mine, ROWS: tl.constexpr):
    """Blocks b .. b + ROWS - 1 of this program's share (pid + b * n, ...), zeros past `mine`."""
    rows = b + tl.arange(0, ROWS)
    offs = tl.arange(0, 4096)
    ptrs = buf_ptr + base + (pid + rows[:, None] * n).to(tl.int64) * 4096 + offs[None, :]
    return tl.load(ptrs, mask=(rows < mine)[:, None] & (offs >= 0)[None, :], other=0.0)


@triton.jit
def _early_tile(buf_ptr, layer, p, phase_blocks_ptr, phase_start_ptr, static_ptr, pid, n,
                LAYERS: tl.constexpr, LAYER_BLOCKS: tl.constexpr, EARLY_BLOCKS: tl.constexpr):
    """This program's first EARLY_BLOCKS blocks of phase p (zeros past its share, or if not static)."""
    mine = (tl.load(phase_blocks_ptr + p) + n - 1 - pid) // n
    count = tl.minimum(mine, EARLY_BLOCKS) * tl.load(static_ptr + p) * (layer < LAYERS)
    base = _phase_base(layer, p, phase_start_ptr, LAYER_BLOCKS)
    return _share_tile(buf_ptr, base, pid, n, 0, count, EARLY_BLOCKS)


@triton.jit
def _stream_share(buf_ptr, base, pid, n, done, mine, acc, ROWS: tl.constexpr):
    """acc + the sum of this program's blocks done .. mine - 1, two ROWS-block tiles in flight
    (pipelined by hand: Triton does not pipeline loads that feed no dot)."""
    b = done
    cur = _share_tile(buf_ptr, base, pid, n, b, mine, ROWS)
    while b < mine:
        nxt = _share_tile(buf_ptr, base, pid, n, b + ROWS, mine, ROWS)
        acc += tl.sum(tl.sum(cur.to(tl.float32), axis=1), axis=0)
        cur = nxt
        b += ROWS
    return acc


@triton.jit
def _layers_kernel(buf_ptr, counter_ptr, out_ptr, phase_blocks_ptr, phase_start_ptr, static_ptr,
                   LAYERS: tl.constexpr, PHASES: tl.constexpr, LAYER_BLOCKS: tl.constexpr, EARLY: tl.constexpr,
                   EARLY_BLOCKS: tl.constexpr, ROWS: tl.constexpr):
    """Each phase of each layer: this program's share of its blocks, then a barrier."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = 0.0
    if EARLY:
        held = _early_tile(buf_ptr, pid * 0, pid * 0, phase_blocks_ptr, phase_start_ptr, static_ptr, pid, n,
                           LAYERS, LAYER_BLOCKS, EARLY_BLOCKS)
    for layer in range(LAYERS):
        for p in range(PHASES):
            mine = (tl.load(phase_blocks_ptr + p) + n - 1 - pid) // n  # blocks pid, pid + n, ...
            base = _phase_base(layer, p, phase_start_ptr, LAYER_BLOCKS)
            done = 0
            if EARLY:
                acc += tl.sum(tl.sum(held.to(tl.float32), axis=1), axis=0)  # loaded before the last barrier
                done = tl.minimum(mine, EARLY_BLOCKS) * tl.load(static_ptr + p)
            acc = _stream_share(buf_ptr, base, pid, n, done, mine, acc, ROWS)
            if EARLY:
                # The next phase's first blocks, issued now and summed after the barrier.
                q = (p + 1) % PHASES
                held = _early_tile(buf_ptr, layer + (p + 1) // PHASES, q, phase_blocks_ptr, phase_start_ptr,
                                   static_ptr, pid, n, LAYERS, LAYER_BLOCKS, EARLY_BLOCKS)
            _grid_barrier(counter_ptr, (layer * PHASES + p + 1) * n, False)
    tl.store(out_ptr + pid, acc)


def barrier_us(rounds: int, dependent: bool) -> float:
    """Microseconds per barrier over `rounds` in one launch of one program per SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    data = torch.zeros(sms, dtype=torch.float32, device="cuda")
    out = torch.empty(sms, dtype=torch.float32, device="cuda")

    def run() -> None:
        counter.zero_()
        _barriers_kernel[(sms,)](counter, data, out, ROUNDS=rounds, DEPENDENT=dependent, num_warps=4)

    run()
    empty = best_us(lambda: counter.zero_())
    return (best_us(run) - empty) / rounds


def layers_us(phases: tuple[float, ...], layers: int, early: bool, rows: int, warps: int) -> tuple[float, float]:
    """(us per layer, MB per layer) of the skeleton over `layers` layers of distinct buffers."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = [round(mb * MB / 2 / BLOCK) for mb in phases]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    layer_blocks = sum(blocks)
    buf = torch.randn(layers * layer_blocks * BLOCK, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(sms, dtype=torch.float32, device="cuda")
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    args = (i32(blocks), i32(starts), i32(list(STATIC) if len(phases) == len(STATIC) else [0] * len(phases)))

    def run() -> None:
        counter.zero_()
        _layers_kernel[(sms,)](buf, counter, out, *args, LAYERS=layers, PHASES=len(phases), LAYER_BLOCKS=layer_blocks,
                               EARLY=early, EARLY_BLOCKS=EARLY_BLOCKS, ROWS=rows, num_warps=warps)

    run()
    torch.cuda.synchronize()
    want = buf.sum(dtype=torch.float32).item()
    got = out.sum().item()
    if abs(got - want) > 1e-3 * buf.numel() ** 0.5 + 1e-4 * abs(want):
        raise AssertionError(f"skeleton read {got} against {want}: a block was skipped or read twice")
    empty = best_us(lambda: counter.zero_())
    us = (best_us(run, iters=5) - empty) / layers

    return us, layer_blocks * BLOCK * 2 / MB


def layer_row(name: str, us: float, mb: float, gbs: float, **extra) -> dict:
    """A skeleton's row, printed: us a layer against the layer's bytes at the read rate."""
    floor = mb * MB / (gbs * 1e3)
    print(f"{name:<32s} {us:7.2f} us a layer for {mb:6.1f} MB ({floor:5.1f} us at {gbs:.0f} GB/s): {us / floor:.2f}x")
    return {"variant": name, "us_per_layer": round(us, 2), "mb_per_layer": round(mb, 2), **extra,
            "floor_us": round(floor, 2), "ratio": round(us / floor, 3)}


def skeleton_args(doc: str) -> tuple[argparse.Namespace, float]:
    """--layers and --json, and the device's read bandwidth in GB/s (printed)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gbs = read_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: read bandwidth {gbs:.0f} GB/s")
    return args, gbs


def report(rows: list, name: str, phases: tuple, early: bool, tile_rows: int, warps: int, layers: int, gbs: float) -> float:
    """Time one skeleton, print it and append its row; -> us a layer."""
    us, mb = layers_us(phases, layers, early, tile_rows, warps)
    rows.append(layer_row(name, us, mb, gbs, barriers_per_layer=len(phases), tile_rows=tile_rows, warps=warps))
    return us


def main() -> None:
    a, gbs = skeleton_args(__doc__)
    rows = []
    for dependent in (False, True):
        us = barrier_us(200, dependent)
        name = "barrier_then_l2_read" if dependent else "barrier"
        rows.append({"variant": name, "us": round(us, 3)})
        print(f"{name:<22s} {us:6.2f} us")
    moe = tuple(mb for mb in MOE if mb)
    tiles = {}
    for tile_rows, warps in ((4, 8), (8, 8), (8, 16), (16, 16)):
        tiles[(tile_rows, warps)] = report(rows, f"moe_stream_rows{tile_rows}_w{warps}", moe, False, tile_rows, warps, a.layers, gbs)
    # The best stream's tile, and (4, 8), whose registers leave room for the early blocks.
    for tile in sorted({min(tiles, key=tiles.get), (4, 8)}):
        for name, phases, early in (("one_phase", (sum(PHASES),), False), ("layer_plain", PHASES, False),
                                    ("layer_early", PHASES, True)):
            report(rows, f"{name}_rows{tile[0]}_w{tile[1]}", phases, early, *tile, a.layers, gbs)
    if a.json:
        write_results(a.json, [record("persistent_layer_bound", "cuda", workload={"layers": a.layers, "phases_mb": PHASES},
                                      read_gbs=round(gbs, 1), rows=rows)])  # fmt: skip


if __name__ == "__main__":
    main()
