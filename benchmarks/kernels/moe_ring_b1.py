"""Batch 1's MoE: the persistent TMA-ring kernel against the two launches it replaced.

    python benchmarks/kernels/moe_ring_b1.py [--layers 26] [--json FILE]

A chain of --layers V2-Lite MoE layers with distinct weights, as the decode step runs them: each
layer's add + RMSNorm + router + selection kernel (PDL), then its experts (6 routed + 2 shared),
unsummed (per-expert parts, or the ring's float32 sum), in one CUDA graph. Every kernel waits for
the one before it (PDL), so the chain runs in order although each entry reads the same token.
Printed per layer: the chain's time less the same chain with the experts skipped (the entry
kernels alone), against the bytes the experts read (138.4 MB: 8 experts' gate/up and down) at the
measured read bandwidth.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeserve import ops  # noqa: E402
from moeserve.ops.triton import fused_moe as fm  # noqa: E402
from moeserve.ops.triton import moe_ring as mr  # noqa: E402
from moeserve.ops.triton import moe_ring_plan as plan  # noqa: E402
from moeserve.ops.triton.tune_moe import time_us  # noqa: E402

EXPERTS, SHARED, TOPK, HIDDEN, INTER = 66, 2, 6, 2048, 1408
# (name, RING_MAX_TOKENS, moe_ring settings other than the shipped ones); runs alternate, so drift falls on all.
VARIANTS = (("two_launches", 0, {}), ("ring", 1, {}), ("ring_slots4", 1, {"MAX_SLOTS": 4}),
            ("ring_warps16", 1, {"WARPS": 16}), ("two_launches_again", 0, {}), ("ring_again", 1, {}))
SETTINGS = ("WARPS", "MAX_SLOTS")
OWNER = {"WARPS": mr, "MAX_SLOTS": plan}  # the module each setting lives in
RULES = dict(top_k=TOPK, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.0, correction_bias=None, scale_after_norm=False, num_shared=SHARED)


def make_layers(count: int) -> list[tuple]:
    """(router, norm weight, w13, w2) per layer, random."""
    layers = []
    for _ in range(count):
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * INTER**-0.5
        router = torch.randn(EXPERTS - SHARED, HIDDEN, device="cuda", dtype=torch.bfloat16)
        layers.append((router, torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16), w13, w2))
    return layers


def chain(layers: list[tuple], x: torch.Tensor, residual: torch.Tensor, experts: bool = True) -> None:
    """Every layer's entry kernel and (unless `experts` is False) its experts."""
    for router, norm, w13, w2 in layers:
        normed, _, weights, ids = ops.add_norm_route(x, residual, norm, 1e-6, router, **RULES)
        if experts:
            ops.fused_moe(normed, w13, w2, weights, ids, sum_slots=False, fixed_tail=SHARED)


def main() -> None:
    from persistent_layer_bound import skeleton_args

    from moeserve.bench.common import record, write_results

    a, gbs = skeleton_args(__doc__)
    layers = make_layers(a.layers)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    moe_mb = 8 * 3 * HIDDEN * INTER * 2 / 1e6
    entry = time_us(lambda: chain(layers, x, residual, experts=False), 20, flush) / a.layers
    rows = []
    shipped = {key: getattr(OWNER[key], key) for key in SETTINGS}
    for name, ring, settings in VARIANTS:
        fm.RING_MAX_TOKENS = ring
        for key, value in {**shipped, **settings}.items():
            setattr(OWNER[key], key, value)
        us = time_us(lambda: chain(layers, x, residual), 20, flush) / a.layers - entry
        floor = moe_mb * 1e3 / gbs
        rows.append({"variant": name, **{key.lower(): getattr(OWNER[key], key) for key in SETTINGS}, "moe_us_per_layer": round(us, 2), "floor_us": round(floor, 2),
                     "ratio": round(us / floor, 3)})
        print(f"{name:20s} MoE {us:6.2f} us a layer (entry kernels {entry:.2f} us apart), {moe_mb:.1f} MB: "
              f"{us / floor:.3f}x its bytes at {gbs / 1e3:.2f} TB/s")
    fm.RING_MAX_TOKENS = 1
    for key, value in shipped.items():
        setattr(OWNER[key], key, value)
    if a.json:
        write_results(a.json, [record("moe_ring_b1", "cuda", read_gbs=round(gbs, 1), layers=a.layers, rows=rows)])


if __name__ == "__main__":
    main()
