"""What the MLA split kernel compiles to on sm_90, without a GPU: registers, spills, shared memory
and an instruction census of the SASS (ptxas and cuobjdump ship with Triton).

    python benchmarks/kernels/mla_sass.py [--kv bf16|fp8] [--tile 32,4,2] [--top 14] [--extend --rows 2,16]

The kernel is compiled with the facts the engine's launches give Triton (16-byte divisible
pointers and strides), so loads vectorise as they do on the device. Useful to see, for instance,
that FP8 key pairs read as 16-bit words go through ldmatrix for both matmuls, where 8-bit tiles
took the value matmul's operand from shared memory a byte at a time (sm_90 has no 8-bit
transposing ldmatrix), and what widening to bfloat16 instead costs (--bf16-matmuls).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moeserve.ops.triton.mla_decode import _mla_split_kernel

POINTERS = {"q_lat_ptr": "*bf16", "q_rope_ptr": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qstart_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "clear_ptr": "*fp32"}
DIVISIBLE = ("stride_qt", "stride_qh", "stride_rt", "stride_rh", "stride_page", "stride_slot", "stride_ot",
             "stride_oh", "num_heads")
CUOBJDUMP = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")


def compile_split(kv: str, block_n: int, warps: int, stages: int, f16: bool, decode: bool = True,
                  rows: tuple[int, int] = (1, 16)):
    """The split kernel (rank 512 + 64; `rows` = query tokens x heads a program) for an sm_90 target,
    decode or extend; `f16`: an FP8 cache's matmuls in float16 (as the engine runs them with
    FP8_F16_MATMULS)."""
    fp8 = kv == "fp8"
    saturate = fp8 and f16
    consts = dict(LATENT=512, ROPE=64, HALF=256, BLOCK_P=64, BLOCK_Q=rows[0], BLOCK_H=rows[1], BLOCK_N=block_n,
                  PAGE_SIZE=16, SPLIT_KV=False, DECODE=decode, EARLY_TILE=False, RELOAD=fp8 and not f16,
                  COMPUTE=tl.float16 if saturate else tl.bfloat16, PRECISION="tf32", PDL=True,
                  SATURATE=saturate, CLEAR_WIDTH=0, CLEAR_BLOCK=1, PAIRED=fp8, WORDS=fp8 and f16)  # fmt: skip
    names = _mla_split_kernel.arg_names
    signature = {}
    for name in names:
        if name == "kv_ptr":
            signature[name] = ("*i16" if f16 else "*fp8e4nv") if fp8 else "*bf16"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in consts:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "out_scale") else "i32"
    divisible = [i for i, n in enumerate(names) if signature[n].startswith("*") or n in DIVISIBLE]
    source = ASTSource(fn=_mla_split_kernel, signature=signature,
                       constexprs={(names.index(c),): v for c, v in consts.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--tile", default="32,4,2", help="key tile, warps, stages")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--bf16-matmuls", action="store_true", help="FP8: widen to bfloat16 (FP8_F16_MATMULS off)")
    ap.add_argument("--extend", action="store_true", help="the prefill (extend) form: causal masks, query blocks")
    ap.add_argument("--rows", default="1,16", help="query tokens, heads a program (extend: 2,16 for V2-Lite)")
    a = ap.parse_args()
    block_n, warps, stages = (int(x) for x in a.tile.split(","))
    block_q, block_h = (int(x) for x in a.rows.split(","))
    kernel = compile_split(a.kv, block_n, warps, stages, f16=not a.bf16_matmuls, decode=not a.extend,
                           rows=(block_q, block_h))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    resources = " ".join(re.findall(r"(?:REG|STACK):\d+", usage))
    print(f"{a.kv} {a.tile}: {resources} shared {kernel.metadata.shared} B, {len(opcodes)} instructions")
    for op, n in collections.Counter(opcodes).most_common(a.top):
        print(f"  {n:6d} {op}")


if __name__ == "__main__":
    main()
