"""A client killed mid-stream frees its KV; /metrics and /health carry what the issue lists."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.launcher import API_KEY, metric_value, wait_for

# A client that starts a long stream, says so after the first chunk, then waits to be killed.
CLIENT = """
import sys, httpx
body = {"model": sys.argv[2], "prompt": "The quick brown fox", "max_tokens": 3500, "stream": True, "ignore_eos": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, headers={"Authorization": "Bearer %s"}, timeout=60) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("streaming", flush=True)
            sys.stdin.read()
"""


def test_killed_client_aborts_its_request_and_frees_kv(server, serve_checkpoint):
    aborted = metric_value(server.url, "moeserve:request_success_total", 'finished_reason="abort"')
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT % API_KEY, server.url, str(serve_checkpoint)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert metric_value(server.url, "moeserve:num_requests_running") == 1
        assert metric_value(server.url, "moeserve:kv_cache_usage_perc") > 0
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_for(lambda: metric_value(server.url, "moeserve:num_requests_running") == 0, timeout=20)
    assert wait_for(lambda: metric_value(server.url, "moeserve:kv_cache_usage_perc") == 0.0, timeout=20)
    assert metric_value(server.url, "moeserve:request_success_total", 'finished_reason="abort"') == aborted + 1


def test_metrics_names_and_types(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    httpx.post(server.url + "/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4}, headers=headers, timeout=30)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    expected = {
        "moeserve:num_requests_running": "gauge",
        "moeserve:num_requests_waiting": "gauge",
        "moeserve:kv_cache_usage_perc": "gauge",
        "moeserve:prefix_cache_hit_rate": "gauge",
        "moeserve:num_retractions_total": "counter",
        "moeserve:prompt_tokens_total": "counter",
        "moeserve:generation_tokens_total": "counter",
        "moeserve:request_success_total": "counter",
        "moeserve:time_to_first_token_seconds": "histogram",
        "moeserve:inter_token_latency_seconds": "histogram",
        "moeserve:e2e_request_latency_seconds": "histogram",
        "moeserve:decode_batch_size": "histogram",
    }
    assert {name: types.get(name) for name in expected} == expected
    assert metric_value(server.url, "moeserve:prompt_tokens_total") >= 3
    assert metric_value(server.url, "moeserve:generation_tokens_total") >= 4
    assert metric_value(server.url, "moeserve:time_to_first_token_seconds_count") >= 1
    # Buckets fine enough to plan CUDA graphs: every 8 up to 128, every 16 up to 512.
    for le in (1, 2, 4, 8, 16, 24, 32, 120, 128, 144, 496, 512):
        assert f'moeserve:decode_batch_size_bucket{{le="{float(le)}"' in text


def test_health_reports_progress(server):
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["seconds_since_engine_message"] < 5


def test_client_gone_before_a_non_streamed_answer_aborts_too(server, serve_checkpoint):
    aborted = metric_value(server.url, "moeserve:request_success_total", 'finished_reason="abort"')
    body = {"model": str(serve_checkpoint), "prompt": "x", "max_tokens": 3500, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0)
    assert wait_for(lambda: metric_value(server.url, "moeserve:request_success_total", 'finished_reason="abort"') == aborted + 1, timeout=20)
    assert wait_for(lambda: metric_value(server.url, "moeserve:kv_cache_usage_perc") == 0.0, timeout=20)
