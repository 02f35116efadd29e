"""A/B of decode-step variants in one engine: module constants toggled, graphs re-captured, replays timed.

    python benchmarks/ab_decode.py --model DIR_OR_CONFIG [--load-format dummy] --batch-sizes 1,8,64,256 \
        --variant base: --variant noroute:moeserve.layers.moe.NORM_ROUTE_MAX_TOKENS=0 [--rounds 3]

A variant is NAME:MODULE.CONSTANT=VALUE[,MODULE.CONSTANT=VALUE...] (an empty list is the tree as
it is). For each batch size, requests of --input-len tokens are prefilled once; then, round after
round, each variant's settings are applied, the decode graph of that size is captured again, a
few engine steps stage real inputs, and the graph's replay is timed with CUDA events. Variants
take turns within every round, so drift (clocks, growing context) falls on all of them alike.
Two builds of one tree differ by up to about 0.1% in replay.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts, record, write_results  # noqa: E402
from moeserve.bench.roofline import replay_ms  # noqa: E402
from moeserve.config.engine_config import KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402
from moeserve.executor.cuda_graph import CudaGraphRunner  # noqa: E402


def parse_variant(spec: str) -> tuple[str, list[tuple[object, str, object]]]:
    """'name:mod.CONST=1,mod.OTHER=x' -> (name, [(module, constant, value)])."""
    name, _, rest = spec.partition(":")
    settings = []
    for item in filter(None, rest.split(",")):
        target, _, raw = item.partition("=")
        module_name, _, const = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, const):
            raise SystemExit(f"{module_name} has no {const}")
        current = getattr(module, const)
        value = type(current)(raw) if not isinstance(current, bool) else raw.lower() in ("1", "true")
        settings.append((module, const, value))
    return name, settings


def apply(settings: list, defaults: dict) -> None:
    """Every known constant back to its default, then this variant's values."""
    for (module, const), value in defaults.items():
        setattr(module, const, value)
    for module, const, value in settings:
        setattr(module, const, value)


def recapture(core: EngineCore, bs: int) -> None:
    """A fresh decode graph of size `bs` (and only that size) under the current settings."""
    runner = core.runner
    old = runner.graphs
    max_pages = old.block_table.shape[1] if old is not None else -(-core.max_model_len // runner.page_size)
    runner.graphs = None
    del old
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphs = CudaGraphRunner(runner.model, runner.kv_cache, [bs], max_pages, runner.device, runner.future_tokens)
    graphs.capture(torch.cuda.graph_pool_handle(), torch.cuda.Stream())
    runner.graphs = graphs


def time_replay(core: EngineCore, bs: int, replays: int, samples: int) -> float:
    """Median over `samples` of the mean replay time (ms) of the size-`bs` graph on staged inputs."""
    graph = core.runner.graphs.graphs[bs]
    graph.replay()
    return statistics.median(replay_ms(graph, replays) for _ in range(samples))


def time_steps(core: EngineCore, steps: int) -> float:
    """Mean wall time (ms) of engine steps (host work and overlap included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def decode_args(description: str) -> argparse.ArgumentParser:
    """The flags every decode-step benchmark takes (model, weights, batch sizes, prompt, output)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--output", default=None, help="JSON list file the records are appended to")
    return ap


def decode_engine(model: str, load_format: str, sizes: list[int], kv_cache_dtype: str = "auto") -> EngineCore:
    """An engine with decode graphs of exactly `sizes` and the suite's 16,384-token prompt steps."""
    return EngineCore(EngineConfig(
        model=model, load_format=load_format, max_model_len=4096, max_num_seqs=max(sizes),
        cuda_graph_bs=",".join(map(str, sizes)), cuda_graph_prefill_tokens="",
        max_num_batched_tokens=16384, chunked_prefill_size=16384, kv_cache_dtype=kv_cache_dtype,
    ))  # fmt: skip


def start_batch(core: EngineCore, bs: int, input_len: int, max_tokens: int, tag: str, seed: int) -> list[str]:
    """`bs` random prompts of `input_len` tokens added and prefilled (each has its first token) -> ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}{bs}-{i}" for i in range(bs)]
    for rid, prompt in zip(ids, random_prompts(bs, input_len, core.model_config.vocab_size, seed), strict=True):
        core.add_request(rid, prompt, params)
    while any(len(core.requests[r].output_token_ids) == 0 for r in ids):
        core.step()
    return ids


def finish_batch(core: EngineCore, ids: list[str]) -> None:
    """Abort the batch's requests and step until the engine has released them."""
    for rid in ids:
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()


def main() -> None:
    ap = decode_args(__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variant]
    defaults = {(m, c): getattr(m, c) for _, settings in variants for m, c, _ in settings}
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    core = decode_engine(a.model, a.load_format, sizes, a.kv_cache_dtype)
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    steps_per_round = len(variants) * 8
    records: list[dict] = []
    for bs in sizes:
        ids = start_batch(core, bs, a.input_len, a.rounds * steps_per_round + 16, "ab", 7 * bs)
        replay: dict[str, list[float]] = {name: [] for name, _ in variants}
        wall: dict[str, list[float]] = {name: [] for name, _ in variants}
        for _ in range(a.rounds):
            for name, settings in variants:
                apply(settings, defaults)
                recapture(core, bs)
                wall[name].append(time_steps(core, 6))  # also stages this size's real inputs
                replay[name].append(time_replay(core, bs, a.replays, a.samples))
        finish_batch(core, ids)
        base = statistics.median(replay[variants[0][0]])
        for (name, _), spec in zip(variants, a.variant, strict=True):
            r, w = statistics.median(replay[name]), statistics.median(wall[name])
            records.append(record(
                f"ab_decode_b{bs}_{name}", "cuda",
                workload={"batch_size": bs, "input_len": a.input_len, "kv_cache_dtype": a.kv_cache_dtype},
                variant=spec, replay_ms=round(r, 4), step_wall_ms=round(w, 4), vs_first=round(r / base - 1, 4),
                replay_rounds_ms=[round(x, 4) for x in replay[name]],
            ))  # fmt: skip
            print(f"b{bs:<4d} {name:<16s} replay {r:7.3f} ms ({(r / base - 1) * 100:+5.1f}%)  step wall {w:7.3f} ms"
                  f"  rounds {[round(x, 3) for x in replay[name]]}", flush=True)
    apply([], defaults)
    write_results(a.output, records)


if __name__ == "__main__":
    main()
