"""bench latency's decode floor counts every request's experts, whatever the batching policy."""

from __future__ import annotations

import pytest

from moeserve.bench import latency
from moeserve.bench.common import random_prompts
from moeserve.config.engine_config import EngineConfig
from moeserve.engine.engine import EngineCore
from moeserve.layers.moe import Router


@pytest.mark.parametrize("mixed", [True, False])
def test_decode_floor_step_decodes_every_request(v3_checkpoint, mixed):
    # A budget of one prompt a step: with mixed chunks the first prompts decode for several steps
    # while the last ones prefill, and used to finish before the counted step.
    core = EngineCore(
        EngineConfig(model=str(v3_checkpoint), dtype="float32", device="cpu", page_size=4,
                     max_num_batched_tokens=12, chunked_prefill_size=12, enable_mixed_chunk=mixed)  # fmt: skip
    )
    prompts = random_prompts(6, 12, core.model_config.vocab_size, 3)
    rows: list[int] = []
    router = next(m for m in core.runner.model.modules() if isinstance(m, Router))
    handle = router.register_forward_hook(lambda _m, inputs, _out: rows.append(inputs[0].shape[0]))
    try:
        info = latency.decode_floor(core, prompts, read_gbs=100.0)
    finally:
        handle.remove()
    assert rows[-1] == len(prompts)  # the last forward, the counted one, decoded every request
    layers = core.model_config.num_hidden_layers - core.model_config.first_k_dense_replace
    assert len(info["touched_experts_per_layer"]) == layers  # one counted forward
    assert core.scheduler.stats.last_decode_batch_size == 0 and not core.has_unfinished_requests()
    # Every decoding token routes to top-k distinct experts: at least k a layer, never more than E.
    k, experts = core.model_config.num_experts_per_tok, core.model_config.n_routed_experts
    assert all(k <= t <= experts for t in info["touched_experts_per_layer"])
    assert info["kv_bytes"] > 0 and info["floor_ms"] > 0
    core.kv.check_idle_accounting()


def test_consecutive_seeds_time_fresh_prompts(v3_checkpoint):
    """Runs at seeds s and s + 1 share no prompts: the timed run must prefill, not hit the cache."""
    core = EngineCore(EngineConfig(model=str(v3_checkpoint), dtype="float32", device="cpu", page_size=4))
    for seed in range(3):
        hits = core.scheduler.stats.prefix_hit_tokens
        latency.measure(core, 2, 12, 2, seed, analyze_floor=False)
        assert core.scheduler.stats.prefix_hit_tokens == hits, f"seed {seed} timed cached prompts"
