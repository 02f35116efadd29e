"""Accuracy cost of the FP8 (e4m3) latent cache against BF16 on the same inputs (the demo model).

    python benchmarks/fp8_kv_accuracy.py [--device cuda] [--prompts 32] [--output-file FILE]

Prompts are held-out Python files (moeserve.eval.corpus). Reports the logit difference of the
first generated position (decode reads the cache) and greedy agreement over the continuation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Appended, not prepended: a PYTHONPATH pointing at another moeserve tree (an A/B baseline) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.assets import default_model_path  # noqa: E402
from moeserve.bench.common import record  # noqa: E402
from moeserve.eval.corpus import iter_documents  # noqa: E402


def agreement(ref: list, got: list) -> tuple[dict, list[float]]:
    """Greedy agreement of two runs over the same prompts, and the logprob differences of the
    reference's tokens up to each first divergence."""
    same = total = first_div = first_same = 0
    lp_diff: list[float] = []
    for r, g in zip(ref, got, strict=True):
        rt, gt = r.token_ids, g.token_ids
        k = next((i for i, (x, y) in enumerate(zip(rt, gt, strict=True)) if x != y), len(rt))
        first_div += k
        same += sum(x == y for x, y in zip(rt, gt, strict=True))
        total += len(rt)
        first_same += rt[0] == gt[0]
        lp_diff += [abs(r.outputs[0].logprobs[i].logprob - g.outputs[0].logprobs[i].logprob) for i in range(k)]
    stats = {
        "greedy_token_agreement": round(same / total, 4),
        "first_token_agreement": round(first_same / len(ref), 4),
        "mean_tokens_before_divergence": round(first_div / len(ref), 2),
    }
    return stats, lp_diff


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--output-file", default=None)
    a = ap.parse_args()
    # Same pool memory for both, so the token capacities show what FP8 buys.
    common = dict(device=a.device, kv_cache_memory_gb=0.05)
    bf16 = LLM(default_model_path(), dtype="bfloat16", kv_cache_dtype="bf16", **common)
    fp8 = LLM(default_model_path(), dtype="bfloat16", kv_cache_dtype="fp8_e4m3", **common)
    fp32 = LLM(default_model_path(), dtype="float32", **common)
    tok = bf16.tokenizer
    prompts = []
    for doc in iter_documents("eval", max_bytes=4_000_000):
        ids = tok.encode(doc)
        if len(ids) > a.prompt_len:
            prompts.append(ids[: a.prompt_len])
        if len(prompts) == a.prompts:
            break
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    ref = bf16.generate(prompts, params)
    fp8_stats, lp_diff = agreement(ref, fp8.generate(prompts, params))
    floor_stats, _ = agreement(ref, fp32.generate(prompts, params))
    diffs = torch.tensor(lp_diff or [0.0])
    result = record(
        "fp8_kv_accuracy_demo_model",
        str(bf16.core.device),
        workload={"prompts": len(prompts), "prompt_len": a.prompt_len, "new_tokens": a.new_tokens},
        fp8_vs_bf16=fp8_stats,
        fp32_vs_bf16_noise_floor=floor_stats,
        sampled_logprob_abs_diff_mean=round(diffs.mean().item(), 5),
        sampled_logprob_abs_diff_max=round(diffs.max().item(), 5),
        kv_tokens_bf16=bf16.core.describe()["kv_tokens"],
        kv_tokens_fp8=fp8.core.describe()["kv_tokens"],
    )
    print(json.dumps(result, indent=1))
    if a.output_file:
        Path(a.output_file).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
