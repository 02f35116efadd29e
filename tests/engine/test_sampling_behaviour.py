"""Sampling parameters end to end: seeds, stops, lengths, logprobs."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(v3_checkpoint) -> LLM:
    return LLM(str(v3_checkpoint), dtype="float32", device="cpu", page_size=4)


PROMPT = [1, 10, 20, 30, 40, 50]


def test_same_seed_same_output_different_seed_differs(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=123, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0].token_ids
    # Same seed inside a busy batch: the neighbours must not change this request's draws.
    batch = llm.generate([[1, 7, 8], PROMPT, [1, 99]], [
        SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True),
        params,
        SamplingParams(max_tokens=5, temperature=0.7, ignore_eos=True),
    ])
    assert batch[1].token_ids == a
    b = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=124, ignore_eos=True))
    assert b[0].token_ids != a


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = llm.generate([PROMPT] * 4, params)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_n_completions_with_seed(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # min_tokens bans stop tokens until reached: the output must run past the stop token.
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at], min_tokens=first + 2)
    )[0]
    assert stop_at not in out.token_ids[: first + 2]


def test_eos_stops_unless_ignored(llm):
    eos = llm.core.eos_token_ids[0]
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    # Make EOS likely by sampling many; any output that stops on EOS must end with it.
    outs = llm.generate([PROMPT] * 8, [SamplingParams(max_tokens=30, temperature=3.0, seed=s) for s in range(8)])
    for o in outs:
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == eos
        else:
            assert eos not in o.token_ids and len(o.token_ids) == 30
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert len(ignored.token_ids) == 30 and ignored.finish_reason == "length"
    assert params.max_tokens == 30


def test_max_tokens_and_length(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_strings_truncate_text(llm):
    full = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    first = full.text.index(stop)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(
        ["def fibonacci(n):"],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == full.text[: first + len(stop)]
    llm.core.kv.check_idle_accounting()


def test_logprobs_of_sampled_tokens(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for tok, lp in zip(out.token_ids, lps, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    # The first logprob equals log_softmax of the prompt's last-position logits.
    logits = llm.core.score(PROMPT)[-1]
    assert lps[0].logprob == pytest.approx(logits.log_softmax(-1)[out.token_ids[0]].item(), abs=1e-5)


def test_text_prompts_use_the_tokenizer(llm):
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt == "def fibonacci(n):"
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    # Streaming never emits half a UTF-8 character, so a dangling one at the end is left out.
    assert out.text.rstrip("\ufffd") == llm.tokenizer.decode(out.token_ids).rstrip("\ufffd")
