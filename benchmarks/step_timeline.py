"""Where a decode graph replay's time goes, kernel by kernel, with PDL's overlap accounted for.

    python benchmarks/step_timeline.py --model DIR_OR_CONFIG [--load-format dummy] [--batch-sizes 1,64,256]
        [--set MODULE.CONSTANT=VALUE ...] [--top 22]

Under programmatic dependent launch a kernel starts (and parks) before the one ahead finishes,
so kernel durations overlap and their sum exceeds the step. Here each kernel is charged the time
from the previous kernel's end to its own end, over 5 profiled replays of one decode graph: the
charges add up to the replay, and a kernel's charge is what removing it would at most save.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.append(str(Path(__file__).resolve().parents[1]))

from moeserve import SamplingParams  # noqa: E402
from moeserve.bench.common import random_prompts  # noqa: E402
from moeserve.config.engine_config import EngineConfig  # noqa: E402
from moeserve.engine.engine import EngineCore  # noqa: E402

REPLAYS = 5


def apply(setting: str) -> None:
    """'module.CONSTANT=value': set a module constant (typed like its current value) before start-up."""
    target, _, raw = setting.partition("=")
    module_name, _, const = target.rpartition(".")
    module = importlib.import_module(module_name)
    current = getattr(module, const)
    # bool("0") is True: flags read 1 / true as on, anything else as off (as ab_decode.py does).
    setattr(module, const, raw.lower() in ("1", "true") if isinstance(current, bool) else type(current)(raw))


def charges(core: EngineCore, bs: int, input_len: int) -> tuple[float, int, dict]:
    """(us per replay, kernels per replay, {kernel: (us charged per replay, calls, mean duration)})."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(bs, input_len, core.model_config.vocab_size, bs)):
        core.add_request(f"p{bs}-{i}", p, params)
    while any(len(r.output_token_ids) == 0 for r in core.requests.values()):
        core.step()
    for _ in range(5):  # real inputs staged in the graph's buffers
        core.step()
    graph = core.runner.graphs.graphs[core.runner.graphs.padded_size(bs)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.end)
    charged, durations, calls = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
    for prev, e in zip(events, events[1:], strict=False):
        charged[e.name] += e.time_range.end - prev.time_range.end
        durations[e.name] += e.time_range.end - e.time_range.start
        calls[e.name] += 1
    while core.has_unfinished_requests():
        core.step()
    span = (events[-1].time_range.end - events[0].time_range.start) / REPLAYS
    table = {n: (charged[n] / REPLAYS, calls[n] / REPLAYS, durations[n] / calls[n]) for n in charged}
    return span, len(events) // REPLAYS, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--set", action="append", default=[], help="MODULE.CONSTANT=VALUE, applied before start-up")
    ap.add_argument("--top", type=int, default=22)
    a = ap.parse_args()
    for setting in a.set:
        apply(setting)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(model=a.model, load_format=a.load_format, max_model_len=4096, cuda_graph_max_bs=max(sizes)))
    for bs in sizes:
        span, kernels, table = charges(core, bs, a.input_len)
        print(f"== b{bs}: {span:.1f} us per replay, {kernels} kernels")
        for name, (us, n, dur) in sorted(table.items(), key=lambda kv: -kv[1][0])[: a.top]:
            print(f"  {us:8.1f} us  x{n:<4.0f} {us / n:6.1f}/call (duration {dur:6.1f})  {name[:60]}")


if __name__ == "__main__":
    main()
