"""Seed 003's CUDA graph sets, padding arithmetic, and the optimal set under a budget."""

from __future__ import annotations

import itertools
import random

import pytest

from moeserve.planner.cuda_graphs import (
    evaluate,
    ladder,
    max_padding,
    optimal_sizes,
    padded_size,
    plan_graphs,
)
from moeserve.planner.histogram import normalize, synthetic


@pytest.mark.parametrize("name, count, pad", [("x2", 23, 1023), ("+64", 49, 63), ("+8", 259, 7)])
def test_seed_003_set_sizes_and_max_padding_above_128(name, count, pad):
    sizes = ladder(name, 2048)
    assert len(sizes) == count and sizes[-1] == 2048
    assert max_padding(sizes, above=128) == pad
    assert sizes[:19] == [1, 2, 4, *range(8, 129, 8)]


def test_x2_is_seed_003s_list():
    assert ladder("x2") == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
                            256, 512, 1024, 2048]
    assert ladder("+64")[19:22] == [192, 256, 320] and ladder("+8")[19:21] == [136, 144]


def test_padding_rules():
    sizes = ladder("x2")
    assert padded_size(sizes, 129) == 256 and padded_size(sizes, 256) == 256 and padded_size(sizes, 3) == 4
    assert padded_size(sizes, 2049) is None
    assert ladder("x2", 300)[-2:] == [256, 300]


def test_expected_padding_of_a_fixed_batch():
    d = synthetic("fixed:300")
    assert [evaluate(n, ladder(n), d).expected_padding for n in ("x2", "+64", "+8")] == [212, 20, 4]
    stats = evaluate("x2", ladder("x2"), d, per_graph_mib=10, kv_bytes_per_token=35_136)
    assert stats.memory_mib == 230 and stats.kv_tokens_lost == 230 * 2**20 // 35_136
    assert stats.relative_waste == pytest.approx(212 / 512)


def test_batches_above_the_largest_graph_run_eagerly():
    d = normalize({100: 1, 3000: 1}, "t")
    stats = evaluate("x2", ladder("x2"), d)
    assert stats.eager_fraction == pytest.approx(0.5) and stats.expected_padding == pytest.approx(2.0)


def brute_force(dist, k):
    xs = sorted(dist.probs)
    best = min(
        (evaluate("b", [*combo, xs[-1]], dist).expected_padding, [*combo, xs[-1]])
        for r in range(k)
        for combo in itertools.combinations(xs[:-1], r)
    )
    return best[0]


@pytest.mark.parametrize("seed", range(5))
def test_optimal_set_matches_brute_force(seed):
    rng = random.Random(seed)
    dist = normalize({rng.randint(1, 300): rng.random() for _ in range(9)}, "random")
    for k in (1, 2, 3, 4):
        sizes, curve = optimal_sizes(dist, k)
        assert len(sizes) <= k and sizes[-1] == max(dist.probs)
        got = evaluate("o", sizes, dist).expected_padding
        assert got == pytest.approx(brute_force(dist, k), abs=1e-9)
        assert curve[-1] == pytest.approx(got, abs=1e-9)


def test_optimal_beats_the_ladder_with_the_same_count_and_budgets():
    dist = synthetic("normal:600,150")
    plan = plan_graphs(dist)
    x2, p64, p8 = plan.sets
    assert plan.budget_graphs == 23 and plan.optimized.num_graphs <= 23
    assert plan.optimized.expected_padding < x2.expected_padding
    assert plan.optimized.expected_padding < p64.expected_padding  # with fewer than half the graphs
    by_memory = plan_graphs(dist, per_graph_mib=10, memory_budget_mib=495)
    assert by_memory.budget_graphs == 49
    assert plan_graphs(dist, max_graphs=30, memory_budget_mib=495).budget_graphs == 30
    assert list(plan.padding_by_budget) == sorted(plan.padding_by_budget, reverse=True)


def test_budget_covering_the_support_has_no_padding():
    dist = normalize({3: 1, 17: 2, 130: 1}, "t")
    sizes, curve = optimal_sizes(dist, 10)
    assert sizes == [3, 17, 130] and curve[-1] == 0
    with pytest.raises(ValueError, match="at least one graph"):
        optimal_sizes(dist, 0)
