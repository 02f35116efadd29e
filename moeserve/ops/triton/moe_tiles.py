"""The fused MoE's tile helpers: which rows and expert a program's block holds, and one tile's
matmul by plain loads or by TMA, in the three modes (`dot`, `swap`, `gemv`) fused_moe.py describes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(m block, n tile) of a program; GROUP_M m blocks share each n tile while resident (L2 reuse)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def block_rows(pid_m, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                TOPK: tl.constexpr, K_PAD: tl.constexpr, DENSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert or -1 to skip, flat (token * k + slot) index per row, row mask) of one m block."""
    if DENSE:
        # pid_m is a flat (token, slot) index; only an expert's first occurrence does the work.
        t = tl.arange(0, BLOCK_M)
        s = tl.arange(0, K_PAD)
        flat_2d = t[:, None] * TOPK + s[None, :]
        ids = tl.load(ids_ptr + flat_2d, mask=(t[:, None] < num_tokens) & (s[None, :] < TOPK), other=-1)
        expert = tl.load(ids_ptr + pid_m)
        hit = ids == expert
        earlier = tl.sum((hit & (flat_2d < pid_m)).to(tl.int32), axis=1)
        rows_hit = tl.sum(hit.to(tl.int32), axis=1)
        flat = t * TOPK + tl.sum(tl.where(hit, s[None, :], 0), axis=1)
        expert = tl.where(tl.sum(earlier, axis=0) == 0, expert, -1)
        return expert.to(tl.int64), flat.to(tl.int64), rows_hit > 0
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        return expert.to(tl.int64), flat.to(tl.int64), flat < num_tokens * TOPK


@triton.jit
def token_rows(x_ptr, x_rows, x_mask, k0, offs_k, K: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The gathered token rows' columns k0 + offs_k: [rows, k], or [k, rows] when TRANSPOSED (swapAB)."""
    k_ok = (k0 + offs_k) < K
    if TRANSPOSED:  # one return: Triton wants every return of a function to have one shape
        rows = tl.load(x_ptr + x_rows[None, :] + (k0 + offs_k)[:, None], mask=x_mask[None, :] & k_ok[:, None], other=0.0)
    else:
        rows = tl.load(x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :], mask=x_mask[:, None] & k_ok[None, :], other=0.0)
    return rows


@triton.jit
def tile_matmul(x_ptr, x_rows, x_mask, w_ptr, w_rows, w_mask,
                 K: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = X[x_rows, :K] @ W[w_rows, :K]^T, rows given as element offsets."""
    offs_k = tl.arange(0, BLOCK_K)
    m_idx = tl.arange(0, BLOCK_M)
    if MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is constexpr: the interpreter cannot range over a runtime int
        k_ok = (k0 + offs_k) < K
        if MODE == 1:
            w = tl.load(w_ptr + w_rows[:, None] + (k0 + offs_k)[None, :], mask=w_mask[:, None] & k_ok[None, :], other=0.0)
            xt = token_rows(x_ptr, x_rows, x_mask, k0, offs_k, K, True)
            if PRECISION == "ieee":  # fp32, or the interpreter, whose tl.dot misreads bf16
                w, xt = w.to(tl.float32), xt.to(tl.float32)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        elif MODE == 2:
            x = token_rows(x_ptr, x_rows, x_mask, k0, offs_k, K, False)
            wt = tl.load(w_ptr + w_rows[None, :] + (k0 + offs_k)[:, None], mask=w_mask[None, :] & k_ok[:, None], other=0.0)
            if PRECISION == "ieee":
                x, wt = x.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(x, wt, acc, input_precision=PRECISION)
        else:
            w = tl.load(w_ptr + w_rows[:, None] + (k0 + offs_k)[None, :], mask=w_mask[:, None] & k_ok[None, :], other=0.0)
            w = w.to(tl.float32)
            # One row at a time: a [BLOCK_M, BLOCK_N, BLOCK_K] product would spill registers.
            for m in tl.static_range(BLOCK_M):
                row = tl.sum(tl.where(m_idx == m, x_rows, 0), axis=0)
                ok = tl.sum(tl.where(m_idx == m, x_mask.to(tl.int32), 0), axis=0) > 0
                xm = tl.load(x_ptr + row + k0 + offs_k, mask=ok & k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * xm[None, :], axis=1)
                acc = tl.where(m_idx[:, None] == m, acc + part[None, :], acc)
    if MODE == 1:
        acc = tl.trans(acc)
    return acc


@triton.jit
def tile_matmul_tma(x_ptr, x_rows, x_mask, w_desc, expert, n0, N: tl.constexpr,
                     K: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr, X_TMA: tl.constexpr):
    """fp32 [BLOCK_M, ROWS] = X[x_rows] @ W_tile^T, the weight tile by TMA.

    The tile is rows n0 .. n0 + ROWS - 1 of the expert's N rows (a descriptor over [E * N, K]),
    or with PAIRED (the gate/up GEMM, a descriptor over w13 viewed as [E, I, 2, K]) ROWS / 2 gate
    rows from n0 interleaved with the same up rows: one bulk copy, one MMA of both. Gathered
    token rows use ordinary loads; with X_TMA (MODE dot) `x_ptr` is a descriptor and the rows are
    the contiguous x_rows .. x_rows + BLOCK_M - 1.
    """
    offs_k = tl.arange(0, BLOCK_K)
    if MODE == 1:
        acc = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PAIRED:
            w = tl.reshape(w_desc.load([expert.to(tl.int32), n0, 0, k0]), [ROWS, BLOCK_K])
        else:
            w = w_desc.load([(expert * N + n0).to(tl.int32), k0])
        if X_TMA:  # noqa: SIM108 (a constexpr branch: only the taken side is compiled)
            x = x_ptr.load([x_rows, k0])
        else:
            x = token_rows(x_ptr, x_rows, x_mask, k0, offs_k, K, MODE == 1)
        if PRECISION == "ieee":
            x, w = x.to(tl.float32), w.to(tl.float32)
        if MODE == 1:
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if MODE == 1:
        acc = tl.trans(acc)
    return acc
