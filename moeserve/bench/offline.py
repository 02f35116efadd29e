"""`moeserve bench offline`: N random prompts submitted at once; output and total tokens/s."""

from __future__ import annotations

import argparse
import logging
import time

from moeserve.bench.common import add_workload_args, random_prompts, record, write_results
from moeserve.engine.generate_cli import add_engine_args, engine_kwargs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench offline`."""
    p = subparsers.add_parser("offline", help="throughput of the engine on random prompts, no HTTP")
    add_engine_args(p)
    add_workload_args(p, "--num-prompts", 256)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Time one generate call over all prompts, after a short warm-up."""
    from moeserve import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO)
    llm = LLM(args.model, **engine_kwargs(args))
    vocab = llm.core.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = random_prompts(args.warmup_prompts, args.input_len, vocab, args.prompt_seed + 1)
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    result = record(
        args.name or f"offline_{args.num_prompts}x_isl{args.input_len}_osl{args.output_len}",
        llm.core.device.type,
        workload={"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
        seconds=round(seconds, 3),
        out_tok_s=round(generated / seconds, 1),
        total_tok_s=round((generated + args.num_prompts * args.input_len) / seconds, 1),
        retractions=llm.core.scheduler.stats.num_retractions,
        engine=llm.core.describe(),
    )
    print(f"{result['name']}: {generated} tokens in {seconds:.2f} s: {result['out_tok_s']:.1f} output tok/s, "
          f"{result['total_tok_s']:.1f} total tok/s")
    write_results(args.output_file, [result])
    return 0
