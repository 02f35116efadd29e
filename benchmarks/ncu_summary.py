"""A compact table of an Nsight Compute report: per kernel its time, DRAM traffic, occupancy and stalls.

    python benchmarks/ncu_summary.py RAW.csv [--top-stalls 3]

RAW.csv is `ncu --import REPORT.ncu-rep --csv --page raw` (ncu_profile.sh writes it). Stalls are
`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`: warps waiting on that reason
per issued instruction, so the largest names what an SM's warps mostly wait for.
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

STALL = re.compile(r"smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio")
NOT_REASONS = {"not_issued", "selected"}  # the sum of the others, and the issuing warp itself


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_rows(path: Path) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Kernel rows and the units row of a raw-page CSV export."""
    with path.open(newline="") as f:
        lines = [line for line in f if not line.startswith("==")]
    rows = list(csv.DictReader(lines))
    if rows and not rows[0].get("ID"):  # the units row, which kernel rows follow
        return rows[1:], rows[0]
    return rows, {}


def _scaled(row: dict[str, str], units: dict[str, str], name: str, to: str) -> float | None:
    """A metric converted into `to` (us, or bytes) from the unit the export used."""
    value = _number(row.get(name, ""))
    if value is None:
        return None
    factors = {
        "us": {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3},
        "B": {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1},
    }[to]
    return value * factors.get(units.get(name, ""), 1.0)


def summarize(row: dict[str, str], units: dict[str, str], top: int) -> str:
    """One kernel as one line."""
    us = _scaled(row, units, "gpu__time_duration.sum", "us") or 0.0
    moved = sum(_scaled(row, units, m, "B") or 0.0 for m in ("dram__bytes_read.sum", "dram__bytes_write.sum"))
    stalls = sorted(
        ((STALL.match(k).group(1), _number(v) or 0.0) for k, v in row.items() if k and STALL.match(k)),
        key=lambda kv: -kv[1],
    )
    stalls = [f"{name} {value:.1f}" for name, value in stalls if name not in NOT_REASONS][:top]

    def pct(metric: str) -> str:
        value = _number(row.get(metric, ""))
        return "   -" if value is None else f"{value:4.0f}"

    issue_rate = _number(row.get("smsp__issue_active.avg.per_cycle_active", ""))
    issue = "   -" if issue_rate is None else f"{issue_rate * 100:4.0f}"
    name = row.get("Kernel Name", "?").split("(")[0][:34]
    grid, block = row.get("launch__grid_size", "?"), row.get("launch__block_size", "?")
    regs = row.get("launch__registers_per_thread", "?")
    gbs = moved / (us * 1e-6) / 1e9 if us else 0.0
    return (
        f"{name:34s} {grid:>5s}x{block:<4s} r{regs:>3s} {us:8.2f} us {moved / 1e6:8.2f} MB {gbs:6.0f} GB/s "
        f"dram%{pct('dram__throughput.avg.pct_of_peak_sustained_elapsed')} "
        f"sm%{pct('sm__throughput.avg.pct_of_peak_sustained_elapsed')} "
        f"occ%{pct('sm__warps_active.avg.pct_of_peak_sustained_active')} "
        f"issue%{issue}  {', '.join(stalls)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top-stalls", type=int, default=3)
    a = ap.parse_args()
    rows, units = read_rows(a.csv)
    total = 0.0
    for row in rows:
        print(summarize(row, units, a.top_stalls))
        total += _scaled(row, units, "gpu__time_duration.sum", "us") or 0.0
    print(f"{len(rows)} kernels, {total:.1f} us (kernels run one at a time under ncu: no PDL overlap)")


if __name__ == "__main__":
    main()
