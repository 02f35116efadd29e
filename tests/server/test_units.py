"""The server's pieces without processes: chat templates, prompts, errors, metrics, stream chunks."""

from __future__ import annotations

import pytest

from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.output_processor import RequestDelta, RequestState
from moeserve.server.chat import ChatTemplate
from moeserve.server.engine_client import check_prompt
from moeserve.server.errors import APIError, from_value_error
from moeserve.server.messages import EngineStats, Ready
from moeserve.server.metrics import ServerMetrics
from moeserve.server.responses import ResponseContext
from moeserve.server.serving import completion_prompts
from moeserve.server.streaming import ChunkBuilder
from tests.tiny_checkpoints import CHAT_TEMPLATE

INFO = Ready(pid=1, max_model_len=16, vocab_size=100, kv_capacity_tokens=64, num_kv_pages=4, page_size=16,
             device="cpu", dtype="float32", model_type="deepseek_v3")  # fmt: skip


def test_chat_template_renders_like_transformers():
    template = ChatTemplate.from_tokenizer_config({"chat_template": CHAT_TEMPLATE, "bos_token": "<bos>"})
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi\n<|assistant|>"
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<|user|>hi\n"
    strict = ChatTemplate.from_tokenizer_config({"chat_template": "{{ raise_exception('no system role') }}"})
    with pytest.raises(ValueError, match="no system role"):
        strict.render([{"role": "system", "content": "x"}])
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]
    assert ChatTemplate.from_tokenizer_config({"chat_template": named, "bos_token": "<s>"}).render([]) == "<s>D"
    assert ChatTemplate.from_tokenizer_config({}) is None


def test_completion_prompts_accept_every_openai_shape():
    assert [p.token_ids for p in completion_prompts(None, [1, 2])] == [[1, 2]]
    assert [p.token_ids for p in completion_prompts(None, [[1], [2, 3]])] == [[1], [2, 3]]
    for bad in ([], "", ["x"]):
        with pytest.raises(APIError) as e:
            completion_prompts(None, bad)
        assert e.value.status == 400


def test_front_end_validation_matches_the_core():
    check_prompt([1, 2, 3], SamplingParams(max_tokens=13), INFO)
    for ids, params, words in [
        ([], SamplingParams(), "empty"),
        ([1, 100], SamplingParams(), "vocabulary"),
        (list(range(16)), SamplingParams(), "context length"),
        ([1, 2, 3], SamplingParams(max_tokens=14), "more than the context length"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_prompt(ids, params, INFO)


def test_value_errors_name_their_parameter():
    assert from_value_error(ValueError("top_p must be in (0, 1], got 0")).param == "top_p"
    assert from_value_error(ValueError("the prompt is empty")).param is None
    assert from_value_error(ValueError("x")).status == 400


def test_metrics_follow_engine_snapshots():
    m = ServerMetrics("m")
    m.observe_engine(EngineStats(kv_used_pages=4, kv_num_pages=16, prompt_tokens=10, prefix_queried_tokens=10, prefix_hit_tokens=5), 0)
    m.observe_engine(EngineStats(kv_used_pages=0, kv_num_pages=16, prompt_tokens=30, generation_tokens=7), 12)
    text = m.render().decode()
    assert 'moeserve:prompt_tokens_total{model_name="m"} 30.0' in text
    assert 'moeserve:kv_cache_usage_perc{model_name="m"} 0.0' in text
    assert 'moeserve:prefix_cache_hit_rate{model_name="m"} 0.5' in text
    # Steps without decodes are not observed: the planner reads this histogram as decode sizes.
    assert 'moeserve:decode_batch_size_count{model_name="m"} 1.0' in text
    assert 'moeserve:decode_batch_size_bucket{le="8.0",model_name="m"} 0.0' in text
    assert 'moeserve:decode_batch_size_bucket{le="16.0",model_name="m"} 1.0' in text
    assert "_created" not in text


def test_chat_chunks_start_with_the_role_and_end_with_the_reason():
    ctx = ResponseContext("chat", "m", None, want_logprobs=False)
    builder = ChunkBuilder(ctx, include_usage=True)
    state = RequestState("r", None, [1], SamplingParams(), None)
    first = builder.chunks(0, RequestDelta(state, [5], "He", []))
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert all(c["usage"] is None for c in first)
    assert builder.chunks(0, RequestDelta(state, [6], "", [])) == []  # nothing new to say yet
    state.finish_reason = "length"
    last = builder.chunks(0, RequestDelta(state, [7], "y", []))
    assert last[0]["choices"][0]["finish_reason"] == "length" and last[0]["object"] == "chat.completion.chunk"


SERVER_DEPS = ("fastapi", "starlette", "uvicorn", "uvloop", "zmq", "msgspec", "prometheus_client", "jinja2", "httpx", "openai")
WITHOUT_SERVER_DEPS = f"""
import subprocess, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_DEPS!r}:
            raise ImportError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Block())
import moeserve.engine.engine, moeserve.engine.llm  # the engine never needs the server's packages
from moeserve.cli import build_parser, main
build_parser().format_help()
main(sys.argv[1:])
"""


def test_cli_works_without_the_server_packages(tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-c", WITHOUT_SERVER_DEPS, *args], capture_output=True, text=True, timeout=120)

    assert run("--help").returncode == 0
    assert "serve" in run("bench", "--help").stdout
    missing = run("serve", "--model", str(tmp_path), "--device", "cpu")
    assert missing.returncode == 1 and "moeserve[server]" in missing.stderr
