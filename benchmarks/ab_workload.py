"""One latency workload over several seeds in this process's moeserve tree, for A/B across trees.

    PYTHONPATH=OTHER_TREE python benchmarks/ab_workload.py --model DIR_OR_CONFIG [--load-format dummy] \
        [--batch-size 256] [--seeds 3] --tag base

Builds the suite's engine once and times the workload (ISL 1024, OSL 256) on prompts of three
seeds of their own. Alternate calls between the trees (base, new, base, new) so drift in the
GPU's clocks falls on both; the first line names the `moeserve` each call imported.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script

import moeserve  # noqa: E402
from moeserve.bench import latency  # noqa: E402


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tag", required=True, help="name of this tree in the output")
    a = ap.parse_args()
    print(a.tag, "imports", moeserve.__file__, flush=True)
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    seconds = []
    for seed in range(a.seeds):
        f = latency.measure(core, a.batch_size, 1024, 256, 100 * a.batch_size + seed, False)
        seconds.append(f["seconds"])
        print(a.tag, f"{f['seconds']:.4f} s", f"{f['out_tok_s']} tok/s", "prompt steps (ms)", f["prefill_step_ms"],
              "decode step (ms)", f["median_decode_step_ms"], flush=True)
    median = statistics.median(seconds)
    print(a.tag, f"median {median:.4f} s, {a.batch_size * 256 / median:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
