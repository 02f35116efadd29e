"""GPU check of the Triton attention kernels: parity at real shapes, then speed against ceilings.

    python benchmarks/kernels/check_attention.py          # exits 1 when a parity check fails

Parity: MLA decode (bf16 / fp8 cache, H = 16 and 128, page sizes 1 / 16 / 64, ragged lengths,
replayed from a CUDA graph with new lengths), MLA extend after prefixes, varlen flash attention
(Dq = 192, Dv = 128) and the KV gather, against the PyTorch references on the same inputs.
Speed (DeepSeek-V2-Lite dims): decode time and KV GB/s vs the measured read bandwidth (at batch 1
also with W_UV and o_proj fused into the merge, counting their weights); prefill
TFLOP/s vs the measured bf16 matmul rate; a small sweep of decode split counts and tile shapes
for tuning. With OUT set, everything also goes to $OUT/check_attention.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import astuple
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the moeserve tree this file is in
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import measure  # noqa: E402

from moeserve.ops.reference import attention as ref  # noqa: E402
from moeserve.ops.triton import mla_decode_hopper  # noqa: E402
from moeserve.ops.triton.flash_attention import varlen_attention  # noqa: E402
from moeserve.ops.triton.gather_kv import gather_kv  # noqa: E402
from moeserve.ops.triton.mla_decode import mla_decode  # noqa: E402
from moeserve.ops.triton.mla_extend import mla_extend_absorbed  # noqa: E402
from moeserve.ops.triton.mla_tiles import Tiles, decode_tiles, num_splits_for  # noqa: E402

RANK, ROPE, HEADS, DQ, DV, HIDDEN = 512, 64, 16, 192, 128, 2048  # DeepSeek-V2-Lite
FP8 = torch.float8_e4m3fn
DEV = "cuda"
DECODE_CASES = [(1, 1024), (1, 32768), (1, 131072), (8, 32768), (64, 1024), (256, 1024)]  # (batch, ctx)
SWEEP_CASES = [(1, 131072), (8, 32768), (64, 1024)]
PROMPTS = (1024, 8192)  # varlen_attention, one prompt each
EXTEND = (7168, 1024)  # mla_extend_absorbed: (prefix, chunk)
# Parity shapes: ragged rows (1 token, shorter than a split, several splits, long).
DECODE_LENS = [1, 100, 777, 4096, 30000]
DECODE_CONFIGS = [(16, 64, "bf16"), (16, 1, "fp8"), (16, 16, "bf16"), (128, 16, "bf16"), (128, 64, "fp8")]
GRAPH_LENS = ([1, 2, 3, 4], [38400, 17, 640, 3000], [64, 4097, 1, 20000])  # rows of a 600 x 64 table
# (seq_lens, query_lens): one split per program; then few queries after long prefixes (split-KV).
EXTEND_LENS = [([300, 2100, 7000, 5], [300, 100, 17, 1]), ([8000, 3000], [3, 1])]
EXTEND_HEADS = [(16, "bf16"), (16, "fp8"), (128, "bf16")]
VARLEN_LENS = ([1024, 300, 1, 77], [1024, 2348, 900, 77])  # (query_lens, kv_lens)
GATHER_LENS = [1, 1000, 7000]
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def paged(seq_lens: list[int], page_size: int, dtype: torch.dtype, gen: torch.Generator, kv_scale: float = 1.0):
    """Random cache rows in shuffled pages (+ spare pages), and a page table one page too wide."""
    counts = [-(-s // page_size) for s in seq_lens]
    pages = sum(counts) + 4
    order = torch.randperm(pages, generator=gen) + 1
    cache = torch.randn(pages + 1, page_size, RANK + ROPE, device=DEV)
    cache = ref.quantize_kv(cache, dtype, kv_scale) if dtype == FP8 else cache.to(dtype)
    table = torch.zeros(len(seq_lens), max(counts) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(counts):
        table[b, :n] = order[used : used + n]
        used += n
    return cache, table.to(DEV)


def queries(rows: int, heads: int):
    q_latent = torch.randn(rows, heads, RANK, device=DEV, dtype=torch.bfloat16) * RANK**-0.25
    q_rope = torch.randn(rows, heads, 128 + ROPE, device=DEV, dtype=torch.bfloat16)[..., 128:]
    return q_latent, q_rope


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def cumsum0(lens: list[int]) -> torch.Tensor:
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()])


def parity_decode(gen: torch.Generator) -> dict:
    out = {}
    for heads, page_size, dtype in DECODE_CONFIGS:
        cache, table = paged(DECODE_LENS, page_size, DTYPES[dtype], gen, kv_scale=0.5)
        q_latent, q_rope = queries(len(DECODE_LENS), heads)
        args = (q_latent, q_rope, cache, table, i32(DECODE_LENS), 0.1, 0.5)
        out[f"decode_h{heads}_p{page_size}_{dtype}"] = rel_err(mla_decode(*args), ref.mla_decode(*args))
    return out


def parity_graph(gen: torch.Generator) -> dict:
    """Decode captured once, replayed with new lengths / tables / queries in the static buffers."""
    batch, page_size = len(GRAPH_LENS[0]), 64
    width = -(-max(max(lens) for lens in GRAPH_LENS) // page_size)
    cache, _ = paged([width * page_size] * batch, page_size, torch.bfloat16, gen)
    q_latent, q_rope = queries(batch, HEADS)
    table, lens = torch.zeros(batch, width, dtype=torch.int32, device=DEV), i32([1] * batch)
    mla_decode(q_latent, q_rope, cache, table, lens, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = mla_decode(q_latent, q_rope, cache, table, lens, 0.1)
    errs = []
    for new_lens in GRAPH_LENS:
        table.copy_(torch.randperm(cache.shape[0] - 1, generator=gen)[: batch * width].view(batch, width) + 1)
        lens.copy_(i32(new_lens))
        q_latent.copy_(torch.randn(q_latent.shape, generator=gen) * RANK**-0.25)
        graph.replay()
        errs.append(rel_err(got, ref.mla_decode(q_latent, q_rope, cache, table, lens, 0.1)))
    return {"decode_cuda_graph_replay": max(errs)}


def parity_prefill(gen: torch.Generator) -> dict:
    out = {}
    for i, (seq_lens, q_lens) in enumerate(EXTEND_LENS):
        for heads, dtype in EXTEND_HEADS:
            cache, table = paged(seq_lens, 16, DTYPES[dtype], gen, kv_scale=0.5)
            q_latent, q_rope = queries(sum(q_lens), heads)
            args = (q_latent, q_rope, cache, table, i32(seq_lens), cumsum0(q_lens), max(q_lens), 0.1, 0.5)
            got = mla_extend_absorbed(*args)
            out[f"extend{i}_h{heads}_{dtype}"] = rel_err(got, ref.mla_extend_absorbed(*args))
    q_lens, kv_lens = VARLEN_LENS
    q = torch.randn(sum(q_lens), HEADS, DQ, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(sum(kv_lens), HEADS, DQ + DV, device=DEV, dtype=torch.bfloat16)
    args = (q, kv[..., :DQ], kv[..., DQ:], cumsum0(q_lens), cumsum0(kv_lens), max(q_lens), max(kv_lens), DQ**-0.5)
    out[f"varlen_{DQ}_{DV}"] = rel_err(varlen_attention(*args), ref.varlen_attention(*args))
    for dtype in DTYPES:
        cache, table = paged(GATHER_LENS, 64, DTYPES[dtype], gen, kv_scale=0.25)
        args = (cache, table, i32(GATHER_LENS), cumsum0(GATHER_LENS), torch.bfloat16, 0.25)
        out[f"gather_{dtype}"] = rel_err(gather_kv(*args), ref.gather_kv(*args))
    return out


def time_us(fn, iters: int = 20) -> float:
    """Median GPU microseconds per call: `iters` calls captured in one CUDA graph (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # the first replay also uploads the graph
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def best_us(fn, iters: int = 20) -> float:
    """Best of three `time_us` medians: for A/Bs and sweeps, where one slow replay should not decide."""
    return min(time_us(fn, iters=iters) for _ in range(3))


def decode_case(batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator, heads: int = HEADS):
    cache, table = paged([ctx] * batch, 64, dtype, gen)
    q_latent, q_rope = queries(batch, heads)
    return (q_latent, q_rope, cache, table, i32([ctx] * batch), 0.1, 1.0), batch * ctx * (RANK + ROPE) * cache.element_size()


def bench_decode(gen: torch.Generator, read_gbs: float) -> list[dict]:
    rows = []
    for name, dtype in DTYPES.items():
        for batch, ctx in DECODE_CASES:
            args, nbytes = decode_case(batch, ctx, dtype, gen)
            us = time_us(lambda args=args: mla_decode(*args))
            tiles = decode_tiles(HEADS, torch.bfloat16, dtype, torch.device(DEV))
            splits = num_splits_for(batch, args[3].shape[1] * 64, tiles, torch.device(DEV))
            gbs = nbytes / us / 1e3
            rows.append({"kernel": "mla_decode", "kv": name, "batch": batch, "ctx": ctx, "splits": splits,
                         "us": round(us, 2), "kv_gbs": round(gbs, 1), "frac_of_read_bw": round(gbs / read_gbs, 3)})
            print(f"mla_decode {name:>4} B={batch:<4} ctx={ctx:<6} splits={splits:<4} {us:9.1f} us "
                  f"{gbs:7.0f} GB/s  ({gbs / read_gbs:.0%} of {read_gbs:.0f})")
            del args
    return rows


def bench_decode_projections(gen: torch.Generator, read_gbs: float) -> list[dict]:
    """Batch 1's decode alone, with W_UV fused into the merge, and with o_proj too (the engine's
    path), its split as the Hopper (Gluon) kernel and as the Triton one: time and GB/s over the KV
    and the weights each reads."""
    w_uv = torch.randn(HEADS, DV, RANK, device=DEV, dtype=torch.bfloat16) * RANK**-0.5
    w_o = torch.randn(HIDDEN, HEADS * DV, device=DEV, dtype=torch.bfloat16) * (HEADS * DV) ** -0.5
    rows = []
    for ctx in (1024, 4096, 32768):
        args, kv_bytes = decode_case(1, ctx, torch.bfloat16, gen)
        for name, extra in (("latent", {}), ("w_uv", {"w_uv": w_uv}), ("w_uv+o_proj", {"w_uv": w_uv, "w_o": w_o})):
            nbytes = kv_bytes + sum(w.numel() * w.element_size() for w in extra.values())
            for split in ("hopper", "triton"):
                mla_decode_hopper.ENABLED = split == "hopper"
                us = time_us(lambda args=args, extra=extra: mla_decode(*args, **extra))
                gbs = nbytes / us / 1e3
                rows.append({"kernel": f"mla_decode+{name}", "split": split, "batch": 1, "ctx": ctx, "us": round(us, 2),
                             "gbs": round(gbs, 1), "frac_of_read_bw": round(gbs / read_gbs, 3)})
                print(f"mla_decode {name:>12} B=1 ctx={ctx:<6} split {split:>6} {us:9.1f} us {gbs:7.0f} GB/s  "
                      f"({gbs / read_gbs:.0%} of {read_gbs:.0f})")
        mla_decode_hopper.ENABLED = True
        del args
    return rows


def sweep_decode(gen: torch.Generator) -> list[dict]:
    """The Triton split's counts and tile shapes around the defaults, for tuning (microseconds; the
    Hopper split, which has one tile, is off meanwhile)."""
    mla_decode_hopper.ENABLED = False
    # The defaults first; every shape here was checked for spills and shared memory with ptxas.
    variants = {
        "bf16": [Tiles(1, 16, 32, 8, 3, 2), Tiles(1, 16, 32, 8, 4, 1), Tiles(1, 16, 64, 8, 3, 1), Tiles(1, 16, 16, 4, 4, 2)],
        "fp8": [Tiles(1, 16, 32, 8, 4, 1), Tiles(1, 16, 32, 8, 3, 1), Tiles(1, 16, 16, 8, 4, 2)],
    }
    rows = []
    for name, tiles_list in variants.items():
        for batch, ctx in SWEEP_CASES:
            args, _ = decode_case(batch, ctx, DTYPES[name], gen)
            splits = num_splits_for(batch, ctx, tiles_list[0], torch.device(DEV))
            for tiles in tiles_list:
                for s in sorted({max(1, splits // 2), splits, splits * 2}):
                    us = time_us(lambda args=args, t=tiles, s=s: mla_decode(*args, num_splits=s, tiles=t), iters=10)
                    rows.append({"kv": name, "batch": batch, "ctx": ctx, "tiles": list(astuple(tiles)),
                                 "splits": s, "us": round(us, 2)})
            best = min((r for r in rows if r["batch"] == batch and r["kv"] == name), key=lambda r: r["us"])
            print(f"  sweep {name:>4} B={batch:<3} ctx={ctx:<6} best {best['us']:.1f} us: tiles {best['tiles']} splits {best['splits']}")
            del args
    mla_decode_hopper.ENABLED = True
    return rows


def bench_prefill(gen: torch.Generator, tflops: float) -> list[dict]:
    rows = []
    for n in PROMPTS:
        q = torch.randn(n, HEADS, DQ, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(n, HEADS, DQ + DV, device=DEV, dtype=torch.bfloat16)
        cu = i32([0, n])
        args = (q, kv[..., :DQ], kv[..., DQ:], cu, cu, n, n, DQ**-0.5)
        us = time_us(lambda args=args: varlen_attention(*args), iters=10)
        flops = 2 * (n * (n + 1) // 2) * HEADS * (DQ + DV)
        rows.append({"kernel": "varlen_attention", "tokens": n, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1)})
    prefix, chunk = EXTEND
    cache, table = paged([prefix + chunk], 64, torch.bfloat16, gen)
    q_latent, q_rope = queries(chunk, HEADS)
    args = (q_latent, q_rope, cache, table, i32([prefix + chunk]), i32([0, chunk]), chunk, 0.1)
    us = time_us(lambda: mla_extend_absorbed(*args), iters=10)
    flops = 2 * (chunk * prefix + chunk * (chunk + 1) // 2) * HEADS * (2 * RANK + ROPE)
    rows.append({"kernel": "mla_extend_absorbed", "tokens": chunk, "prefix": prefix, "us": round(us, 1),
                 "tflops": round(flops / us / 1e6, 1)})
    for r in rows:
        print(f"{r['kernel']:>20} tokens={r['tokens']:<5} prefix={r.get('prefix', 0):<5} {r['us']:9.1f} us "
              f"{r['tflops']:6.1f} TFLOP/s ({r['tflops'] / tflops:.0%} of {tflops:.0f})")
    return rows


TOLERANCE = 1e-2  # bf16 queries; fp8 caches are compared with the reference on the same fp8 cache


def main() -> int:
    start = time.time()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    parity = {**parity_decode(gen), **parity_graph(gen), **parity_prefill(gen)}
    failed = {k: v for k, v in parity.items() if not v < TOLERANCE}  # NaN fails too
    for name, err in parity.items():
        print(f"parity {name:32} rel err {err:.2e} {'FAIL' if name in failed else 'ok'}")
    ceilings = measure()
    print(f"ceilings: {ceilings}")
    decode = bench_decode(gen, ceilings["read_gbs"])
    projections = bench_decode_projections(gen, ceilings["read_gbs"])
    prefill = bench_prefill(gen, ceilings["bf16_tflops"])
    sweep = sweep_decode(gen)
    result = {"device": ceilings["device"], "ceilings": ceilings, "parity": parity, "parity_ok": not failed,
              "decode": decode, "decode_projections": projections, "prefill": prefill, "decode_sweep": sweep, "seconds": round(time.time() - start, 1)}
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "check_attention.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    print(f"{'PARITY FAILED: ' + ', '.join(failed) if failed else 'parity ok'} ({result['seconds']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
