"""Seed 000's KV capacity table, reproduced from first principles, and the layouts around it."""

from __future__ import annotations

import pytest

from moeserve.planner.capacity import CapacityInputs, kv_bytes_per_token, plan_capacity
from moeserve.planner.hardware import PRESETS
from moeserve.planner.layout import GIB, Layout, Precision
from moeserve.planner.model_shape import shape_from_config

SEED_LAYOUT = Layout(tp=16, ep=16, dp_attention=True)  # seed 000's DEP16
FP4_FP8KV = Precision.for_weights("fp4", "fp8")


def seed_plan(v3, gpu: str, **kw):
    inp = CapacityInputs(v3, PRESETS[gpu], FP4_FP8KV, SEED_LAYOUT, mem_fraction_static=0.75,
                         isl=128_000, osl=8_000, **kw)
    return plan_capacity(inp)


def test_r1_fp8_kv_is_35136_bytes_per_token(v3):
    assert kv_bytes_per_token(v3, "fp8") == (512 + 64) * 61 * 1 == 35_136
    assert kv_bytes_per_token(v3, "bf16") == 70_272


def test_seed_000_table_gb300(v3):
    p = seed_plan(v3, "GB300", weights_gb_per_gpu=40)
    assert p.static_budget_gb == pytest.approx(216)
    assert p.kv_pool_gb == pytest.approx(176)
    assert p.tokens_per_request == 136_000
    assert p.kv_per_request_gib == pytest.approx(4.45, abs=0.005)
    assert round(p.max_requests_per_gpu) == 40  # seed: "about 40 req/GPU" (39.55 unrounded)
    assert p.max_requests_per_gpu == pytest.approx(176 / 4.4504, rel=1e-3)


def test_seed_000_table_gb200(v3):
    p = seed_plan(v3, "GB200", weights_gb_per_gpu=40)
    assert p.static_budget_gb == pytest.approx(144)
    assert p.kv_pool_gb == pytest.approx(104)
    assert p.kv_per_request_gib == pytest.approx(4.45, abs=0.005)
    # Seed: "about 24". 104 / 4.45 = 23.37: 23 fit, the 24th would need 106.8 GiB (docs/planner.md).
    assert abs(p.max_requests_per_gpu - 24) < 1
    assert p.max_whole_requests_per_gpu == 23
    assert 23 * p.kv_per_request_gib <= p.kv_pool_gb < 24 * p.kv_per_request_gib


def test_seed_000_units_are_gib_throughout(v3):
    # Only capacities read as GiB give the seed's 40: in decimal GB the same table gives 36.8.
    p = seed_plan(v3, "GB300", weights_gb_per_gpu=40)
    decimal_cap = (288e9 * 0.75 - 40e9) / (136_000 * 35_136)
    assert decimal_cap == pytest.approx(36.83, abs=0.01)
    assert p.kv_pool_gb * GIB / (136_000 * 35_136) == pytest.approx(39.55, abs=0.01)


def test_seed_000_practical_row_at_85_percent(v3):
    gb300 = seed_plan(v3, "GB300", weights_gb_per_gpu=40)
    gb200 = seed_plan(v3, "GB200", weights_gb_per_gpu=40)
    # The seed prints 36 and 20 (576 and 320 at DEP16); 36 is 90% of 40, not 85% (docs/planner.md).
    assert (gb300.practical_requests_per_gpu, gb200.practical_requests_per_gpu) == (33, 19)
    assert (gb300.total_concurrent_requests, gb200.total_concurrent_requests) == (33 * 16, 19 * 16)
    assert seed_plan(v3, "GB300", weights_gb_per_gpu=40, headroom=0.9).practical_requests_per_gpu == 35


def test_computed_weights_for_the_seed_layout(v3):
    p = seed_plan(v3, "GB300")
    assert p.weights_source == "computed"
    assert 30 < p.weights_gb_per_gpu < 40  # FP4 experts / 16 + replicated FP8 attention + BF16 embedding
    assert p.max_whole_requests_per_gpu == 40
    assert seed_plan(v3, "GB200").max_whole_requests_per_gpu == 24


def test_tp_attention_replicates_mla_latent_but_splits_gqa_heads(v3):
    tp8 = Layout(tp=8, ep=1, dp_attention=False)
    mla = plan_capacity(CapacityInputs(v3, PRESETS["H200"], Precision.for_weights("fp8", "bf16"), tp8,
                                       mem_fraction_static=0.9, isl=4000, osl=1000))
    assert mla.kv_bytes_per_token_per_gpu == mla.kv_bytes_per_token
    # Every GPU of the TP group stores all of the group's requests: per GPU is the group's cap / 8.
    assert mla.total_concurrent_requests == int(0.85 * mla.max_requests_per_gpu * 8 + 1e-9)
    llama = shape_from_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "vocab_size": 128256, "intermediate_size": 14336})
    for tp, heads in ((1, 8), (4, 2), (8, 1), (16, 1)):
        gqa = plan_capacity(CapacityInputs(llama, PRESETS["H100"], Precision.for_weights("bf16", "bf16"),
                                           Layout(tp=tp), isl=4000, osl=1000))
        assert gqa.kv_bytes_per_token_per_gpu == 2 * heads * 128 * 32 * 2


def test_ep_splits_experts_and_dp_attention_replicates_attention(v3):
    prec = Precision.for_weights("fp8", "fp8")
    ep8 = plan_capacity(CapacityInputs(v3, PRESETS["H200"], prec, Layout(tp=8, ep=8, dp_attention=True)))
    ep8_tp = plan_capacity(CapacityInputs(v3, PRESETS["H200"], prec, Layout(tp=8, ep=8, dp_attention=False)))
    assert ep8.weights_gb_per_gpu > ep8_tp.weights_gb_per_gpu  # attention is held 8 times over
    assert ep8.total_gpus == 8 and ep8.total_concurrent_requests == ep8.practical_requests_per_gpu * 8


def test_more_replicas_multiply_concurrency(v3):
    one = seed_plan(v3, "GB300", weights_gb_per_gpu=40)
    lay = Layout(tp=16, ep=16, dp_attention=True, gpus=64)
    four = plan_capacity(CapacityInputs(v3, PRESETS["GB300"], FP4_FP8KV, lay, weights_gb_per_gpu=40))
    assert four.total_concurrent_requests == 4 * one.total_concurrent_requests


def test_weights_that_do_not_fit_are_a_clear_error(v3):
    with pytest.raises(ValueError, match="do not fit in the static budget"):
        plan_capacity(CapacityInputs(v3, PRESETS["H100"], Precision.for_weights("fp8", "fp8"), Layout()))


@pytest.mark.parametrize(
    "kw, match",
    [({"mem_fraction_static": 1.5}, "mem-fraction-static"), ({"headroom": 0}, "headroom"),
     ({"isl": 0, "osl": 0}, "positive sum"), ({"weights_gb_per_gpu": -1}, "weights-gb-per-gpu")],
)
def test_input_validation(v3, kw, match):
    with pytest.raises(ValueError, match=match):
        CapacityInputs(v3, PRESETS["GB300"], FP4_FP8KV, SEED_LAYOUT, **kw)


def test_layout_validation():
    with pytest.raises(ValueError, match="divide"):
        Layout(tp=8, ep=12)
    with pytest.raises(ValueError, match="multiple"):
        Layout(tp=8, ep=8, gpus=12)
    with pytest.raises(ValueError, match=">= 1"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="precision"):
        Precision(experts="int4")
