"""The MLA split kernel's key tiles over an FP8 latent cache stored in key pairs (mla_decode.py).

An FP8 page holds its slots two by two: slots 2j and 2j + 1 side by side, column by column, so
column c of the pair is the 16-bit word (slot 2j's byte, slot 2j + 1's byte). Read as 16-bit
words, a tile is an ordinary 16-bit matrix for both of the split's matmuls: Triton stages it
through shared memory and loads it in each matmul's operand layout with ldmatrix (the value
matmul transposed), then one instruction a word widens it to the two keys' float16 values. With
one key a byte the value matmul, whose K side is keys, had to read its operand a byte at a time:
sm_90 has no 8-bit transposing ldmatrix.

So each tile is two half-tiles, the even keys and the odd keys, each with its own scores, softmax
weights and value products; the online softmax takes both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.ops.triton.mla_key_tiles import load_pages


@triton.jit
def widen_pairs(words):
    """16-bit words of two e4m3 values (the even key's in the low byte) -> (even, odd) as float16."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t;"
        " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
    )


@triton.jit
def _load_pair_rows(
    kv16_ptr, page, key, hi, offs_c, offs_p, stride_page, stride_pair,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """The key pairs whose even keys are `key`, in `page`, as 16-bit words -> (latent halves, rotary key)."""
    rows = kv16_ptr + page.to(tl.int64) * stride_page + (key % PAGE_SIZE // 2) * stride_pair
    a_ok = offs_c[None, :] < LATENT
    b_ok = (HALF + offs_c)[None, :] < LATENT
    p_ok = offs_p[None, :] < ROPE
    if MASKED:  # a pair is read when its even key is in range
        a_ok = a_ok & (key < hi)[:, None]
        b_ok = b_ok & (key < hi)[:, None]
        p_ok = p_ok & (key < hi)[:, None]
    lat_a = tl.load(rows[:, None] + offs_c[None, :], mask=a_ok, other=0)
    lat_b = tl.load(rows[:, None] + HALF + offs_c[None, :], mask=b_ok, other=0)
    rope = tl.load(rows[:, None] + LATENT + offs_p[None, :], mask=p_ok, other=0)
    if MASKED:
        # An odd key past the sequence holds whatever its slot last held, possibly NaN's pattern,
        # and a zero softmax weight times NaN is NaN: its value bytes become zeros (its score is
        # masked to -inf anyway). Here, on the words as loaded, rather than on the widened
        # operands, where the mask would cost a layout conversion.
        odd_ok = (key + 1 < hi)[:, None]
        lat_a = tl.where(odd_ok, lat_a, lat_a & 0xFF)
        lat_b = tl.where(odd_ok, lat_b, lat_b & 0xFF)
    return lat_a, lat_b, rope


@triton.jit
def _scores(q_a, q_b, q_rope, lat_a, lat_b, rope, keys, hi, pos, qk_scale, MASKED: tl.constexpr,
            PRECISION: tl.constexpr):
    """[rows, keys] scaled scores of one half-tile, -inf where a row may not see the key."""
    s = tl.dot(q_a, tl.trans(lat_a), input_precision=PRECISION)
    s += tl.dot(q_b, tl.trans(lat_b), input_precision=PRECISION)
    s += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
    s *= qk_scale
    if MASKED:
        s = tl.where((keys[None, :] <= pos[:, None]) & (keys[None, :] < hi), s, float("-inf"))
    return s


@triton.jit
def _attend_pair_tile(
    acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, words_a, words_b, words_rope, key, hi, pos, qk_scale,
    MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over the loaded key pairs (even keys `key`), as their even and odd halves."""
    even_a, odd_a = widen_pairs(words_a)
    even_b, odd_b = widen_pairs(words_b)
    even_rope, odd_rope = widen_pairs(words_rope)
    s_even = _scores(q_a, q_b, q_rope, even_a, even_b, even_rope, key, hi, pos, qk_scale, MASKED, PRECISION)
    s_odd = _scores(q_a, q_b, q_rope, odd_a, odd_b, odd_rope, key + 1, hi, pos, qk_scale, MASKED, PRECISION)
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s_even, 1), tl.max(s_odd, 1)))
    # A row may have no visible key yet in a causal tile; exp2(-inf - 0) keeps it at zero weight.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p_even = tl.exp2(s_even - m_base[:, None])
    p_odd = tl.exp2(s_odd - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p_even, 1) + tl.sum(p_odd, 1)
    p_even = p_even.to(tl.float16)
    p_odd = p_odd.to(tl.float16)
    acc_a = tl.dot(p_even, even_a, acc=acc_a * alpha[:, None], input_precision=PRECISION)
    acc_a = tl.dot(p_odd, odd_a, acc=acc_a, input_precision=PRECISION)
    acc_b = tl.dot(p_even, even_b, acc=acc_b * alpha[:, None], input_precision=PRECISION)
    acc_b = tl.dot(p_odd, odd_b, acc=acc_b, input_precision=PRECISION)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def attend_pair_tiles(
    acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, kv16_ptr, table_row, lo, hi, pos, offs_c, offs_p,
    stride_page, stride_pair, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online softmax over keys lo .. hi (lo tile-aligned) of a key-pair FP8 cache read as 16-bit
    words (kv16_ptr; strides in words). Unmasked: whole tiles all rows see.

    Page ids are read a tile ahead, as in mla_decode's _attend_tiles.
    """
    offs = 2 * tl.arange(0, BLOCK_N // 2)
    pages = load_pages(table_row, lo + offs, hi, PAGE_SIZE, "")
    for start in range(lo, hi, BLOCK_N):
        key = start + offs
        words_a, words_b, words_rope = _load_pair_rows(
            kv16_ptr, pages, key, hi, offs_c, offs_p, stride_page, stride_pair, LATENT, ROPE, HALF, PAGE_SIZE, MASKED,
        )
        pages = load_pages(table_row, key + BLOCK_N, hi, PAGE_SIZE, "")
        acc_a, acc_b, m_i, l_i = _attend_pair_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_rope, words_a, words_b, words_rope, key, hi, pos, qk_scale,
            MASKED, PRECISION,
        )
    return acc_a, acc_b, m_i, l_i
