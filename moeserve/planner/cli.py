"""`moeserve plan {capacity,decode,cuda-graphs}`: argument parsing and dispatch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict

from moeserve.planner.capacity import UNITS, CapacityInputs, plan_capacity, weights_bytes
from moeserve.planner.hardware import DTYPES, PRESETS, resolve_gpu
from moeserve.planner.histogram import DEFAULT_METRIC, SYNTHETIC_HELP, load_histogram, synthetic
from moeserve.planner.layout import KV_DTYPES, Layout, Precision, auto_dp_attention
from moeserve.planner.model_shape import builtin_shapes, load_model_shape

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", default="deepseek-v3",
                   help=f"config.json path, a folder holding one, or a built-in shape ({', '.join(builtin_shapes())})")
    p.add_argument("--gpu", help=f"GPU preset: {', '.join(PRESETS)}")
    p.add_argument("--gpu-spec", metavar="FILE", help="JSON file with GpuSpec fields, for GPUs without a preset")
    p.add_argument("--weight-dtype", choices=DTYPES, default="fp8", help="routed-expert weights (default fp8)")
    p.add_argument("--dense-weight-dtype", choices=DTYPES,
                   help="attention / dense MLP / shared experts (default: fp8 when experts are fp4, else same)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache element type (default bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    p.add_argument("--dp-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="replicate attention on every GPU, each with its own requests (default: on when EP > 1)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs in the deployment (default: one instance, max(TP, EP))")
    p.add_argument("--mem-fraction-static", type=float, default=0.75,
                   help="share of HBM for weights + KV cache (default 0.75, seed 000's setting)")
    p.add_argument("--weights-gb-per-gpu", type=float,
                   help="weight GiB per GPU, replacing the computed figure (seed 000 uses 40)")
    p.add_argument("--isl", type=int, default=128_000, help="input tokens per request (default 128000)")
    p.add_argument("--osl", type=int, default=8_000, help="output tokens per request (default 8000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _capacity_inputs(args: argparse.Namespace, headroom: float = 0.85) -> CapacityInputs:
    layout = Layout(args.tp, args.ep, auto_dp_attention(args.dp_attention, args.ep), args.gpus)
    return CapacityInputs(
        shape=load_model_shape(args.model_config),
        gpu=resolve_gpu(args.gpu, args.gpu_spec),
        precision=Precision.for_weights(args.weight_dtype, args.kv_dtype, args.dense_weight_dtype),
        layout=layout,
        mem_fraction_static=args.mem_fraction_static,
        isl=args.isl,
        osl=args.osl,
        headroom=headroom,
        weights_gb_per_gpu=args.weights_gb_per_gpu,
    )


def _context_json(inp: CapacityInputs) -> dict:
    lay = inp.layout
    return {
        "model": inp.shape.name,
        "gpu": inp.gpu.to_dict(),
        "layout": {"tp": lay.tp, "ep": lay.ep, "dp_attention": lay.dp_attention, "gpus": lay.total_gpus},
        "precision": asdict(inp.precision),
        "mem_fraction_static": inp.mem_fraction_static,
        "isl": inp.isl,
        "osl": inp.osl,
    }


def run_capacity(args: argparse.Namespace) -> int:
    """`plan capacity`: seed 000's KV capacity table for any model, GPU and layout."""
    from moeserve.planner import report

    inp = _capacity_inputs(args, args.headroom)
    plan = plan_capacity(inp)
    _, _, computed = weights_bytes(inp)
    if args.json:
        weights = {k: round(v / 2**30, 3) for k, v in asdict(computed).items()}
        report.print_json({**plan.to_dict(), **_context_json(inp),
                           "computed_weights_gb_per_gpu": weights, "units": UNITS})
    else:
        report.capacity_table(inp, plan, computed)
        if plan.weights_source == "computed":
            report.weights_table(computed)
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes wants integers like {DEFAULT_BATCHES}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("--batch-sizes must be integers >= 1")
    return sizes


