"""The issue-4 benchmark suite on one GPU, in one process per engine configuration.

    python benchmarks/gpu_suite.py --model DIR --output FILE [--parts latency,offline,graph_sets]

Workloads are those of ../shared/targets (same names): ttft_b1_isl1024, b{1,8,64,256}_isl1024_osl256,
offline_1024x_isl1024_osl512; plus the x2 / +64 / +8 CUDA-graph set comparison at several
concurrencies. Each engine is built once and runs several workloads, so weights load once.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from moeserve.bench import latency, offline  # noqa: E402
from moeserve.bench.common import record  # noqa: E402
from moeserve.bench.roofline import read_bandwidth_gbs  # noqa: E402
from moeserve.config.engine_config import EngineConfig  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402

LATENCY = [("b1_isl1024_osl256", 1), ("b8_isl1024_osl256", 8), ("b64_isl1024_osl256", 64), ("b256_isl1024_osl256", 256)]


# Prompt tokens a step (--prefill-tokens; moeserve's own default, for serving, is 8,192). Fewer,
# longer prefill steps run the GEMMs at larger M: on one H200 b256's 256K prompt tokens took 2.319 s
# at 16,384 a step (the peer's offline default on this GPU), 2.247 at 32,768 and 2.222 at 65,536;
# on another, 2.21 at 65,536, 2.19 at 131,072 (activation peak 9.6 GiB, the KV pool 0.6 GiB
# smaller) and 2.21 at 262,144 (19 GiB).
PREFILL_TOKENS_PER_STEP = 131072


def engine(model: str, **kw) -> EngineCore:
    base = dict(model=model, max_model_len=4096, mem_fraction_static=0.9, max_num_seqs=1024, cuda_graph_max_bs=1024,
                max_num_batched_tokens=PREFILL_TOKENS_PER_STEP, chunked_prefill_size=PREFILL_TOKENS_PER_STEP)
    return EngineCore(EngineConfig(**{**base, **kw}))


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser with the engine and batch arguments the single-workload scripts share."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch-size", type=int, default=256)
    return ap


def latency_part(model: str, read_gbs: float, out: list, kw: dict, workloads: list[tuple[str, int]]) -> None:
    core = engine(model, **kw)
    desc = core.describe()
    runs = [latency.measure(core, 1, 1024, 1, seed, False) for seed in range(5)]
    ttft = sorted(runs, key=lambda r: r["ttft_s"])[len(runs) // 2]  # the median of five
    ttft["ttft_runs_s"] = [r["ttft_s"] for r in runs]
    out.append(record("ttft_b1_isl1024", "cuda", **ttft, engine=desc))
    print("ttft_b1_isl1024", ttft["ttft_runs_s"], flush=True)
    for name, bs in workloads:
        # Prompts of their own per workload: one engine serves them all, and prompts drawn from one
        # seed share their first rows, which the prefix cache would then serve (64 of b256's 256).
        fields = latency.measure(core, bs, 1024, 256, 100 * bs, True, read_gbs)
        out.append(record(name, "cuda", **fields, engine=desc))
        keys = ("out_tok_s", "ttft_s", "median_decode_step_ms", "floor_ratio", "gpu_clocks")
        print(name, {k: fields[k] for k in keys if k in fields}, flush=True)
        print(f"  {fields['prefill_steps']} prefill steps (ms): {fields['prefill_step_ms'][:40]}", flush=True)


def offline_part(model: str, out: list, kw: dict) -> None:
    core = engine(model, **kw)
    fields = offline.measure(core, 1024, 1024, 512, 0)
    out.append(record("offline_1024x_isl1024_osl512", "cuda", **fields, engine=core.describe()))
    print("offline_1024x_isl1024_osl512", fields, flush=True)


def _graph_set_rows(model: str, preset: str, kw: dict, concurrencies: list[int], isl: int, osl: int) -> list:
    """One engine with one batch-size set, measured at each concurrency (freed on return)."""
    start = time.perf_counter()
    core = engine(model, cuda_graph_bs=preset, **kw)
    startup = time.perf_counter() - start
    desc, rows = core.describe(), []
    for conc in concurrencies:
        fields = offline.measure(core, conc, isl, osl, conc)  # own prompts: no prefix hits across rows
        row = dict(set=preset, concurrency=conc, graphs=desc["cuda_graphs"], graph_mib=desc["cuda_graph_mib"],
                   kv_tokens=desc["kv_tokens"], startup_s=round(startup, 1),
                   capture_s=desc["cuda_graph_capture_s"], **fields)  # fmt: skip
        rows.append(record(f"graph_set_{preset}_c{conc}_isl{isl}_osl{osl}", "cuda", **row))
        print("graph set", preset, conc, fields["out_tok_s"], desc["cuda_graphs"], desc["cuda_graph_mib"], flush=True)
    return rows


def graph_sets_part(model: str, out: list, kw: dict, concurrencies: list[int], isl: int, osl: int) -> None:
    for preset in ("x2", "+64", "+8"):
        out.extend(_graph_set_rows(model, preset, kw, concurrencies, isl, osl))
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--parts", default="latency,offline,graph_sets")
    ap.add_argument("--concurrencies", default="160,384,800")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enable-mixed-chunk", action="store_true", help="decodes share steps with prompt chunks")
    ap.add_argument("--graph-set-isl", type=int, default=256)
    ap.add_argument("--graph-set-osl", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS_PER_STEP, help="prompt tokens a step")
    ap.add_argument("--latency-only", default=None, help="comma-separated latency workload names to run")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    read_gbs = read_bandwidth_gbs()
    print(f"device {torch.cuda.get_device_name()}, read bandwidth {read_gbs:.0f} GB/s", flush=True)
    out: list = []
    kw = dict(kv_cache_dtype=a.kv_cache_dtype, enable_mixed_chunk=a.enable_mixed_chunk,
              max_num_batched_tokens=a.prefill_tokens, chunked_prefill_size=a.prefill_tokens)
    keep = set(a.latency_only.split(",")) if a.latency_only else None
    workloads = [w for w in LATENCY if keep is None or w[0] in keep]
    parts = a.parts.split(",")
    try:
        if "latency" in parts:
            latency_part(a.model, read_gbs, out, kw, workloads)
            gc.collect()
            torch.cuda.empty_cache()
        if "offline" in parts:
            offline_part(a.model, out, kw)
            gc.collect()
            torch.cuda.empty_cache()
        if "graph_sets" in parts:
            concurrencies = [int(c) for c in a.concurrencies.split(",")]
            graph_sets_part(a.model, out, kw, concurrencies, a.graph_set_isl, a.graph_set_osl)
    finally:
        Path(a.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
