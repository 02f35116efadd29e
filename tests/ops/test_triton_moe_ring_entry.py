"""The MoE's entry (add + norm, router, selection) inside the one-token ring kernel picks the experts
the entry kernel picks and gives the reference's layer output, alone and chained in a replayed
CUDA graph (GPU); it takes only the routing rules and shapes it implements (CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve import ops
from moeserve.ops.reference import moe as ref

entry_module = pytest.importorskip("moeserve.ops.triton.moe_ring_entry")
fused_moe_module = pytest.importorskip("moeserve.ops.triton.fused_moe")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

PLAIN = dict(top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.0, correction_bias=None, scale_after_norm=False, num_shared=2)  # fmt: skip


def entry(routed: int, hidden: int, dtype=torch.bfloat16, device="cpu", **rules) -> object:
    residual = torch.zeros(1, hidden, dtype=dtype, device=device)
    router = torch.zeros(routed, hidden, dtype=dtype, device=device)
    return entry_module.Entry(residual, torch.ones(hidden, dtype=dtype, device=device), 1e-6, router, {**PLAIN, **rules})


def test_the_entry_takes_only_plain_top_k_one_expert_a_program_and_one_row():
    w13 = torch.empty(66, 2, 512, dtype=torch.bfloat16)  # only its expert count and dtype matter here
    row, part = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 512)
    usable = entry_module.entry_usable
    assert usable(row, w13, entry(64, 512), programs=132) and usable(part, w13, entry(64, 512), programs=132)
    assert usable(row, w13, entry(64, 512, scoring_func="sigmoid", norm_topk_prob=True), programs=64)
    assert not usable(row, w13, entry(64, 512), programs=63)  # more experts than programs
    grouped = entry(64, 512, topk_method="group_limited_greedy", n_group=8, topk_group=3)
    assert not usable(row, w13, grouped, programs=132)  # expert groups: the entry kernel selects
    assert not usable(torch.zeros(1, 512), w13, entry(64, 512), programs=132)  # float32, not a one-slot part
    assert not usable(torch.zeros(2, 512, dtype=torch.bfloat16), w13, entry(64, 512), programs=132)  # two tokens
    assert not usable(row, w13, entry(64, 512, num_shared=1), programs=132)  # shared experts not last in w13
    assert not usable(row, w13, entry(64, 512, dtype=torch.float16), programs=132)  # router not the experts' dtype


def layer(routed: int, shared: int, hidden: int, inter: int, rows: int, seed: int, dtype=torch.bfloat16):
    """Random expert weights, router, norm gains and next projection of one MoE layer (GPU)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype) * scale

    experts = routed + shared
    w13, w2 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5), randn(experts, hidden, inter, scale=inter**-0.5)
    router = randn(routed, hidden, scale=hidden**-0.5)
    gains = [torch.rand(hidden, generator=gen, device="cuda", dtype=dtype) + 0.5 for _ in range(2)]
    return w13, w2, router, gains, randn(rows, hidden, scale=hidden**-0.5)


