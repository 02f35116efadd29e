"""Tune the fused MoE kernels' block sizes for one MoE shape on this GPU and write the config JSON.

    python -m moeserve.ops.triton.tune_moe --experts 64 --hidden 2048 --inter 1408 --topk 6 \\
        [--shared 2] [--batch-sizes 1 8 64 ...] [--output DIR] [--quick] [--update]

For each batch size it times every token grouping that suits the load (dense / sorted, gemv /
swapAB / dot, BLOCK_M), and for each grouping tunes the gate/up and the down GEMM separately
(they share only the grouping), then keeps the fastest total. Weights are read cold: L2 is
flushed before every timed call, as each layer's experts are when a model runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch

from moeserve.ops.triton.fused_moe import RoutePlan, moe_down, moe_topk_sum, moe_up, plan_route
from moeserve.ops.triton.moe_config import (
    CONFIG_DIR,
    Config,
    config_file_name,
    device_capability,
    device_name,
    validate_config,
)

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096)
_SMEM_BYTES = 200 * 1024  # Hopper allows 227 KiB a block; keep headroom for the epilogue


def _gemm(bn: int, bk: int, warps: int, stages: int, group_m: int = 1) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}


def _has_tma(t: torch.Tensor) -> bool:
    """Whether `t` lives on a GPU with the tensor-memory accelerator (Hopper or later)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def candidate_groupings(tokens: int, experts: int, topk: int, quick: bool, tma: bool = False) -> list[Config]:
    """Token groupings worth timing at this load (config skeletons without GEMM tiles).

    With `tma` (Hopper), sorted dot groupings of 64+ rows are also tried with ACT_TMA.
    """
    per_expert = tokens * topk / experts
    out: list[tuple[bool, str, int]] = []
    if tokens <= 8:
        out.append((True, "gemv", max(1, 1 << (tokens - 1).bit_length())))
    if tokens <= 16:
        out.append((True, "swap", 16))
    if per_expert <= 4 and not quick:
        out += [(False, "gemv", bm) for bm in (2, 4, 8) if bm <= 2 * max(1, per_expert) + 2]
    if 0.5 <= per_expert <= 64:
        out += [(False, "swap", bm) for bm in (16, 32) if bm <= 4 * per_expert + 16]
    if per_expert >= 4:
        # Up to 4x the mean load: fused shared experts see every token, and one bigger block
        # reads their weights fewer times (on H200 at 256 tokens, 64 beat 32 by 15 us a layer).
        out += [(False, "dot", bm) for bm in (16, 32, 64, 128) if 4 * per_expert >= bm >= min(64, per_expert / 2)]
    if quick and len(out) > 3:
        out = out[:1] + out[-2:]
    groupings = [{"DENSE": d, "MODE": m, "BLOCK_M": bm} for d, m, bm in out]
    if tma:
        # Activations in block order, read back by TMA: the down GEMM 8% faster at 16K prompt
        # tokens on H200, even at 2-4K, 1% slower at 1K.
        groupings += [{**g, "ACT_TMA": True} for g in groupings if g["MODE"] == "dot" and g["BLOCK_M"] >= 64]
    return groupings


# Quick search: a few shapes per mode and GEMM that cover the likely optimum (BLOCK_N, BLOCK_K, stages).
_QUICK = {
    ("gemv", "up"): [(16, 256, 1), (32, 256, 1), (64, 128, 1)],
    ("gemv", "down"): [(32, 128, 1), (32, 256, 1), (64, 128, 1)],
    ("swap", "up"): [(32, 128, 4), (32, 256, 3), (64, 128, 4), (64, 64, 4), (16, 256, 4)],
    ("swap", "down"): [(64, 128, 4), (64, 256, 3), (128, 128, 3), (32, 128, 4), (64, 64, 5)],
    ("dot", "up"): [(64, 64, 3), (64, 64, 4), (128, 64, 3), (128, 64, 4), (64, 128, 3), (32, 128, 4)],
    ("dot", "down"): [(128, 64, 3), (128, 64, 4), (64, 64, 3), (256, 64, 3), (256, 64, 4), (128, 128, 3)],
}


