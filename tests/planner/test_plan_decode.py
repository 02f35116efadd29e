"""Decode roofline: distinct experts, bytes, FLOPs, all-to-all and MTP."""

from __future__ import annotations

import random

import pytest

from moeserve.planner.decode_roofline import (
    DecodeInputs,
    MtpConfig,
    decode_point,
    distinct_experts,
    forward_cost,
    sweep,
)
from moeserve.planner.hardware import PRESETS
from moeserve.planner.layout import Layout, Precision
from moeserve.planner.weights import active_params_per_token, weights_per_gpu


def inputs(shape, gpu="H200", layout=None, prec=None, context=4096, **kw):
    prec = prec or Precision.for_weights("bf16", "bf16")
    return DecodeInputs(shape, PRESETS[gpu], prec, layout or Layout(), context, **kw)


def test_distinct_experts_formula():
    assert distinct_experts(256, 8, 1) == pytest.approx(8)
    assert distinct_experts(256, 8, 2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert distinct_experts(0, 0, 5) == 0
    values = [distinct_experts(64, 6, b) for b in range(1, 200)]
    assert values == sorted(values)


def test_distinct_experts_matches_a_uniform_routing_simulation():
    rng = random.Random(0)
    e, k, b, trials = 32, 4, 6, 4000
    hits = sum(len({x for _ in range(b) for x in rng.sample(range(e), k)}) for _ in range(trials)) / trials
    assert hits == pytest.approx(distinct_experts(e, k, b), rel=0.02)


def test_batch_one_reads_weights_touched_experts_and_kv(v2_lite):
    inp = inputs(v2_lite)
    cost = forward_cost(inp, 1, 1, v2_lite.num_layers, v2_lite.num_dense_layers, v2_lite.num_moe_layers)
    w = weights_per_gpu(v2_lite, inp.layout, inp.precision)
    assert cost.weight_bytes == pytest.approx(w.read_per_step)
    assert cost.expert_bytes == pytest.approx(26 * 6 * v2_lite.expert_params() * 2)
    assert cost.kv_bytes == pytest.approx(4096 * 576 * 27 * 2)
    assert cost.memory_s == pytest.approx((cost.weight_bytes + cost.expert_bytes + cost.kv_bytes) / 4.8e12)


def test_flops_at_zero_context_are_two_per_active_parameter(v3):
    inp = inputs(v3, prec=Precision.for_weights("fp8", "bf16"), context=0)
    cost = forward_cost(inp, 1, 1, v3.num_layers, v3.num_dense_layers, v3.num_moe_layers)
    assert cost.flops == pytest.approx(2 * active_params_per_token(v3))


def test_throughput_trades_against_latency(v2_lite):
    report = sweep(inputs(v2_lite), [1, 4, 16, 64, 256])
    per_gpu = [p.tps_per_gpu for p in report.rows]
    per_user = [p.tps_per_user for p in report.rows]
    assert per_gpu == sorted(per_gpu) and per_user == sorted(per_user, reverse=True)
    for p in report.rows:
        assert p.tps_per_gpu == pytest.approx(p.batch_size * p.tps_per_user)
        assert p.step_ms == pytest.approx(max(p.memory_ms, p.compute_ms) + p.comm_ms)
    assert report.rows[0].bound == "memory"


def test_all_to_all_only_with_ep_and_dearer_off_the_nvlink_domain(v3):
    prec = Precision.for_weights("fp8", "fp8")
    assert decode_point(inputs(v3, "H200", Layout(tp=8), prec), 32).comm_ms == 0
    within = decode_point(inputs(v3, "H200", Layout(tp=8, ep=8, dp_attention=True), prec), 32).comm_ms
    across = decode_point(inputs(v3, "H200", Layout(tp=16, ep=16, dp_attention=True), prec), 32).comm_ms
    nvl72 = decode_point(inputs(v3, "GB200", Layout(tp=16, ep=16, dp_attention=True), prec), 32).comm_ms
    assert 0 < within < across and nvl72 < across
    overlapped = inputs(v3, "H200", Layout(tp=16, ep=16, dp_attention=True), prec, overlap_comm=True)
    p = decode_point(overlapped, 32)
    assert p.step_ms == pytest.approx(max(p.memory_ms, p.compute_ms, p.comm_ms))


def test_mtp_raises_tps_per_user_at_small_batch(v3):
    inp = inputs(v3, "GB300", Layout(tp=16, ep=16, dp_attention=True), Precision.for_weights("fp4", "fp8"),
                 context=132_000)
    mtp = MtpConfig(draft_tokens=3, accept_length=2.37)
    plain, spec = decode_point(inp, 4), decode_point(inp, 4, mtp)
    assert spec.tps_per_user > 1.3 * plain.tps_per_user
    assert spec.tps_per_user == pytest.approx(2.37 / (spec.step_ms / 1e3))


def test_kv_capacity_flag_and_validation(v2_lite):
    report = sweep(inputs(v2_lite), [8, 64], max_requests=10)
    assert [p.fits_kv for p in report.rows] == [True, False]
    with pytest.raises(ValueError, match="accept-length"):
        MtpConfig(draft_tokens=1, accept_length=3)
    with pytest.raises(ValueError, match="batch sizes"):
        decode_point(inputs(v2_lite), 0)
    with pytest.raises(ValueError, match="mem-efficiency"):
        inputs(v2_lite, mem_efficiency=0)
