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
    observe = lambda _weights, ids: rows.append(ids.shape[0])  # noqa: E731
    router.observers.append(observe)
    try:
        info = latency.decode_floor(core, prompts, read_gbs=100.0)
    finally:
        router.observers.remove(observe)
    assert rows[-1] == len(prompts)  # the last forward, the counted one, decoded every request
    layers = core.model_config.num_hidden_layers - core.model_config.first_k_dense_replace
    assert len(info["touched_experts_per_layer"]) == layers  # one counted forward
    assert core.scheduler.stats.last_decode_batch_size == 0 and not core.has_unfinished_requests()
    # Every decoding token routes to top-k distinct experts: at least k a layer, never more than E.
    k, experts = core.model_config.num_experts_per_tok, core.model_config.n_routed_experts
    assert all(k <= t <= experts for t in info["touched_experts_per_layer"])
    per_key = core.model_config.kv_cache_dim * core.model_config.num_hidden_layers * 4  # float32 cache
    assert info["kv_bytes_per_key"] == per_key and info["dense_bytes"] > 0 and info["read_gbs"] == 100.0
    core.kv.check_idle_accounting()


def test_consecutive_seeds_time_fresh_prompts(v3_checkpoint):
    """Runs at seeds s and s + 1 share no prompts: the timed run must prefill, not hit the cache."""
    core = EngineCore(EngineConfig(model=str(v3_checkpoint), dtype="float32", device="cpu", page_size=4))
    for seed in range(3):
        hits = core.scheduler.stats.prefix_hit_tokens
        latency.measure(core, 2, 12, 2, seed, analyze_floor=False)
        assert core.scheduler.stats.prefix_hit_tokens == hits, f"seed {seed} timed cached prompts"


def test_each_decode_step_is_charged_the_kv_of_its_own_context(v3_checkpoint):
    """Step i of a batch reads prompt + i + 1 keys a request: its floor grows with the context."""
    core = EngineCore(EngineConfig(model=str(v3_checkpoint), dtype="float32", device="cpu", page_size=4))
    fields = latency.measure(core, 2, 12, 5, 7, analyze_floor=True, read_gbs=100.0)
    floor = fields["hbm_floor"]
    res = latency.run_batch(core, random_prompts(2, 12, core.model_config.vocab_size, 8), 5, "again")
    assert res["decode_keys"] == [2 * (12 + n) for n in range(1, 5)]  # tokens 1-4 of each request
    # The reported floor is the one at the median step's context: 2 x 14.5 keys -> int 29.
    assert floor["kv_keys"] == 29 and floor["kv_bytes"] == 29 * floor["kv_bytes_per_key"]
    assert floor["total_bytes"] == floor["dense_bytes"] + floor["expert_bytes"] + floor["kv_bytes"]
    assert fields["floor_ratio"] <= fields["floor_ratio_p90"] <= fields["floor_ratio_max"]


def test_step_floors_charge_each_step_its_own_kv_read():
    """Steps that grow exactly as their KV read does have one ratio; the floor is the median one."""
    floor = dict(dense_bytes=600_000, expert_bytes=400_000, kv_bytes_per_key=1_000, read_gbs=1.0)
    keys = [100, 200, 300, 400, 500]
    steps_ms = [2 * (1_000_000 + k * 1_000) / 1e6 for k in keys]  # twice each step's floor
    steps_ms[-1] *= 1.5  # one slow step shows in the worst ratio, not the median
    out = latency.step_floors(floor, steps_ms, keys)
    assert out["floor_ratio"] == 2.0 and out["floor_ratio_max"] == 3.0
    assert out["hbm_floor"]["kv_keys"] == 300 and out["hbm_floor"]["floor_ms"] == 1.3
