"""MLA attention through the real launch, default tiles, in whichever tree PYTHONPATH names.

    PYTHONPATH=OTHER_TREE python benchmarks/kernels/ab_mla.py --tag base [--json out.json] [--heads 128]

Decode at the latency workloads' sizes (1,152 keys: the median b256 step), FP8 at b256, batch 1
at long contexts with W_UV fused as the engine calls it, and one absorbed-form prefill chunk.
Alternate the trees (base, new, base, new): the first line names the `moeserve` each imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import FP8, best_us, cumsum0, decode_case, i32, paged, queries  # noqa: E402

import moeserve  # noqa: E402
from moeserve.ops.triton.mla_decode import mla_decode  # noqa: E402
from moeserve.ops.triton.mla_extend import mla_extend_absorbed  # noqa: E402

BF16 = torch.bfloat16
DECODE = [(1, 1152, BF16), (8, 1152, BF16), (64, 1152, BF16), (128, 1152, BF16), (256, 1152, BF16),
          (256, 1280, BF16), (1, 1152, FP8), (8, 1152, FP8), (64, 1152, FP8), (128, 1152, FP8), (256, 1152, FP8),
          (256, 4096, FP8)]
LONG_B1 = [1152, 4096, 16384, 65536]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--json", help="append the rows to this JSON list file")
    ap.add_argument("--heads", type=int, default=16, help="query heads (V3: 128; the W_UV rows are V2-Lite's only)")
    a = ap.parse_args()
    print(a.tag, "imports", moeserve.__file__, flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    shape = "" if a.heads == 16 else f" {a.heads} heads"
    for batch, ctx, dtype in DECODE:
        args, _ = decode_case(batch, ctx, dtype, gen, a.heads)
        us = best_us(lambda args=args: mla_decode(*args))
        rows.append({"case": f"decode b{batch} {ctx} keys {str(dtype)[6:]}{shape}", "us": round(us, 1)})
    w_uv = torch.randn(16, 128, 512, device="cuda", dtype=BF16) * 0.05
    out = torch.empty(1, 16, 128, device="cuda", dtype=BF16)
    for ctx in LONG_B1 if a.heads == 16 else []:
        args, _ = decode_case(1, ctx, BF16, gen)
        us = best_us(lambda args=args: mla_decode(*args, w_uv=w_uv, out=out))
        rows.append({"case": f"decode + W_UV b1 {ctx} keys", "us": round(us, 1)})
    q_lens, prefix = [256] * 4, 1024
    kv_lens = [prefix + q for q in q_lens]
    q_latent, q_rope = queries(sum(q_lens), a.heads)
    lens, starts = i32(kv_lens), cumsum0(q_lens)
    for dtype in (BF16, FP8):
        cache, table = paged(kv_lens, 64, dtype, gen)
        us = best_us(lambda c=cache, t=table: mla_extend_absorbed(q_latent, q_rope, c, t, lens, starts, 256, 0.1), iters=10)
        rows.append({"case": f"extend 4 x 256 rows after 1,024 cached {str(dtype)[6:]}{shape}", "us": round(us, 1)})
    for r in rows:
        print(a.tag, f"{r['case']:<40} {r['us']:8.1f} us", flush=True)
    if a.json:
        path = Path(a.json)
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append({"tag": a.tag, "rows": rows})
        path.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
