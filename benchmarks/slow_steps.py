"""Which decode steps of a latency workload are slow, and why: host time, GPU wait and GC passes in each.

    python benchmarks/slow_steps.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] [--runs 2]

Wraps the engine's `step` and the runner's `collect` with clocks and times every collection with
`gc.callbacks`, then prints, for each step past 1.15x the median (and its neighbours), its wall
time, how long it waited on the GPU, the host time left, and the GC passes inside it. A step whose
host time runs long while the GPU still has the next step queued is made up by a short one after it.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script

from moeserve.bench import latency  # noqa: E402


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    steps, passes, waits, started = [], [], [], [0.0]
    step, collect = core.step, core.runner.collect

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        steps.append((t0, time.perf_counter()))
        return out

    def timed_collect(handle):
        t0 = time.perf_counter()
        out = collect(handle)
        waits.append((t0, time.perf_counter()))
        return out

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((info["generation"], started[0], time.perf_counter()))

    core.step, core.runner.collect = timed_step, timed_collect
    for run in range(a.runs):
        steps.clear(), passes.clear(), waits.clear()
        gc.callbacks.append(timer)
        f = latency.measure(core, a.batch_size, 1024, 256, 300 + run, False)
        gc.callbacks.remove(timer)
        decode = steps[-(255 + f["prefill_steps"]) :][f["prefill_steps"] :]
        median = statistics.median((b - t) * 1e3 for t, b in decode)
        print(f"run {run}: {f['seconds']} s, median step {median:.2f} ms, slow {f['slow_decode_steps']}")
        slow = {i for i, (t, b) in enumerate(decode) if (b - t) * 1e3 > 1.15 * median}
        for i in sorted(slow | {j + d for j in slow for d in (-1, 1) if 0 <= j + d < len(decode)}):
            t, b = decode[i]
            wait = sum(y - x for x, y in waits if x >= t and y <= b) * 1e3
            gcs = [(g, round((y - x) * 1e3, 2)) for g, x, y in passes if x >= t and y <= b]
            print(f"  step {i}: {(b - t) * 1e3:.2f} ms, GPU wait {wait:.2f}, host {(b - t) * 1e3 - wait:.2f}, gc {gcs}")


if __name__ == "__main__":
    main()
