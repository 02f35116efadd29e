"""What a batch-1 kernel costs in the decode step: the graph re-captured with it skipped (timing only).

    python benchmarks/skip_bound.py --model DIR_OR_CONFIG [--load-format dummy] --variants base,noprep,noroute

Each variant captures the b1 decode graph with some ops replaced by stand-ins that launch nothing
and return tensors made before the capture, so the replay is the step without those kernels (its
tokens are wrong; only the time means anything). `noprep`: the MLA token prep (latent norm,
rotary, cache store, W_UK absorbed), the decode reading a zero query; `noroute`: the MoE entry
(add + norm, router, selection) in every form, the experts reading a routing fixed at warm-up.
Variants take turns within each round, as in ab_decode.py. The gap to `base` bounds what fusing
or hiding that work can gain.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import ab_decode as ab  # noqa: E402

from moeserve import ops  # noqa: E402
from moeserve.bench.common import record, write_results  # noqa: E402
from moeserve.ops.triton import fused_moe  # noqa: E402

ORIGINAL = {name: getattr(ops, name) for name in ("mla_rope_norm_store", "mla_decode", "add_norm_route")}
_zeros: dict[tuple, torch.Tensor] = {}
_routes: dict[int, tuple[torch.Tensor, ...]] = {}


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A zero tensor of t's shape made outside any capture (made on the warm-up run)."""
    key = (tuple(t.shape), t.dtype)
    if key not in _zeros:
        assert not torch.cuda.is_current_stream_capturing()
        _zeros[key] = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return _zeros[key]


def _no_prep(positions, q_rope, kv, norm_weight, *args, **kwargs):
    rank = norm_weight.shape[0]
    return _zeros_like(kv[:, :rank]), _zeros_like(kv[:, rank:])


def _decode_zero_query(q_latent, *args, **kwargs):
    return ORIGINAL["mla_decode"](_zeros_like(q_latent), *args, **kwargs)


def _fixed_route(x, residual, norm_weight, eps, router_weight, **routing):
    key = router_weight.data_ptr()
    if key not in _routes:
        assert not torch.cuda.is_current_stream_capturing()
        _routes[key] = tuple(t.clone() for t in ORIGINAL["add_norm_route"](x, residual, norm_weight, eps,
                                                                           router_weight, **routing))
    return _routes[key]


def use(variant: str) -> None:
    """Install the stand-ins `variant` names (none for 'base')."""
    skip_prep, skip_route = "noprep" in variant, "noroute" in variant
    ops.mla_rope_norm_store = _no_prep if skip_prep else ORIGINAL["mla_rope_norm_store"]
    ops.mla_decode = _decode_zero_query if skip_prep else ORIGINAL["mla_decode"]
    ops.add_norm_route = _fixed_route if skip_route else ORIGINAL["add_norm_route"]
    fused_moe.add_norm_route = ops.add_norm_route  # its one-token path calls the entry kernel directly
    fused_moe.RING_ENTRY = not skip_route  # the ring's own entry would still route: take the entry kernel's path
    _routes.clear()


def main() -> None:
    ap = ab.decode_args(__doc__.splitlines()[0])
    ap.add_argument("--variants", default="base,noprep,noroute,noprep_noroute")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    names = a.variants.split(",")
    core = ab.decode_engine(a.model, a.load_format, [1], a.kv_cache_dtype)
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    ids = ab.start_batch(core, 1, a.input_len, a.rounds * len(names) * 8 + 16, "bound", 7)
    replay: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(a.rounds):
        for name in names:
            use(name)
            ab.recapture(core, 1)
            use("base")  # eager work outside the graph runs the real ops
            ab.time_steps(core, 6)  # stages real inputs (the graph's tokens are wrong for skipped variants)
            replay[name].append(ab.time_replay(core, 1, 20, 5))
    ab.finish_batch(core, ids)
    base = statistics.median(replay[names[0]])
    records = []
    for name in names:
        r = statistics.median(replay[name])
        records.append(record(f"skip_bound_b1_{name}", "cuda", workload={"batch_size": 1, "input_len": a.input_len},
                              variant=name, replay_ms=round(r, 4), vs_first=round(r / base - 1, 4),
                              replay_rounds_ms=[round(x, 4) for x in replay[name]]))  # fmt: skip
        print(f"{name:<16s} {r:.4f} ms ({(r / base - 1) * 100:+.2f}%) rounds {[round(x, 4) for x in replay[name]]}")
    write_results(a.output, records)


if __name__ == "__main__":
    main()
