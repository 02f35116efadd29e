"""GPU check of the small Triton ops: parity with the references at model shapes, then timings.

    python benchmarks/kernels/check_small_ops.py      # on a CUDA machine, well under a minute

Parity covers RMSNorm (plain and fused with the residual add) at widths 512 / 1536 / 2048 / 7168,
SiLU-and-mul, and MLA rope + norm + cache store (interleaved or not, bf16 and FP8 caches, 16 and
128 heads), plus one CUDA-graph replay. Timings replay a CUDA graph of back-to-back calls (what
decode sees) at T = 1, 64, 256, 8192 and report GB/s against the measured read bandwidth. Exits 1
when any parity check fails; writes $OUT/check_small_ops.json when OUT is set.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from ceilings import measure, time_ms  # noqa: E402

from moeserve.ops.reference import activation as ref_act  # noqa: E402
from moeserve.ops.reference import norm as ref_norm  # noqa: E402
from moeserve.ops.reference import rope as ref_rope  # noqa: E402
from moeserve.ops.triton import activation as tri_act  # noqa: E402
from moeserve.ops.triton import norm as tri_norm  # noqa: E402
from moeserve.ops.triton import rope_store as tri_rope  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
TOKENS = (1, 64, 256, 8192)
HEADS, NOPE, RANK, ROPE = 16, 128, 512, 64  # DeepSeek-V2-Lite's attention
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """Fresh standard-normal values on the GPU."""
    return torch.randn(*shape, generator=GEN).to(device="cuda", dtype=dtype)


def norm_args(tokens: int, width: int, residual: bool) -> tuple:
    """rms_norm / fused_add_rms_norm arguments; x is a column slice of a wider tensor."""
    x = randn(tokens, width + 64)[:, 32 : 32 + width]
    w = (torch.rand(width, generator=GEN) + 0.5).to("cuda", BF16)
    return (x, randn(tokens, width), w, 1e-6) if residual else (x, w, 1e-6)


def rope_args(tokens: int, heads: int, cache_dtype: torch.dtype, interleaved: bool, page_size: int = 64) -> tuple:
    """mla_rope_norm_store arguments with q_rope and kv as the model's strided views."""
    q = randn(tokens, heads, NOPE + ROPE)
    kv = randn(tokens, 2048 + RANK + ROPE)[:, 2048:]  # kv_a's output sits beside q_a's
    w = (torch.rand(RANK, generator=GEN) + 0.5).to("cuda", BF16)
    pos = torch.randint(0, 160_000, (tokens,), generator=GEN).cuda()
    inv_freq = (1.0 / 10000 ** (torch.arange(0, ROPE, 2).float() / ROPE)).cuda()
    pages = tokens // page_size + 2
    cache = randn(pages, page_size, RANK + ROPE).to(cache_dtype)
    slots = (torch.randperm((pages - 1) * page_size, generator=GEN)[:tokens] + page_size).cuda()
    kv_scale = 0.05 if cache_dtype == FP8 else 1.0
    return (pos, q[..., NOPE:], kv, w, 1e-6, inv_freq, 0.7, interleaved, cache, slots, kv_scale), q, cache


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    """(within tolerance, max abs error); FP8 caches may differ by one FP8 step on <1% of values."""
    g, w = got.float(), want.float()
    err = (g - w).abs().max().item() if g.numel() else 0.0
    if got.dtype == FP8:
        return bool((g == w).float().mean() > 0.99 and torch.allclose(g, w, rtol=0.13, atol=2**-9)), err
    rtol, atol = (1e-5, 1e-5) if got.dtype == torch.float32 else (1.6e-2, 1e-2)
    return bool(torch.allclose(g, w, rtol=rtol, atol=atol)), err


