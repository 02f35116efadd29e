"""`moeserve serve` with no --model serves the shipped demo model, fully offline."""

from __future__ import annotations

import openai

from tests.server.launcher import start_server


def test_serve_without_model_uses_demo_model(tmp_path):
    server = start_server(None, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["moeserve-demo"]
        out = client.completions.create(model="moeserve-demo", prompt="def fibonacci(n):", max_tokens=16, temperature=0)
        assert out.choices[0].text.strip()
        assert out.usage.completion_tokens >= 1
    finally:
        server.stop()
