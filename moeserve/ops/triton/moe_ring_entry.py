"""The MoE's entry inside the ring kernel at one token: residual add + RMSNorm, router, expert selection.

Without it a batch-1 MoE is two kernels: the entry (norm_route.py: add + norm, one router dot a
program, the last program selects) and the ring (moe_ring.py), whose routed copies wait for the
entry's ids. Each hop between dependent kernels costs about a microsecond, and the ids' store and
reload another round trip. Here the ring's programs do the entry themselves after their PDL wait:
every program adds and normalises the attention's output row into its staged input (as the tail
does for the next layer), program e < E scores expert e against it with its router row (loaded
before the wait), and after a counter says all E logits are stored, every program reads them and
selects the experts itself. Meanwhile the shared experts' copies, issued before the wait, keep
HBM busy. Program 0 also stores the selection, as `add_norm_route` returns it.

What it gains is small (H200 b1 decode replay -0.2 to -0.3%, where skipping the entry outright
gains 4%): the entry's round trips remain, now inside the ring ahead of its routed copies, and the
selection is kept cheap only by giving each warp its own copy of the logits and taking a pick as
one int64 max (docs/performance.md has the forms that were slower).

Only plain top-k routing (softmax or sigmoid scores, an optional correction bias, no expert
groups) with at most one expert per program; other models keep the entry kernel. The add + RMSNorm
into the staged row (`stage_next_input`) lives here too: the ring's tail runs it for the next layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moeserve.ops.triton.moe_ring_plan import COLS, Tail
from moeserve.ops.triton.routing import selection_constants

_COLS = gl.constexpr(COLS)


@dataclass(frozen=True)
class Entry:
    """The MoE's input before its add + norm, for the ring kernel to route: norm(x + residual) scored by the router."""

    residual: torch.Tensor  # [1, H]
    norm_weight: torch.Tensor  # [H]
    eps: float
    router_weight: torch.Tensor  # [E, H]
    routing: dict  # select_experts' keywords (num_shared included)


def entry_constants(entry: Entry) -> dict:
    """The kernel's compile-time routing arguments (`select_rows`' rules), with E_PAD."""
    experts = entry.router_weight.shape[0]
    c = selection_constants(experts, **entry.routing)
    return dict(ROUTED=experts, TOP_K=c["TOP_K"], SIGMOID=c["SIGMOID"], HAS_CBIAS=c["HAS_BIAS"],
                NORMALISE=c["NORMALISE"], SCALE=c["SCALE"], K_PAD=c["K_PAD"], E_PAD=triton.next_power_of_2(experts))


def entry_usable(x: torch.Tensor, w13: torch.Tensor, entry: Entry, programs: int) -> bool:
    """Whether the ring can take this entry: x one row ([1, H] of the residual's dtype or a float32
    [1, 1, H] part), a contiguous router of the experts' dtype with at most one expert a program,
    plain top-k rules, and shared experts (if any) last in the ring's slots."""
    experts, width = entry.router_weight.shape
    rules = entry.routing
    grouped = rules["topk_method"] != "greedy" and rules["n_group"] > 1
    part = x.dtype == torch.float32 and x.dim() == 3 and x.shape[1] == 1
    return (
        not grouped and experts <= programs and x.shape[-1] == width and x.numel() == width and x.is_contiguous()
        and (part or x.dtype == entry.residual.dtype)
        and entry.router_weight.dtype == w13.dtype and entry.router_weight.is_contiguous()
        and entry.residual.shape == (1, width) and entry.residual.dtype == w13.dtype
        and entry.residual.is_contiguous() and entry.norm_weight.shape == (width,)
        and experts + rules.get("num_shared", 0) == w13.shape[0]
    )


@gluon.jit
def row_offsets(HIDDEN: gl.constexpr, H_PAD: gl.constexpr, layout: gl.constexpr):
    """Offsets of a row of HIDDEN values viewed as [H_PAD, COLS] rows of COLS, and the mask of
    those inside the width."""
    r = gl.arange(0, H_PAD, layout=gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, _COLS, layout=gl.SliceLayout(0, layout))[None, :]
    return r * _COLS + c, r < HIDDEN // _COLS


@gluon.jit
def _load_row(ptr, valid, HIDDEN: gl.constexpr, H_PAD: gl.constexpr, layout: gl.constexpr):
    """A row of HIDDEN values as [H_PAD, COLS] rows of COLS (zeros past the width, or everywhere
    where not `valid`)."""
    offs, inside = row_offsets(HIDDEN, H_PAD, layout)
    return gl.load(ptr + offs, mask=inside & valid, other=0.0)


@gluon.jit
def load_gain(gain_ptr, HIDDEN: gl.constexpr, H_PAD: gl.constexpr, layout: gl.constexpr):
    """An RMSNorm's gain as [H_PAD, COLS] float32: a weight, so it loads before the PDL wait, off
    the path of the norm it serves."""
    return _load_row(gain_ptr, True, HIDDEN, H_PAD, layout).to(gl.float32)


