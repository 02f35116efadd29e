"""A compact table of an Nsight Compute report: per kernel its time, DRAM traffic, occupancy and stalls.

    python benchmarks/ncu_summary.py RAW.csv [--top-stalls 3]

RAW.csv is `ncu --import REPORT.ncu-rep --csv --page raw --print-units base` (ncu_profile.sh writes
it): times in nanoseconds, traffic in bytes. Stalls are
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


def read_rows(path: Path) -> list[dict[str, str]]:
    """The kernel rows of a raw-page CSV export (its units row, if any, dropped)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("==")))
    return rows[1:] if rows and not rows[0].get("ID") else rows


def summarize(row: dict[str, str], top: int) -> tuple[str, float]:
    """One kernel as one line, and its time in microseconds."""
    us = (_number(row.get("gpu__time_duration.sum", "")) or 0.0) / 1e3  # base units: nanoseconds
    moved = sum(_number(row.get(m, "")) or 0.0 for m in ("dram__bytes_read.sum", "dram__bytes_write.sum"))
    stalls = []
    for key, value in row.items():
        match = STALL.match(key or "")
        if match and match.group(1) not in NOT_REASONS:
            stalls.append((_number(value) or 0.0, match.group(1)))
    worst = ", ".join(f"{reason} {value:.1f}" for value, reason in sorted(stalls, reverse=True)[:top])

    def pct(metric: str, scale: float = 1.0) -> str:
        value = _number(row.get(metric, ""))
        return "   -" if value is None else f"{value * scale:4.0f}"

    name = row.get("Kernel Name", "?").split("(")[0][:34]
    grid, block = row.get("launch__grid_size", "?"), row.get("launch__block_size", "?")
    regs = row.get("launch__registers_per_thread", "?")
    gbs = moved / (us * 1e-6) / 1e9 if us else 0.0
    line = (
        f"{name:34s} {grid:>5s}x{block:<4s} r{regs:>3s} {us:8.2f} us {moved / 1e6:8.2f} MB {gbs:6.0f} GB/s "
        f"dram%{pct('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed')} "
        f"sm%{pct('sm__throughput.avg.pct_of_peak_sustained_elapsed')} "
        f"occ%{pct('sm__warps_active.avg.pct_of_peak_sustained_active')} "
        f"issue%{pct('smsp__issue_active.avg.per_cycle_active', 100.0)}  {worst}"
    )
    return line, us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top-stalls", type=int, default=3)
    a = ap.parse_args()
    rows = read_rows(a.csv)
    total = 0.0
    for row in rows:
        line, us = summarize(row, a.top_stalls)
        print(line)
        total += us
    print(f"{len(rows)} kernels, {total:.1f} us (kernels run one at a time under ncu: no PDL overlap)")


if __name__ == "__main__":
    main()
