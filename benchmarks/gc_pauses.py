"""Python GC passes during a latency workload: how many per generation, how long, the slow steps.

    python benchmarks/gc_pauses.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] [--runs 2]

Builds the suite's engine, times every collection with `gc.callbacks` over each run, and prints
per generation the passes, their total and the ones past 1 ms, beside the run's slow decode steps
(a pass longer than the host's slack behind the GPU shows up as one). PYTHONPATH picks the tree.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script

import moeserve  # noqa: E402
from moeserve.bench import latency  # noqa: E402


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    print("imports", moeserve.__file__, flush=True)
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    passes: list[tuple[int, float]] = []
    started = [0.0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    for run in range(a.runs):
        passes.clear()
        gc.callbacks.append(timer)
        f = latency.measure(core, a.batch_size, 1024, 256, 100 * a.batch_size + run, False)
        gc.callbacks.remove(timer)
        print(f"run {run}: {f['seconds']} s, {f['out_tok_s']} tok/s, slow decode steps {f.get('slow_decode_steps')}")
        for gen in range(3):
            ms = [t for g, t in passes if g == gen]
            long = [round(t, 2) for t in ms if t > 1]
            print(f"  gen {gen}: {len(ms)} passes, {sum(ms):.1f} ms in all, past 1 ms: {long}", flush=True)


if __name__ == "__main__":
    main()
