"""The one-launch row argmax matches torch.argmax (first maximum on ties, NaN as the maximum)
with chunks of one block, of several blocks, and of a whole row."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.triton import argmax
from moeserve.ops.triton.argmax import ArgmaxConfig, argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter runs every program in Python: small vocabularies and blocks on the CPU.
VOCAB, BLOCK = (102400, 2048) if DEVICE == "cuda" else (1000, 128)
ONE_BLOCK = ArgmaxConfig(BLOCK)
CONFIGS = {
    "one-block": ONE_BLOCK,
    "three-blocks": ArgmaxConfig(BLOCK, steps=3, num_warps=8),
    "whole-row": ArgmaxConfig(BLOCK, steps=-(-VOCAB // BLOCK)),  # one chunk: no merge
}
EACH_CONFIG = pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen).to(DEVICE, dtype)


@EACH_CONFIG
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_matches_torch_argmax_on_random_rows(rows, dtype, config):
    x = _logits(rows, VOCAB, dtype, seed=rows)
    assert torch.equal(argmax_rows(x, config=config), x.argmax(dim=-1))


@EACH_CONFIG
def test_ties_take_the_first_index_across_and_inside_chunks(config):
    x = _logits(4, VOCAB, torch.bfloat16, seed=7)
    x[0, 3] = x[0, VOCAB - 1] = 50.0  # first and last chunk
    x[1, BLOCK + 1] = x[1, BLOCK + 2] = 50.0  # inside one chunk
    x[2] = 0.0  # all equal
    x[3, 10] = float("nan")  # NaN wins, as in torch
    x[3, BLOCK + 10] = float("nan")  # the first NaN, in whichever lane, block or chunk the second is
    got = argmax_rows(x, config=config)
    assert got.tolist() == [3, BLOCK + 1, 0, 10]
    assert torch.equal(got, x.argmax(dim=-1))


@EACH_CONFIG
def test_vocab_not_a_multiple_of_the_block_and_strided_rows(config):
    wide = _logits(3, VOCAB + 100, torch.bfloat16, seed=3)
    x = wide[:, 50 : 50 + VOCAB - 7]  # rows strided, vocab ragged
    x[1, -1] = 60.0
    got = argmax_rows(x, config=config)
    assert torch.equal(got, x.argmax(dim=-1)) and got[1].item() == VOCAB - 8


def test_counters_are_reset_for_the_next_call():
    for seed in range(3):
        x = _logits(2, VOCAB, torch.bfloat16, seed=seed)
        assert torch.equal(argmax_rows(x, config=ONE_BLOCK), x.argmax(dim=-1))
    assert int(argmax._counters(torch.device(DEVICE)).abs().sum()) == 0


def test_default_config_by_row_count(monkeypatch):
    """One-block chunks for few rows, longer chunks for more, whole rows past that; all exact."""
    picked = []
    launch = argmax._argmax_kernel

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                picked.append((kwargs["BLOCK"], kwargs["STEPS"], kwargs["num_warps"]))
                return launch[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(argmax, "_argmax_kernel", Recorder())
    monkeypatch.setattr(argmax, "LONG_CHUNK_MIN_ROWS", 3)
    monkeypatch.setattr(argmax, "WHOLE_ROW_MIN_ROWS", 5)
    for rows in (2, 3, 5):
        x = _logits(rows, VOCAB, torch.bfloat16, seed=rows)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert picked == [(2048, 1, 4), (4096, 7, 8), (4096, -(-VOCAB // 4096), 8)]


def test_rejects_a_non_matrix():
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.zeros(3, device=DEVICE))


def test_writes_into_out_contiguous_or_strided():
    x = _logits(6, VOCAB, torch.bfloat16, seed=11)
    out = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x, out=out, config=ONE_BLOCK) is out and torch.equal(out, x.argmax(dim=-1))
    pairs = torch.full((6, 2), -1, dtype=torch.int64, device=DEVICE)
    argmax_rows(x, out=pairs[:, 1], config=ONE_BLOCK)  # strided: the torch fallback writes it
    assert torch.equal(pairs[:, 1], x.argmax(dim=-1)) and (pairs[:, 0] == -1).all()
    with pytest.raises(ValueError, match="out must be int64"):
        argmax_rows(x, out=out[:5], config=ONE_BLOCK)
