"""A step launched while nothing is in flight is capped at idle_step_tokens (overlap mode only)."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config.engine_config import EngineConfig


def step_sizes(checkpoint, **kw) -> list[int]:
    """Tokens computed by each step of a burst of six 20-token prompts, 3 new tokens each."""
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=200,
              chunked_prefill_size=200, **kw)  # fmt: skip
    core, sizes = llm.core, []
    launch = core.runner.launch

    def spy(batch):
        sizes.append(sum(it.num_new_tokens for it in batch.items))
        return launch(batch)

    core.runner.launch = spy
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(6):
        core.add_request(str(i), [1, *range(10 + i, 29 + i)], params)
    while core.has_unfinished_requests():
        core.step()
    core.kv.check_idle_accounting()
    return sizes


@pytest.mark.parametrize("cap", [45, 10, 1000])
def test_first_step_of_a_burst_is_capped_then_the_rest_runs_whole(v3_checkpoint, cap):
    sizes = step_sizes(v3_checkpoint, idle_step_tokens=cap)
    # The cap may cut a prompt into chunks; the next step, scheduled while the first is in
    # flight, takes the rest of the burst under the full budget.
    first = min(cap, 120)
    assert sizes[0] == first
    assert sizes[1] == (120 - first if first < 120 else 6)  # the rest of the prompts, or six decodes
    assert sum(sizes) == 120 + 6 * 2  # every prompt token once, then two decode steps' tokens


def test_without_overlap_no_step_is_capped(v3_checkpoint):
    assert step_sizes(v3_checkpoint, idle_step_tokens=10, disable_overlap_schedule=True)[0] == 120


def test_idle_step_tokens_must_be_positive():
    with pytest.raises(ValueError, match="idle_step_tokens"):
        EngineConfig(model="unused", idle_step_tokens=0)


def test_flag_reaches_the_engine_config():
    import argparse

    from moeserve.engine.generate_cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--idle-step-tokens", "99"])).idle_step_tokens == 99
    assert engine_config(parser.parse_args([])).idle_step_tokens == EngineConfig(model="m").idle_step_tokens