def _fits(mode: str, rows: int, bn: int, bk: int, bm: int, stages: int, itemsize: int) -> bool:
    """Shared memory and accumulator registers within bounds (at 4 warps)."""
    if mode == "gemv":
        return rows * bn * bk <= 16384
    smem = (rows * bn + bm) * bk * itemsize * stages
    # Accumulator registers per thread at 8 warps: 128x256 tiles are Hopper's prefill sweet spot.
    return smem <= _SMEM_BYTES and rows * bn * bm // 256 <= 128


def candidate_gemms(grouping: Config, part: str, itemsize: int, quick: bool, tma: bool = False) -> list[dict]:
    """Tile shapes for one GEMM ('up' or 'down') under a grouping, pruned by shared memory."""
    mode, bm = grouping["MODE"], grouping["BLOCK_M"]
    rows = 2 if part == "up" else 1  # the up tile holds gate and up rows
    if quick:
        shapes = _QUICK[(mode, part)]
    elif mode == "gemv":
        shapes = [(bn, bk, 1) for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512)]
    else:
        bns = (32, 64, 128) if mode == "swap" else (64, 128, 256)
        shapes = [(bn, bk, st) for bn in bns for bk in (64, 128, 256) for st in (3, 4, 5)]
    cands = []
    for bn, bk, stages in shapes:
        if not _fits(mode, rows, bn, bk, bm, stages, itemsize):
            continue
        warps = 8 if rows * bn * bm // 128 > 64 else 4
        cands.append(_gemm(bn, bk, warps, stages, 8 if mode == "dot" else 1))
        if mode == "dot" and tma:
            # Weight tiles by TMA: H200 prefill (8192 tokens) 12-14% faster; decode sizes about even.
            cands.append({**cands[-1], "TMA": True})
    return cands


def time_us(fn: Callable[[], object], iters: int, flush: torch.Tensor | None) -> float:
    """Median GPU microseconds of `fn`, with L2 flushed before each call on the GPU.

    On the GPU `fn` is captured in a CUDA graph and replayed, as the model runs it: timing eager
    calls would measure the host's launch overhead for multi-kernel steps such as the routing.
    """
    if flush is None:  # the interpreter: wall clock, only for smoke tests
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    # Warm up (compile, lazy library set-up) on a side stream, as graph capture wants.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    fn = graph.replay
    events = []
    for _ in range(iters):
        flush.zero_()
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        fn()
        pair[1].record()
        events.append(pair)
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2] * 1e3


