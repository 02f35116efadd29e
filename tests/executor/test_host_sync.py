"""Launching a step never waits for the GPU: the overlap scheduler needs the host to run ahead.

A device read inside the forward pass (for instance to size an output) would stall the host once
a layer until the GPU caught up, so prefill steps would leave the GPU idle while they launch.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams


@pytest.mark.gpu
def test_launches_with_cached_prefixes_and_decodes_do_not_synchronize(v3_checkpoint):
    llm = LLM(str(v3_checkpoint), dtype="bfloat16", device="cuda", max_model_len=512, num_kv_pages=128,
              cuda_graph_max_bs=8, enable_mixed_chunk=True)  # fmt: skip
    core = llm.core
    runner, launch = core.runner, core.runner.launch
    launched = []

    def checked_launch(batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append([it.num_new_tokens for it in batch.items])
        return handle

    runner.launch = checked_launch
    prompt = [1, *range(100, 300)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request("first", prompt, params)
    while core.has_unfinished_requests():
        core.step()
    # Prefix hits beside running decodes: 150 new tokens take the decompressed form, which
    # gathers the cached prefix from pages; 30 take the absorbed form.
    for i in range(3):
        core.add_request(f"d{i}", [1, *range(20 + i, 90 + i)], params)
    core.step()
    core.add_request("longer", [*prompt, *range(10, 160)], params)
    core.add_request("short", [*prompt, *range(300, 330)], params)
    while core.has_unfinished_requests():
        core.step()
    assert core.requests == {} and any(len(sizes) > 1 for sizes in launched)


@pytest.mark.gpu
def test_the_guard_catches_a_device_read():
    """gather_kv left to size its output itself reads the device: the mode above would catch it."""
    from moeserve import ops

    cache = torch.zeros(4, 16, 8, device="cuda")
    table = torch.tensor([[1, 2]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 20], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert ops.gather_kv(cache, table, lens, cu, torch.float32, total=20).shape == (20, 8)
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.gather_kv(cache, table, lens, cu, torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