@gluon.jit
def stage_next_input(x_rows, out_ptr, res_ptr, gain, sum_ptr, eps, HIDDEN: gl.constexpr, H_PAD: gl.constexpr,
                      layout: gl.constexpr):
    """x_rows <- rms_norm(out + residual) * gain, rounded as the add + norm kernels round (the sum
    to the residual's dtype, then the normalised row); program 0 stores the sum (the next residual).
    `gain`: from `load_gain`, read before the kernel's waits."""
    offs, ok = row_offsets(HIDDEN, H_PAD, layout)
    part = gl.load(out_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")  # other programs' atomics
    res = gl.load(res_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")  # maybe this launch's sum
    x = (part.to(res.dtype).to(gl.float32) + res.to(gl.float32)).to(res.dtype)
    if gl.program_id(0) == 0:
        gl.store(sum_ptr + offs, x, mask=ok)
    xf = x.to(gl.float32)
    mean_sq = gl.sum(gl.sum(xf * xf, axis=1), axis=0) / HIDDEN
    normed = (xf * gl.rsqrt(mean_sq + eps)).to(res.dtype).to(gl.float32)
    x_rows.store((normed * gain).to(res.dtype))
    gl.thread_barrier()


@gluon.jit
def load_router_row(router_ptr, ROUTED: gl.constexpr, HIDDEN: gl.constexpr, H_PAD: gl.constexpr,
                    layout: gl.constexpr):
    """This program's expert's router row as [H_PAD, COLS] (zeros past the experts): a weight, so
    it loads before the PDL wait."""
    pid = gl.program_id(0)
    return _load_row(router_ptr + pid * HIDDEN, pid < ROUTED, HIDDEN, H_PAD, layout)


@gluon.jit
def _order_keys(choice, cols, E_PAD: gl.constexpr):
    """int64 keys whose order is (value, then the lower index) for float32 values: the float's bits
    made monotonic, above the index flipped, so one max reduction gives both a pick and its value."""
    bits = choice.to(gl.int32, bitcast=True)
    ordered = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(gl.int64) << 32) | (E_PAD - 1 - cols).to(gl.int64)


@gluon.jit
def _key_value(key):
    """The float32 value a key of `_order_keys` was made from."""
    ordered = (key >> 32).to(gl.int32)
    return gl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(gl.float32, bitcast=True)


@gluon.jit
def _select(logits, cols, bias_ptr, scaling, ROUTED: gl.constexpr, TOP_K: gl.constexpr, SIGMOID: gl.constexpr,
            HAS_CBIAS: gl.constexpr, NORMALISE: gl.constexpr, SCALE: gl.constexpr, NUM_SHARED: gl.constexpr,
            K_PAD: gl.constexpr, E_PAD: gl.constexpr, layout: gl.constexpr):
    """(weights fp32, ids int32) [rows, K_PAD] from one token's logits, a copy per row [rows, E_PAD]:
    `select_rows` without groups (the same picks: the largest choice, the lower index on ties).
    Each warp holds a whole row, so no reduction crosses warps, and a pick is one reduction."""
    valid = cols < ROUTED
    if SIGMOID:
        scores = gl.where(valid, 1.0 / (1.0 + gl.exp(-logits)), 0.0)
    else:
        shifted = gl.exp(logits - gl.max(logits, axis=1)[:, None])
        scores = gl.where(valid, shifted / gl.sum(shifted, axis=1)[:, None], 0.0)
    choice = scores
    if HAS_CBIAS:
        choice += gl.load(bias_ptr + cols, mask=valid, other=0.0)
    keys = _order_keys(gl.where(valid, choice, float("-inf")), cols, E_PAD)
    kcols = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, layout))[None, :]
    rows: gl.constexpr = logits.shape[0]
    top_w = gl.zeros([rows, K_PAD], gl.float32, layout)
    top_i = gl.zeros([rows, K_PAD], gl.int32, layout)
    for i in gl.static_range(TOP_K):
        key = gl.max(keys, axis=1)[:, None]
        best = (E_PAD - 1 - (key & 0xFFFF)).to(gl.int32)
        hit = cols == best
        if HAS_CBIAS:  # noqa: SIM108 (the weight is the score, not the biased choice; a constexpr branch)
            weight = gl.sum(gl.where(hit, scores, 0.0), axis=1)[:, None]
        else:
            weight = _key_value(key)
        top_w = gl.where(kcols == i, weight, top_w)
        top_i = gl.where(kcols == i, best, top_i)
        keys = gl.where(hit, -(2**63), keys)
    if NORMALISE:
        top_w = top_w / (gl.sum(top_w, axis=1)[:, None] + 1e-20)
    if SCALE:
        top_w = top_w * scaling
    if NUM_SHARED > 0:  # always-on shared experts after the routed ones, as experts E .. E + S - 1
        top_w = gl.where(kcols >= TOP_K, 1.0, top_w)
        top_i = gl.where(kcols >= TOP_K, ROUTED - TOP_K + kcols, top_i)
    return top_w, top_i


