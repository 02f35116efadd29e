"""Where batch 1's MLA split and merge spend their time: %globaltimer stamps inside both kernels.

    python benchmarks/kernels/b1_attention_stamps.py [--keys 1152] [--json FILE]

Batch 1's attention is a chain of short dependent kernels: token prep, W_UK, the MLA split, the
merge + W_UV, o_proj. In the decode graph the split is charged about 9.6 us and the merge about
5.6 us (`step_timeline.py`), against about 1 us for a minimal dependent kernel
(`pdl_hops.py`). This replays that chain for 26 layers (V2-Lite shapes, a weight set and a
cache per layer) with the engine's own prep, W_UK and o_proj launches, and the split and merge
as copies of the engine's kernels that read the GPU's global timer at each phase and store the
readings per program. It prints, averaged over the middle layers and relative to the moment the
split's wait returned, when the programs of each kernel started, when their pre-wait loads were
issued, when their waits returned, when the attention math and the merge were done, and when
they finished. The engine's own split + merge run in the same chain first, so the copies' chain
time can be checked against theirs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_attention import best_us, paged  # noqa: E402

from moeserve import ops  # noqa: E402
from moeserve.bench.common import record, write_results  # noqa: E402
from moeserve.ops.triton.mla_decode import (  # noqa: E402
    _attend_tile,
    _load_query,
    _store_result,
    decode_tiles,
    num_splits_for,
)
from moeserve.ops.triton.mla_key_tiles import load_pages, load_rows  # noqa: E402
from moeserve.ops.triton.mla_reduce import PROJECT_BLOCK_V, REDUCE_BLOCK_S, split_len  # noqa: E402
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid  # noqa: E402

LAYERS, HEADS, RANK, ROPE, NOPE, V, HIDDEN = 26, 16, 512, 64, 128, 128, 2048
SLOTS = 8  # stamps a program
# The engine's shapes first (REDUCE_BLOCK_S splits a merge step, 8 warps each kernel, the next
# kernel launched right after the wait), then the next kernel launched after a program's stores
# (LATE).
# With prefetch_o the split's empty programs warm o_proj's weights in L2 (prefetch.global.L2).
ENGINE = {"split_warps": 8, "block_s": REDUCE_BLOCK_S, "merge_warps": 8, "late_split": False, "late_merge": False,
          "prefetch_o": False}
VARIANTS = [
    ENGINE,
    {**ENGINE, "late_merge": True},
    {**ENGINE, "prefetch_o": True},
    {**ENGINE, "prefetch_o": True, "late_merge": True},
]
BF16 = torch.bfloat16


@triton.jit
def _stamp(dep):
    """The global timer (ns), read only once `dep` (a float32 scalar) is available."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 d; mov.f32 d, $1; mov.u64 $0, %globaltimer; }", "=l,f", [dep],
        dtype=tl.int64, is_pure=False, pack=1,
    )


@triton.jit
def _store_stamps(base, t1, t2, t3, t4, t5):
    """A program's stamps 1-5 into its row, and the SM it ran on into the last slot."""
    tl.store(base + 1, t1)
    tl.store(base + 2, t2)
    tl.store(base + 3, t3)
    tl.store(base + 4, t4)
    tl.store(base + 5, t5)
    tl.store(base + 7, tl.extra.cuda.smid().to(tl.int64))


@triton.jit
def _wait(LATE: tl.constexpr, PDL: tl.constexpr):
    """pdl.wait_for_prior_grid, or with LATE its wait alone (the next kernel launched later)."""
    if LATE:
        if PDL:
            tl.extra.cuda.gdc_wait()
    else:
        wait_for_prior_grid(PDL)


