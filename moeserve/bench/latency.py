"""`moeserve bench latency`: a fixed batch; prefill time, decode step times, and the HBM floor."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import TYPE_CHECKING

from moeserve.bench.common import add_workload_args, random_prompts, record, write_results
from moeserve.bench.gpu_clocks import GpuClocks
from moeserve.engine.generate_cli import add_engine_args, engine_config

if TYPE_CHECKING:
    from moeserve.engine.engine import EngineCore


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench latency`."""
    p = subparsers.add_parser("latency", help="prefill and per-step decode latency of one batch, no HTTP")
    add_engine_args(p)
    add_workload_args(p, "--batch-size", 1)
    p.add_argument("--analyze-floor", action="store_true", help="count bytes a decode step reads vs HBM bandwidth")
    p.add_argument("--read-gbs", type=float, default=None, help="read bandwidth (GB/s); measured when omitted")
    p.set_defaults(func=run)


def run_batch(core: EngineCore, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Submit all prompts, step to completion; return step times split into prefill and decode,
    and for each decode step the keys its attention read (summed over requests)."""
    from moeserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompt_lens = {}
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
        prompt_lens[f"{tag}-{i}"] = len(p)
    started, decode_ms, decode_keys, prefill_ms, generated = time.perf_counter(), [], [], [], 0
    produced: dict[str, int] = {}
    ttft = None
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        was_decoding = ttft is not None
        outs = core.step()
        elapsed = time.perf_counter() - t0
        keys = 0
        for o in outs:
            n = produced.get(o.request_id, 0)
            # Output token n >= 1 comes from the step whose query sits at position prompt + n - 1:
            # it reads prompt + n keys.
            keys += prompt_lens[o.request_id] + n if n and o.new_token_ids else 0
            produced[o.request_id] = n + len(o.new_token_ids)
            generated += len(o.new_token_ids)
        if was_decoding:
            decode_ms.append(elapsed * 1000)
            decode_keys.append(keys)
        else:
            prefill_ms.append(elapsed * 1000)
            if len(produced) == len(prompts):
                ttft = time.perf_counter() - started
    seconds = time.perf_counter() - started
    return {"ttft_s": ttft, "decode_ms": decode_ms, "decode_keys": decode_keys, "prefill_ms": prefill_ms,
            "seconds": seconds, "generated": generated}


def decode_floor(core: EngineCore, prompts: list[list[int]], read_gbs: float | None) -> dict:
    """Run one eager decode step with routing counted -> the bytes any decode step of this batch
    reads whatever its context (dense weights, touched experts), the KV bytes a key adds, and the
    read bandwidth; `step_floors` turns them into each step's floor."""
    from moeserve import SamplingParams
    from moeserve.bench.roofline import count_touched_experts, decode_weight_bytes, read_bandwidth_gbs

    # Room for every request to outlive the prefill phase: with decodes mixed into prefill steps,
    # the first prompts decode while later ones prefill, and a request that had finished would
    # drop out of the counted step (it once counted 18 of 64 requests' experts).
    steps = len(prompts) + sum(map(len, prompts)) // core.engine.max_num_batched_tokens
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"floor-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(rid, p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in core.requests.values()):
        core.step()  # prefill until every request decodes
    graphs, core.runner.graphs = core.runner.graphs, None
    with count_touched_experts(core.runner.model) as touched:
        core.step()
    decoded = core.scheduler.stats.last_decode_batch_size
    core.runner.graphs = graphs
    for rid in ids:
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    if decoded != len(prompts):
        raise RuntimeError(f"decode floor: the counted step decoded {decoded} of {len(prompts)} requests")
    kv = core.runner.kv_cache
    per_key = core.model_config.kv_cache_dim * core.model_config.num_hidden_layers * kv.buffer.element_size()
    return dict(
        **decode_weight_bytes(core.runner.model, touched), kv_bytes_per_key=per_key,
        read_gbs=round(read_gbs or read_bandwidth_gbs(), 1), touched_experts_per_layer=touched,
        mean_touched_experts=round(sum(touched) / max(1, len(touched)), 2),
    )


def step_floors(floor: dict, decode_ms: list[float], decode_keys: list[int]) -> dict:
    """Each decode step against its own floor (its context sets its KV read) -> the floor at the
    median context, and the median, 90th-percentile and worst step-to-floor ratios."""
    fixed = floor["dense_bytes"] + floor["expert_bytes"]

    def bytes_at(keys: int) -> int:
        return fixed + keys * floor["kv_bytes_per_key"]

    ratios = sorted(ms / (bytes_at(k) / floor["read_gbs"] / 1e6) for ms, k in zip(decode_ms, decode_keys, strict=True))
    keys = int(statistics.median(decode_keys))
    hbm = dict(floor, kv_keys=keys, kv_bytes=bytes_at(keys) - fixed, total_bytes=bytes_at(keys),
               floor_ms=round(bytes_at(keys) / floor["read_gbs"] / 1e6, 3))
    p90 = ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]
    return dict(hbm_floor=hbm, floor_ratio=round(statistics.median(ratios), 3),
                floor_ratio_p90=round(p90, 3), floor_ratio_max=round(ratios[-1], 3))


