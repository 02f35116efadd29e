"""How a latency run's decode steps change as it goes: graph replay time and routing at a few steps.

    python benchmarks/decode_drift.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-size 256] \
        [--steps 1,32,96,160,224,250]

A fresh engine (the suite's settings) runs one batch of random prompts. At each listed decode
step the batch's decode graph is replayed five times on the inputs the step before staged (it
recomputes that step, rewriting the same cache rows and tokens) and timed with CUDA events; then
the step runs eagerly once with every router hooked, to count the distinct experts each layer
touched and the busiest expert's tokens. Answers whether steps slow down as the context grows or
as routing concentrates.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import gpu_suite  # noqa: E402 - beside this script
from ab_decode import time_replay  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402
from moeserve.bench.roofline import routed_expert_loads  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402


def routed_step(core: EngineCore) -> list[tuple[int, int]]:
    """One eager engine step with the routers hooked -> per MoE layer (distinct experts, busiest expert's tokens)."""
    graphs, core.runner.graphs = core.runner.graphs, None
    try:
        with routed_expert_loads(core.runner.model) as loads:
            core.step()
    finally:
        core.runner.graphs = graphs
    return [(int((load > 0).sum()), int(load.max())) for load in loads]


def main() -> None:
    ap = gpu_suite.workload_parser(__doc__)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--steps", default="1,32,96,160,224,250")
    a = ap.parse_args()
    core = gpu_suite.engine(a.model, load_format=a.load_format)
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(a.batch_size, a.input_len, core.model_config.vocab_size, 0, "drift")):
        core.add_request(f"d{i}", prompt, params)
    marks, step = {int(s) for s in a.steps.split(",")}, 0
    while core.has_unfinished_requests():
        decoding = all(r.output_token_ids for r in core.requests.values())
        if decoding and step in marks:
            graphs = core.runner.graphs
            assert graphs is not None, "decode_drift needs CUDA graphs"
            torch.cuda.synchronize()
            ms = time_replay(core, graphs.padded_size(a.batch_size), replays=5, samples=1)
            stats = routed_step(core)
            layers = max(1, len(stats))
            print(f"decode step {step}: replay {ms:.3f} ms; experts touched {sum(s[0] for s in stats) / layers:.1f} "
                  f"a layer, busiest expert {sum(s[1] for s in stats) / layers:.1f} tokens "
                  f"(most in a layer {max((s[1] for s in stats), default=0)})", flush=True)
        else:
            core.step()
        step += int(decoding)


if __name__ == "__main__":
    main()
