"""Is a step host- or GPU-bound? Each step's host parts and the GPU span of what it launched.

    python benchmarks/step_parts.py MODEL_DIR [LOAD_FORMAT]

A fresh engine (the suite's settings) runs a warm-up b256 batch (ISL 1024, 4 tokens), then the
b256 latency batch; for its first 12 steps and its last 3 it prints the step's wall time split into schedule /
launch / collect / update, and the span between CUDA events recorded around the step's launch.
Walls that add up to more than the spans mean the GPU waited on the host; "start to start" is the
GPU time from this step's first launched work to the next step's (its span plus any idle after).
"""
import sys
import time
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402

core = gpu_suite.engine(sys.argv[1], **({"load_format": sys.argv[2]} if len(sys.argv) > 2 else {}))
parts = {}


def timed(obj, name, key):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        parts[key] = parts.get(key, 0.0) + (time.perf_counter() - t) * 1000
        return r
    setattr(obj, name, wrapper)


timed(core.scheduler, "schedule", "sched")
timed(core.scheduler, "update", "update")
timed(core.runner, "collect", "collect")
launch = core.runner.launch
gpu = []


def ev_launch(batch):
    t = time.perf_counter()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    h = launch(batch)
    b.record()
    parts["launch"] = parts.get("launch", 0.0) + (time.perf_counter() - t) * 1000
    gpu.append((a, b, sum(it.num_new_tokens for it in batch.items), len(batch.items)))
    return h


core.runner.launch = ev_launch


def run(bs, out_len, seed, tag):
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(bs, 1024, core.model_config.vocab_size, seed)):
        core.add_request(f"{tag}-{i}", p, params)
    rows = []
    step = 0
    while core.has_unfinished_requests():
        parts.clear()
        n0 = len(gpu)
        t = time.perf_counter()
        core.step()
        wall = (time.perf_counter() - t) * 1000
        rows.append((step, wall, dict(parts), n0))
        step += 1
    torch.cuda.synchronize()
    for step, wall, p, n0 in rows[:12] + rows[-3:]:
        g = gpu[n0] if n0 < len(gpu) else None
        gms = g[0].elapsed_time(g[1]) if g else 0
        nxt = gpu[n0 + 1] if n0 + 1 < len(gpu) else None
        to_next = g[0].elapsed_time(nxt[0]) if g and nxt else 0
        print(f"{tag} step {step:3d} wall {wall:6.2f} | " + " ".join(f"{k} {v:5.2f}" for k, v in p.items())
              + f" | launched {g[2] if g else 0} tok {g[3] if g else 0} rows, its GPU {gms:6.2f} ms,"
              f" start to start {to_next:6.2f}", flush=True)


run(256, 4, 1, "warm")
run(256, 256, 0, "timed")
