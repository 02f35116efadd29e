"""The fused MoE against PyTorch's grouped GEMM (CUTLASS on Hopper) at prefill sizes.

    python benchmarks/kernels/moe_grouped_mm.py [--tokens 4096,8192,16384,65536] [--output FILE]

For each prompt-token count (64 experts, hidden 2048, inter 1408, top-6, bf16, random balanced
routing) it times `ops.fused_moe` (per-slot outputs, as the model takes them) and the same MoE
through `torch.nn.functional.grouped_mm`: pairs sorted by expert, token rows gathered into that
order, gate/up grouped GEMM, SiLU-and-mul, down grouped GEMM, weighted scatter back to pair order.
It also times each part of the grouped path and one cuBLAS GEMM with the gate/up GEMM's FLOPs,
and checks both paths agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve import ops  # noqa: E402
from moeserve.bench.common import record, write_results  # noqa: E402

EXPERTS, HIDDEN, INTER, TOPK = 64, 2048, 1408, 6


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def bench_us(fn) -> float:
    """Median microseconds of `fn` (eager: every timed call here runs for hundreds of microseconds)."""
    return triton.testing.do_bench(fn, warmup=3, rep=200) * 1e3


def grouped_parts(x, weights, ids, w13, w2):
    """The grouped path's stages as closures over their inputs, run once to build each input."""
    gm = _grouped_mm()
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0, dtype=torch.int32)
    rows = x.index_select(0, order // TOPK)
    gate_up = gm(rows, w13.transpose(1, 2), offs=offs)
    act = ops.silu_and_mul(gate_up)
    down = gm(act, w2.transpose(1, 2), offs=offs)
    scale = weights.reshape(-1)[order, None].to(down.dtype)

    def scatter():
        out = torch.empty_like(down)
        out[order] = down * scale
        return out

    return {
        "sort": lambda: torch.cumsum(torch.bincount(flat[torch.argsort(flat, stable=True)], minlength=EXPERTS), 0),
        "gather": lambda: x.index_select(0, order // TOPK),
        "up": lambda: gm(rows, w13.transpose(1, 2), offs=offs),
        "act": lambda: ops.silu_and_mul(gate_up),
        "down": lambda: gm(act, w2.transpose(1, 2), offs=offs),
        "scatter": scatter,
    }


def grouped_moe(x, weights, ids, w13, w2) -> torch.Tensor:
    """Per-slot outputs [T, k, H] of the MoE through grouped GEMMs."""
    parts = grouped_parts(x, weights, ids, w13, w2)
    return parts["scatter"]().view(x.shape[0], TOPK, HIDDEN)


def measure(tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """One token count: both paths timed, the grouped path by parts, and a cuBLAS GEMM for scale."""
    dev = w13.device
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
    weights, ids = torch.randn(tokens, EXPERTS, device=dev).softmax(-1).topk(TOPK, dim=-1)
    ids = ids.to(torch.int32)
    fused = ops.fused_moe(x, w13, w2, weights, ids, sum_slots=False)
    diff = (fused.float() - grouped_moe(x, weights, ids, w13, w2).float()).abs().max().item()
    flops_up, flops_down = 2 * tokens * TOPK * HIDDEN * 2 * INTER, 2 * tokens * TOPK * HIDDEN * INTER
    t_fused = bench_us(lambda: ops.fused_moe(x, w13, w2, weights, ids, sum_slots=False))
    t_grouped = bench_us(lambda: grouped_moe(x, weights, ids, w13, w2))
    parts = {k: round(bench_us(fn), 1) for k, fn in grouped_parts(x, weights, ids, w13, w2).items()}
    dense_x = torch.randn(tokens * TOPK, HIDDEN, device=dev, dtype=torch.bfloat16)
    dense_w = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    t_dense = bench_us(lambda: F.linear(dense_x, dense_w))
    tfs = {"fused": (flops_up + flops_down) / t_fused / 1e6, "grouped_up": flops_up / parts["up"] / 1e6,
           "grouped_down": flops_down / parts["down"] / 1e6, "cublas_dense_up_shape": flops_up / t_dense / 1e6}
    print(f"{tokens:6d} tokens: fused {t_fused:8.0f} us, grouped {t_grouped:8.0f} us, parts {parts}, "
          f"cuBLAS dense up-shape {t_dense:.0f} us, TFLOP/s {({k: round(v) for k, v in tfs.items()})}, "
          f"max diff {diff:.2e}", flush=True)
    return record(
        f"moe_grouped_mm_{tokens}", str(dev),
        workload={"tokens": tokens, "experts": EXPERTS, "hidden": HIDDEN, "inter": INTER, "topk": TOPK},
        out_tok_s=None, seconds=None, fused_us=round(t_fused, 1), grouped_us=round(t_grouped, 1),
        grouped_parts_us=parts, cublas_dense_up_shape_us=round(t_dense, 1),
        tflops={k: round(v, 1) for k, v in tfs.items()}, max_abs_diff=diff, torch=torch.__version__,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192,16384,65536")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    write_results(args.output, [measure(tokens, w13, w2) for tokens in map(int, args.tokens.split(","))])


if __name__ == "__main__":
    main()
