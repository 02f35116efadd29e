"""Tried and dropped: batch 1's MoE as one kernel, the slot sum by float32 atomics.

    python benchmarks/kernels/moe_one_kernel_b1.py [--layers 26] [--sweep]

At one token the fused MoE is two launches (gate/up, then down, `ops/triton/fused_moe.py`), and
the down GEMM can start only when the last gate/up program is done. Here each program takes one
(slot, slice of BLOCK_I intermediate columns): it streams the slot's expert's gate and up rows for
its slice, applies SiLU-and-mul and the routing weight, then streams the matching BLOCK_I columns
of the down weights and adds its share of the output row into a float32 accumulator by atomics
(MMA: both GEMMs as tensor-core dots against the token in column 0 of a 16-wide operand, so
Triton pipelines the loads; otherwise a float32 multiply-reduce, whose loads it does not pipeline).

Prints the shipped two-kernel path and the one-kernel tiles: one layer with L2 flushed, then a
CUDA graph of `--layers` layers with distinct weights, each fed the one before's output row. On
H200 the chain favoured the one kernel (39.4 against 45.3 us a layer at BLOCK_I 32, BLOCK_K 128,
BLOCK_N 256, 4 warps, 4 stages), but in the engine (branch `exp/moe-one-token`: the MoE's entry
kernel zeroes the accumulator, the next add + RMSNorm reads it as one float32 part) the b1
decode-graph replay went 1.997 -> 2.153 ms (+7.8%); other tiles +7.1% to +28%, and with the atomics
replaced by plain stores (a wrong sum, timing only) still +5.9 to +7.3%: the weight stream itself is
slower than the tuned two launches, each program refilling its pipeline for the down half.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve.ops.triton import fused_moe as fm  # noqa: E402
from moeserve.ops.triton.moe_config import get_config  # noqa: E402
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid  # noqa: E402
from moeserve.ops.triton.tune_moe import make_inputs, make_weights, time_us  # noqa: E402

HIDDEN, INTER, ROUTED, SHARED, EXPERTS = 2048, 1408, 6, 2, 66
VARIANTS = [  # BLOCK_I, BLOCK_K, BLOCK_N, warps, stages, MMA
    (32, 256, 256, 4, 3, False), (32, 128, 256, 4, 3, True), (32, 256, 128, 4, 4, True), (64, 128, 128, 4, 4, True),
]


@triton.jit
def _moe_one_kernel(x_ptr, w13_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, stride_we1, stride_wn1, stride_we2,
                    stride_wn2, INTER: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MMA: tl.constexpr, PDL: tl.constexpr):
    """out[n] += weight[slot] * sum_i down[n, i] * silu(gate_i . x) * (up_i . x) over this slice's i.

    MMA: both GEMMs as tensor-core dots against x (then act) in column 0 of a 16-wide operand, so
    Triton pipelines the weight loads; otherwise float32 multiply-reduce on the CUDA cores.
    """
    slot = tl.program_id(0)
    wait_for_prior_grid(PDL)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < INTER
    gate_rows = w13_ptr + expert * stride_we1 + offs_i[:, None].to(tl.int64) * stride_wn1
    up_rows = gate_rows + INTER * stride_wn1
    col0 = tl.arange(0, 16)[None, :] == 0
    if MMA:
        acc_gate = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        gate = tl.load(gate_rows + offs_k[None, :], mask=i_ok[:, None], other=0.0)
        up = tl.load(up_rows + offs_k[None, :], mask=i_ok[:, None], other=0.0)
        if MMA:
            xs = tl.where(col0, x[:, None], 0.0).to(gate.dtype)
            acc_gate = tl.dot(gate, xs, acc_gate)
            acc_up = tl.dot(up, xs, acc_up)
        else:
            acc_gate += tl.sum(gate.to(tl.float32) * x[None, :], axis=1)
            acc_up += tl.sum(up.to(tl.float32) * x[None, :], axis=1)
    if MMA:
        acc_gate = tl.sum(acc_gate, axis=1)  # only column 0 is non-zero
        acc_up = tl.sum(acc_up, axis=1)
    # Rounded to bf16 as the two-kernel path stores it, then weighted (its order differs by a rounding).
    act = (acc_gate * tl.sigmoid(acc_gate) * acc_up).to(tl.bfloat16).to(tl.float32)
    act = act * tl.load(weights_ptr + slot)
    down_cols = w2_ptr + expert * stride_we2 + offs_i[None, :]
    acts = tl.where(col0, act[:, None], 0.0).to(tl.bfloat16)
    for n0 in range(0, HIDDEN, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        down = tl.load(down_cols + offs_n[:, None].to(tl.int64) * stride_wn2, mask=i_ok[None, :], other=0.0)
        if MMA:
            part = tl.sum(tl.dot(down, acts), axis=1)
        else:
            part = tl.sum(down.to(tl.float32) * act[None, :], axis=1)
        tl.atomic_add(out_ptr + offs_n, part, sem="relaxed")


def moe_one_kernel(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor, variant: tuple) -> torch.Tensor:
    """Add batch 1's MoE output into the zeroed float32 row `out` [H]."""
    block_i, block_k, block_n, warps, stages, mma = variant
    grid = (ids.shape[1], triton.cdiv(INTER, block_i))
    _moe_one_kernel[grid](hidden, w13, w2, ids, weights, out, w13.stride(0), w13.stride(1), w2.stride(0),
                          w2.stride(1), INTER=INTER, HIDDEN=HIDDEN, BLOCK_I=block_i, BLOCK_K=block_k,
                          BLOCK_N=block_n, MMA=mma, num_warps=warps, num_stages=stages, **pdl_launch(hidden))
    return out