def run_decode(args: argparse.Namespace) -> int:
    """`plan decode`: the roofline sweep over batch sizes, with MTP when an accept length is given."""
    from moeserve.planner import report
    from moeserve.planner.decode_roofline import DecodeInputs, MtpConfig, sweep

    cap_inp = _capacity_inputs(args)
    context = args.context if args.context is not None else args.isl + args.osl // 2
    inp = DecodeInputs(
        cap_inp.shape, cap_inp.gpu, cap_inp.precision, cap_inp.layout, context,
        args.mem_efficiency, args.compute_efficiency, args.a2a_latency_us, args.overlap_comm,
    )
    mtp = None if args.mtp_accept_length is None else MtpConfig(args.mtp_draft_tokens, args.mtp_accept_length)
    cap = plan_capacity(cap_inp).max_requests_per_gpu
    result = sweep(inp, args.batch_sizes, mtp, cap)
    title = (f"decode roofline: {cap_inp.shape.name} on {cap_inp.gpu.name}, {cap_inp.layout.describe()}, "
             f"context {context:,} tokens")
    if args.plot:
        from moeserve.planner.plots import plot_decode

        plot_decode(result, args.plot, title)
    if args.json:
        report.print_json({**result.to_dict(), **_context_json(cap_inp),
                           "plot": args.plot, "overlap_comm": args.overlap_comm})
    else:
        report.decode_table(title, result)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def run_cuda_graphs(args: argparse.Namespace) -> int:
    """`plan cuda-graphs`: padding of seed 003's sets on a distribution, and the best set in a budget."""
    from moeserve.planner import report
    from moeserve.planner.capacity import kv_bytes_per_token
    from moeserve.planner.cuda_graphs import optimal_sizes, plan_graphs

    if args.histogram:
        dist = load_histogram(args.histogram, args.metric)
    else:
        dist = synthetic(args.distribution, args.max_batch_size)
    kv = None
    if args.model_config:
        kv = kv_bytes_per_token(load_model_shape(args.model_config), args.kv_dtype)
    plan = plan_graphs(dist, args.per_graph_mb, args.max_batch_size, args.max_graphs, args.graph_memory_mb, kv)
    if args.plot:
        from moeserve.planner.plots import plot_graphs

        most = max(plan.budget_graphs, *(s.num_graphs for s in plan.sets))
        plot_graphs(plan, optimal_sizes(dist, most)[1], args.plot)
    if args.json:
        report.print_json({**plan.to_dict(), "plot": args.plot})
    else:
        report.graphs_table(plan)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input becomes one clear line on stderr and exit code 2, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ValueError as exc:
            print(f"moeserve plan: error: {exc}", file=sys.stderr)
            return 2

    run.__doc__ = func.__doc__
    return run


def _add_decode_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="roofline TPS/GPU and TPS/user of a decode step across batch sizes",
                       description=run_decode.__doc__)
    _add_model_args(p)
    p.add_argument("--batch-sizes", type=_batch_sizes, default=_batch_sizes(DEFAULT_BATCHES),
                   help=f"requests decoding per GPU, comma-separated (default {DEFAULT_BATCHES})")
    p.add_argument("--context", type=int, help="mean KV tokens per request during decode (default ISL + OSL/2)")
    p.add_argument("--mtp-accept-length", type=float, help="add MTP rows: mean tokens accepted per step (e.g. 2.37)")
    p.add_argument("--mtp-draft-tokens", type=int, default=3, help="MTP draft tokens per step (default 3)")
    p.add_argument("--mem-efficiency", type=float, default=1.0, help="reached share of HBM bandwidth (default 1)")
    p.add_argument("--compute-efficiency", type=float, default=1.0, help="reached share of peak FLOP/s (default 1)")
    p.add_argument("--a2a-latency-us", type=float, default=10.0,
                   help="fixed microseconds per EP dispatch and per combine (default 10)")
    p.add_argument("--overlap-comm", action="store_true", help="hide all-to-all under compute instead of adding it")
    p.add_argument("--plot", metavar="PNG", help="write TPS/GPU against TPS/user to this PNG")
    p.set_defaults(func=_guarded(run_decode))


def _add_graphs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cuda-graphs", help="padding waste of CUDA graph batch-size sets; the best set in a budget",
                       description=run_cuda_graphs.__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--histogram", metavar="FILE",
                     help='JSON {"batch_size": count} / [[bs, count]], or Prometheus text of the histogram')
    src.add_argument("--distribution", metavar="SPEC", help=f"synthetic: {SYNTHETIC_HELP}")
    p.add_argument("--metric", default=DEFAULT_METRIC, help=f"Prometheus histogram name (default {DEFAULT_METRIC})")
    p.add_argument("--per-graph-mb", type=float, default=10.0, help="MiB per captured graph (default 10, seed 003)")
    p.add_argument("--max-batch-size", type=int, default=2048, help="largest size of the x2/+64/+8 sets (default 2048)")
    p.add_argument("--max-graphs", type=int, help="graph-count budget for the optimal set (default: x2's count)")
    p.add_argument("--graph-memory-mb", type=float, help="memory budget in MiB for the optimal set's graphs")
    p.add_argument("--model-config", help="with --kv-dtype: report KV tokens the graphs' memory displaces")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV element type for --model-config")
    p.add_argument("--plot", metavar="PNG", help="write minimum padding against graph count to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_guarded(run_cuda_graphs))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` and its subcommands capacity, decode and cuda-graphs on the top-level parser."""
    plan = subparsers.add_parser("plan", help="capacity and deployment planner (CPU only, no GPU needed)",
                                 description="Capacity and deployment planning on paper: "
                                 "KV capacity, decode roofline, CUDA graph batch sizes.")
    sub = plan.add_subparsers(dest="plan_command", required=True, metavar="{capacity,decode,cuda-graphs}")
    cap = sub.add_parser("capacity", help="KV bytes per token, KV pool, requests per GPU and in the deployment",
                         description=run_capacity.__doc__)
    _add_model_args(cap)
    cap.add_argument("--headroom", type=float, default=0.85,
                     help="practical target as a share of the theoretical cap (default 0.85, seed 000)")
    cap.set_defaults(func=_guarded(run_capacity))
    _add_decode_parser(sub)
    _add_graphs_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Run `plan` on its own, without the rest of the moeserve CLI: `python -m moeserve.planner.cli ...`."""
    parser = argparse.ArgumentParser(prog="moeserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