@gluon.jit
def route_in_ring(x_rows, w_row, logits_ptr, count_ptr, bias_ptr, sel_w_ptr, sel_ids_ptr, out_w_ptr, out_ids_ptr,
                  scaling, ROUTED: gl.constexpr, TOP_K: gl.constexpr, SIGMOID: gl.constexpr, HAS_CBIAS: gl.constexpr,
                  NORMALISE: gl.constexpr, SCALE: gl.constexpr, NUM_SHARED: gl.constexpr, K_PAD: gl.constexpr,
                  E_PAD: gl.constexpr, layout: gl.constexpr):
    """Score this program's expert against the staged input x_rows, wait for every expert's logit
    (count_ptr), select, and store the selection in this program's rows sel_w / sel_ids [K_PAD]
    (program 0 also in out_w / out_ids [TOP_K + NUM_SHARED])."""
    pid = gl.program_id(0)
    if pid < ROUTED:
        x = x_rows.load(layout).to(gl.float32)
        logit = gl.sum(gl.sum(w_row.to(gl.float32) * x, axis=1), axis=0)
        gl.store(logits_ptr + pid, logit)
        gl.thread_barrier()
        gl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    while gl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < ROUTED:
        pass
    # A copy of the logits per warp: the selection's many small reductions then never cross warps
    # (on one row spread over the warps, each would go through shared memory behind a barrier).
    nw: gl.constexpr = gl.num_warps()
    sel_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [nw, 1], [1, 0])
    rows = gl.arange(0, nw, layout=gl.SliceLayout(1, sel_l))[:, None]
    cols = gl.arange(0, E_PAD, layout=gl.SliceLayout(0, sel_l))[None, :]
    # Other programs' stores: read from L2 (".cg"), never from this SM's incoherent L1.
    logits = gl.load(logits_ptr + cols + rows * 0, mask=(cols < ROUTED) & (rows >= 0), other=float("-inf"),
                     cache_modifier=".cg")
    top_w, top_i = _select(logits, cols, bias_ptr, scaling, ROUTED, TOP_K, SIGMOID, HAS_CBIAS, NORMALISE, SCALE,
                           NUM_SHARED, K_PAD, E_PAD, sel_l)
    kcols = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, sel_l))[None, :] + rows * 0
    first = rows == 0
    gl.store(sel_w_ptr + kcols, top_w, mask=first)
    gl.store(sel_ids_ptr + kcols, top_i, mask=first)
    if pid == 0:
        width: gl.constexpr = TOP_K + NUM_SHARED
        gl.store(out_w_ptr + kcols, top_w, mask=first & (kcols < width))
        gl.store(out_ids_ptr + kcols, top_i, mask=first & (kcols < width))
    gl.thread_barrier()  # the selection is in before any thread reads it back


_NO_ENTRY = dict(ENTRY=False, ROUTED=1, TOP_K=1, SIGMOID=False, HAS_CBIAS=False, NORMALISE=False, SCALE=False,
                 K_PAD=1, E_PAD=1)


def entry_arguments(hidden: torch.Tensor, w13: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     then: Tail | None, entry: Entry | None, programs: int) -> dict:
    """The kernel's entry arguments: `args` (router, logits, correction bias, residual, gain, sum,
    weights and ids out, eps, scaling), the constexprs, and with an entry the per-program
    `selection` scratch rows that stand in for the weights and ids, and `entry_sum` (the sum the
    kernel writes, which its tail then reads as the residual)."""
    if entry is None:
        placeholders = (hidden,) * 8
        return dict(args=(*placeholders, 0.0, 1.0), **_NO_ENTRY)
    if then is None or not entry_usable(hidden, w13, entry, programs):
        raise ValueError("moe_ring's entry wants a tail, one row of x, a plain top-k router of the experts' dtype "
                         "with at most one expert a program, and the shared experts last")
    constants = entry_constants(entry)
    k_pad, device = constants["K_PAD"], hidden.device
    width = topk_ids.shape[1]
    if topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32 or not (
        topk_weights.shape == topk_ids.shape == (1, width) and topk_weights.is_contiguous() and topk_ids.is_contiguous()
    ):
        raise ValueError("moe_ring's entry writes its selection into contiguous float32 / int32 [1, k + S] tensors")
    bias = entry.routing["correction_bias"]
    entry_sum = torch.empty_like(entry.residual)
    args = (
        entry.router_weight, torch.empty(constants["E_PAD"], dtype=torch.float32, device=device),
        bias.float().contiguous() if bias is not None else topk_weights, entry.residual,
        entry.norm_weight.contiguous(), entry_sum, topk_weights, topk_ids, float(entry.eps),
        float(entry.routing["routed_scaling_factor"]),
    )
    selection = (torch.empty(programs, k_pad, dtype=torch.float32, device=device),
                 torch.empty(programs, k_pad, dtype=torch.int32, device=device))
    return dict(args=args, selection=selection, entry_sum=entry_sum, ENTRY=True, **constants)
