"""What the GPU runs between two decode graphs: a profiler trace of b256 decode steps, printed around one step boundary.

    python benchmarks/step_boundary.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] [--steps 48]

A fresh engine (the suite's settings) warms up, runs the workload once untraced and once under
the PyTorch profiler; then it prints every GPU event (kernels, copies, memsets) from about 200 us
before the 30th argmax kernel (the end of a decode graph) to 400 us after it, with the gap before
each: the copies and launches between one step's graph and the next.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script
from idle_trace import run  # noqa: E402 - beside this script


def boundary(events: list[dict], index: int) -> list[str]:
    """Lines for the GPU events around the index-th argmax kernel."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    argmax = [e for e in gpu if "argmax" in e["name"].lower()]
    t0 = argmax[min(index, len(argmax) - 1)]["ts"]
    lines, prev_end = [], None
    for e in (e for e in gpu if t0 - 200 <= e["ts"] <= t0 + 400):
        gap = "" if prev_end is None else f"gap {e['ts'] - prev_end:6.1f}"
        lines.append(f"t={e['ts'] - t0:8.1f} dur={e['dur']:7.1f} {gap:10s} {e['cat']:10s} {e['name'][:90]}")
        prev_end = e["ts"] + e["dur"]
    return lines


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--steps", type=int, default=48, help="tokens each request generates")
    a = ap.parse_args()
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    run(core, a.batch_size, 4, 1, "warm")
    run(core, a.batch_size, a.steps, 7, "plain")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(core, a.batch_size, a.steps, 0, "traced")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    print("\n".join(boundary(events, 30)))


if __name__ == "__main__":
    main()