def parity_rope(tokens: int, heads: int, cache_dtype: torch.dtype, interleaved: bool, page_size: int) -> list:
    """Both implementations on copies of q and the cache; compares outputs, q and the cache."""
    args, q, cache = rope_args(tokens, heads, cache_dtype, interleaved, page_size)
    runs = []
    for impl in (tri_rope.mla_rope_norm_store, ref_rope.mla_rope_norm_store):
        q_i, cache_i = q.clone(), cache.clone()
        outs = impl(args[0], q_i[..., NOPE:], *args[2:8], cache_i, *args[9:])
        runs.append((*outs, q_i, cache_i))
    return [close(g, w) for g, w in zip(*runs, strict=True)]


def parity_checks() -> list[dict]:
    """Every parity case -> {name, ok, max_abs_err}."""
    cases: list[tuple[str, Callable[[], list]]] = []
    for width in (512, 1536, 2048, 7168):
        for tokens in (1, 257):
            a = norm_args(tokens, width, False)
            cases.append((f"rms_norm D={width} T={tokens}", lambda a=a: [close(tri_norm.rms_norm(*a), ref_norm.rms_norm(*a))]))
            a = norm_args(tokens, width, True)
            cases.append((f"fused_add_rms_norm D={width} T={tokens}", lambda a=a: [
                close(g, w) for g, w in zip(tri_norm.fused_add_rms_norm(*a), ref_norm.fused_add_rms_norm(*a), strict=True)
            ]))
    for inter in (1408, 2816, 10944):
        x = randn(300, 2 * inter)
        cases.append((f"silu_and_mul I={inter}", lambda x=x: [close(tri_act.silu_and_mul(x), ref_act.silu_and_mul(x))]))
    for heads, cache_dtype, interleaved, page_size in [
        (16, BF16, True, 1), (16, BF16, False, 64), (16, FP8, True, 64), (16, FP8, False, 16), (128, FP8, True, 16),
    ]:
        name = f"mla_rope_norm_store H={heads} cache={str(cache_dtype)[6:]} interleaved={interleaved} page={page_size}"
        cases.append((name, lambda c=(heads, cache_dtype, interleaved, page_size): parity_rope(300, *c)))
    cases.append(("cuda graph replay (norm + silu + rope store)", graph_parity))
    results = []
    for name, run in cases:
        checks = run()
        results.append({"name": name, "ok": all(ok for ok, _ in checks), "max_abs_err": max(e for _, e in checks)})
    return results


def graph_parity() -> list:
    """Capture one step of all three ops, refill the inputs, replay, compare with eager calls."""
    x, residual, w, eps = norm_args(8, 2048, True)
    gate_up = randn(8, 2 * 1408)
    args, _, _ = rope_args(8, HEADS, FP8, True)

    def step():
        return (*tri_norm.fused_add_rms_norm(x, residual, w, eps), tri_act.silu_and_mul(gate_up), *tri_rope.mla_rope_norm_store(*args))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, residual, gate_up, args[2]):
        t.copy_(torch.randn(t.shape, generator=GEN).to(t))
    args[0].copy_(torch.randint(0, 4096, args[0].shape, generator=GEN))
    graph.replay()
    return [close(g, e) for g, e in zip(captured, step(), strict=True)]


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call, replaying a CUDA graph of `reps` calls cycling over `calls`."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def reference_us(calls: list[Callable[[], object]], reps: int) -> float:
    """graph_us, or eager timing (launch gaps included) where a reference cannot be captured."""
    try:
        return graph_us(calls, reps)
    except RuntimeError as exc:
        print(f"  reference not capturable ({str(exc).splitlines()[0]}); timing it eagerly", flush=True)
        torch.cuda.synchronize()
        return time_ms(lambda: [call() for call in calls]) * 1e3 / len(calls)


def copies(nbytes: int) -> int:
    """Input sets to cycle through so the working set is several times the L2 (when it can be)."""
    return max(1, min(8, math.ceil(200e6 / max(nbytes, 1))))


