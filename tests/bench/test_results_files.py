"""Committed benchmark results: every row of a results list carries the fields the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.bench.common import record

REQUIRED = ("name", "device", "out_tok_s", "seconds", "commit", "command")
RESULTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob("*.json"))


def test_record_carries_every_required_field():
    row = record("x", "cpu", workload={"batch_size": 1})
    assert all(key in row for key in REQUIRED)
    assert row["out_tok_s"] is None and row["seconds"] is None
    assert record("x", "cpu", out_tok_s=5.0, seconds=2.0)["out_tok_s"] == 5.0


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_results_rows_have_the_required_fields(path):
    rows = json.loads(path.read_text())
    if isinstance(rows, dict):  # a single-report file (accuracy runs), not a results list
        return
    for row in rows:
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, f"{path.name}: {row.get('name')} lacks {missing}"
        assert row["device"] and row["commit"] and row["command"], row.get("name")
