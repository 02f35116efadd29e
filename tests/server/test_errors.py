"""Every error of the issue, OpenAI-shaped, and the server keeps serving after them."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.launcher import API_KEY, metric_value, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, **kwargs) -> httpx.Response:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature", ["temperature"]),
        ({"prompt": "x", "top_p": 0}, "top_p", ["top_p"]),
        ({"prompt": "x", "n": 0}, "n", ["n must be"]),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
        ({"prompt": "x", "logprobs": 50}, "logprobs", ["logprobs"]),
        ({"prompt": "x", "stop": [""]}, "stop", ["stop strings"]),
        ({"prompt": "x", "n": "two"}, "n", ["valid integer"]),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
        ({"prompt": []}, "prompt", ["empty"]),
        ({"prompt": [1, 2, 100000]}, None, ["100000", "vocabulary"]),
        ({"prompt": [-1]}, None, ["vocabulary"]),
        ({"prompt": [7] * 4096}, None, ["context length"]),
        ({"prompt": [7] * 100, "max_tokens": 4000}, None, ["more than the context length"]),
        ({}, "prompt", ["Field required"]),
    ],
)
def test_invalid_parameters_are_400(server, body, param, words):
    error = assert_openai_error(post(server, "/v1/completions", json=body), 400, *words)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_invalid_chat_requests_are_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", json={"messages": []}), 400, "messages")
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert_openai_error(post(server, "/v1/chat/completions", json=image), 400, "image_url")
    lp = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_openai_error(post(server, "/v1/chat/completions", json=lp), 400, "top_logprobs")


def test_malformed_json_and_wrong_content_type_are_400(server):
    assert_openai_error(post(server, "/v1/completions", content=b'{"prompt": "x"', headers={"Content-Type": "application/json"}), 400, "not valid JSON")
    assert_openai_error(post(server, "/v1/completions", content=b"\xff\xfe", headers={"Content-Type": "application/json"}), 400, "not valid JSON")
    assert_openai_error(post(server, "/v1/completions", json=[1, 2]), 400, "JSON object")
    form = post(server, "/v1/completions", data={"prompt": "x"})
    assert_openai_error(form, 400, "Content-Type", "application/x-www-form-urlencoded")
    text = post(server, "/v1/completions", content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert_openai_error(text, 400, "Content-Type")


def test_openai_client_sees_bad_request(client, serve_checkpoint):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=str(serve_checkpoint), prompt="x", max_tokens=5000)
    assert "context length" in str(e.value)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_is_404(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)


def test_wrong_or_missing_api_key_is_401(server, serve_checkpoint):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=str(serve_checkpoint), prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert assert_openai_error(r, 401, "API key")["code"] == "invalid_api_key"
    # Health and metrics stay open to probes and scrapers.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_body_over_limit_is_413(server):
    big = {"prompt": "x" * 70000, "max_tokens": 1}
    assert_openai_error(post(server, "/v1/completions", json=big), 413, "limit")

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 8000
        yield b'"}'

    # No Content-Length (chunked upload): the limit is enforced while reading.
    r = post(server, "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413, "limit")


def test_server_still_serves_and_holds_no_kv_after_errors(server, client, serve_checkpoint):
    out = client.completions.create(model=str(serve_checkpoint), prompt="ok", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert wait_for(lambda: metric_value(server.url, "moeserve:kv_cache_usage_perc") == 0.0)
    assert metric_value(server.url, "moeserve:num_requests_waiting") == 0
