"""One decode step's graph replayed between cudaProfilerStart/Stop: the window `ncu_profile.sh` profiles.

    python benchmarks/ncu_step.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256]
        [--kv-cache-dtype auto|fp8_e4m3] [--mem-fraction-static F]

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
from moeserve.config.engine_config import EngineConfig  # noqa: E402

MAX_TOKENS = 64


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="size the KV pool by this share of the GPU instead of to the requests")
    a = ap.parse_args()
    # By default a KV pool just large enough for these requests: ncu's replay passes save and
    # restore device memory, and on an H100 a 0.6 share (a 17 GB pool) let b1 profile 4 kernels in
    # 170 s, a 0.42 share (about 2 GB) 36. A share too small shortens the contexts (0.42 at b256).
    if a.mem_fraction_static is not None:
        pool = {"mem_fraction_static": a.mem_fraction_static}
    else:
        pool = {"num_kv_pages": a.batch_size * -(-(a.input_len + MAX_TOKENS + 1) // EngineConfig.page_size)}
    core = gpu_suite.engine(
        a.model,
        load_format=a.load_format,
        **pool,
        cuda_graph_bs=str(a.batch_size),
        kv_cache_dtype=a.kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
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
