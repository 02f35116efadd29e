"""`moeserve bench offline`: N random prompts submitted at once; output and total tokens/s."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING

from moeserve.bench.common import add_workload_args, random_prompts, record, write_results
from moeserve.bench.gpu_clocks import GpuClocks
from moeserve.engine.generate_cli import add_engine_args, engine_config

if TYPE_CHECKING:
    from moeserve.engine.engine import EngineCore


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench offline`."""
    p = subparsers.add_parser("offline", help="throughput of the engine on random prompts, no HTTP")
    add_engine_args(p)
    add_workload_args(p, "--num-prompts", 256)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.set_defaults(func=run)


def measure(core: EngineCore, num_prompts: int, input_len: int, output_len: int, seed: int, warmup: int = 4) -> dict:
    """All prompts submitted at once to an existing engine; wall time around the whole run."""
    from moeserve import SamplingParams

    vocab = core.model_config.vocab_size
    for i, p in enumerate(random_prompts(warmup, input_len, vocab, seed, "warmup")):
        core.add_request(f"warm-{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    retractions = core.scheduler.stats.num_retractions
    with GpuClocks() as clocks:
        start = time.perf_counter()
        for i, p in enumerate(random_prompts(num_prompts, input_len, vocab, seed)):
            core.add_request(f"offline-{i}", p, params)
        generated = 0
        while core.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in core.step())
        seconds = time.perf_counter() - start
    return dict(
        workload={"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len},
        seconds=round(seconds, 3),
        out_tok_s=round(generated / seconds, 1),
        total_tok_s=round((generated + num_prompts * input_len) / seconds, 1),
        retractions=core.scheduler.stats.num_retractions - retractions,
        gpu_clocks=clocks.summary,
    )


def run(args: argparse.Namespace) -> int:
    """Build the engine, measure, print, record."""
    from moeserve.engine.engine import EngineCore

    logging.basicConfig(level=logging.INFO)
    core = EngineCore(engine_config(args))
    fields = measure(core, args.num_prompts, args.input_len, args.output_len, args.prompt_seed, args.warmup_prompts)
    fields["engine"] = core.describe()
    name = args.name or f"offline_{args.num_prompts}x_isl{args.input_len}_osl{args.output_len}"
    result = record(name, core.device.type, **fields)
    print(f"{name}: {fields['out_tok_s']:.1f} output tok/s, {fields['total_tok_s']:.1f} total tok/s "
          f"in {fields['seconds']:.2f} s")  # fmt: skip
    write_results(args.output_file, [result])
    return 0