def _precompile(jobs: list) -> None:
    """Compile many candidates at once on a thread pool (Triton's async compile), if available."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    with ThreadPoolExecutor(max_workers=16) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for job in jobs:
            try:
                job()
            except Exception as exc:  # a candidate that cannot compile is skipped when timed
                logger.debug("precompile failed: %s", exc)


def _with(plan: RoutePlan, part: str, gemm: dict) -> RoutePlan:
    return RoutePlan(**{**plan.__dict__, "config": {**plan.config, part: gemm}})


def _best_gemm(run, plan: RoutePlan, part: str, cands: list[dict], iters: int, flush) -> tuple[dict, float]:
    """The fastest of `cands` for one GEMM; `run(plan)` launches it."""
    best, best_us = None, float("inf")
    for gemm in cands:
        try:
            us = time_us(lambda g=gemm: run(_with(plan, part, g)), iters, flush)
        except Exception as exc:  # out of shared memory or registers for this tile: skip it
            logger.debug("candidate %s failed: %s", gemm, exc)
            continue
        if us < best_us:
            best, best_us = gemm, us
    if best is None:
        raise RuntimeError(f"no {part} candidate ran for {plan.config}")
    return best, best_us


def tune_grouping(grouping: Config, inputs: dict, search: dict, flush: torch.Tensor | None) -> tuple[Config, dict]:
    """Best tiles for both GEMMs under one grouping -> (full config, timings in us)."""
    hidden, w13, w2 = inputs["hidden"], inputs["w13"], inputs["w2"]
    item, quick, cap, iters = hidden.element_size(), search["quick"], search["max_candidates"], search["iters"]
    tma = _has_tma(hidden)
    ups = candidate_gemms(grouping, "up", item, quick, tma)[:cap]
    downs = candidate_gemms(grouping, "down", item, quick, tma)
    if grouping.get("ACT_TMA"):
        downs = [g for g in downs if g.get("TMA")]  # block-order activations are read by TMA
        # Each also as one persistent program per SM (H200, 16K tokens: 833 against 900 us).
        downs = [v for g in downs for v in (g, {**g, "PERSISTENT": True})]
    downs = downs[:cap]
    skeleton = {**grouping, "up": ups[0], "down": downs[0]}
    route = lambda: plan_route(inputs["weights"], inputs["ids"], w13.shape[0], skeleton)  # noqa: E731
    plan = route()
    act = moe_up(hidden, w13, plan)
    if hidden.is_cuda:
        _precompile([lambda g=g: moe_up(hidden, w13, _with(plan, "up", g), compile_only=True) for g in ups]
                    + [lambda g=g: moe_down(act, w2, _with(plan, "down", g), compile_only=True) for g in downs])
    up, up_us = _best_gemm(lambda p: moe_up(hidden, w13, p), plan, "up", ups, iters, flush)
    down, down_us = _best_gemm(lambda p: moe_down(act, w2, p), plan, "down", downs, iters, flush)
    out = moe_down(act, w2, _with(plan, "down", down))
    times = {
        "route_us": time_us(route, iters, flush), "up_us": up_us, "down_us": down_us,
        "sum_us": time_us(lambda: moe_topk_sum(out, plan.topk), iters, flush),
    }
    times["total_us"] = sum(times.values())
    return {**grouping, "up": up, "down": down}, times


def make_inputs(tokens: int, weights: tuple[torch.Tensor, torch.Tensor], topk: int, shared: int = 0) -> dict:
    """Random hidden states and a balanced random routing (distinct experts per token).

    With `shared` > 0 the last `shared` experts are the shared ones every token uses, appended
    after its routed top-k as the model's fused path does.
    """
    w13, w2 = weights
    experts, hidden_size = w13.shape[0], w13.shape[2]
    device, dtype = w13.device, w13.dtype
    ids = torch.rand(tokens, experts - shared, device=device).topk(topk, dim=1).indices.to(torch.int32)
    if shared:
        always = torch.arange(experts - shared, experts, device=device, dtype=torch.int32)
        ids = torch.cat([ids, always.expand(tokens, shared)], dim=1)
    return {
        "hidden": torch.randn(tokens, hidden_size, device=device, dtype=dtype),
        "w13": w13, "w2": w2, "ids": ids,
        "weights": torch.rand(tokens, ids.shape[1], device=device, dtype=torch.float32),
    }


def tune_batch(tokens: int, weights: tuple, topk: int, search: dict, flush: torch.Tensor | None, shared: int = 0) -> tuple[Config, dict]:
    """The fastest config for one batch size and all candidates' timings."""
    inputs = make_inputs(tokens, weights, topk, shared)
    results = []
    w = weights[0]
    for grouping in candidate_groupings(tokens, w.shape[0], topk + shared, search["quick"], _has_tma(w)):
        try:
            results.append(tune_grouping(grouping, inputs, search, flush))
        except Exception as exc:
            logger.warning("grouping %s failed at %d tokens: %s", grouping, tokens, exc)
    if not results:
        raise RuntimeError(f"nothing ran at {tokens} tokens")
    best, times = min(results, key=lambda r: r[1]["total_us"])
    assert validate_config(best, tokens) is None
    summary = [{"DENSE": c["DENSE"], "MODE": c["MODE"], "BLOCK_M": c["BLOCK_M"], "ACT_TMA": c.get("ACT_TMA", False), **t}
               for c, t in results]
    return best, {"best": times, "all": summary}


