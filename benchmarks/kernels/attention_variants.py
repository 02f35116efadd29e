"""Prefill attention tiles against the shipped choice, at the MHA prefill's real shapes.

    python benchmarks/kernels/attention_variants.py      # H200; prints a table, $OUT/attention_variants.json

Each tile (BLOCK_M, BLOCK_N, warps, stages) runs through `varlen_attention`'s own launch, is
checked against the shipped tiles on the same inputs, then graph-timed; TFLOP/s count causal
FLOPs (QK^T over 192 dims and PV over 128 per visible pair). Its first version (2087613) also
timed copies of the key loop with the scale folded into exp2's argument (shipped since) and with
Triton's warp specialization (no change on Hopper): row `prefill_attention_variants`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_skinny_gemm import graph_us  # noqa: E402

from moeserve.ops.triton.flash_attention import varlen_attention  # noqa: E402

HEADS, DNOPE, DROPE, DV = 16, 128, 64, 128
CASES = {"b256_step_128x1024": [1024] * 128, "16x1024": [1024] * 16, "1x8192": [8192]}
TILES = {  # name: (BLOCK_M, BLOCK_N, warps, stages); "shipped" is the device's own choice
    "shipped": None,
    "128x64_s2": (128, 64, 8, 2),
    "128x128_s2": (128, 128, 8, 2),
    "64x64_w4_s2": (64, 64, 4, 2),
    "64x64_w4_s3": (64, 64, 4, 3),
    "64x128_w4_s2": (64, 128, 4, 2),
}
ROUNDS = 2


def inputs(lens: list[int], gen: torch.Generator):
    """q, k (a strided slice of a kv_b_proj-like output), the shared rotary key, v, as the model has them."""
    tokens = sum(lens)
    q = torch.randn(tokens, HEADS, DNOPE + DROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(tokens, HEADS, DNOPE + DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_rope = torch.randn(tokens, DROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    return q, kv[..., :DNOPE], k_rope, kv[..., DNOPE:], cu


def causal_flops(lens: list[int]) -> float:
    return sum(HEADS * n * (n + 1) / 2 * 2 * (DNOPE + DROPE + DV) for n in lens)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = (DNOPE + DROPE) ** -0.5
    rows = []
    for case, lens in CASES.items():
        q, k, k_rope, v, cu = inputs(lens, gen)
        n = max(lens)
        want = varlen_attention(q, k, v, cu, cu, n, n, scale, k_rope=k_rope)
        flops = causal_flops(lens)
        best: dict[str, float] = {}
        errors: dict[str, float | str] = {}
        # Two rounds, best of each: whichever tile runs first after new inputs read a few % slow.
        for _ in range(ROUNDS):
            for name, tiles in TILES.items():
                out = torch.empty_like(want)
                run = functools.partial(varlen_attention, q, k, v, cu, cu, n, n, scale, k_rope=k_rope, out=out,
                                        tiles=tiles)
                try:
                    run()
                    errors[name] = (out.float() - want.float()).abs().max().item()
                    best[name] = min(best.get(name, float("inf")), graph_us([run]))
                except Exception as exc:  # a tile that does not fit is a result too
                    errors[name] = str(exc).splitlines()[0][:160]
        for name in TILES:
            if name not in best:
                rows.append({"case": case, "tiles": name, "error": errors[name]})
                continue
            us = best[name]
            rows.append({"case": case, "tiles": name, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                         "max_err": errors[name]})
    for r in rows:
        print(r)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
