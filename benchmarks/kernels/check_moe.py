"""GPU check of the Triton fused MoE and routing: parity at real shapes, then speed against the HBM ceiling.

    python benchmarks/kernels/check_moe.py [--tune] [--output DIR] [--no-v3]

1. parity with the reference ops on fresh random inputs (DeepSeek-V2-Lite and V3-like shapes, every
   tile mode, skewed loads, int32/int64 ids, CUDA-graph capture and replay); exits 1 on a failure;
2. fused_moe times for V2-Lite (and V3-like) at T = 1..1024: expert bytes actually touched
   (distinct experts hit x bytes per expert) / time = GB/s, against the measured read bandwidth,
   and TFLOP/s; plus routing times against the PyTorch reference;
3. with --tune, tunes V2-Lite's shape (quick search), writes the config JSON into --output
   (default $OUT), and times the table again with the tuned configs.
All numbers go to $OUT/check_moe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import measure  # noqa: E402

from moeserve.ops.reference import moe as ref  # noqa: E402
from moeserve.ops.triton import tune_moe  # noqa: E402
from moeserve.ops.triton.fused_moe import fused_moe, moe_down, moe_topk_sum, moe_up, plan_route  # noqa: E402
from moeserve.ops.triton.moe_config import CONFIG_DIR, get_config, pick_config  # noqa: E402
from moeserve.ops.triton.routing import select_experts  # noqa: E402

V2_LITE = {"experts": 64, "hidden": 2048, "inter": 1408, "topk": 6}
V3_LIKE = {"experts": 256, "hidden": 7168, "inter": 2048, "topk": 8}
ROUTING = {
    "v2-lite": (64, dict(top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                         norm_topk_prob=False, routed_scaling_factor=1.0, scale_after_norm=False)),
    "v2": (160, dict(top_k=6, topk_method="group_limited_greedy", scoring_func="softmax", n_group=8,
                     topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0, scale_after_norm=False)),
    "v3": (256, dict(top_k=8, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
                     norm_topk_prob=True, routed_scaling_factor=2.5, scale_after_norm=True)),
}
TOKENS = (1, 8, 64, 256, 1024)


def _g(bn: int, bk: int, stages: int = 3) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 4, "num_warps": 4, "num_stages": stages}


MODES = {
    "dense-gemv": {"DENSE": True, "MODE": "gemv", "BLOCK_M": 8, "up": _g(16, 256), "down": _g(32, 128)},
    "dense-swap": {"DENSE": True, "MODE": "swap", "BLOCK_M": 16, "up": _g(32, 128), "down": _g(64, 64)},
    "sorted-gemv": {"DENSE": False, "MODE": "gemv", "BLOCK_M": 4, "up": _g(16, 256), "down": _g(32, 128)},
    "sorted-swap": {"DENSE": False, "MODE": "swap", "BLOCK_M": 16, "up": _g(32, 128), "down": _g(64, 64)},
    "sorted-dot": {"DENSE": False, "MODE": "dot", "BLOCK_M": 64, "up": _g(64, 64), "down": _g(64, 64, 2)},
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def make_weights(shape: dict, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return tune_moe.make_weights(shape["experts"], shape["hidden"], shape["inter"], dtype, "cuda")


def make_batch(tokens: int, shape: dict, dtype=torch.bfloat16, pattern: str = "random", ids_dtype=torch.int32):
    """Hidden states, routing weights and distinct expert ids per token under a load pattern."""
    experts, topk = shape["experts"], shape["topk"]
    x = torch.randn(tokens, shape["hidden"], device="cuda", dtype=dtype)
    weights = torch.rand(tokens, topk, device="cuda")
    if pattern == "one-expert":  # expert 0 is every token's first choice
        ids = torch.rand(tokens, experts - 1, device="cuda").topk(topk - 1, dim=1).indices + 1
        ids = torch.cat([torch.zeros(tokens, 1, dtype=ids.dtype, device="cuda"), ids], dim=1)
    elif pattern == "all-experts":
        ids = (torch.arange(tokens * topk, device="cuda") % experts).view(tokens, topk)
    else:
        ids = torch.rand(tokens, experts, device="cuda").topk(topk, dim=1).indices
    return x, weights, ids.to(ids_dtype)


def parity_moe(results: list, tol: float = 1e-2, v3: bool = True) -> None:
    """fused_moe against the reference at real shapes, every mode and load pattern."""
    shapes = [("v2-lite", V2_LITE, TOKENS)] + ([("v3", V3_LIKE, (1, 64, 512))] if v3 else [])
    for name, shape, tokens_list in shapes:
        w13, w2 = make_weights(shape)
        for i, tokens in enumerate(tokens_list):
            x, w, ids = make_batch(tokens, shape, ids_dtype=(torch.int32, torch.int64)[i % 2])
            err = rel_err(fused_moe(x, w13, w2, w, ids), ref.fused_moe(x, w13, w2, w, ids))
            results.append({"case": f"{name} T={tokens}", "rel_err": err, "ok": err < tol})
        del w13, w2
    w13, w2 = make_weights(V2_LITE)
    for pattern in ("one-expert", "all-experts"):
        x, w, ids = make_batch(300, V2_LITE, pattern=pattern)
        err = rel_err(fused_moe(x, w13, w2, w, ids), ref.fused_moe(x, w13, w2, w, ids))
        results.append({"case": f"v2-lite T=300 {pattern}", "rel_err": err, "ok": err < tol})
    small = {"experts": 16, "hidden": 512, "inter": 352, "topk": 4}
    for dtype, limit in ((torch.bfloat16, tol), (torch.float32, 3e-4)):
        s13, s2 = make_weights(small, dtype)
        for mode, config in MODES.items():
            x, w, ids = make_batch(min(13, config["BLOCK_M"]) if config["DENSE"] else 150, small, dtype, ids_dtype=torch.int64)
            err = rel_err(fused_moe(x, s13, s2, w, ids, config=config), ref.fused_moe(x, s13, s2, w, ids))
            results.append({"case": f"mode {mode} {str(dtype)[6:]}", "rel_err": err, "ok": err < limit})


def parity_routing(results: list) -> None:
    """select_experts against the reference: same expert sets, same weights."""
    for name, (experts, kwargs) in ROUTING.items():
        bias = torch.randn(experts, device="cuda") * 0.5 if kwargs["topk_method"] == "noaux_tc" else None
        for tokens in (1, 100, 4096):
            logits = torch.randn(tokens, experts, device="cuda") * 2
            w, ids = select_experts(logits, correction_bias=bias, **kwargs)
            rw, rids = ref.select_experts(logits, correction_bias=bias, **kwargs)
            got_ids, got_o = ids.long().sort(1)
            want_ids, want_o = rids.sort(1)
            same = torch.equal(got_ids, want_ids)
            err = rel_err(w.gather(1, got_o), rw.gather(1, want_o)) if same else float("inf")
            results.append({"case": f"routing {name} T={tokens}", "rel_err": err, "ok": same and err < 1e-5})


def _graph_case(tokens: int, w13: torch.Tensor, w2: torch.Tensor, results: list) -> None:
    experts, kwargs = ROUTING["v2-lite"]
    logits = torch.randn(tokens, experts, device="cuda")
    x = torch.randn(tokens, V2_LITE["hidden"], device="cuda", dtype=torch.bfloat16)
    step = lambda: fused_moe(x, w13, w2, *select_experts(logits, correction_bias=None, **kwargs))  # noqa: E731
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        logits.copy_(torch.randn_like(logits))
        x.copy_(torch.randn_like(x))
        graph.replay()
        rw, rids = ref.select_experts(logits, correction_bias=None, **kwargs)
        err = rel_err(out, ref.fused_moe(x, w13, w2, rw, rids))
        results.append({"case": f"cuda graph T={tokens}", "rel_err": err, "ok": err < 1e-2})


def parity_graphs(results: list) -> None:
    """Routing + fused_moe captured once per T in a CUDA graph, replayed on new inputs."""
    w13, w2 = make_weights(V2_LITE)
    for tokens in (8, 128):
        _graph_case(tokens, w13, w2, results)


def _time_one(tokens: int, shape: dict, weights: tuple, ceilings: dict, flush, configs: dict | None) -> dict:
    w13, w2 = weights
    x, w, ids = make_batch(tokens, shape)
    experts, topk = shape["experts"], shape["topk"]
    config = pick_config(configs, tokens, experts, topk) if configs else get_config(x, w13, topk)
    us = tune_moe.time_us(lambda: fused_moe(x, w13, w2, w, ids, config=config), 30, flush)
    plan = plan_route(w, ids, experts, config)
    act = moe_up(x, w13, plan)
    out = moe_down(act, w2, plan)
    split = {
        "route_us": tune_moe.time_us(lambda: plan_route(w, ids, experts, config), 20, flush),
        "up_us": tune_moe.time_us(lambda: moe_up(x, w13, plan), 20, flush),
        "down_us": tune_moe.time_us(lambda: moe_down(act, w2, plan), 20, flush),
        "sum_us": tune_moe.time_us(lambda: moe_topk_sum(out, topk), 20, flush),
    }
    touched = int(ids.unique().numel())
    touched_bytes = touched * 3 * shape["hidden"] * shape["inter"] * w13.element_size()
    gbs = touched_bytes / us / 1e3
    flops = 6 * tokens * topk * shape["hidden"] * shape["inter"]
    mode = f"{'dense' if config['DENSE'] else 'sorted'}-{config['MODE']}-{config['BLOCK_M']}"
    return {"tokens": tokens, "us": us, "experts_touched": touched, "mb_touched": touched_bytes / 1e6, "gbs": gbs,
            "pct_read_bw": 100 * gbs / ceilings["read_gbs"], "tflops": flops / us / 1e6, "mode": mode, **split}


def time_moe(shape: dict, tokens_list, ceilings: dict, flush, configs: dict | None = None) -> list[dict]:
    """One row per T: time, experts touched, achieved GB/s and TFLOP/s, per-kernel split."""
    weights = make_weights(shape)
    return [_time_one(tokens, shape, weights, ceilings, flush, configs) for tokens in tokens_list]


def _time_route_one(name: str, tokens: int, flush) -> dict:
    experts, kwargs = ROUTING[name]
    bias = torch.randn(experts, device="cuda") if kwargs["topk_method"] == "noaux_tc" else None
    logits = torch.randn(tokens, experts, device="cuda")
    tri = tune_moe.time_us(lambda: select_experts(logits, correction_bias=bias, **kwargs), 30, flush)
    torch_us = tune_moe.time_us(lambda: ref.select_experts(logits, correction_bias=bias, **kwargs), 30, flush)
    return {"variant": name, "tokens": tokens, "triton_us": tri, "torch_us": torch_us}


def time_routing(flush) -> list[dict]:
    """select_experts vs the PyTorch reference, both captured in graphs."""
    return [_time_route_one(name, tokens, flush) for name in ROUTING for tokens in (1, 64, 1024, 4096)]


def print_moe(title: str, rows: list[dict], ceilings: dict) -> None:
    print(f"\n{title}  (read ceiling {ceilings['read_gbs']:.0f} GB/s, bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s)")
    print(f"{'T':>5} {'us':>8} {'experts':>7} {'MB':>7} {'GB/s':>7} {'%BW':>5} {'TFLOP/s':>7}  "
          f"{'route':>6} {'up':>7} {'down':>7} {'sum':>5}  mode")
    for r in rows:
        print(f"{r['tokens']:>5} {r['us']:8.1f} {r['experts_touched']:>7} {r['mb_touched']:7.1f} {r['gbs']:7.0f} "
              f"{r['pct_read_bw']:5.1f} {r['tflops']:7.1f}  {r['route_us']:6.1f} {r['up_us']:7.1f} "
              f"{r['down_us']:7.1f} {r['sum_us']:5.1f}  {r['mode']}")


def run_section(report: dict, name: str, fn) -> None:
    """Run one section; a crash is recorded (and fails the run) but later sections still run."""
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception:
        report.setdefault("errors", []).append({"section": name, "traceback": traceback.format_exc()})
        print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
    print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)


def parity_all(v3: bool) -> list[dict]:
    results: list[dict] = []
    parity_routing(results)
    parity_moe(results, v3=v3)
    parity_graphs(results)
    for r in results:
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['case']:<32} rel err {r['rel_err']:.2e}")
    return results


def tune_and_retime(out_dir: str | None, ceilings: dict, flush) -> dict:
    configs = tune_moe.tune(**V2_LITE, batch_sizes=list(TOKENS), dtype=torch.bfloat16, quick=True)
    path = tune_moe.write_configs(configs, Path(out_dir) if out_dir else CONFIG_DIR, torch.bfloat16)
    print(f"wrote {path}")
    tuned = {int(k): v for k, v in configs.items() if not k.startswith("_")}
    rows = time_moe(V2_LITE, TOKENS, ceilings, flush, configs=tuned)
    print_moe("fused_moe V2-Lite, tuned configs", rows, ceilings)
    return {"file": str(path), "configs": configs, "moe_v2_lite": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="also tune V2-Lite's shape and write the JSON")
    parser.add_argument("--output", default=os.environ.get("OUT"),
                        help="where the tuned JSON goes (default $OUT, else the package's moe_configs/)")
    parser.add_argument("--no-v3", action="store_true", help="skip the V3-like shape (22 GiB of weights)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_moe needs a CUDA device")
        return 2
    report: dict = {"device": torch.cuda.get_device_name()}
    run_section(report, "ceilings", measure)
    ceilings = report.get("ceilings", {"read_gbs": float("nan"), "bf16_tflops": float("nan")})
    print(f"device {report['device']}: {ceilings}")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    run_section(report, "parity", lambda: parity_all(not args.no_v3))
    run_section(report, "moe_v2_lite", lambda: time_moe(V2_LITE, TOKENS, ceilings, flush))
    if "moe_v2_lite" in report:
        print_moe("fused_moe V2-Lite (E=64 H=2048 I=1408 k=6, bf16), default configs", report["moe_v2_lite"], ceilings)
    if not args.no_v3:
        run_section(report, "moe_v3", lambda: time_moe(V3_LIKE, (1, 8, 64, 256), ceilings, flush))
        if "moe_v3" in report:
            print_moe("fused_moe V3-like (E=256 H=7168 I=2048 k=8, bf16)", report["moe_v3"], ceilings)
    run_section(report, "routing", lambda: time_routing(flush))
    for r in report.get("routing", []):
        print(f"  routing {r['variant']:<8} T={r['tokens']:<5} triton {r['triton_us']:7.1f} us   "
              f"torch {r['torch_us']:7.1f} us")
    if args.tune:
        run_section(report, "tuned", lambda: tune_and_retime(args.output, ceilings, flush))
    failed = [r["case"] for r in report.get("parity", []) if not r["ok"]]
    report["ok"] = not failed and not report.get("errors") and "parity" in report
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_moe.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'PASS' if report['ok'] else 'FAIL'}" + (f": {failed}" if failed else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
