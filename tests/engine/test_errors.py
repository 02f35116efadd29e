"""Bad input raises a clear error and the engine keeps serving everyone else."""

from __future__ import annotations

import json
import shutil

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config.model_config import ConfigError, ModelConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(v3_checkpoint) -> LLM:
    return LLM(str(v3_checkpoint), dtype="float32", device="cpu", page_size=4, max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt is empty"),
        ("", GREEDY, "prompt is empty"),
        ([1, 2, 384], GREEDY, "token id 384 is outside the vocabulary"),
        ([1, -3], GREEDY, "token id -3 is outside the vocabulary"),
        ([1] * 64, GREEDY, "context length is 64"),
        ([1] * 60, SamplingParams(max_tokens=10), "more than the context length"),
    ],
)
def test_bad_requests_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 5, 6], prompt], params)
    # Nothing of the failed call lingers: the pool is whole and the next call works.
    assert not llm.core.has_unfinished_requests()
    llm.core.kv.check_idle_accounting()
    assert len(llm.generate([[1, 5, 6]], GREEDY)[0].token_ids) == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=-5), "max_tokens must be >= 1"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-7), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs=99), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop strings"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_request_mid_flight_does_not_disturb_others(llm):
    core = llm.core
    expected = llm.generate([[1, 8, 9, 10]], GREEDY)[0].token_ids
    core.add_request("good", [1, 8, 9, 10], GREEDY)
    got = []
    for step in range(40):
        if step == 3:
            with pytest.raises(ValueError, match="outside the vocabulary"):
                core.add_request("bad", [1, 10_000], GREEDY)
            with pytest.raises(ValueError, match="already in use"):
                core.add_request("good", [1, 2], GREEDY)
        for out in core.step():
            got.extend(out.new_token_ids)
        if not core.has_unfinished_requests():
            break
    assert got == expected
    core.kv.check_idle_accounting()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk_method": "random_routing"}, "topk_method"),
        ({"scoring_func": "tanh"}, "scoring_func"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"model_type": "llama"}, "model_type"),
        ({"n_group": 3}, "multiple of n_group"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(v3_checkpoint, tmp_path, change, message):
    raw = json.loads((v3_checkpoint / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_missing_config_field_is_named(v3_checkpoint, tmp_path):
    shutil.copytree(v3_checkpoint, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    del raw["kv_lora_rank"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_missing_model_folder():
    with pytest.raises(ConfigError, match="no config.json"):
        LLM("/nonexistent/model", device="cpu")
