"""Start-up refusals, SIGTERM drain, the shutdown timeout, and the engine process dying."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.server.launcher import engine_alive, metric_value, start_server, wait_for


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeserve", "serve", "--device", "cpu", *args]


def test_bad_model_path_is_refused(tmp_path):
    result = subprocess.run(serve_cmd("--model", str(tmp_path / "missing"), "--port", "0"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "no config.json" in result.stderr


def test_port_in_use_is_refused(serve_checkpoint):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        result = subprocess.run(serve_cmd("--model", str(serve_checkpoint), "--port", port), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot listen" in result.stderr


def long_stream(server, model: str, max_tokens: int):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(
        model=model, prompt="Latent attention", max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    return chunks


def test_sigterm_drains_running_requests_and_refuses_new_ones(serve_checkpoint, tmp_path):
    args = ("--shutdown-timeout", "300", "--health-stall-timeout", "2")
    server = start_server(serve_checkpoint, tmp_path / "server.log", *args)
    try:
        assert server.health_seen[0] == 503  # HTTP answers while the engine is still loading
        chunks = long_stream(server, str(serve_checkpoint), 200)
        # Freeze the engine so the request is surely still running while we look at the drain.
        os.kill(server.engine_pid, signal.SIGSTOP)
        try:
            # A silent engine with work to do is reported as stuck.
            health = lambda: httpx.get(server.url + "/health").json()["status"]  # noqa: E731
            assert wait_for(lambda: health() == "stalled", timeout=20)
            server.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=10)
            assert httpx.get(server.url + "/health").json()["status"] == "draining"
            refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        finally:
            os.kill(server.engine_pid, signal.SIGCONT)
        rest = list(chunks)
        assert rest[-2].choices[0].finish_reason == "length"
        assert rest[-1].usage.completion_tokens == 200
        assert server.proc.wait(timeout=60) == 0
        assert wait_for(lambda: not engine_alive(server.engine_pid), timeout=15)
    finally:
        server.stop()


def test_shutdown_timeout_aborts_what_is_still_running(serve_checkpoint, tmp_path):
    server = start_server(serve_checkpoint, tmp_path / "server.log", "--shutdown-timeout", "0.5")
    try:
        chunks = long_stream(server, str(serve_checkpoint), 4000)
        server.proc.send_signal(signal.SIGTERM)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["abort"]
        assert server.proc.wait(timeout=60) == 0
        assert "aborted 1 request(s)" in server.log()
    finally:
        server.stop()


def test_engine_death_fails_waiting_requests_and_exits_nonzero(serve_checkpoint, tmp_path):
    server = start_server(serve_checkpoint, tmp_path / "server.log")
    model = str(serve_checkpoint)
    try:
        chunks = long_stream(server, model, 4000)
        blocking: dict = {}

        def non_streaming():
            body = {"model": model, "prompt": "x", "max_tokens": 4000, "ignore_eos": True}
            blocking["response"] = httpx.post(server.url + "/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=non_streaming)
        thread.start()
        assert wait_for(lambda: metric_value(server.url, "moeserve:num_requests_running") == 2, timeout=30)
        os.kill(server.engine_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            list(chunks)
        assert "engine" in str(e.value)
        thread.join(timeout=60)
        assert blocking["response"].status_code == 500
        assert blocking["response"].json()["error"]["code"] == "engine_dead"
        assert server.proc.wait(timeout=60) != 0
        assert "exited unexpectedly" in server.log()
    finally:
        server.stop()
