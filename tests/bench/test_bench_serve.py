"""`moeserve bench serve` against a real server: the report, the JSON fields, and sane values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeserve.bench.serve import RequestResult, format_report, random_requests, sharegpt_requests, summarize
from moeserve.engine.tokenizer import Tokenizer
from tests.server.launcher import start_server

FIELDS = [
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_token_throughput",
    *[f"{s}_{k}_ms" for k in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")],
]  # fmt: skip


@pytest.fixture(scope="module")
def server(v3_checkpoint, tmp_path_factory):
    proc = start_server(v3_checkpoint, tmp_path_factory.mktemp("bench") / "server.log")
    yield proc
    proc.stop()


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moeserve", "bench", "serve", "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bench_serve_random_dataset(server, v3_checkpoint, tmp_path):
    out = tmp_path / "result.json"
    result = bench(
        "--base-url", server.url + "/v1", "--model", str(v3_checkpoint), "--dataset-name", "random",
        "--random-input-len", "24", "--random-output-len", "12", "--random-range-ratio", "0.25", "--num-prompts", "12",
        "--max-concurrency", "4", "--request-rate", "50", "--seed", "1", "--warmup-requests", "1", "--ignore-eos",
        "--output-file", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for line in ("Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):", "Output token throughput (tok/s):"):
        assert line in result.stdout
    data = json.loads(out.read_text())
    assert all(name in data for name in FIELDS)
    assert data["completed"] == 12 and data["failed"] == 0
    assert data["max_concurrency"] == 4 and data["request_rate"] == 50
    assert 12 * 18 <= data["total_input_tokens"] <= 12 * 30
    assert data["total_output_tokens"] == sum(data["output_lens"]) and min(data["output_lens"]) >= 9
    assert data["total_input_tokens"] == sum(data["input_lens"])
    assert 0 < data["mean_ttft_ms"] <= data["mean_e2el_ms"] and data["mean_itl_ms"] > 0
    assert data["p99_e2el_ms"] >= data["median_e2el_ms"] > 0
    assert data["mean_tpot_ms"] > 0 and data["output_throughput"] > 0
    assert abs(data["total_token_throughput"] - data["input_throughput"] - data["output_throughput"]) < 1e-6


def test_bench_serve_sharegpt_and_model_discovery(server, v3_checkpoint, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Write {i} lines of Python, please."},
                                {"from": "gpt", "value": "def f(x):\n    return x * 2\n" * 2}]} for i in range(6)]  # fmt: skip
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(convs))
    out = tmp_path / "result.json"
    result = bench(
        "--base-url", server.url, "--tokenizer", str(v3_checkpoint), "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset), "--num-prompts", "5", "--output-file", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["model_id"] == str(v3_checkpoint)  # found through /v1/models
    assert data["completed"] == 5 and all(n > 0 for n in data["input_lens"])


def test_bench_serve_reports_an_unreachable_server():
    result = bench("--base-url", "http://127.0.0.1:9", "--model", "m", "--random-vocab-size", "100", "--num-prompts", "2")
    assert result.returncode == 1
    assert "warm-up request failed" in result.stderr


def test_datasets_and_summary_without_a_server(v3_checkpoint, tmp_path):
    reqs = random_requests(50, 100, 10, 0.5, 384, seed=0)
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(max(r.prompt) < 384 for r in reqs)
    assert random_requests(3, 8, 4, 0.0, 384, seed=7) == random_requests(3, 8, 4, 0.0, 384, seed=7)
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps([{"conversations": [{"value": "hi"}]}]))
    with pytest.raises(ValueError, match="fewer than --num-prompts"):
        sharegpt_requests(str(tiny), 1, Tokenizer.load(v3_checkpoint), None, 0)
    metrics = summarize([RequestResult(True, 10, 5, 0.1, 0.5, [0.1] * 4), RequestResult(error="boom")], 2.0)
    assert metrics["completed"] == 1 and metrics["failed"] == 1 and metrics["errors"] == ["boom"]
    assert metrics["mean_tpot_ms"] == pytest.approx(100.0)
    assert "Failed requests:" in format_report(metrics, None, float("inf"))