def op_cases(tokens: int) -> list[tuple[str, int, Callable[[], tuple], Callable, Callable]]:
    """(name, bytes moved per call, argument maker, triton fn, reference fn) at `tokens` rows."""
    e = 2
    kv_row = (RANK + ROPE) * e
    rope_bytes = tokens * (2 * HEADS * ROPE * e + 2 * kv_row + 16)
    rope = lambda cache_dtype: (lambda: rope_args(tokens, HEADS, cache_dtype, True)[0])
    return [
        ("rms_norm D=2048", tokens * 2048 * 2 * e, lambda: norm_args(tokens, 2048, False), tri_norm.rms_norm, ref_norm.rms_norm),
        ("fused_add_rms_norm D=2048", tokens * 2048 * 4 * e, lambda: norm_args(tokens, 2048, True),
         tri_norm.fused_add_rms_norm, ref_norm.fused_add_rms_norm),
        ("fused_add_rms_norm D=7168", tokens * 7168 * 4 * e, lambda: norm_args(tokens, 7168, True),
         tri_norm.fused_add_rms_norm, ref_norm.fused_add_rms_norm),
        ("silu_and_mul I=2816", tokens * 2816 * 3 * e, lambda: (randn(tokens, 2 * 2816),), tri_act.silu_and_mul, ref_act.silu_and_mul),
        ("silu_and_mul I=10944", tokens * 10944 * 3 * e, lambda: (randn(tokens, 2 * 10944),),
         tri_act.silu_and_mul, ref_act.silu_and_mul),
        ("mla_rope_norm_store H=16 bf16 cache", rope_bytes + tokens * kv_row, rope(BF16),
         tri_rope.mla_rope_norm_store, ref_rope.mla_rope_norm_store),
        ("mla_rope_norm_store H=16 fp8 cache", rope_bytes + tokens * kv_row // 2, rope(FP8),
         tri_rope.mla_rope_norm_store, ref_rope.mla_rope_norm_store),
    ]


def timings(read_gbs: float) -> list[dict]:
    """Triton and reference microseconds per call, with the Triton kernels' GB/s."""
    rows = []
    for tokens in TOKENS:
        for name, nbytes, make, tri_fn, ref_fn in op_cases(tokens):
            arg_sets = [make() for _ in range(copies(nbytes))]
            reps = max(len(arg_sets), 40 if tokens < 8192 else 8)
            tri = graph_us([lambda a=a, f=tri_fn: f(*a) for a in arg_sets], reps)
            ref = reference_us([lambda a=a, f=ref_fn: f(*a) for a in arg_sets], reps)
            gbs = nbytes / tri / 1e3
            rows.append({
                "op": name, "tokens": tokens, "bytes": nbytes, "triton_us": round(tri, 2), "reference_us": round(ref, 2),
                "gb_s": round(gbs, 1), "pct_of_read_bw": round(100 * gbs / read_gbs, 1),
            })
            print(f"{name:38s} T={tokens:5d} {tri:9.2f} us  (reference {ref:9.2f} us)  {gbs:8.1f} GB/s  "
                  f"{100 * gbs / read_gbs:5.1f}% of read bw", flush=True)
            del arg_sets
    return rows


def main() -> int:
    """Parity first (exit 1 on any failure), then timings; JSON to $OUT when set."""
    if not torch.cuda.is_available():
        print("check_small_ops needs a CUDA device", file=sys.stderr)
        return 2
    ceilings = measure()
    print(ceilings, flush=True)
    parity = parity_checks()
    for p in parity:
        print(f"{'ok  ' if p['ok'] else 'FAIL'} {p['name']}  max abs err {p['max_abs_err']:.3g}", flush=True)
    ok = all(p["ok"] for p in parity)
    report = {"ceilings": ceilings, "parity_ok": ok, "parity": parity}
    report["timings"] = timings(ceilings["read_gbs"]) if ok else []
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_small_ops.json").write_text(json.dumps(report, indent=1))
    print("parity ok" if ok else "PARITY FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
