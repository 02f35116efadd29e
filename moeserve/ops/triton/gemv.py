"""Triton GEMV for decode-size dense projections: out = x @ w^T (+ bias) for a few rows of x.

`add_norm_linear` also runs a decode layer's residual add + RMSNorm inside its first projection,
and `embed_norm_linear` a decode step's token embedding and first RMSNorm.

With one to a few tokens a projection is a weight stream, and at a few microseconds a kernel its
time is mostly latency. Each program holds BLOCK_N whole weight rows in registers and issues all
of their loads *before* `wait_for_prior_grid`: weights are never written by a kernel, so under
programmatic dependent launch the weight stream overlaps the tail of the kernel before (cuBLAS
cannot, which is where its GEMVs lose: 6 us for a 15 MB fused_qkv_a on H200 against a 3.5 us
stream). Then it reads x and reduces each row in float32. Rows of K beyond `MAX_K` do not fit in
registers; `linear` hands those, and calls with too many rows, to the skinny GEMM (up to
SKINNY_MAX_ROWS rows) or cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.ops.reference.linear import linear as reference_linear
from moeserve.ops.triton.norm import check_inputs, fused_add_rms_norm, normalize_row, rms_norm
from moeserve.ops.triton.pdl import pdl_launch, wait_for_prior_grid
from moeserve.ops.triton.skinny_gemm import SkinnyConfig, skinny_bmm

MAX_ROWS = 8
# Past one row: its float32 multiply-reduce grows with rows x N while cuBLAS's MMA path stays
# flat; measured on H200 behind an RMSNorm (benchmarks/kernels/check_gemv.py): fused_qkv_a (N 3648)
# 6.1 / 7.4 / 9.8 us at 1 / 2 / 4 rows against cuBLAS's 7.8, o_proj (N 2048) 4.2 / 4.9 / 6.0 / 9.0
# at 1 / 2 / 4 / 8 against 7.1, the router (N 64) 1.9 - 5.2 against 5.7. One row is a weight stream
# at any N: V2-Lite's LM head (102,400 x 2,048) as this GEMV made b1 decode-graph replay 0.9%
# shorter than cuBLAS's (H200, `ab_decode.py`; 2, 4 or 8 weight rows a program alike, 8 warps
# +0.3%; -1.2% with the trees alternating), while at 4 / 8 rows it was 1.8 / 8.0% longer; the
# skinny GEMM takes 2-16 rows of it, even with cuBLAS.
MAX_ROWS_X_N = 8192
MAX_K = 8192
# Past the GEMV's rows, up to SKINNY_MAX_ROWS rows go to the skinny GEMM with this tile rather
# than cuBLAS. Its pipeline (32 weight rows x 128 columns a step, 6 stages) keeps enough loads in
# flight that the weight stream beats cuBLAS's small-M kernels, and its first tile loads before
# the PDL wait. H200, behind an RMSNorm at 8 rows (benchmarks/kernels/check_gemv.py --skinny):
# fused_qkv_a 7.24 against 7.94 us, o_proj 6.32 against 7.15; decode-graph replay b8 -2.3%,
# b16 -1.8%. Whole-K tiles (one step) were far slower (10-15 us): too few loads in flight.
SKINNY_MAX_ROWS = 16
SKINNY_MAX_K = 8192
SKINNY_BLOCK_N = 32
SKINNY_BLOCK_K = 128
SKINNY_WARPS = 4
SKINNY_STAGES = 6


@triton.jit
def _weight_rows(w_ptr, stride_wn, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offs_n, n_ok, offs_k, k_ok, rows) of this program's BLOCK_N whole weight rows, loaded now."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return offs_n, n_ok, offs_k, k_ok, w


@triton.jit(do_not_specialize=["M", "N"])
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program: BLOCK_N output columns for every row of x."""
    offs_n, n_ok, offs_k, k_ok, w = _weight_rows(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_prior_grid(PDL)
    m = 0
    while m < M:  # while, not range: Triton's interpreter cannot range over a runtime int
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0)
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        m += 1


# Up to this many rows, add_norm_linear is one kernel: every program sums the row's parts and
# residual and normalises it itself (36 KB from L2 behind a MoE) instead of waiting on a norm
# kernel. H200 decode-graph replay at batch 1 against the two kernels: 8 weight rows a program
# on 4 warps -1.1% (8 warps -1.0%, 2 warps +6.1%), 4 rows +0.2%, 16 rows +2.8%; taking 2 rows
# too: +1.8% at batch 2.
ADD_NORM_MAX_ROWS = 1
ADD_NORM_BLOCK_N = 8
ADD_NORM_WARPS = 4
# At one token, a decode step's embedding row is gathered by the first projection's add + norm
# GEMV (embed_norm_linear) rather than by PyTorch's embedding (a launch outside PDL) and a norm
# kernel before it: H100 decode-graph replay at batch 1 2.094 -> 2.089 ms (-0.2%, 6 of 7 rounds).
EMBED_IN_GEMV = True


