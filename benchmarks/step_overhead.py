"""What a decode step costs the GPU beyond its graph: replays timed alone and with each op the engine adds.

    python benchmarks/step_overhead.py --model DIR_OR_CONFIG [--load-format dummy] \
        [--batch-sizes 1,8,64,256] [--output FILE]

An engine step replays the decode graph and, around it, copies the next step's packed inputs to
the device, copies the sampled tokens into the future-token buffer and starts their copy to the
host. For each batch size this times (CUDA events, 30 back-to-back repetitions, after the batch
has decoded a while): the replay alone, the replay with each of those copies, all of them, whole
engine steps, and the replay alone again, so drift during the run shows as the two replay rows'
difference.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from ab_decode import decode_args, decode_engine  # noqa: E402 - beside this script

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts, record, write_results  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402


def time_us(fn: Callable[[], None], reps: int = 30) -> float:
    """Mean GPU microseconds per call of `fn` over `reps` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def variants(core: EngineCore, bs: int) -> dict[str, Callable[[], None]]:
    """The replay alone, with each per-step copy, with all of them, and a whole engine step."""
    graphs = core.runner.graphs
    assert graphs is not None
    graph = graphs.graphs[graphs.padded_size(bs)]
    future, greedy = core.runner.future_tokens, graphs.greedy_ids
    host = graphs.host_staged[0]
    size = 1 + 4 * bs + bs * 20  # ids, positions, slots, lengths and a 20-page block table

    def to_future() -> None:
        future[0, :bs].copy_(greedy[:bs])

    def to_host() -> None:
        pinned = torch.empty(bs, dtype=torch.int64, pin_memory=True)
        pinned.copy_(future[0, :bs], non_blocking=True)
        torch.cuda.Event().record()

    def inputs() -> None:
        graphs.staged[:size].copy_(host[:size], non_blocking=True)

    def run(before: tuple = (), after: tuple = ()) -> Callable[[], None]:
        def call() -> None:
            for op in before:
                op()
            graph.replay()
            for op in after:
                op()
        return call

    return {
        "replay": run(), "replay+future_copy": run(after=(to_future,)), "replay+host_copy": run(after=(to_host,)),
        "replay+input_copy": run(before=(inputs,)), "replay+all_copies": run((inputs,), (to_future, to_host)),
        "engine_step": core.step, "replay_again": run(),
    }


def main() -> None:
    a = decode_args(__doc__.splitlines()[0]).parse_args()
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    core = decode_engine(a.model, a.load_format, sizes)
    records = []
    for bs in sizes:
        ids = [f"o{bs}-{i}" for i in range(bs)]
        # Enough tokens for every timed engine step (10 warm-up decodes, then 33 timed).
        params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        for rid, prompt in zip(ids, random_prompts(bs, a.input_len, core.model_config.vocab_size, 11 * bs), strict=True):
            core.add_request(rid, prompt, params)
        while any(len(core.requests[r].output_token_ids) == 0 for r in ids):
            core.step()  # the prefill
        for _ in range(10):
            core.step()
        times = {name: time_us(fn) for name, fn in variants(core, bs).items()}
        for rid in ids:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
        print(f"b{bs}: " + "  ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
        records.append(record(f"step_overhead_b{bs}", "cuda", workload={"batch_size": bs, "input_len": a.input_len},
                              us_per_call={k: round(v, 1) for k, v in times.items()}))
    write_results(a.output, records)


if __name__ == "__main__":
    main()