def make_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str) -> tuple:
    """Random expert weights of the model's shape (values do not affect timing)."""
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter**-0.5
    return w13, w2


def tune(experts: int, hidden: int, inter: int, topk: int, batch_sizes: list[int], dtype: torch.dtype,
         device: str = "cuda", iters: int = 20, quick: bool = False, max_candidates: int | None = None,
         shared: int = 0) -> dict:
    """{"_meta": ..., "<tokens>": config} for every batch size (`experts` routed + `shared`)."""
    search = {"iters": iters, "quick": quick, "max_candidates": max_candidates}
    experts += shared  # the file is named by the stacked count, as the model's fused call sees it
    weights = make_weights(experts, hidden, inter, dtype, device)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device == "cuda" else None
    result: dict = {}
    timings = {}
    for tokens in batch_sizes:
        start = time.perf_counter()
        config, timings[tokens] = tune_batch(tokens, weights, topk, search, flush, shared)
        result[str(tokens)] = config
        best = timings[tokens]["best"]
        print(f"T={tokens:5d}  {best['total_us']:9.1f} us  {config['MODE']:4s} BLOCK_M={config['BLOCK_M']:3d} "
              f"dense={config['DENSE']!s:5s} up={best['up_us']:.1f} down={best['down_us']:.1f} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    meta = {"experts": experts, "shared": shared, "hidden": hidden, "inter": inter, "topk": topk, "dtype": str(dtype),
            "device": device_name(torch.device(device)), "capability": device_capability(torch.device(device)),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "timings": timings}
    return {"_meta": meta, **result}


def write_configs(configs: dict, output: Path, dtype: torch.dtype, update: bool = False) -> Path:
    """Write the tuned JSON under `output` with the name the loader looks for.

    With `update`, batch sizes tuned now replace theirs in an existing file and the rest stay.
    """
    meta = configs["_meta"]
    name = config_file_name(meta["experts"], meta["inter"], meta["hidden"], meta["device"], dtype)
    output.mkdir(parents=True, exist_ok=True)
    path = output / name
    if update and path.exists():
        old = json.loads(path.read_text())
        old_meta = old.pop("_meta")
        for key in ("experts", "shared", "hidden", "inter", "topk", "dtype"):
            if old_meta.get(key, 0) != meta.get(key, 0):
                raise ValueError(f"--update: {path} was tuned with {key}={old_meta.get(key)}, not {meta.get(key)}")
        meta["timings"] = {**old_meta.get("timings", {}), **{str(k): v for k, v in meta["timings"].items()}}
        meta["updated"] = sorted({*old_meta.get("updated", []), *(int(k) for k in configs if k != "_meta")})
        merged = {**old, **{k: v for k, v in configs.items() if k != "_meta"}}
        configs = {"_meta": meta, **dict(sorted(merged.items(), key=lambda kv: int(kv[0])))}
    path.write_text(json.dumps(configs, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> Path:
    """Command-line entry point; returns the written file."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True, help="moe_intermediate_size")
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument("--shared", type=int, default=0, help="shared experts fused in as extra experts")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--output", type=Path, default=CONFIG_DIR)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smaller search (about a third of the time)")
    parser.add_argument("--max-candidates", type=int, default=None, help="cap on tile shapes per GEMM")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--update", action="store_true", help="replace only these batch sizes in an existing file")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    configs = tune(args.experts, args.hidden, args.inter, args.topk, args.batch_sizes, dtype, args.device,
                   args.iters, args.quick, args.max_candidates, args.shared)
    path = write_configs(configs, args.output, dtype, args.update)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
