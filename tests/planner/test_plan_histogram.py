"""Batch-size histograms: JSON, Prometheus text exposition, synthetic distributions."""

from __future__ import annotations

import json

import pytest

from moeserve.planner.histogram import load_histogram, parse_prometheus, synthetic

PROM = """\
# HELP moeserve:decode_batch_size Requests in each decode step.
# TYPE moeserve:decode_batch_size histogram
moeserve:decode_batch_size_bucket{le="1.0",model="r1"} 2.0
moeserve:decode_batch_size_bucket{le="4.0",model="r1"} 5.0
moeserve:decode_batch_size_bucket{le="8.0",model="r1"} 9.0
moeserve:decode_batch_size_bucket{le="+Inf",model="r1"} 10.0
moeserve:decode_batch_size_bucket{le="1.0",model="v2"} 0
moeserve:decode_batch_size_bucket{le="4.0",model="v2"} 3
moeserve:decode_batch_size_bucket{le="8.0",model="v2"} 3
moeserve:decode_batch_size_bucket{le="+Inf",model="v2"} 3
moeserve:decode_batch_size_sum{model="r1"} 50.0
moeserve:decode_batch_size_count{model="r1"} 10.0
other_metric_bucket{le="1.0"} 99
"""


def test_json_dict_and_pair_list(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"8": 3, "16": 1}))
    d = load_histogram(path)
    assert d.probs == {8: 0.75, 16: 0.25} and d.total_count == 4 and d.mean() == 10
    path.write_text(json.dumps([[8, 3], [16, 1], [8, 0]]))
    assert load_histogram(path).probs == {8: 0.75, 16: 0.25}


@pytest.mark.parametrize("raw, match", [({"0": 1}, ">= 1"), ({"8": -1}, ">= 0"), ({"8.5": 1}, "bad entry"),
                                        ({"8": 0}, "empty"), ("text", "expected")])
def test_json_errors(tmp_path, raw, match):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        load_histogram(path)


def test_prometheus_buckets_are_differenced_summed_and_spread(tmp_path):
    path = tmp_path / "metrics.txt"
    path.write_text(PROM)
    d = load_histogram(path)
    # Buckets over both series: (0,1]: 2, (1,4]: 6 over 2..4, (4,8]: 4 over 5..8, +Inf: 1 left out.
    assert d.total_count == pytest.approx(12) and d.overflow_count == pytest.approx(1)
    assert d.probs[1] == pytest.approx(2 / 12)
    assert d.probs[3] == pytest.approx(2 / 12) and d.probs[7] == pytest.approx(1 / 12)
    assert sorted(d.probs) == list(range(1, 9))
    assert "+Inf" in d.notes[0]


def test_prometheus_errors():
    with pytest.raises(ValueError, match="no `moeserve:decode_batch_size_bucket`"):
        parse_prometheus("other 1\n", "t")
    bad = 'moeserve:decode_batch_size_bucket{le="4"} 5\nmoeserve:decode_batch_size_bucket{le="8"} 3\n'
    with pytest.raises(ValueError, match="cumulative"):
        parse_prometheus(bad, "t")
    custom = 'my_bs_bucket{le="2"} 1\nmy_bs_bucket{le="+Inf"} 1\n'
    assert parse_prometheus(custom, "t", metric="my_bs").probs == {1: 0.5, 2: 0.5}


def test_synthetic_distributions():
    u = synthetic("uniform:129-256")
    assert min(u.probs) == 129 and max(u.probs) == 256 and sum(u.probs.values()) == pytest.approx(1)
    n = synthetic("normal:600,100")
    assert n.mean() == pytest.approx(600, abs=0.5) and n.quantile(0.5) == 600
    ln = synthetic("lognormal:200,0.5", max_batch_size=4096)
    assert ln.quantile(0.5) == pytest.approx(200, abs=1)
    assert synthetic("normal:2000,500", max_batch_size=2048).probs[2048] > 0.4  # tail folded on the max
    assert synthetic("fixed:64").probs == {64: 1.0}


@pytest.mark.parametrize("spec", ["uniform:5", "normal:1", "beta:1,2", "uniform:9-3", "normal:-1,2"])
def test_synthetic_errors(spec):
    with pytest.raises(ValueError):
        synthetic(spec)
