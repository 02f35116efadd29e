"""The Hopper (Gluon) gate/up GEMM equals the Triton one, and fused_moe takes it at prompt sizes.

It runs only on sm_90, so every test here is a `gpu` test and skips elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.reference import moe as ref
from moeserve.ops.triton import fused_moe as fused_moe_module
from moeserve.ops.triton.fused_moe import fused_moe, moe_up, plan_route
from tests.ops.test_triton_moe import V2_LITE, make_case, poisoned, rel_err  # noqa: F401 - poisoned is a fixture

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="the kernel is sm_90's")]


def _config(block_k: int = 64) -> dict:
    """A sorted, block-order plan in 128-row blocks, as the shipped prompt-size configs are."""
    up = {"BLOCK_N": 128, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True}
    down = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True,
            "PERSISTENT": True}
    return {"DENSE": False, "MODE": "dot", "BLOCK_M": 128, "ACT_TMA": True, "up": up, "down": down}


@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "inter", "topk", "pattern"),
    # V2-Lite's experts at a prompt step (with a ragged last block per expert), every pair on one
    # expert, and a small shape whose intermediate width ends in a part tile (320 = 2.5 x 128).
    [(8229, *V2_LITE, "random"), (8192, *V2_LITE, "one-expert"), (700, 8, 256, 320, 2, "random")],
)
@pytest.mark.usefixtures("poisoned")
def test_gpu_hopper_up_equals_the_triton_kernel(tokens, experts, hidden, inter, topk, pattern):
    from moeserve.ops.triton import moe_up_hopper as hopper

    x, w13, _, weights, ids = make_case(tokens, experts, hidden, inter, topk, torch.bfloat16, pattern, tokens)
    plan = plan_route(weights, ids, experts, _config())
    want = moe_up(x, w13, plan)
    got = hopper.moe_up_hopper(x, w13, plan.sorted_ids, plan.block_expert, plan.num_padded, plan.num_m, topk)
    rows = plan.sorted_ids[: int(plan.num_padded)] < tokens * topk  # the padding rows are never read
    assert got.shape == want.shape
    assert torch.equal(got[: rows.numel()][rows], want[: rows.numel()][rows])


@pytest.mark.usefixtures("poisoned")
def test_gpu_fused_moe_takes_the_hopper_kernel_at_prompt_sizes(monkeypatch):
    from moeserve.ops.triton import moe_up_hopper as hopper

    calls = []
    real = hopper.moe_up_hopper

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(hopper, "moe_up_hopper", spy)
    experts, hidden, inter, topk = V2_LITE
    x, w13, w2, weights, ids = make_case(hopper.MIN_TOKENS + 5, experts, hidden, inter, topk, torch.bfloat16,
                                         "random", 3)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(fused_moe(x, w13, w2, weights, ids), want) < 1e-2
    assert calls == [x.shape[0]]
    # Below MIN_TOKENS, with HOPPER_UP off, or with a config of the caller's: the Triton kernel.
    fused_moe(x[:100], w13, w2, weights[:100], ids[:100])
    monkeypatch.setattr(fused_moe_module, "HOPPER_UP", False)
    assert rel_err(fused_moe(x, w13, w2, weights, ids), want) < 1e-2
    monkeypatch.setattr(fused_moe_module, "HOPPER_UP", True)
    fused_moe(x, w13, w2, weights, ids, config=_config())
    assert calls == [x.shape[0]]


def test_gpu_hopper_up_declines_what_it_cannot_take():
    from moeserve.ops.triton import moe_up_hopper as hopper

    experts, hidden, inter, topk = V2_LITE
    x, w13, *_ = make_case(hopper.MIN_TOKENS, experts, hidden, inter, topk, torch.bfloat16, "random", 0)
    assert hopper.moe_up_hopper_usable(x, w13, _config())
    assert not hopper.moe_up_hopper_usable(x[:-1], w13, _config())  # too few tokens
    assert not hopper.moe_up_hopper_usable(x.float(), w13.float(), _config())
    assert not hopper.moe_up_hopper_usable(x, w13, {**_config(), "BLOCK_M": 64})
    assert not hopper.moe_up_hopper_usable(x, w13, {**_config(), "ACT_TMA": False})
    assert not hopper.moe_up_hopper_usable(x, w13, {**_config(), "MODE": "swap"})
    assert not hopper.moe_up_hopper_usable(x[:, :-8], w13[:, :, :-8], _config())  # a part k step
    assert not hopper.moe_up_hopper_usable(x.cpu(), w13.cpu(), _config())