@triton.jit
def _launch_late(LATE: tl.constexpr, PDL: tl.constexpr):
    """With LATE: let the next kernel launch now."""
    if LATE and PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """One `prefetch.global.L2` a lane: the line is fetched into L2, nothing waits on it."""
    tl.inline_asm_elementwise("{ prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _split_stamped(q_lat_ptr, q_rope_ptr, kv_ptr, table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, stamp_ptr,
                   pf_ptr, pf_lines, stride_qh, stride_rh, stride_page, stride_slot, num_splits, qk_scale,
                   LATENT: tl.constexpr, ROPE_D: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr):
    """The engine's batch-1 split program (early tile, one tile a split), stamped; LATE lets the
    next kernel launch only once this program's stores are issued."""
    t0 = _stamp(0.0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr, cache_modifier=".cg")
    chunk = split_len(seq_len, num_splits, BLOCK_N)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    base = stamp_ptr + split * 8
    tl.store(base, t0)
    if lo >= hi:
        tl.store(base + 7, -1)
        if pf_lines > 0:  # the empty splits warm the weights given (o_proj's) in L2
            active = tl.cdiv(seq_len, chunk)
            per = tl.cdiv(pf_lines, num_splits - active)
            first_line = (split - active) * per
            offs = tl.arange(0, 256)
            for start in range(first_line, tl.minimum(first_line + per, pf_lines), 256):
                line = (start + offs).to(tl.int64)
                _prefetch_l2(pf_ptr + tl.minimum(line, pf_lines - 1) * 64)
        return
    head = tl.arange(0, 16)
    row_ok = head < 16
    q_row = tl.zeros([16], tl.int64)
    offs_c = tl.arange(0, HALF)
    offs_p = tl.arange(0, BLOCK_P)
    first_n = lo + tl.arange(0, BLOCK_N)
    key = seq_len - 1
    lat_a, lat_b, rope, pv_a, pv_b = load_rows(
        kv_ptr, load_pages(table_ptr, first_n, hi, PAGE_SIZE, ".cg"), first_n, tl.minimum(hi, key), offs_c, offs_p,
        stride_page, stride_slot, LATENT, ROPE_D, HALF, PAGE_SIZE, True, False, ".cg", False,
    )
    in_tile = (key >= lo) & (key < hi)
    page = tl.load(table_ptr + key // PAGE_SIZE, mask=in_tile, other=0, cache_modifier=".cg")
    t1 = _stamp(0.0)
    _wait(LATE, PDL)
    t2 = _stamp(0.0)
    row = kv_ptr + page.to(tl.int64) * stride_page + (key % PAGE_SIZE) * stride_slot
    new_a = tl.load(row + offs_c, mask=in_tile, other=0.0, cache_modifier=".cg")
    new_b = tl.load(row + HALF + offs_c, mask=in_tile, other=0.0, cache_modifier=".cg")
    new_rope = tl.load(row + LATENT + offs_p, mask=in_tile & (offs_p < ROPE_D), other=0.0, cache_modifier=".cg")
    newest = (first_n == key)[:, None]
    lat_a = tl.where(newest, new_a[None, :], lat_a)
    lat_b = tl.where(newest, new_b[None, :], lat_b)
    rope = tl.where(newest, new_rope[None, :], rope)
    q_a, q_b, q_rope = _load_query(q_lat_ptr, q_rope_ptr, q_row, head, row_ok, offs_c, offs_p, 0, stride_qh, 0,
                                   stride_rh, LATENT, ROPE_D, HALF, tl.bfloat16, False)
    t3 = _stamp(tl.sum(q_a.to(tl.float32) * 0.0) + tl.sum(lat_a.to(tl.float32) * 0.0))
    acc_a = tl.zeros([16, HALF], dtype=tl.float32)
    acc_b = tl.zeros([16, HALF], dtype=tl.float32)
    m_i = tl.full([16], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([16], dtype=tl.float32)
    acc_a, acc_b, m_i, l_i = _attend_tile(acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, lat_a, lat_b, rope,
                                          lat_a, lat_b, first_n, hi, key + tl.zeros([16], tl.int32), qk_scale,
                                          True, tl.bfloat16, "tf32")
    t4 = _stamp(tl.sum(l_i) + tl.sum(tl.sum(acc_a, 1) + tl.sum(acc_b, 1)) * 0.0)
    _store_result(acc_a, acc_b, m_i, l_i, q_row, head, row_ok, offs_c, split, 16, 1.0,
                  part_o_ptr, part_o_ptr, part_lse_ptr, 0, 0, num_splits, LATENT, HALF, True)
    _launch_late(LATE, PDL)
    _store_stamps(base, t1, t2, t3, t4, _stamp(0.0))


@triton.jit
def _reduce_stamped(part_o_ptr, part_lse_ptr, seq_lens_ptr, w_ptr, out_ptr, stamp_ptr, num_splits,
                    V_DIM: tl.constexpr, LATENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_V: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr):
    """The engine's merge + W_UV program (batch 1; mla_reduce._merge inlined), stamped; LATE as
    the split's."""
    t0 = _stamp(0.0)
    head = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.arange(0, LATENT)
    w = tl.load(w_ptr + head * V_DIM * LATENT + offs_v[:, None] * LATENT + offs_c[None, :])
    seq_len = tl.load(seq_lens_ptr, cache_modifier=".cg")
    t1 = _stamp(0.0)
    _wait(LATE, PDL)
    t2 = _stamp(0.0)
    n_valid = tl.cdiv(seq_len, split_len(seq_len, num_splits, BLOCK_N))
    first = head * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([LATENT], dtype=tl.float32)
    t_first = t2
    for s0 in range(0, n_valid, BLOCK_S):
        ok = s0 + offs_s < n_valid
        lse = tl.load(part_lse_ptr + first + s0 + offs_s, mask=ok, other=float("-inf"))
        o = tl.load(part_o_ptr + (first + s0 + offs_s)[:, None] * LATENT + offs_c[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        wt = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(wt[:, None] * o, 0)
        den = den * alpha + tl.sum(wt, 0)
        m = m_new
        if s0 == 0:
            t_first = _stamp(den)
    o = acc / tl.maximum(den, 1.0)
    t3 = _stamp(tl.sum(o * 0.0))
    o = o.to(tl.bfloat16).to(tl.float32)
    v = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
    tl.store(out_ptr + head * V_DIM + offs_v, v.to(tl.bfloat16))
    _launch_late(LATE, PDL)
    t4 = _stamp(tl.sum(v * 0.0))
    base = stamp_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 8
    tl.store(base, t0)
    _store_stamps(base, t1, t2, t3, t4, t_first)


class Layer:
    """One layer's weights, cache and activations at batch 1, `keys` cached keys after this step."""

    def __init__(self, keys: int, max_ctx: int, gen: torch.Generator) -> None:
        dev = "cuda"
        self.w_qkv_a = torch.randn(HEADS * (NOPE + ROPE) + RANK + ROPE, HIDDEN, device=dev, dtype=BF16) * 0.02
        kv_b = torch.randn(HEADS * (NOPE + V), RANK, device=dev, dtype=BF16) * 0.05
        w = kv_b.view(HEADS, NOPE + V, RANK)
        self.w_uk, self.w_uv = w[:, :NOPE], w[:, NOPE:].contiguous()
        self.w_o = torch.randn(HIDDEN, HEADS * V, device=dev, dtype=BF16) * 0.02
        self.norm = torch.ones(RANK, device=dev, dtype=BF16)
        self.cache, table = paged([keys], 16, BF16, gen)
        self.table = torch.zeros(1, max_ctx // 16, dtype=torch.int32, device=dev)
        self.table[:, : table.shape[1]] = table
        pos = keys - 1
        self.positions = torch.tensor([pos], device=dev)
        self.slots = (self.table[0, pos // 16].long() * 16 + pos % 16).view(1)
        self.seq_lens = torch.tensor([keys], dtype=torch.int32, device=dev)
        self.q_latent = torch.empty(1, HEADS, RANK, device=dev, dtype=BF16)
        self.out = torch.empty(1, HEADS, V, device=dev, dtype=BF16)
        self.tiles = decode_tiles(HEADS, BF16, BF16, torch.device(dev), 1)
        self.splits = num_splits_for(1, max_ctx, self.tiles, torch.device(dev))
        self.part_o = torch.empty(1, HEADS, self.splits, RANK, device=dev, dtype=torch.float32)
        self.part_lse = torch.empty(1, HEADS, self.splits, device=dev, dtype=torch.float32)
        self.split_stamps = torch.zeros(self.splits, SLOTS, dtype=torch.int64, device=dev)
        self.reduce_stamps = torch.zeros(HEADS * (V // PROJECT_BLOCK_V), SLOTS, dtype=torch.int64, device=dev)

    def forward(self, hidden: torch.Tensor, inv_freq: torch.Tensor, stamped: dict | None) -> torch.Tensor:
        """hidden [1, 2048] -> attention output [1, 2048], as the engine runs batch 1's decode."""
        qkv = ops.linear(hidden, self.w_qkv_a)
        q = qkv[:, : HEADS * (NOPE + ROPE)].view(1, HEADS, NOPE + ROPE)
        kv = qkv[:, HEADS * (NOPE + ROPE):]
        ops.mla_rope_norm_store(self.positions, q[..., NOPE:], kv, self.norm, 1e-6, inv_freq, 1.0, False,
                                self.cache, self.slots, q_nope=q[..., :NOPE], w_uk=self.w_uk, q_latent=self.q_latent)
        q_rope = q[..., NOPE:]
        if not stamped:
            ops.mla_decode(self.q_latent, q_rope, self.cache, self.table, self.seq_lens, 0.1, 1.0,
                           w_uv=self.w_uv, out=self.out)
        else:
            launch = pdl_launch(hidden)
            _split_stamped[(1, 1, self.splits)](
                self.q_latent, q_rope, self.cache, self.table, self.seq_lens, self.part_o, self.part_lse,
                self.split_stamps, self.w_o, self.w_o.numel() * 2 // 128 if stamped["prefetch_o"] else 0,
                self.q_latent.stride(1), q_rope.stride(1), self.cache.stride(0),
                self.cache.stride(1), self.splits, 0.1 * 1.4426950408889634, LATENT=RANK, ROPE_D=ROPE,
                HALF=RANK // 2, BLOCK_P=ROPE, BLOCK_N=self.tiles.block_n, PAGE_SIZE=16,
                LATE=stamped["late_split"], num_warps=stamped["split_warps"], num_stages=self.tiles.num_stages,
                **launch,
            )
            _reduce_stamped[(HEADS, V // PROJECT_BLOCK_V)](
                self.part_o, self.part_lse, self.seq_lens, self.w_uv, self.out, self.reduce_stamps, self.splits,
                V_DIM=V, LATENT=RANK, BLOCK_N=self.tiles.block_n, BLOCK_S=stamped["block_s"],
                BLOCK_V=PROJECT_BLOCK_V, LATE=stamped["late_merge"], num_warps=stamped["merge_warps"], **launch,
            )
        return ops.linear(self.out.flatten(1), self.w_o)


def phases(layers: list[Layer]) -> dict:
    """Median over the middle layers of each phase's time (us) from the split's first wait return."""
    splits = [layer.split_stamps.cpu() for layer in layers]
    # Each layer's reference: the first return from its split's wait, over the keyed programs.
    refs = [s[s[:, 7] >= 0][:, 2].min().item() for s in splits]
    rows = []
    for i in range(2, len(layers) - 2):
        s, r, ref = splits[i], layers[i].reduce_stamps.cpu(), refs[i]
        valid = s[:, 7] >= 0
        sv = s[valid]
        rows.append({
            "split first start": s[:, 0].min().item() - ref,
            "split last start (keyed)": sv[:, 0].max().item() - ref,
            "split pre-wait loads issued (last)": sv[:, 1].max().item() - ref,
            "split wait returned (last)": sv[:, 2].max().item() - ref,
            "split tile and query in (last)": sv[:, 3].max().item() - ref,
            "split math done (last)": sv[:, 4].max().item() - ref,
            "split stores issued (last)": sv[:, 5].max().item() - ref,
            "merge first start": r[:, 0].min().item() - ref,
            "merge last start": r[:, 0].max().item() - ref,
            "merge W_UV loads issued (last)": r[:, 1].max().item() - ref,
            "merge wait returned (first)": r[:, 2].min().item() - ref,
            "merge wait returned (last)": r[:, 2].max().item() - ref,
            "merge first block merged (last)": r[:, 5].max().item() - ref,
            "merge merged (last)": r[:, 3].max().item() - ref,
            "merge done (last)": r[:, 4].max().item() - ref,
            "next layer's split wait returned": refs[i + 1] - ref,
            "keyed split programs": int(valid.sum()),
            "their distinct SMs": len(set(sv[:, 7].tolist())),
        })
    keys = rows[0].keys()
    return {k: round(sorted(row[k] for row in rows)[len(rows) // 2] / (1 if "programs" in k or "SMs" in k else 1e3), 2)
            for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1152)
    ap.add_argument("--max-ctx", type=int, default=4096, help="the block table's capacity (sets the split count)")
    ap.add_argument("--json", help="append a results row to this JSON list")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    layers = [Layer(a.keys, a.max_ctx, gen) for _ in range(LAYERS)]
    hidden = torch.randn(1, HIDDEN, device="cuda", dtype=BF16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, device="cuda").float() / ROPE))

    def chain(stamped: dict | None):
        def run() -> None:
            x = hidden
            for layer in layers:
                x = layer.forward(x, inv_freq, stamped)
        return run

    engine_us = best_us(chain(None), iters=1) / LAYERS
    print(f"splits {layers[0].splits}, chain a layer with the engine's kernels {engine_us:.2f} us")
    rows = []
    for variant in VARIANTS:
        us = best_us(chain(variant), iters=1) / LAYERS
        table = phases(layers)
        print(f"stamped copies {variant}: chain a layer {us:.2f} us")
        for k, v in table.items():
            print(f"  {k:38s} {v:8.2f}")
        rows.append({**variant, "chain_us_per_layer": round(us, 2), "phases_us_from_split_wait": table})
    workload = {"keys": a.keys, "max_ctx": a.max_ctx, "layers": LAYERS, "splits": layers[0].splits}
    write_results(a.json, [record("b1_attention_stamps", "cuda", workload=workload,
                                  engine_chain_us_per_layer=round(engine_us, 2), variants=rows)])


if __name__ == "__main__":
    main()
