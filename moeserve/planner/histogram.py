"""Decode batch-size distributions: JSON or Prometheus histogram files, or named synthetic shapes."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_METRIC = "moeserve:decode_batch_size"
SYNTHETIC_HELP = "uniform:LO-HI, normal:MEAN,STD, lognormal:MEDIAN,SIGMA or fixed:N"
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class BatchDistribution:
    """Probability of each decode batch size, where it came from, and what could not be placed."""

    probs: dict[int, float]
    source: str
    total_count: float = 0.0  # observations behind the probabilities (0 for synthetic ones)
    overflow_count: float = 0.0  # Prometheus +Inf-bucket observations above the last finite bound
    notes: tuple[str, ...] = field(default=())

    def mean(self) -> float:
        """Expected batch size."""
        return sum(b * p for b, p in self.probs.items())

    def quantile(self, q: float) -> int:
        """Smallest batch size whose cumulative probability reaches q."""
        acc = 0.0
        for b in sorted(self.probs):
            acc += self.probs[b]
            if acc >= q - 1e-12:
                return b
        return max(self.probs)

    def summary(self) -> dict:
        """Mean, median, p90, p99, max and the number of distinct sizes."""
        return {
            "source": self.source,
            "distinct_sizes": len(self.probs),
            "mean": round(self.mean(), 2),
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "max": max(self.probs),
            "total_count": self.total_count,
            "overflow_count": self.overflow_count,
            "notes": list(self.notes),
        }


def normalize(counts: dict[int, float], source: str, **extra) -> BatchDistribution:
    """Counts -> probabilities, rejecting sizes < 1 and counts that are negative or not finite."""
    for b, c in counts.items():
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"{source}: batch sizes must be integers >= 1, got {b!r}")
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"{source}: counts must be finite and >= 0, got {c!r} for batch size {b}")
    total = sum(counts.values())
    if total <= 0:
        raise ValueError(f"{source}: the histogram is empty (all counts are zero)")
    probs = {b: c / total for b, c in sorted(counts.items()) if c > 0}
    extra.setdefault("total_count", total)
    return BatchDistribution(probs, source, **extra)


def _json_counts(raw: object, source: str) -> dict[int, float]:
    """{"batch_size": count} or [[batch_size, count], ...]."""
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list | tuple) and len(p) == 2 for p in raw):
        pairs = raw
    else:
        raise ValueError(f"{source}: expected {{\"batch_size\": count}} or [[batch_size, count], ...]")
    counts: dict[int, float] = {}
    for bs, count in pairs:
        try:
            b, c = int(bs), float(count)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: bad entry {bs!r}: {count!r}") from None
        if str(bs).strip() != str(b) and not (isinstance(bs, float) and bs == b):
            raise ValueError(f"{source}: batch size {bs!r} is not an integer")
        counts[b] = counts.get(b, 0.0) + c
    return counts


def parse_prometheus(text: str, source: str, metric: str = DEFAULT_METRIC) -> BatchDistribution:
    """A Prometheus text-format histogram: cumulative `<metric>_bucket{le="..."}` counts, summed over series.

    Observations in a bucket (lo, hi] are spread evenly over the integers in it; observations in the
    +Inf bucket beyond the last finite bound are counted in overflow_count and left out.
    """
    cumulative: dict[float, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m["name"] != f"{metric}_bucket":
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        if "le" not in labels:
            raise ValueError(f"{source}: bucket line without an le label: {line!r}")
        le = math.inf if labels["le"] in ("+Inf", "Inf", "inf") else float(labels["le"])
        cumulative[le] = cumulative.get(le, 0.0) + float(m["value"])
    if not cumulative:
        raise ValueError(f"{source}: no `{metric}_bucket` samples found")
    counts: dict[int, float] = {}
    lo, prev, overflow = 0.0, 0.0, 0.0
    for le in sorted(cumulative):
        in_bucket = cumulative[le] - prev
        if in_bucket < -1e-9:
            raise ValueError(f"{source}: bucket counts decrease at le={le}; they must be cumulative")
        prev = cumulative[le]
        if math.isinf(le):
            overflow = max(in_bucket, 0.0)
            break
        sizes = range(math.floor(lo) + 1, math.floor(le) + 1)
        if in_bucket > 0 and not sizes:
            raise ValueError(f"{source}: bucket ({lo}, {le}] holds observations but no integer batch size")
        for b in sizes:
            counts[b] = counts.get(b, 0.0) + in_bucket / len(sizes)
        lo = le
    notes = (f"{overflow:g} observations above le={lo:g} (+Inf bucket) left out",) if overflow else ()
    return normalize(counts, source, overflow_count=overflow, notes=notes)


def load_histogram(path: str | Path, metric: str = DEFAULT_METRIC) -> BatchDistribution:
    """Read a histogram file: JSON ({bs: count} or [[bs, count]]) or Prometheus text exposition."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"--histogram: no such file {str(path)!r}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return parse_prometheus(text, str(path), metric)
    return normalize(_json_counts(raw, str(path)), str(path))


def _numbers(spec: str, body: str, sep: str, n: int) -> list[float]:
    parts = body.split(sep)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != n:
        raise ValueError(f"bad distribution {spec!r}; expected {SYNTHETIC_HELP}")
    return values


def synthetic(spec: str, max_batch_size: int = 2048) -> BatchDistribution:
    """A named distribution over 1..max_batch_size: uniform:LO-HI, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, fixed:N."""
    kind, _, body = spec.partition(":")
    if kind == "uniform":
        lo, hi = (int(v) for v in _numbers(spec, body, "-", 2))
        if not 1 <= lo <= hi:
            raise ValueError(f"{spec!r}: need 1 <= LO <= HI")
        return normalize({b: 1.0 for b in range(lo, hi + 1)}, spec, total_count=0.0)
    if kind == "fixed":
        (n,) = _numbers(spec, body, ",", 1)
        return normalize({int(n): 1.0}, spec, total_count=0.0)
    if kind not in ("normal", "lognormal"):
        raise ValueError(f"unknown distribution {spec!r}; expected {SYNTHETIC_HELP}")
    center, spread = _numbers(spec, body, ",", 2)
    if center <= 0 or spread <= 0:
        raise ValueError(f"{spec!r}: both parameters must be > 0")
    if kind == "normal":
        cdf = lambda x: 0.5 * (1 + math.erf((x - center) / (spread * math.sqrt(2))))  # noqa: E731
    else:
        mu = math.log(center)
        cdf = lambda x: 0.5 * (1 + math.erf((math.log(x) - mu) / (spread * math.sqrt(2))))  # noqa: E731
    # Integer b takes the mass of (b - 0.5, b + 0.5]; the tails are folded onto 1 and max_batch_size.
    edges = [cdf(b + 0.5) for b in range(0, max_batch_size + 1)]
    counts = {b: edges[b] - edges[b - 1] for b in range(2, max_batch_size)}
    counts[1] = edges[1]
    counts[max_batch_size] = 1.0 - edges[max_batch_size - 1]
    # Drop sizes too unlikely to matter so the optimiser works on a short support.
    counts = {b: c for b, c in counts.items() if c > 1e-9}
    return normalize(counts, spec, total_count=0.0)
