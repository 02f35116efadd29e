"""`moeserve generate`: complete one prompt from the command line."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from moeserve.config.engine_config import (
    CUDA_GRAPH_PRESETS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    EngineConfig,
)


def _defaults() -> dict:
    """EngineConfig's field defaults: the flags repeat none of them."""
    return {f.name: f.default for f in fields(EngineConfig)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine; defaults are EngineConfig's."""
    d = _defaults()
    parser.add_argument(
        "--model",
        required=False,
        default=None,
        help="checkpoint folder (config.json + safetensors); default: the shipped demo model",
    )
    parser.add_argument("--dtype", default=d["dtype"], choices=DTYPES)
    parser.add_argument("--device", default=d["device"], help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--load-format", default=d["load_format"], choices=LOAD_FORMATS)
    parser.add_argument("--page-size", type=int, default=d["page_size"], help="tokens a KV page holds (even for fp8_e4m3)")
    parser.add_argument("--max-model-len", type=int, default=d["max_model_len"])
    parser.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"])
    parser.add_argument(
        "--chunked-prefill-size", type=int, default=d["chunked_prefill_size"], help="0 disables chunked prefill"
    )
    parser.add_argument(
        "--idle-step-tokens",
        type=int,
        default=d["idle_step_tokens"],
        help="most tokens a step launched onto an idle GPU computes (overlap mode), so the GPU starts sooner",
    )
    parser.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="decodes share steps with prefill chunks (smoother inter-token latency under arrivals)",
    )
    parser.add_argument("--kv-cache-memory-gb", type=float, default=d["kv_cache_memory_gb"])
    parser.add_argument("--mem-fraction-static", type=float, default=d["mem_fraction_static"])
    parser.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES)
    parser.add_argument("--disable-prefix-caching", action="store_true")
    parser.add_argument(
        "--cuda-graph-bs",
        default=d["cuda_graph_bs"],
        help=f"a preset ({', '.join(CUDA_GRAPH_PRESETS)}) or a comma-separated list of batch sizes",
    )
    parser.add_argument("--cuda-graph-max-bs", type=int, default=d["cuda_graph_max_bs"])
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument(
        "--cuda-graph-prefill-tokens",
        default=d["cuda_graph_prefill_tokens"],
        help="token counts of one-prompt prefill graphs (comma-separated; '' for none)",
    )
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument(
        "--mha-threshold", type=int, default=d["mha_threshold"], help="prefill uses MHA once sum(e*(e+p)) reaches it"
    )
    parser.add_argument("--seed", type=int, default=d["seed"])


def model_path(args: argparse.Namespace) -> str:
    """The --model folder, or the shipped demo model when none was given."""
    from moeserve.assets import default_model_path

    return args.model or default_model_path()


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe, the demo model standing in for a missing --model."""
    return EngineConfig(model=model_path(args), **engine_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from parsed engine flags."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "load_format": args.load_format,
        "page_size": args.page_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "idle_step_tokens": args.idle_step_tokens,
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "mem_fraction_static": args.mem_fraction_static,
        "enable_prefix_caching": not args.disable_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graph_bs": args.cuda_graph_bs,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "disable_cuda_graph": args.disable_cuda_graph,
        "cuda_graph_prefill_tokens": args.cuda_graph_prefill_tokens,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "mha_threshold": args.mha_threshold,
        "seed": args.seed,
    }


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `moeserve generate`."""
    p = subparsers.add_parser("generate", help="complete a prompt and print the result")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--verbose", action="store_true", help="log engine start-up")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Build the engine, generate, print the completion."""
    from moeserve.core.sampling_params import SamplingParams
    from moeserve.engine.llm import LLM

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(model_path(args), **engine_kwargs(args))
    out = llm.generate([args.prompt], params)[0]
    print(out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0
