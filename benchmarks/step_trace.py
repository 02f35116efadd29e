"""Why a step is slow: Triton compiles and allocator retries logged against per-step wall times.

    python benchmarks/step_trace.py --model DIR [--batch-size 256] [--min-ms 150]

Runs `bench latency`'s warm-up and timed batch on the suite's engine settings, printing each step
slower than --min-ms with the kernels Triton compiled and the allocator retries during it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton import knobs

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import gpu_suite  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402

compiles: list[str] = []
launched: list[int] = []  # tokens of each step the runner launched


def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:  # noqa: A002
    # The key holds the argument specialisations and constexprs that made this variant new.
    compiles.append(f"{repr[:120]} key={str(key)[:700]}")


def run(core: EngineCore, bs: int, output_len: int, seed: int, min_ms: float, tag: str) -> None:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(bs, 1024, core.model_config.vocab_size, seed)):
        core.add_request(f"{tag}-{i}", p, params)
    step = 0
    while core.has_unfinished_requests():
        compiles.clear()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        t0 = time.perf_counter()
        core.step()
        ms = (time.perf_counter() - t0) * 1000
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
        if ms > min_ms or compiles or retries:
            decodes = sum(1 for r in core.requests.values() if r.output_token_ids)
            tokens = launched[-1] if launched else 0
            print(f"{tag} step {step}: {ms:.1f} ms, {tokens} tokens launched, {decodes} decoding, "
                  f"{retries} alloc retries", flush=True)
            for c in compiles:
                print("   compiled", c, flush=True)
        step += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--min-ms", type=float, default=150.0)
    a = ap.parse_args()
    core = gpu_suite.engine(a.model)
    knobs.runtime.jit_post_compile_hook = on_compile
    launch = core.runner.launch

    def counting_launch(batch):
        launched.append(sum(it.num_new_tokens for it in batch.items))
        return launch(batch)

    core.runner.launch = counting_launch
    run(core, a.batch_size, 4, 1, a.min_ms, "warmup")
    run(core, a.batch_size, 256, 0, a.min_ms, "timed")


if __name__ == "__main__":
    main()