def measure(core: EngineCore, batch_size: int, input_len: int, output_len: int, seed: int, analyze_floor: bool,
            read_gbs: float | None = None) -> dict:
    """Warm up, time one batch; optionally compare each decode step with its HBM floor."""
    vocab = core.model_config.vocab_size
    # Warm-up and floor prompts come from streams of their own: drawn from seed + 1, a run at
    # s + 1 timed the prompts the run at s had warmed up, straight from the prefix cache.
    run_batch(core, random_prompts(batch_size, input_len, vocab, seed, "warmup"), 4, "warmup")
    with GpuClocks() as clocks:
        res = run_batch(core, random_prompts(batch_size, input_len, vocab, seed), output_len, "timed")
    step_ms = statistics.median(res["decode_ms"]) if res["decode_ms"] else None
    fields = dict(
        workload={"batch_size": batch_size, "input_len": input_len, "output_len": output_len},
        seconds=round(res["seconds"], 4),
        out_tok_s=round(res["generated"] / res["seconds"], 1),
        ttft_s=round(res["ttft_s"], 4),
        median_decode_step_ms=round(step_ms, 3) if step_ms else None,
        # Steps until every request has its first token (prefill chunks, with decodes mixed in).
        prefill_steps=len(res["prefill_ms"]),
        prefill_step_ms=[round(ms, 1) for ms in res["prefill_ms"]],
        decode_tok_s=round(batch_size * 1000 / step_ms, 1) if step_ms else None,
        gpu_clocks=clocks.summary,
    )
    if step_ms:
        # Where the mean leaves the median: steps that took much longer than the typical one.
        slow = [(i, round(ms, 2)) for i, ms in enumerate(res["decode_ms"]) if ms > 1.2 * step_ms]
        fields.update(mean_decode_step_ms=round(statistics.fmean(res["decode_ms"]), 3), slow_decode_steps=slow[:32])
    if analyze_floor and step_ms:
        floor = decode_floor(core, random_prompts(batch_size, input_len, vocab, seed, "floor"), read_gbs)
        fields.update(step_floors(floor, res["decode_ms"], res["decode_keys"]))
    return fields


def run(args: argparse.Namespace) -> int:
    """Build the engine, measure, print, record."""
    from moeserve.engine.engine import EngineCore

    logging.basicConfig(level=logging.INFO)
    core = EngineCore(engine_config(args))
    fields = measure(core, args.batch_size, args.input_len, args.output_len, args.prompt_seed,
                     args.analyze_floor, args.read_gbs)  # fmt: skip
    fields["engine"] = core.describe()
    name = args.name or f"b{args.batch_size}_isl{args.input_len}_osl{args.output_len}"
    result = record(name, core.device.type, **fields)
    step_ms = fields["median_decode_step_ms"]
    print(
        f"{name}: ttft {fields['ttft_s'] * 1000:.1f} ms, median decode step {step_ms or 0:.2f} ms, "
        f"{fields['out_tok_s']:.1f} output tok/s over {fields['seconds']:.2f} s"
        + (f", floor {fields['hbm_floor']['floor_ms']:.2f} ms at the median context (steps x{fields['floor_ratio']} "
           f"median, x{fields['floor_ratio_p90']} p90)" if "hbm_floor" in fields else "")
    )
    write_results(args.output_file, [result])
    return 0
