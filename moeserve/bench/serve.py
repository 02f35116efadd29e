"""`moeserve bench serve`: load any OpenAI-compatible server (moeserve, vLLM, SGLang) over HTTP.

Shaped like vLLM's and SGLang's serving benchmarks: random or ShareGPT prompts sent to
/v1/completions as streams, arriving all at once or as a Poisson process, optionally under a
concurrency cap; it prints the familiar result block (TTFT, TPOT, ITL, E2E latency) and writes
the same numbers, plus the per-request lists, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeserve.engine.tokenizer import Tokenizer

# Requests stream for as long as the server takes; only a dead connection should end them.
REQUEST_TIMEOUT_S = 6 * 3600
# ShareGPT filtering, as in vLLM's benchmark: drop tiny turns and very long conversations.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench serve`."""
    p = subparsers.add_parser("serve", help="load an OpenAI-compatible HTTP server (moeserve, vLLM, SGLang)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: --model when it is one)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="override each conversation's output length")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--random-vocab-size", type=int, default=None, help="token ids to draw from without a tokenizer")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (default inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request runs its full length")
    p.add_argument("--output-file", default=None, help="write the results here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class BenchRequest:
    """One prompt with the number of tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What one request measured."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# -- datasets ------------------------------------------------------------------------------------


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, ratio: float, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Prompts of random token ids (sent as id lists, so their length is exact)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)  # skip the low ids, where special and byte tokens live
    ins, outs = _lengths(rng, num, input_len, ratio), _lengths(rng, num, output_len, ratio)
    return [BenchRequest([rng.randrange(low, vocab_size) for _ in range(i)], i, o) for i, o in zip(ins, outs, strict=True)]


def sharegpt_requests(path: str, num: int, tokenizer: Tokenizer | None, output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's length as the output length (vLLM's filtering)."""
    if tokenizer is None and output_len is None:
        raise ValueError("sharegpt needs a tokenizer (--tokenizer) or a fixed --sharegpt-output-len")
    data = json.loads(Path(path).read_text())
    convs = [d["conversations"] for d in data if len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)
    requests = []
    for conv in convs:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer.encode(prompt)) if tokenizer else max(1, len(prompt) // 4)
        out_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        too_short = prompt_len < SHAREGPT_MIN_LEN or out_len < SHAREGPT_MIN_LEN
        if output_len is None and (too_short or prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + out_len > SHAREGPT_MAX_TOTAL):
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
        if len(requests) == num:
            return requests
    raise ValueError(f"{path} has only {len(requests)} usable conversations, fewer than --num-prompts {num}")


def _load_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    from moeserve.engine.tokenizer import Tokenizer

    for candidate in (args.tokenizer, args.model):
        if candidate and Path(candidate).is_dir():
            tokenizer = Tokenizer.load(candidate)
            if tokenizer is not None:
                return tokenizer
    if args.tokenizer:
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    return None


def build_requests(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    """The benchmark's prompts."""
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len, args.seed)
    vocab = args.random_vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if vocab is None:
        raise ValueError("random prompts need a vocabulary size: give --tokenizer or --random-vocab-size")
    return random_requests(
        args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab, args.seed
    )


# -- requests ------------------------------------------------------------------------------------


def _stream_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def send_request(client: Any, url: str, headers: dict, model: str, req: BenchRequest, args: argparse.Namespace) -> RequestResult:
    """Stream one completion, timing the first token and every gap after it."""
    payload: dict[str, Any] = {
        "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": args.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if args.ignore_eos:
        payload["ignore_eos"] = True
    result, chunks, usage = RequestResult(prompt_len=req.prompt_len), 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in r.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"])[:300]
                    return result
                usage = obj.get("usage") or usage
                if _stream_text(obj):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as e:  # a benchmark records failures and goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = usage["completion_tokens"] if usage else chunks
    result.prompt_len = usage["prompt_tokens"] if usage else req.prompt_len
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream carried no text"
    return result


async def _arrivals(requests: list[BenchRequest], rate: float, seed: int):
    """Yield requests at Poisson arrival times (all at once for an infinite rate)."""
    rng = random.Random(seed)
    for i, req in enumerate(requests):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        yield req


async def benchmark(args: argparse.Namespace, url: str, model: str, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Warm up, then send every request; return the results and the wall time."""
    import httpx
    from rich.console import Console
    from rich.progress import Progress

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30), limits=limits) as client:
        for _ in range(args.warmup_requests):
            warm = await send_request(client, url, headers, model, requests[0], args)
            if not warm.success:
                raise ValueError(f"the warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        with Progress(console=Console(stderr=True), disable=args.no_progress, transient=True) as progress:
            bar = progress.add_task("requests", total=len(requests))

            async def one(req: BenchRequest) -> RequestResult:
                if gate is None:
                    result = await send_request(client, url, headers, model, req, args)
                else:
                    async with gate:
                        result = await send_request(client, url, headers, model, req, args)
                progress.advance(bar)
                return result

            start = time.perf_counter()
            tasks = [asyncio.create_task(one(req)) async for req in _arrivals(requests, args.request_rate, args.seed)]
            results = await asyncio.gather(*tasks)
            return list(results), time.perf_counter() - start


# -- results -------------------------------------------------------------------------------------


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values_s or [0.0]) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's result fields (throughputs, and mean/median/std/p99 of TTFT, TPOT, ITL, E2EL)."""
    ok = [r for r in results if r.success]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [gap for r in ok for gap in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_len for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft for r in ok],
        "errors": [r.error for r in results if not r.success],
    }


def format_report(m: dict[str, Any], max_concurrency: int | None, rate: float) -> str:
    """The result block vLLM and SGLang users know."""
    rows: list[str] = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        rows.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", "inf" if rate == float("inf") else f"{rate:.2f}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Input token throughput (tok/s):", m["input_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for key, title, label in [
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ]:
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):", m[f"{stat}_{key}_ms"])
    rows.append("=" * 50)
    return "\n".join(rows)


def _first_model(root: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(root + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"could not list the models at {root}/v1/models ({e}): pass --model") from None


def run(args: argparse.Namespace) -> int:
    """Build the prompts, run the benchmark, print and save the results."""
    for name in ("num_prompts", "warmup_requests", "max_concurrency", "random_input_len", "random_output_len"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup_requests" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup_requests' else 1}, got {value}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    root = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.model or _first_model(root, args.api_key)
    tokenizer = _load_tokenizer(args)
    requests = build_requests(args, tokenizer)
    results, duration = asyncio.run(benchmark(args, root + args.endpoint, model, requests))
    metrics = summarize(results, duration)
    print(format_report(metrics, args.max_concurrency, args.request_rate))
    if metrics["errors"]:
        print(f"first error: {metrics['errors'][0]}", file=sys.stderr)
    if args.output_file:
        record = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "moeserve " + " ".join(sys.argv[1:]),
            "backend": "openai",
            "base_url": root,
            "endpoint": args.endpoint,
            "model_id": model,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "warmup_requests": args.warmup_requests,
            **metrics,
        }
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if metrics["completed"] else 1