def two_kernels(layer: dict, x: torch.Tensor) -> torch.Tensor:
    """The shipped path on token x: gate/up then down, one output row per slot."""
    return fm.moe_down(fm.moe_up(x, layer["w13"], layer["plan"]), layer["w2"], layer["plan"])


def one_kernel(layer: dict, x: torch.Tensor, out: torch.Tensor, variant: tuple) -> torch.Tensor:
    """This file's kernel on token x, adding into the zeroed float32 row `out`."""
    return moe_one_kernel(x, layer["w13"], layer["w2"], layer["ids"], layer["weights"], out, variant)


def check(layer: dict, variant: tuple) -> float:
    """Largest difference from the two-kernel path's slot sum, over that sum's largest value."""
    want = two_kernels(layer, layer["hidden"]).float().sum(0)
    got = one_kernel(layer, layer["hidden"], torch.zeros(HIDDEN, device="cuda"), variant)
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    """One layer cold, then a chain of --layers layers, for the shipped path and each variant."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--sweep", action="store_true", help="a wider grid of tiles, timed in the chain only")
    args = ap.parse_args()
    variants = VARIANTS
    if args.sweep:
        variants = [v for v in itertools.product((16, 32, 64), (128, 256), (64, 128, 256), (4, 8), (3, 4),
                                                 (True,)) if v[0] * (2 * v[1] + v[2]) * v[4] <= 96 * 1024]
    torch.manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    layers = []
    for _ in range(args.layers):
        inputs = make_inputs(1, make_weights(EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda"), ROUTED, SHARED)
        inputs["config"] = get_config(inputs["hidden"], inputs["w13"], ROUTED + SHARED)
        inputs["plan"] = fm.plan_route(inputs["weights"], inputs["ids"], EXPERTS, inputs["config"])
        layers.append(inputs)
    first = layers[0]
    nbytes = (ROUTED + SHARED) * 3 * HIDDEN * INTER * 2
    print("shipped config", first["config"], flush=True)
    acc = torch.zeros(args.layers, HIDDEN, device="cuda")
    zero_us = time_us(lambda: acc.zero_(), 50, flush)
    print(f"zeroing the accumulators: {zero_us:.2f} us", flush=True)

    def show(name: str, one: float, chain: float) -> None:
        per = chain / args.layers
        print(f"{name:34s} one layer {one:6.1f} us ({nbytes / one / 1e6:4.2f} TB/s)   chain {per:6.1f} us a layer "
              f"({nbytes / per / 1e6:4.2f} TB/s)", flush=True)

    def shipped_chain() -> None:
        x = first["hidden"]
        for layer in layers:
            x = two_kernels(layer, x)[:1]

    show("two kernels (shipped)", time_us(lambda: two_kernels(first, first["hidden"]), 50, flush),
         time_us(shipped_chain, 20, flush))
    for variant in variants:
        try:
            err = check(first, variant)
        except Exception as exc:  # a tile that cannot compile (registers, shared memory) is skipped
            print(f"{variant}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue

        def one(variant: tuple = variant) -> None:
            acc[0].zero_()
            one_kernel(first, first["hidden"], acc[0], variant)

        def chain(variant: tuple = variant) -> None:
            acc.zero_()  # in the model the MoE's entry kernel would zero it on its way
            x = first["hidden"]
            for index, layer in enumerate(layers):
                x = one_kernel(layer, x, acc[index], variant)

        single = float("nan") if args.sweep else time_us(one, 50, flush)
        show(f"one kernel {variant} err {err:.1e}", single, time_us(chain, 20, flush))


if __name__ == "__main__":
    main()
