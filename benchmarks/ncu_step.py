"""One decode step's graph replayed between cudaProfilerStart/Stop: the window `ncu_profile.sh` profiles.

    python benchmarks/ncu_step.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256]
        [--kv-cache-dtype auto|fp8_e4m3]

A fresh engine (the suite's settings), with one decode graph captured (for --batch-size), runs that many prompts to
their first decode steps; then one replay of the graph runs inside the profiler's window, so
`ncu --profile-from-start off` sees a decode step's kernels and nothing of the start-up, the
compiles or the prompt steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import gpu_suite  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto")
    # ncu's kernel replay saves and restores what each kernel writes: leave it GPU memory.
    ap.add_argument("--mem-fraction-static", type=float, default=0.6)
    a = ap.parse_args()
    core = gpu_suite.engine(
        a.model,
        load_format=a.load_format,
        mem_fraction_static=a.mem_fraction_static,
        cuda_graph_bs=str(a.batch_size),
        kv_cache_dtype=a.kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(a.batch_size, a.input_len, core.model_config.vocab_size, a.batch_size)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    while any(len(r.output_token_ids) == 0 for r in core.requests.values()):
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    # Only the size of the last step run: another size would read a stale block table.
    graph = core.runner.graphs.graphs[core.runner.graphs.padded_size(a.batch_size)]
    torch.cuda.cudart().cudaProfilerStart()
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one b{a.batch_size} decode replay ({a.kv_cache_dtype} cache)")


if __name__ == "__main__":
    main()
