"""Python GC passes during a latency workload, and the slow decode steps: host time, GPU wait, GC.

    python benchmarks/gc_pauses.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] [--runs 2]

Builds the suite's engine, times every collection with `gc.callbacks` and every engine step and
GPU wait (the runner's `collect`) with clocks, and prints per generation the passes, their total
and the ones past 1 ms; then, for each decode step past 1.15x the median and its neighbours, its
wall time, its wait on the GPU, the host time left and the GC passes inside it. A step whose host
time runs long while the GPU still has the next step queued is made up by a short one after it;
only host time with no GPU work queued (a run's last step) is lost. PYTHONPATH picks the tree.
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

import moeserve  # noqa: E402
from moeserve.bench import latency  # noqa: E402

Span = tuple[float, float]
OUTPUT_LEN = 256


def slow_steps(decode: list[Span], waits: list[Span], passes: list[tuple[int, float, float]]) -> None:
    """Print the slow decode steps (and their neighbours) with their GPU wait, host time and GC passes."""
    median = statistics.median((b - t) * 1e3 for t, b in decode)
    slow = {i for i, (t, b) in enumerate(decode) if (b - t) * 1e3 > 1.15 * median}
    print(f"  median decode step {median:.2f} ms")
    for i in sorted(slow | {j + d for j in slow for d in (-1, 1) if 0 <= j + d < len(decode)}):
        t, b = decode[i]
        wait = sum(y - x for x, y in waits if x >= t and y <= b) * 1e3
        gcs = [(g, round((y - x) * 1e3, 2)) for g, x, y in passes if x >= t and y <= b]
        print(f"  step {i}: {(b - t) * 1e3:.2f} ms, GPU wait {wait:.2f}, host {(b - t) * 1e3 - wait:.2f}, gc {gcs}")


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    print("imports", moeserve.__file__, flush=True)
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    steps: list[Span] = []
    waits: list[Span] = []
    passes: list[tuple[int, float, float]] = []
    started = [0.0]
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
        steps.clear(), waits.clear(), passes.clear()
        gc.callbacks.append(timer)
        f = latency.measure(core, a.batch_size, 1024, OUTPUT_LEN, 100 * a.batch_size + run, False)
        gc.callbacks.remove(timer)
        print(f"run {run}: {f['seconds']} s, {f['out_tok_s']} tok/s, slow decode steps {f.get('slow_decode_steps')}")
        for gen in range(3):
            ms = [(y - x) * 1e3 for g, x, y in passes if g == gen]
            long = [round(t, 2) for t in ms if t > 1]
            print(f"  gen {gen}: {len(ms)} passes, {sum(ms):.1f} ms in all, past 1 ms: {long}", flush=True)
        # The timed batch's steps come last: its prompt steps, then one a decode token after the first.
        prefill = f["prefill_steps"]
        slow_steps(steps[-(prefill + OUTPUT_LEN - 1) :][prefill:], waits, passes)


if __name__ == "__main__":
    main()