def entry_set(fn, on: bool):
    """`fn` called with the ring's entry on or off (off: the entry kernel, then the ring)."""

    def call(*args, **kwargs):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_moe_module, "RING_ENTRY", on)
            return fn(*args, **kwargs)

    return call


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check_layer(x, residual, weights_of, got, rules, bias=None):
    """`got` (out, next residual, weights, ids) of routed_moe_add_norm_linear on x and residual,
    against the entry kernel + ring on the same inputs and the CPU reference of the whole op."""
    w13, w2, router, (gain, next_gain), proj = weights_of
    args = (x, residual, gain, 1e-6, router, w13, w2, next_gain, 1e-6, proj, bias)
    shared = rules["num_shared"]
    two = entry_set(ops.routed_moe_add_norm_linear, False)(*args, fixed_tail=shared, **rules)
    out, next_res, weights, ids = got
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (1, rules["top_k"] + shared)
    # Same logits but for the sum's order: the same experts, and their weights to float32 rounding.
    assert ids.tolist() == two[3].tolist() and torch.allclose(weights, two[2], rtol=1e-5, atol=1e-7)
    assert rel_error(next_res, two[1]) < 1e-2 and rel_error(out, two[0]) < 2e-2
    cpu = [a.cpu() if torch.is_tensor(a) else a for a in args]
    rules_cpu = {**rules, "correction_bias": None if rules["correction_bias"] is None else rules["correction_bias"].cpu()}
    want = ref.routed_moe_add_norm_linear(*cpu, fixed_tail=shared, **rules_cpu)
    assert ids.cpu().tolist() == want[3].tolist()
    assert rel_error(next_res.cpu(), want[1]) < 1e-2 and rel_error(out.cpu(), want[0]) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    ("routed", "shared", "hidden", "inter", "rows", "rules", "part", "bias", "dtype"),
    [(64, 2, 2048, 1408, 3648, {}, True, False, torch.bfloat16),
     (64, 2, 2048, 1408, 3648, {}, False, False, torch.bfloat16),
     (16, 1, 1024, 256, 72, dict(top_k=4, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                                 scale_after_norm=True, num_shared=1), True, True, torch.float16),
     (12, 0, 1024, 128, 64, dict(top_k=3, norm_topk_prob=True, num_shared=0), False, False, torch.bfloat16)],
    ids=["v2-lite-part", "v2-lite-row", "sigmoid-bias-fp16", "no-shared"],
)
def test_gpu_entry_in_the_ring_matches_the_entry_kernel(routed, shared, hidden, inter, rows, rules, part, bias, dtype):
    weights_of = layer(routed, shared, hidden, inter, rows, seed=11, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(12)
    rules = {**PLAIN, **rules}
    if rules["scoring_func"] == "sigmoid":  # a correction bias, as noaux_tc models carry (without groups here)
        rules["correction_bias"] = torch.rand(routed, generator=gen, device="cuda") * 0.1
    b = torch.randn(rows, generator=gen, device="cuda", dtype=dtype) if bias else None
    residual = torch.randn(1, hidden, generator=gen, device="cuda", dtype=dtype)
    x = torch.randn(1, 1, hidden, generator=gen, device="cuda") if part else torch.randn_like(residual)
    w13, w2, router, (gain, next_gain), proj = weights_of
    assert entry_module.entry_usable(x, w13, entry_module.Entry(residual, gain, 1e-6, router, rules), 132)
    for _ in range(2):  # twice: the kernel leaves its counters at zero for the next launch
        got = entry_set(ops.routed_moe_add_norm_linear, True)(
            x, residual, gain, 1e-6, router, w13, w2, next_gain, 1e-6, proj, b, fixed_tail=shared, **rules
        )
        check_layer(x, residual, weights_of, got, rules, b)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_gpu_entry_in_the_ring_chained_in_a_graph():
    """Layers chained as the model runs them at one token, the first fed a float32 one-slot part (the
    attention's fused output), each next one the previous projection's first H columns; replayed
    on fresh inputs, each layer checked on the inputs it really read in that replay."""
    hidden, shared, rows = 2048, 2, 3648
    layers = [layer(64, shared, hidden, 1408, rows, seed=20 + i) for i in range(3)]
    x = torch.zeros(1, 1, hidden, device="cuda")
    residual = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16)

    def forward():
        seen, h, res = [], x, residual
        for w13, w2, router, (gain, next_gain), proj in layers:
            got = ops.routed_moe_add_norm_linear(h, res, gain, 1e-6, router, w13, w2, next_gain, 1e-6, proj,
                                                 fixed_tail=shared, **PLAIN)  # fmt: skip
            seen.append((h, res, got))
            h, res = got[0][:, :hidden], got[1]
        return seen

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen = forward()
    for seed in (1, 2):
        fresh = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=fresh, device="cuda"))
        residual.copy_(torch.randn(residual.shape, generator=fresh, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for weights_of, (h, res, got) in zip(layers, seen, strict=True):
            check_layer(h.clone(), res.clone(), weights_of, [t.clone() for t in got], PLAIN)
