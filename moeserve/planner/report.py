"""Rendering of planner answers: rich tables for people, one JSON object with --json."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from moeserve.planner.capacity import CapacityInputs, CapacityPlan
from moeserve.planner.cuda_graphs import GraphPlan, SetStats
from moeserve.planner.decode_roofline import DecodePoint, DecodeReport
from moeserve.planner.layout import GIB
from moeserve.planner.weights import WeightsPerGpu


def console() -> Console:
    """A console on the current stdout; 120 columns when it is not a terminal (pipes, docs, tests)."""
    con = Console(file=sys.stdout, highlight=False, soft_wrap=False)
    if not con.is_terminal:
        con = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=120)
    return con


def print_json(obj: dict) -> None:
    """One JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _gib(x: float) -> str:
    return f"{x:,.2f} GiB"


def capacity_table(inp: CapacityInputs, plan: CapacityPlan, computed: WeightsPerGpu) -> None:
    """Seed 000's table, row by row, for one GPU and layout."""
    lay, mfs = inp.layout, inp.mem_fraction_static
    t = Table(title=f"KV capacity: {inp.shape.name} on {inp.gpu.name}, {lay.describe()}")
    t.add_column("item")
    t.add_column("how")
    t.add_column("value", justify="right")
    weights_how = "--weights-gb-per-gpu" if plan.weights_source == "given" else (
        f"experts {inp.precision.experts}, other linears {inp.precision.dense}, embeddings bf16"
    )
    per_gpu_note = "" if plan.kv_bytes_per_token_per_gpu == plan.kv_bytes_per_token else (
        f" ({plan.kv_bytes_per_token_per_gpu:,} B on each GPU)"
    )
    rows = [
        ("HBM per GPU", "datasheet 'GB', read as GiB", _gib(plan.hbm_gb)),
        ("static budget", f"HBM x mem_fraction_static {mfs}", _gib(plan.static_budget_gb)),
        ("weights per GPU", weights_how, _gib(plan.weights_gb_per_gpu)),
        ("KV pool", "static budget - weights", _gib(plan.kv_pool_gb)),
        ("KV bytes per token", f"{inp.shape.attention.upper()}, {inp.precision.kv} KV",
         f"{plan.kv_bytes_per_token:,} B{per_gpu_note}"),
        ("KV pool in tokens", "KV pool / bytes per token", f"{plan.kv_pool_tokens:,}"),
        ("tokens per request", f"ISL {inp.isl:,} + OSL {inp.osl:,}", f"{plan.tokens_per_request:,}"),
        ("KV per request", "tokens x bytes per token", _gib(plan.kv_per_request_gib)),
        ("theoretical cap", "KV pool / KV per request",
         f"{plan.max_requests_per_gpu:.2f} req/GPU ({plan.max_whole_requests_per_gpu} whole)"),
        ("practical target", f"floor({plan.headroom:.0%} of cap)",
         f"{plan.practical_requests_per_gpu:g} req/GPU"),
        ("deployment", f"{plan.total_gpus} GPUs, {lay.attention_groups} attention group(s)",
         f"{plan.total_concurrent_requests:,} concurrent requests"),
    ]
    for row in rows:
        t.add_row(*row)
    con = console()
    con.print(t)
    if plan.weights_source == "given":
        con.print(f"(computed weights for this layout would be {_gib(computed.total / GIB)} per GPU)")


def weights_table(w: WeightsPerGpu) -> None:
    """Where the per-GPU weight bytes go."""
    t = Table(title="computed weights per GPU")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for name in ("attention", "dense_mlp", "routed_experts", "shared_experts", "router", "embedding", "lm_head"):
        t.add_row(name, f"{getattr(w, name) / GIB:,.2f}")
    t.add_row("total", f"{w.total / GIB:,.2f}")
    console().print(t)


def _decode_rows(t: Table, rows: tuple[DecodePoint, ...]) -> None:
    for p in rows:
        fits = "" if p.fits_kv is None else ("yes" if p.fits_kv else "NO")
        t.add_row(
            str(p.batch_size), f"{p.step_ms:.2f}", p.bound, f"{p.tps_per_gpu:,.0f}", f"{p.tps_per_user:,.1f}",
            f"{p.memory_ms:.2f}", f"{p.compute_ms:.2f}", f"{p.comm_ms:.2f}", f"{p.bytes_read_gb:,.1f}",
            f"{p.kv_gb:,.1f}", f"{p.distinct_experts_per_layer:.1f}", fits,
        )


def decode_table(title: str, report: DecodeReport) -> None:
    """The sweep, and the MTP sweep when there is one."""
    con = console()
    con.print(title)
    for label, rows in (("no MTP", report.rows), ("MTP", report.mtp_rows)):
        if not rows:
            continue
        if report.mtp is not None and label == "MTP":
            label = f"MTP: {report.mtp.draft_tokens} draft tokens, accept length {report.mtp.accept_length}"
        t = Table(title=label)
        for col in ("batch", "step ms", "bound", "TPS/GPU", "TPS/user", "HBM ms", "FLOP ms", "a2a ms",
                    "read GB", "KV GB", "experts hit", "fits KV"):
            t.add_column(col, justify="left" if col == "bound" else "right")
        _decode_rows(t, rows)
        con.print(t)
    cap = report.max_requests_per_gpu
    if cap is not None:
        con.print(f"KV capacity at ISL+OSL: {cap:.2f} requests per GPU ('fits KV').")
    con.print("batch = requests decoding per GPU; read GB = 1e9 bytes read from HBM per GPU per step;", soft_wrap=True)
    con.print("experts hit = distinct experts per MoE layer over the EP group, E(1-(1-k/E)^tokens).", soft_wrap=True)


def _set_row(t: Table, s: SetStats, with_kv: bool) -> None:
    lost = [f"{s.kv_tokens_lost:,}"] if with_kv and s.kv_tokens_lost is not None else []
    t.add_row(
        s.name, str(s.num_graphs), f"{s.memory_mib:,.0f}", *lost, f"{s.expected_padding:,.2f}",
        f"{s.relative_waste:.2%}", str(s.max_padding_above_128), f"{s.eager_fraction:.2%}",
    )


def graphs_table(plan: GraphPlan) -> None:
    """Padding of x2 / +64 / +8 and of the optimal set on the distribution."""
    d = plan.distribution.summary()
    con = console()
    con.print(
        f"batch sizes from {d['source']}: {d['distinct_sizes']} distinct, mean {d['mean']}, "
        f"p50 {d['p50']}, p90 {d['p90']}, p99 {d['p99']}, max {d['max']}"
    )
    for note in d["notes"]:
        con.print(f"note: {note}")
    t = Table(title=f"CUDA graph sets up to batch {plan.max_batch_size}, {plan.per_graph_mib:g} MiB per graph")
    with_kv = plan.optimized.kv_tokens_lost is not None
    cols = ("set", "graphs", "MiB", *(["KV tokens lost"] if with_kv else []), "mean pad/step", "waste",
            "max pad >128", "eager")
    for col in cols:
        t.add_column(col, justify="left" if col == "set" else "right")
    for s in (*plan.sets, plan.optimized):
        _set_row(t, s, with_kv)
    con.print(t)
    con.print(f"optimal sizes within {plan.budget_graphs} graphs: {list(plan.optimized.sizes)}", soft_wrap=True)
    con.print("waste = padded slots / slots computed; eager = steps above the largest graph (no graph).")
