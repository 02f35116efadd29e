"""The server through the official `openai` client: completions, chat, streaming, n, stop, seeds, usage."""

from __future__ import annotations

import asyncio

import openai
import pytest

from moeserve import LLM, SamplingParams
from tests.server.launcher import API_KEY, metric_value, wait_for

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server, serve_checkpoint):
    return str(serve_checkpoint)


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == 4096


def test_greedy_completion_matches_offline_llm(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=4)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_token_id_prompts_and_prompt_lists(client, model):
    out = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9], [10]], max_tokens=3, n=2, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.prompt_tokens == 6  # each prompt counts once, not once per sample
    assert out.usage.completion_tokens == 18


def test_cached_prompt_tokens_are_reported(client, model):
    prompt = list(range(20, 60))  # 40 tokens: two whole pages can be reused
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32


def test_same_seed_same_text(client, model):
    def run(seed):
        kwargs = dict(model=model, prompt="The quick brown", max_tokens=16, temperature=1.0, seed=seed)
        return client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_n_samples_differ_and_count(client, model):
    out = client.completions.create(model=model, prompt="import numpy", max_tokens=10, n=3, seed=11, extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert out.usage.completion_tokens == 30


def test_stream_equals_non_stream(client, model):
    kwargs = dict(model=model, prompt="héllo wörld", max_tokens=20, temperature=0.8, seed=5, n=2)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 40 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_completion_and_stream(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=2, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=2, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_prompt_uses_the_chat_template(server, client, model):
    import httpx

    messages = [{"role": "user", "content": "hi"}]
    tok = httpx.post(server.url + "/v1/tokenize", json={"messages": messages}, headers={"Authorization": f"Bearer {API_KEY}"})
    text = httpx.post(server.url + "/v1/detokenize", json={"tokens": tok.json()["tokens"]}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert text.json()["prompt"] == "<|user|>hi\n<|assistant|>"
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == tok.json()["count"]


def test_stop_string_truncates_and_frees_the_request(server, client, model):
    base = client.completions.create(model=model, prompt="Pack my box", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
    before = metric_value(server.url, "moeserve:request_success_total", 'finished_reason="stop"')
    out = client.completions.create(model=model, prompt="Pack my box", max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    assert metric_value(server.url, "moeserve:request_success_total", 'finished_reason="stop"') == before + 1
    streamed = client.completions.create(model=model, prompt="Pack my box", max_tokens=24, temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]
    assert wait_for(lambda: metric_value(server.url, "moeserve:kv_cache_usage_perc") == 0.0)


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="x = ", max_tokens=5, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_32_concurrent_streams(server, model):
    async def one(client, i):
        kwargs = dict(model=model, prompt=f"{i} dozen liquor jugs", max_tokens=24, seed=i, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in await client.completions.create(**kwargs, stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
        await client.close()
        return results

    before = metric_value(server.url, "moeserve:decode_batch_size_count")
    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length"] * 32
    assert len({text for text, _ in results}) > 16
    # The 32 streams were batched: some decode steps ran many requests at once.
    steps = metric_value(server.url, "moeserve:decode_batch_size_count") - before
    assert 0 < steps < 32 * 23
    assert metric_value(server.url, "moeserve:decode_batch_size_bucket", 'le="8.0"') < metric_value(
        server.url, "moeserve:decode_batch_size_count"
    )
    assert wait_for(lambda: metric_value(server.url, "moeserve:num_requests_running") == 0)


def test_stop_token_ids_and_min_tokens(client, model):
    every_token = list(range(384))
    out = client.completions.create(model=model, prompt="x", max_tokens=10, extra_body={"stop_token_ids": every_token})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.model_extra["stop_reason"], int)
    assert out.usage.completion_tokens == 1
    held = client.completions.create(model=model, prompt="x", max_tokens=10, extra_body={"stop_token_ids": every_token, "min_tokens": 3})
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"
