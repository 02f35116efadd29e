"""CUDA graph batch-size sets: padding arithmetic (seed 003) and the best set under a budget."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

from moeserve.planner.histogram import BatchDistribution

LADDERS = ("x2", "+64", "+8")
DENSE_UP_TO = 128  # all three of seed 003's sets share 1, 2, 4 and every multiple of 8 up to here
MAX_SUPPORT = 4096  # the optimiser's n x n table; larger supports should be binned first


def ladder(name: str, max_batch_size: int = 2048) -> list[int]:
    """Seed 003's sets: 1, 2, 4, 8..128 step 8, then doubling (x2), step 64 (+64) or step 8 (+8)."""
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    base = [1, 2, 4, *range(8, DENSE_UP_TO + 1, 8)]
    if name == "x2":
        upper, s = [], 2 * DENSE_UP_TO
        while s <= max_batch_size:
            upper.append(s)
            s *= 2
    elif name in ("+64", "+8"):
        step = int(name[1:])
        upper = list(range(DENSE_UP_TO + step, max_batch_size + 1, step))
    else:
        raise ValueError(f"unknown set {name!r}; expected one of {LADDERS}")
    sizes = sorted({b for b in base + upper if b <= max_batch_size} | {max_batch_size})
    return sizes


def padded_size(sizes: list[int], batch: int) -> int | None:
    """The captured size a batch runs at: the smallest one >= batch, None when it runs eagerly."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def max_padding(sizes: list[int], above: int = 0) -> int:
    """Largest padding (slots) any batch size in (above, max(sizes)] can get."""
    worst, prev = 0, 0
    for s in sorted(sizes):
        if s > above:
            worst = max(worst, s - max(prev, above) - 1)
        prev = s
    return worst


@dataclass(frozen=True)
class SetStats:
    """How a set of captured sizes does on a distribution."""

    name: str
    sizes: tuple[int, ...]
    num_graphs: int
    memory_mib: float
    expected_padding: float  # padded slots per decode step
    relative_waste: float  # padded slots / slots computed, over steps that run a graph
    max_padding: int
    max_padding_above_128: int
    eager_fraction: float  # steps whose batch exceeds the largest graph
    kv_tokens_lost: int | None  # KV tokens the graphs' memory would otherwise hold

    def to_dict(self, with_sizes: bool = True) -> dict:
        """JSON-ready dict."""
        out = asdict(self)
        out["sizes"] = list(self.sizes) if with_sizes else None
        for k in ("memory_mib", "expected_padding", "relative_waste", "eager_fraction"):
            out[k] = round(out[k], 6)
        return out


def evaluate(
    name: str,
    sizes: list[int],
    dist: BatchDistribution,
    per_graph_mib: float = 10.0,
    kv_bytes_per_token: int | None = None,
) -> SetStats:
    """Expected padding of a set: sum over batch sizes b of P(b) x (padded size - b)."""
    sizes = sorted(set(sizes))
    padding = computed = eager = 0.0
    for b, p in dist.probs.items():
        target = padded_size(sizes, b)
        if target is None:
            eager += p
            continue
        padding += p * (target - b)
        computed += p * target
    memory = len(sizes) * per_graph_mib
    return SetStats(
        name=name,
        sizes=tuple(sizes),
        num_graphs=len(sizes),
        memory_mib=memory,
        expected_padding=padding,
        relative_waste=padding / computed if computed else 0.0,
        max_padding=max_padding(sizes),
        max_padding_above_128=max_padding(sizes, DENSE_UP_TO),
        eager_fraction=eager,
        kv_tokens_lost=None if not kv_bytes_per_token else int(memory * 2**20 // kv_bytes_per_token),
    )


def optimal_sizes(dist: BatchDistribution, max_graphs: int) -> tuple[list[int], list[float]]:
    """The <= max_graphs sizes (largest = largest observed batch) minimising expected padding.

    Also returns the minimum expected padding for 1, 2, ... graphs. An optimal size always sits on an
    observed batch size (lowering it to the next observed one only cuts padding), so this is a 1-D
    segmentation of the support, solved exactly by dynamic programming.
    """
    import numpy as np  # only this subcommand needs it; keeps `plan capacity` light

    if max_graphs < 1:
        raise ValueError(f"the graph budget must allow at least one graph, got {max_graphs}")
    xs = sorted(dist.probs)
    if len(xs) > MAX_SUPPORT:
        raise ValueError(f"{len(xs)} distinct batch sizes; bin the histogram to at most {MAX_SUPPORT}")
    n = len(xs)
    k_max = min(max_graphs, n)
    x = np.array(xs, dtype=np.float64)
    w = np.array([dist.probs[b] for b in xs], dtype=np.float64)
    cw = np.concatenate(([0.0], np.cumsum(w)))
    cm = np.concatenate(([0.0], np.cumsum(w * x)))
    # cost[j, i]: padding of points i+1..j (1-based) all padded up to x_j; infinite unless i < j.
    # Rows indexed by j keep each argmin over contiguous memory (about 6x faster than columns).
    i = np.arange(n + 1)
    cost = np.full((n + 1, n + 1), np.inf)
    cost[1:, :] = x[:, None] * (cw[1:, None] - cw[None, i]) - (cm[1:, None] - cm[None, i])
    cost[np.triu_indices(n + 1)] = np.inf
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    total = np.empty_like(cost)
    choices, curve = [], []
    for _ in range(k_max):
        np.add(cost, best[None, :], out=total)
        arg = np.argmin(total, axis=1)
        best = total[i, arg]
        choices.append(arg)
        curve.append(max(float(best[n]), 0.0))
    sizes, end = [], n
    for arg in reversed(choices):
        if end == 0:
            break
        sizes.append(xs[end - 1])
        end = int(arg[end])
    curve += [0.0] * (max_graphs - k_max)
    return sorted(sizes), curve


@dataclass(frozen=True)
class GraphPlan:
    """Seed 003's three sets and the optimised one, on one distribution."""

    distribution: BatchDistribution
    per_graph_mib: float
    max_batch_size: int
    budget_graphs: int
    sets: tuple[SetStats, ...]
    optimized: SetStats
    padding_by_budget: tuple[float, ...]  # minimum expected padding with 1, 2, ... graphs

    def to_dict(self) -> dict:
        """JSON-ready dict; the fixed sets' size lists are left out (they follow from their names)."""
        return {
            "distribution": self.distribution.summary(),
            "per_graph_mib": self.per_graph_mib,
            "max_batch_size": self.max_batch_size,
            "budget_graphs": self.budget_graphs,
            "sets": [s.to_dict(with_sizes=False) for s in self.sets],
            "optimized": self.optimized.to_dict(),
            "units": {
                "expected_padding": "padded batch slots per decode step",
                "memory_mib": "MiB (2**20 bytes) of per-graph memory outside the shared pool",
            },
        }


def plan_graphs(
    dist: BatchDistribution,
    per_graph_mib: float = 10.0,
    max_batch_size: int = 2048,
    max_graphs: int | None = None,
    memory_budget_mib: float | None = None,
    kv_bytes_per_token: int | None = None,
) -> GraphPlan:
    """Compare x2 / +64 / +8 and find the best set within a graph-count or memory budget (default: x2's count)."""
    if per_graph_mib <= 0:
        raise ValueError(f"--per-graph-mb must be > 0, got {per_graph_mib}")
    sets = tuple(
        evaluate(n, ladder(n, max_batch_size), dist, per_graph_mib, kv_bytes_per_token) for n in LADDERS
    )
    budgets = [b for b in (max_graphs,) if b is not None]
    if memory_budget_mib is not None:
        budgets.append(int(memory_budget_mib // per_graph_mib))
    budget = min(budgets) if budgets else sets[0].num_graphs
    best, curve = optimal_sizes(dist, budget)
    optimized = evaluate(f"optimal<={budget}", best, dist, per_graph_mib, kv_bytes_per_token)
    return GraphPlan(dist, per_graph_mib, max_batch_size, budget, sets, optimized, tuple(curve))
