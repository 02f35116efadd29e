"""Where a decode step's time goes: CUDA kernel times of replayed decode graphs and of a prefill.

python benchmarks/profile_step.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-sizes 1,8,64]
    [--tokens-per-step 16384]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402
from moeserve.config.engine_config import EngineConfig  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402


def table(prof, title: str, steps: int, rows: int = 40) -> None:
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"== {title}: {total / steps / 1000:.3f} ms of kernels per step")
    for e in events[:rows]:
        print(f"  {e.device_time_total / steps:9.1f} us  x{e.count // steps:<4d} {e.key[:90]}")


def _time_prefill(core: EngineCore, bs: int, input_len: int, vocab: int, params: SamplingParams) -> None:
    """Wall time to every request's first token, unprofiled, for fresh prompts (median of 3)."""
    walls = []
    for rep in range(3):
        ids = [f"t{bs}-{rep}-{i}" for i in range(bs)]
        for rid, p in zip(ids, random_prompts(bs, input_len, vocab, 1000 + rep), strict=True):
            core.add_request(rid, p, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while any(len(core.requests[r].output_token_ids) == 0 for r in ids):
            core.step()
        walls.append(time.perf_counter() - start)
        for rid in ids:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
    print(f"== prefill b{bs} isl{input_len} unprofiled wall: {sorted(walls)[1] * 1000:.1f} ms (runs {walls})")


def _cpu_profile(core: EngineCore, input_len: int) -> None:
    """Where the host's time goes in batch-1 prefills (eager launches dominate short prompts)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _time_prefill(core, 1, input_len, core.model_config.vocab_size, params)  # compile and warm up
    prof = cProfile.Profile()
    prof.enable()
    _time_prefill(core, 1, input_len, core.model_config.vocab_size, params)
    prof.disable()
    print("== host profile of 3 batch-1 prefills")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _cpu_profile_decode(core: EngineCore, bs: int, steps: int = 20) -> None:
    """Host time of decode steps by function: a short wait in collect means the GPU idled."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        core.step()
    prof.disable()
    print(f"== host profile of {steps} decode steps at b{bs}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def _time_graph_replay(core: EngineCore, bs: int) -> None:
    """GPU time of one replay of the decode graph for `bs` (CUDA events), beside the step's wall."""
    graphs = core.runner.graphs
    size = graphs.padded_size(bs) if graphs is not None else None
    if size is None:
        return
    graph = graphs.graphs[size]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"== decode b{bs}: graph b{size} replay {start.elapsed_time(end) / 20:.3f} ms on the GPU")


def _time_steps(core: EngineCore, bs: int, steps: int = 10) -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    print(f"== decode b{bs}: {(time.perf_counter() - t0) * 1000 / steps:.3f} ms wall per engine step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--tokens-per-step", type=int, default=8192, help="prompt tokens a step (chunked prefill)")
    ap.add_argument(
        "--disable-cuda-graph", action="store_true", help="eager decode: the profiler sees its kernels"
    )
    ap.add_argument(
        "--cpu-profile", action="store_true", help="also cProfile the host side of a batch-1 prefill"
    )
    a = ap.parse_args()
    core = EngineCore(
        EngineConfig(
            model=a.model,
            load_format=a.load_format,
            max_model_len=4096,
            cuda_graph_max_bs=256,
            disable_cuda_graph=a.disable_cuda_graph,
            max_num_batched_tokens=a.tokens_per_step,
            chunked_prefill_size=a.tokens_per_step,
        )
    )
    if a.cpu_profile:
        _cpu_profile(core, a.input_len)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for bs in [int(b) for b in a.batch_sizes.split(",")]:
        for i, p in enumerate(random_prompts(bs, a.input_len, vocab, bs)):
            core.add_request(f"p{bs}-{i}", p, params)
        prefill_steps = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while any(len(r.output_token_ids) == 0 for r in core.requests.values()):
                core.step()
                prefill_steps += 1
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        table(
            prof,
            f"prefill b{bs} isl{a.input_len} ({prefill_steps} steps, {wall * 1000:.1f} ms wall, profiled)",
            1,
        )
        for _ in range(5):
            core.step()
        _time_steps(core, bs)
        _time_graph_replay(core, bs)
        if a.cpu_profile:
            _cpu_profile_decode(core, bs)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                core.step()
            torch.cuda.synchronize()
        table(prof, f"decode b{bs}", 10)
        while core.has_unfinished_requests():
            core.step()
        _time_prefill(core, bs, a.input_len, vocab, params)


if __name__ == "__main__":
    main()