@triton.jit(do_not_specialize=["M", "N", "vocab"])
def _add_norm_gemv_kernel(
    x_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, sum_ptr, M, N, eps,
    stride_xm, stride_xs, stride_rm, stride_wn, stride_om, vocab,
    K: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, GATHER: tl.constexpr = False,
):
    """Program: BLOCK_N output columns of norm(sum of x's slots + residual) @ w^T for every row;
    program 0 also stores the summed rows (the next residual). GATHER: x holds token ids and res
    the embedding table (`vocab` rows), whose rows take the sum's place."""
    offs_n, n_ok, offs_k, k_ok, w = _weight_rows(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    gain = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_prior_grid(PDL)
    slots = tl.arange(0, SLOTS_PAD)
    m = 0
    while m < M:
        if GATHER:
            token = tl.load(x_ptr + m * stride_xm).to(tl.int64)
            known = (token >= 0) & (token < vocab)  # the engine checks ids; a stray one reads zeros, not past the table
            x = tl.load(res_ptr + token * stride_rm + offs_k, mask=k_ok & known, other=0.0)
        else:
            parts = tl.load(x_ptr + m * stride_xm + slots[:, None] * stride_xs + offs_k[None, :],
                            mask=(slots[:, None] < SLOTS) & k_ok[None, :], other=0.0)
            # Rounded as the reference rounds: the slot sum, then the residual add, in the residual's
            # dtype (x may be a MoE's float32 sum).
            x = tl.sum(parts.to(tl.float32), axis=0).to(res_ptr.dtype.element_ty)
            res = tl.load(res_ptr + m * stride_rm + offs_k, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(res_ptr.dtype.element_ty)
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + m * K + offs_k, x, mask=k_ok)
        y = normalize_row(x.to(tl.float32), gain, K, eps, res_ptr.dtype.element_ty)
        acc = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        m += 1


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: BLOCK_N weight rows per program."""

    block_n: int
    num_warps: int = 4


# One row: four weight rows a program. Alone with L2 flushed two were the fastest at every
# V2-Lite shape and row count, but in batch 1's decode graph (o_proj, launched early beside the
# MLA merge) four give fewer programs to place: replay -0.3 / -0.4% on two H200s.
ONE_ROW_BLOCK_N = 4


def pick_config(n: int, k: int, rows: int) -> GemvConfig:
    """Two weight rows a program (many small programs keep the most loads in flight; a 2 x 8192
    slice is 64 registers a thread), ONE_ROW_BLOCK_N for a single row."""
    return GemvConfig(block_n=ONE_ROW_BLOCK_N if rows == 1 else 2)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV takes this call: few rows (times N), K small enough for rows in registers."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        0 < rows <= MAX_ROWS and (rows == 1 or rows * weight.shape[0] <= MAX_ROWS_X_N) and weight.shape[1] <= MAX_K
        and weight.stride(1) == 1
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K]^T (+ bias) -> [M, N] in out_dtype (default x's), fp32 sums,
    into `out` (rows contiguous) when given.

    `weight` and `bias` must not be the output of the kernel just before: they are read before the wait.
    """
    if not fits(x, weight) or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} @ weight {tuple(weight.shape)}^T is not a supported GEMV")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = _output(out, m, n, out_dtype or x.dtype, x.device)
    config = config or pick_config(n, k, m)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0),
        K=k, BLOCK_N=config.block_n, BLOCK_K=triton.next_power_of_2(k), HAS_BIAS=bias is not None,
        num_warps=config.num_warps, **pdl_launch(x),
    )
    return out


