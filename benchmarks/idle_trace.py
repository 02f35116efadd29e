"""Where the GPU idles in one latency workload: a profiler trace of the whole run, reduced to gaps.

    python benchmarks/idle_trace.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] \
        [--trace FILE.json.gz]

A fresh engine (the suite's settings) runs the workload once to warm up, once untraced, then once
under the PyTorch profiler (CPU and CUDA). Prints the wall time, the GPU's busy time (kernels and
copies merged), the idle time before the first kernel and after the last, and the idle between
kernels by step: the first four one by one (prompt steps), the later ones as a mean.
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402


def run(core, batch_size: int, output_len: int, seed: int, tag: str) -> tuple[float, int]:
    """Submit a batch, step it to completion (each step a profiler range); -> (seconds, steps)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch_size, 1024, core.model_config.vocab_size, seed)):
        core.add_request(f"{tag}-{i}", p, params)
    start, steps = time.perf_counter(), 0
    while core.has_unfinished_requests():
        with torch.profiler.record_function(f"step{steps}"):
            core.step()
        steps += 1
    return time.perf_counter() - start, steps


def idle_report(events: list[dict]) -> dict:
    """GPU busy and idle times (ms) of a chrome trace's events, idle split by step range."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("step")), key=lambda e: e["ts"])
    starts = [s["ts"] for s in steps]
    begin, end = starts[0], steps[-1]["ts"] + steps[-1]["dur"]
    busy, idle_by_step = 0.0, [0.0] * len(steps)
    run_start, run_end = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] > run_end:
            busy += run_end - run_start
            idle_by_step[bisect.bisect_right(starts, run_end) - 1] += e["ts"] - run_end
            run_start = e["ts"]
        run_end = max(run_end, e["ts"] + e["dur"])
    busy += run_end - run_start
    return {
        "wall_ms": (end - begin) / 1000, "gpu_busy_ms": busy / 1000,
        "idle_before_first_kernel_ms": (gpu[0]["ts"] - begin) / 1000, "idle_after_last_kernel_ms": (end - run_end) / 1000,
        "idle_between_kernels_ms": sum(idle_by_step) / 1000,
        "idle_by_step_ms": [round(v / 1000, 3) for v in idle_by_step],
    }


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--trace", default=None, help="also write the chrome trace here (.json.gz)")
    a = ap.parse_args()
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    run(core, a.batch_size, 4, 1, "warm")
    print("untraced (s, steps):", run(core, a.batch_size, a.output_len, 7, "plain"), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, steps = run(core, a.batch_size, a.output_len, 0, "traced")
    path = Path(a.trace or "/tmp/idle_trace.json")
    compress = path.suffix == ".gz"
    raw = path.with_suffix("") if compress else path  # the profiler writes plain JSON only
    prof.export_chrome_trace(str(raw))
    text = raw.read_text()
    events = json.loads(text)["traceEvents"]
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
        raw.unlink()
    report = idle_report(events)
    first, rest = report["idle_by_step_ms"][:4], report["idle_by_step_ms"][4:-1]
    print(f"traced: {wall:.3f} s, {steps} steps; GPU busy {report['gpu_busy_ms']:.1f} ms of {report['wall_ms']:.1f}")
    print(f"idle before the first kernel {report['idle_before_first_kernel_ms']:.1f} ms, after the last "
          f"{report['idle_after_last_kernel_ms']:.1f} ms, between kernels {report['idle_between_kernels_ms']:.1f} ms")
    print(f"  between kernels: steps 0-3 {first} ms, later steps {sum(rest) / max(len(rest), 1) * 1000:.0f} us each")


if __name__ == "__main__":
    main()
