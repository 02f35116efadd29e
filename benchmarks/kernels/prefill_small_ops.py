"""Prompt-step helpers around the shared experts: SiLU-and-mul block sizes and the down GEMM's shape.

At prompt sizes the shared experts run as cuBLAS GEMMs with a Triton SiLU-and-mul between them.
This times, on V2-Lite's shapes, (a) the SiLU kernel at several MAX_BLOCK sizes against its bytes and
(b) the shared experts' down projection as S GEMMs of K = I accumulating into the output (as
`Experts.add_shared` ran them) against one GEMM of K = S * I over the experts' concatenated
weights. Prints JSON rows.

    python benchmarks/kernels/prefill_small_ops.py --tokens 1024 16384 131072
"""

from __future__ import annotations

import argparse
import json

import torch

from moeserve.bench.roofline import time_ms
from moeserve.ops.triton import activation


def silu_rows(tokens: int, shared: int, inter: int, reps: int) -> list[dict]:
    """SiLU-and-mul over the shared experts' gate/up output at each MAX_BLOCK."""
    x = torch.randn(tokens * shared, 2 * inter, dtype=torch.bfloat16, device="cuda")
    reference = activation.silu_and_mul(x)
    rows, shipped = [], activation.MAX_BLOCK
    for block in (1024, 2048, 4096):
        activation.MAX_BLOCK = block
        try:
            torch.testing.assert_close(activation.silu_and_mul(x), reference, rtol=0, atol=0)
            ms = time_ms(lambda: activation.silu_and_mul(x), reps)
        finally:
            activation.MAX_BLOCK = shipped
        moved = x.numel() * 2 * 1.5  # read gate and up, write half as many
        rows.append({"op": "silu_and_mul", "tokens": tokens, "max_block": block, "ms": round(ms, 4),
                     "tb_s": round(moved / ms / 1e9, 3)})
    return rows


def shared_down_rows(tokens: int, shared: int, inter: int, hidden: int, reps: int, reverse: bool) -> list[dict]:
    """The shared experts' down GEMM: S accumulating GEMMs of K = I against one of K = S * I."""
    act = torch.randn(tokens, shared, inter, dtype=torch.bfloat16, device="cuda")
    w2 = torch.randn(shared, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    w2_cat = torch.cat(list(w2), dim=1)  # [H, S * I]
    base = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")

    def separate(out: torch.Tensor) -> torch.Tensor:  # as Experts.add_shared ran it, in place
        for j in range(shared):
            out.addmm_(act[:, j], w2[j].t())
        return out

    def joined(out: torch.Tensor) -> torch.Tensor:
        return out.addmm_(act.view(tokens, shared * inter), w2_cat.t())

    torch.testing.assert_close(joined(base.clone()).float(), separate(base.clone()).float(), rtol=2e-2, atol=6e-2)
    flops = 2 * tokens * hidden * shared * inter
    rows = []
    variants = (("separate", separate), ("joined", joined))
    for name, fn in variants[::-1] if reverse else variants:  # both orders: clocks settle
        ms = time_ms(lambda fn=fn: fn(base), reps)
        rows.append({"op": "shared_down", "variant": name, "tokens": tokens, "ms": round(ms, 4),
                     "tflop_s": round(flops / ms / 1e9, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--shared", type=int, default=2)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        rows += silu_rows(tokens, args.shared, args.inter, args.reps)
    for tokens in args.tokens:
        for reverse in (False, True):
            rows += shared_down_rows(tokens, args.shared, args.inter, args.hidden, args.reps, reverse)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
