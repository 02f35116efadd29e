"""Key tiles of the MLA split kernel (mla_decode.py) from the paged latent cache: page ids, row
addresses (a slot's, or in an FP8 cache its key pair's: mla_pairs.py), and decode's first tile
loaded before the PDL wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.ops.triton.pdl import wait_for_prior_grid


@triton.jit
def load_pages(table_row, offs_n, hi, PAGE_SIZE: tl.constexpr, CACHE: tl.constexpr):
    """The page holding each key offs_n (the scratch page 0 from hi on); ".cg" (L2 only) where it
    is read before the wait (first_tile_then_wait)."""
    return tl.load(table_row + offs_n // PAGE_SIZE, mask=offs_n < hi, other=0, cache_modifier=CACHE)


@triton.jit
def slot_offset(slot, stride_slot, PAIRED: tl.constexpr):
    """Offset of a slot's row: slot * stride_slot, or in a key-pair FP8 cache (reference.attention.
    slot_view) its pair's, plus the slot's byte in each column (columns then step by 2). The slot
    may count from the page or from the cache's start: pages hold whole pairs."""
    if PAIRED:
        return slot // 2 * (2 * stride_slot) + slot % 2
    return slot * stride_slot


@triton.jit
def slot_rows(kv_ptr, page, offs_n, stride_page, stride_slot, PAGE_SIZE: tl.constexpr, PAIRED: tl.constexpr):
    """Where each key's row starts (see slot_offset)."""
    # int64: page * stride_page overflows int32 in pools past ~3.7M tokens.
    return kv_ptr + page.to(tl.int64) * stride_page + slot_offset(offs_n % PAGE_SIZE, stride_slot, PAIRED)


@triton.jit
def load_rows(
    kv_ptr, page, offs_n, hi, offs_c, offs_p, stride_page, stride_slot,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    RELOAD: tl.constexpr, CACHE: tl.constexpr, PAIRED: tl.constexpr,
):
    """Cached rows of keys offs_n in the cache's dtype (zeros from hi on when MASKED) -> (latent
    halves for the scores, rotary key, latent halves for the output).

    The latent comes as two halves of columns so that the score is two independent MMA chains of
    half the depth (plus the rotary one): with heads on the M side a tile's score is a [heads,
    keys] block whose K loop is a chain of dependent MMAs, which set the pace at 256 sequences.
    The latent feeds two matmuls. Loaded once and widened (FP8), Triton's pipeliner no longer
    stages it through shared memory, so RELOAD gives each matmul its own load: the second one
    hits L2, and both stay in the multi-buffered cp.async pipeline.
    """
    rows = slot_rows(kv_ptr, page, offs_n, stride_page, stride_slot, PAGE_SIZE, PAIRED)
    a_ok = offs_c[None, :] < LATENT
    b_ok = (HALF + offs_c)[None, :] < LATENT
    p_ok = offs_p[None, :] < ROPE
    if MASKED:
        a_ok = a_ok & (offs_n < hi)[:, None]
        b_ok = b_ok & (offs_n < hi)[:, None]
        p_ok = p_ok & (offs_n < hi)[:, None]
    step: tl.constexpr = 2 if PAIRED else 1  # a key-pair cache interleaves the pair's columns
    cols_a, cols_b, cols_p = step * offs_c, step * (HALF + offs_c), step * (LATENT + offs_p)
    lat_a = tl.load(rows[:, None] + cols_a[None, :], mask=a_ok, other=0.0, cache_modifier=CACHE)
    lat_b = tl.load(rows[:, None] + cols_b[None, :], mask=b_ok, other=0.0, cache_modifier=CACHE)
    rope = tl.load(rows[:, None] + cols_p[None, :], mask=p_ok, other=0.0, cache_modifier=CACHE)
    if RELOAD:
        # A different cache modifier also keeps the compiler from merging the two loads.
        pv_a = tl.load(rows[:, None] + cols_a[None, :], mask=a_ok, other=0.0, cache_modifier=".cg")
        pv_b = tl.load(rows[:, None] + cols_b[None, :], mask=b_ok, other=0.0, cache_modifier=".cg")
    else:
        pv_a, pv_b = lat_a, lat_b
    return lat_a, lat_b, rope, pv_a, pv_b


@triton.jit
def first_tile_then_wait(
    kv_ptr, table_row, lo, hi, seq_len, offs_c, offs_p, stride_page, stride_slot,
    LATENT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    RELOAD: tl.constexpr, PDL: tl.constexpr, PAIRED: tl.constexpr,
):
    """Decode: a split's first KV tile, loaded before waiting on the previous kernel -> (keys, rows).

    All keys but the newest were stored by earlier steps, so under PDL (pdl.py) they stream in
    while the previous kernel drains; the newest key's row, which this step's store kernel may
    just have written, is read after the wait. At decode sizes a split is a tile or two, so this
    takes the table and cache round trips off the path behind the previous kernel.
    """
    first_n = lo + tl.arange(0, BLOCK_N)
    key = seq_len - 1
    lat_a, lat_b, rope, pv_a, pv_b = load_rows(
        kv_ptr, load_pages(table_row, first_n, hi, PAGE_SIZE, ".cg"), first_n, tl.minimum(hi, key), offs_c, offs_p,
        stride_page, stride_slot, LATENT, ROPE, HALF, PAGE_SIZE, True, RELOAD, ".cg", PAIRED,
    )
    in_tile = (key >= lo) & (key < hi) & (key < lo + BLOCK_N)
    page = tl.load(table_row + key // PAGE_SIZE, mask=in_tile, other=0, cache_modifier=".cg")
    row = slot_rows(kv_ptr, page, key, stride_page, stride_slot, PAGE_SIZE, PAIRED)
    step: tl.constexpr = 2 if PAIRED else 1
    wait_for_prior_grid(PDL)
    new_a = tl.load(row + step * offs_c, mask=in_tile & (offs_c < LATENT), other=0.0, cache_modifier=".cg")
    new_b = tl.load(row + step * (HALF + offs_c), mask=in_tile & (HALF + offs_c < LATENT), other=0.0,
                    cache_modifier=".cg")
    new_rope = tl.load(row + step * (LATENT + offs_p), mask=in_tile & (offs_p < ROPE), other=0.0, cache_modifier=".cg")
    newest = (first_n == key)[:, None]
    lat_a = tl.where(newest, new_a[None, :], lat_a)
    lat_b = tl.where(newest, new_b[None, :], lat_b)
    rope = tl.where(newest, new_rope[None, :], rope)
    pv_a = tl.where(newest, new_a[None, :], pv_a)
    pv_b = tl.where(newest, new_b[None, :], pv_b)
    return first_n, lat_a, lat_b, rope, pv_a, pv_b
