"""Fused-MoE tiles timed where they run: inside the engine's decode graph, not alone.

    python benchmarks/ab_moe_tiles.py --model DIR_OR_CONFIG [--load-format dummy] --batch-sizes 1 \
        [--part up|down|both] [--rounds 1] [--confirm 4 --confirm-rounds 3]

The tuner times each GEMM alone with L2 flushed; in a decode step the gate/up GEMM starts under
PDL behind the routing and the down GEMM behind it, so the fastest tile alone need not be the
fastest in the step. For each batch size this swaps the shipped config's up or down tile for every
candidate of a grid (the grouping and mode kept), re-captures the decode graph and times its
replay (ab_decode.py's method, variants taking turns). The best few are then timed again over
more rounds against the shipped config.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from ab_decode import decode_args, decode_engine, finish_batch, recapture, start_batch, time_replay, time_steps  # noqa: E402, I001

from moeserve.bench.common import record, write_results  # noqa: E402
from moeserve.ops.triton import fused_moe as fused_moe_module  # noqa: E402
from moeserve.ops.triton.moe_config import validate_config  # noqa: E402

SMEM_BYTES = 200 * 1024  # what a tile's stages may take (H100 / H200 give 227 KB a block)


def tile_grid(part: str, block_m: int, warp_counts: tuple[int, ...] = (4, 8)) -> list[dict]:
    """Candidate tiles of one GEMM whose pipelined operands fit in shared memory (the shipped grouping kept)."""
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), warp_counts, (3, 4, 5)):
        rows = 2 * bn if part == "up" else bn
        if stages * (rows + block_m) * bk * 2 <= SMEM_BYTES:
            out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
    return out


def candidates(shipped: dict, part: str, tokens: int, warp_counts: tuple[int, ...] = (4, 8)) -> list[tuple[str, dict]]:
    """(name, config) for each tile of `part` (or both parts, one at a time) in place of the shipped one."""
    parts = ("up", "down") if part == "both" else (part,)
    out = []
    for p in parts:
        for tile in tile_grid(p, shipped["BLOCK_M"], warp_counts):
            if all(shipped[p].get(k) == v for k, v in tile.items()):
                continue
            config = {**shipped, p: {**shipped[p], **tile}}
            if validate_config(config, tokens) is None:
                name = f"{p}_n{tile['BLOCK_N']}k{tile['BLOCK_K']}w{tile['num_warps']}s{tile['num_stages']}"
                out.append((name, config))
    return out


def patch_config(bs: int, experts: int, config: dict | None) -> None:
    """Calls with `bs` tokens over `experts` stacked experts get `config` (None: the shipped files)."""
    original = getattr(fused_moe_module, "_shipped_get_config", fused_moe_module.get_config)
    fused_moe_module._shipped_get_config = original
    if config is None:
        fused_moe_module.get_config = original
        return

    def get_config(hidden: torch.Tensor, w13: torch.Tensor, topk: int) -> dict:
        return config if hidden.shape[0] == bs and w13.shape[0] == experts else original(hidden, w13, topk)

    fused_moe_module.get_config = get_config


def shipped_call(core, bs: int) -> tuple[int, dict]:
    """(stacked experts, config) of the fused MoE call the size-`bs` decode graph makes: with the
    shared experts fused, or the routed ones alone where they run on a second stream."""
    original = fused_moe_module.get_config
    seen: dict[int, dict] = {}

    def recording(hidden: torch.Tensor, w13: torch.Tensor, topk: int) -> dict:
        config = original(hidden, w13, topk)
        if hidden.shape[0] == bs:
            seen[w13.shape[0]] = config
        return config

    fused_moe_module.get_config = recording
    try:
        recapture(core, bs)
    finally:
        fused_moe_module.get_config = original
    if len(seen) != 1:
        raise SystemExit(f"expected one fused-MoE shape at {bs} tokens, saw {sorted(seen)}")
    return next(iter(seen.items()))


def time_variants(core, bs: int, experts: int, variants: list[tuple[str, dict | None]],
                  rounds: int) -> dict[str, list[float]]:
    """Replay ms of each variant per round, variants taking turns."""
    replay: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, config in variants:
            patch_config(bs, experts, config)
            recapture(core, bs)
            time_steps(core, 4)
            replay[name].append(time_replay(core, bs, 20, 5))
    patch_config(bs, experts, None)
    return replay


def main() -> None:
    ap = decode_args(__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("up", "down", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--confirm", type=int, default=4, help="best candidates timed again")
    ap.add_argument("--confirm-rounds", type=int, default=3)
    ap.add_argument("--warps", default="4,8", help="warp counts to try")
    a = ap.parse_args()
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    core = decode_engine(a.model, a.load_format, sizes, a.kv_cache_dtype)
    device = torch.cuda.get_device_name()
    print(f"device {device}", flush=True)
    records = []
    for bs in sizes:
        experts, shipped = shipped_call(core, bs)
        grid = candidates(shipped, a.part, bs, tuple(int(w) for w in a.warps.split(",")))
        steps = (len(grid) + 1) * (a.rounds * 4 + 2) + (a.confirm + 1) * a.confirm_rounds * 4 + 64
        ids = start_batch(core, bs, a.input_len, steps, "tiles", 11 * bs)
        sweep = time_variants(core, bs, experts, [("shipped", None), *grid], a.rounds)
        best = sorted(grid, key=lambda v: statistics.median(sweep[v[0]]))[: a.confirm]
        confirm = time_variants(core, bs, experts, [("shipped", None), *best], a.confirm_rounds)
        base = statistics.median(confirm["shipped"])
        for name in ["shipped", *(n for n, _ in best)]:
            r = statistics.median(confirm[name])
            print(f"b{bs:<4d} {name:<22s} replay {r:7.3f} ms ({(r / base - 1) * 100:+5.2f}%)  sweep "
                  f"{statistics.median(sweep[name]):7.3f}  rounds {[round(x, 3) for x in confirm[name]]}", flush=True)
        sweep_ms = {name: round(statistics.median(v), 4) for name, v in sweep.items()}
        records.append(record(
            f"ab_moe_tiles_b{bs}", "cuda", workload={"batch_size": bs, "input_len": a.input_len, "part": a.part, "experts": experts},
            shipped=shipped, sweep_replay_ms=sweep_ms,
            confirmed=[{"name": n, "config": c, "replay_ms": round(statistics.median(confirm[n]), 4),
                        "vs_shipped": round(statistics.median(confirm[n]) / base - 1, 4)} for n, c in [("shipped", shipped), *best]],
        ))  # fmt: skip
        finish_batch(core, ids)
    write_results(a.output, records)


if __name__ == "__main__":
    main()