def _output(out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out` checked to take an [m, n] result of `dtype` with contiguous rows, or a new tensor."""
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=device)
    if out.shape != (m, n) or out.dtype != dtype or out.device != device or out.stride(1) != 1:
        raise ValueError(f"linear: out {tuple(out.shape)} {out.dtype} cannot take a [{m}, {n}] {dtype} result")
    return out


def _skinny_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> bool:
    """Whether a projection the GEMV does not take goes to the skinny GEMM (else cuBLAS)."""
    return (
        x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS and bias is None and out_dtype in (None, x.dtype)
        and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2
        and weight.shape[1] <= SKINNY_MAX_K and weight.stride(1) == 1
    )


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T through the skinny GEMM with the module's tile (into `out` when given)."""
    block_k = min(SKINNY_BLOCK_K, max(16, triton.next_power_of_2(x.shape[1])))
    m, n = x.shape[0], weight.shape[0]
    out = _output(out, m, n, x.dtype, x.device)
    # Past 16 rows (when SKINNY_MAX_ROWS allows them) the kernel's own wider tile re-reads x less.
    config = SkinnyConfig(SKINNY_BLOCK_N, block_k, 1, SKINNY_WARPS, SKINNY_STAGES) if m <= 16 else None
    # Batch stride 0 (there is one batch): x[None]'s would be rows x K, and Triton specialises
    # integers by divisibility, so a new row count could compile a new variant mid-serving.
    x1 = x.as_strided((1, m, x.shape[1]), (0, x.stride(0), x.stride(1)))
    skinny_bmm(x1, weight[None], out.as_strided((1, m, n), (0, out.stride(0), 1)), config=config)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference `linear`: through the GEMV or the skinny GEMM for decode-size inputs, cuBLAS otherwise."""
    if fits(x, weight) and x.dtype == weight.dtype:
        return gemv(x, weight, bias, out_dtype, out=out)
    if _skinny_fits(x, weight, bias, out_dtype):
        return _skinny_linear(x, weight, out)
    if out is not None:
        if x.dim() == 2 and bias is None and out_dtype in (None, x.dtype) and x.dtype == weight.dtype:
            return torch.mm(x, weight.t(), out=out)  # what nn.Linear runs, written in place
        return out.copy_(linear(x, weight, bias, out_dtype))
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return reference_linear(x, weight, bias, out_dtype)
    # Half-precision operands accumulate and write out_dtype directly: no widened copies.
    result = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype).view(*x.shape[:-1], -1)
    return result if bias is None else result + bias.to(out_dtype)


def add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference `add_norm_linear`: one kernel up to ADD_NORM_MAX_ROWS rows, the norm then `linear` past them."""
    rows, width = residual.shape[0], residual.shape[-1]
    one_kernel = (
        residual.dim() == 2 and 0 < rows <= ADD_NORM_MAX_ROWS and fits(residual, weight) and weight.shape[1] == width
        and residual.dtype == weight.dtype and x.stride(-1) == 1 and residual.stride(-1) == 1
    )  # x's dtype (the residual's, or float32 parts) is check_inputs' to judge
    if not one_kernel:  # the norm checks the inputs itself
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias), summed
    check_inputs(x, residual, norm_weight)
    return _add_norm_gemv(x, residual, norm_weight, eps, weight, bias)


def embed_norm_linear(
    ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference `embed_norm_linear`: one kernel up to ADD_NORM_MAX_ROWS ids (EMBED_IN_GEMV), else
    the embedding, the norm and `linear`."""
    rows, width = ids.shape[0], table.shape[1]
    one_kernel = (
        EMBED_IN_GEMV and ids.dim() == 1 and 0 < rows <= ADD_NORM_MAX_ROWS and table.dim() == 2
        and weight.shape[1] == width <= MAX_K and table.dtype == weight.dtype and norm_weight.shape == (width,)
        and table.stride(1) == 1 and weight.stride(1) == 1
    )
    if not one_kernel:
        embedded = F.embedding(ids, table)
        return linear(rms_norm(embedded, norm_weight, eps), weight, bias), embedded
    return _add_norm_gemv(ids, table, norm_weight, eps, weight, bias, gather=True)


def _add_norm_gemv(
    x: torch.Tensor, rows_from: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None, gather: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One _add_norm_gemv_kernel launch over x's rows -> (projection [rows, N], the normalised rows'
    input [rows, H]): x's slots ([rows, slots, H] or [rows, H]) plus the residual `rows_from`, or
    (gather) the rows of the table `rows_from` that the ids x [rows] name."""
    rows, n, width = x.shape[0], weight.shape[0], rows_from.shape[-1]
    slots = x.shape[1] if x.dim() == 3 else 1
    out = torch.empty(rows, n, dtype=rows_from.dtype, device=x.device)
    summed = torch.empty(rows, width, dtype=rows_from.dtype, device=x.device)
    _add_norm_gemv_kernel[(triton.cdiv(n, ADD_NORM_BLOCK_N),)](
        x, rows_from, norm_weight.contiguous(), weight, bias if bias is not None else weight, out, summed, rows, n,
        float(eps), x.stride(0), x.stride(1) if slots > 1 else 0, rows_from.stride(0), weight.stride(0), out.stride(0),
        rows_from.shape[0] if gather else 0,
        K=width, SLOTS=slots, SLOTS_PAD=triton.next_power_of_2(slots), BLOCK_N=ADD_NORM_BLOCK_N,
        BLOCK_K=triton.next_power_of_2(width), HAS_BIAS=bias is not None, GATHER=gather, num_warps=ADD_NORM_WARPS,
        **pdl_launch(x),
    )
    return out, summed
