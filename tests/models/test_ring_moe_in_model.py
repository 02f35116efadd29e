"""A V2-Lite-shaped model (three layers, dummy weights) decodes one token with the one-token ring
MoE as it does with the two fused-MoE launches: each ring output (the dense layer's MLP as one fixed
expert, then each MoE layer's), on the inputs and routing the engine really hands it, matches the
two launches (with the next layer's add + norm + first projection in the ring's tail where there
is a next layer, against the GEMV kernel on the two launches' parts), and the float32 sum reaches
the final norm (GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve import LLM, SamplingParams, ops
from moeserve.core.batch import ScheduledRequest

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 4096, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "rope_theta": 10000,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def one_decode(tmp_path):
    """The V2-Lite-shaped model (dummy weights) with one request prefilled and its next token
    scheduled -> (the model runner, the scheduled decode)."""
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE))
    llm = LLM(str(tmp_path / "config.json"), load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=512,
              disable_cuda_graph=True, disable_overlap_schedule=True, num_kv_pages=64)  # fmt: skip
    core = llm.core
    core.add_request("0", [1, *range(40, 90)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    core.step()  # the prefill; the request now has a token to feed
    item = ScheduledRequest(core.scheduler.running[0], 1)
    assert core.kv.allocate(item.request, item.start + 1)
    item.output_index = len(item.request.output_token_ids)
    return core.runner, item


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper")
def test_gpu_one_token_decode_with_the_ring_moe_matches_two_launches(tmp_path, monkeypatch):
    from moeserve.layers.moe import Router
    from moeserve.ops.triton import fused_moe, moe_ring

    monkeypatch.setattr(fused_moe, "RING_ENTRY", False)  # the entry kernel routes; see the next test
    runner, item = one_decode(tmp_path)
    kernel = moe_ring.moe_ring
    calls: list[tuple[torch.Tensor, float]] = []

    def checked(hidden, w13, w2, weights, ids, fixed_tail=0, then=None):
        """The ring's output, checked against the two launches on the same token and routing (and
        with a tail, their parts through the add + norm + GEMV kernel)."""
        out = kernel(hidden, w13, w2, weights, ids, fixed_tail, then)
        monkeypatch.setattr(fused_moe, "RING_MAX_TOKENS", 0)
        parts = fused_moe.fused_moe(hidden, w13, w2, weights, ids, sum_slots=False, fixed_tail=fixed_tail)
        monkeypatch.setattr(fused_moe, "RING_MAX_TOKENS", 1)
        if then is None:
            calls.append((ids.clone(), rel_error(out[0], parts.float().sum(1)), False))
            return out
        want = ops.add_norm_linear(parts, then.residual, then.norm_weight, then.eps, then.weight, then.bias)
        calls.append((ids.clone(), max(rel_error(got, w) for got, w in zip(out, want, strict=True)), True))
        return out

    routes: list[list[int]] = []
    for router in (m for m in runner.model.modules() if isinstance(m, Router)):
        router.observers.append(lambda _weights, ids: routes.append(sorted(ids.flatten().tolist())))
    monkeypatch.setattr(moe_ring, "moe_ring", checked)
    logits = {}
    with torch.inference_mode():
        for ring in (0, 1):
            monkeypatch.setattr(fused_moe, "RING_MAX_TOKENS", ring)
            calls.clear()
            batch = runner.prepare([item])
            logits[ring] = runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch)).float()
    # The dense layer (as one fixed expert) and both MoE layers took the ring when it was on, not when off.
    assert len(calls) == 3 and len(routes) == 4
    assert [tail for *_, tail in calls] == [True, True, False]  # the last layer has no next projection
    assert all(error < 2e-2 for _, error, _ in calls), calls
    assert calls[0][0].tolist() == [[0]]  # the dense MLP: expert 0, its only one
    assert calls[1][0][0, -2:].tolist() == [64, 65]  # the shared experts come last
    # The second layer's routing may flip between near-tied experts on a last-bit difference in
    # its input; where it does not, the logits agree closely, and they stay near either way.
    error = rel_error(logits[1], logits[0])
    assert error < (1e-2 if routes[:2] == routes[2:] else 0.1), (error, routes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper")
def test_gpu_one_token_decode_with_the_entry_in_the_ring_matches_the_entry_kernel(tmp_path, monkeypatch):
    """The MoE layers followed by a next layer (here the first) take their add + norm and routing
    inside the ring when that is on; the routings the routers report and the logits agree with the
    entry kernel's."""
    from moeserve.layers.moe import Router
    from moeserve.ops.triton import fused_moe, moe_ring

    runner, item = one_decode(tmp_path)
    kernel, entries = moe_ring.moe_ring, []

    def recorded(*args, **kwargs):
        entries.append(kwargs.get("entry", args[7] if len(args) > 7 else None) is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(moe_ring, "moe_ring", recorded)
    routers = [m for m in runner.model.modules() if isinstance(m, Router)]
    routes: dict[bool, list[list[int]]] = {False: [], True: []}
    logits = {}
    with torch.inference_mode():
        for on in (False, True):
            monkeypatch.setattr(fused_moe, "RING_ENTRY", on)
            entries.clear()
            observers = [lambda _w, ids, on=on: routes[on].append(sorted(ids.flatten().tolist())) for _ in routers]
            for router, observe in zip(routers, observers, strict=True):
                router.observers.append(observe)
            batch = runner.prepare([item])
            logits[on] = runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch)).float()
            for router, observe in zip(routers, observers, strict=True):
                router.observers.remove(observe)
            # The dense layer's MLP, then the first MoE layer (entry in the ring when on); the last has no next layer.
            assert entries == [False, on, False]
    assert len(routes[True]) == len(routes[False]) == 2 and routes[True][0] == routes[False][0]
    error = rel_error(logits[True], logits[False])
    assert error < (1e-2 if routes[True] == routes[False] else 0.1), (error, routes)
