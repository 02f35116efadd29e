"""The HBM floor of a decode step: bytes it must read over the device's measured read bandwidth."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from moeserve.layers.moe import MoE, Router
from moeserve.models.deepseek import DeepseekForCausalLM


def time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median milliseconds of `fn` over `iters` runs, with CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run `fn` once (compiling what it launches), then capture it in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean milliseconds a replay of `graph` over `replays` back-to-back replays (one pair of CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def read_bandwidth_gbs(gib: float = 4.0) -> float:
    """GB/s (1e9) reading a large buffer once (a sum): the decode roofline's denominator."""
    x = torch.randn(int(gib * 2**30 / 2), dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: x.sum(dtype=torch.float32))
    return x.numel() * 2 / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, iters=10)
    return 2 * n**3 / ms / 1e9


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dense_weight_bytes(model: DeepseekForCausalLM) -> int:
    """Weights every decode step reads whatever the routing: all but routed experts, the
    embedding table (a step reads only its rows) and MTP modules (unused in plain decode).
    Shared experts count here, though they are stored beside the routed ones."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name == "model.embed_tokens.weight" or ".experts.w" in name:
            continue
        total += _nbytes(p)
    for module in model.model.modules():
        if isinstance(module, MoE):
            total += module.experts.num_shared * expert_bytes(model)
    return total


def expert_bytes(model: DeepseekForCausalLM) -> int:
    """Bytes of one routed expert (gate, up and down)."""
    for module in model.modules():
        if isinstance(module, MoE):
            return (_nbytes(module.experts.w13_weight) + _nbytes(module.experts.w2_weight)) // module.experts.w13_weight.shape[0]
    return 0


@contextmanager
def routed_expert_loads(model: DeepseekForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Collects, per MoE layer of the next eager forward(s), the tokens routed to each expert ([E])."""
    loads: list[torch.Tensor] = []

    routers = [m for m in model.model.modules() if isinstance(m, Router)]

    def observer(router: Router) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def observe(_weights: torch.Tensor, ids: torch.Tensor) -> None:
            routed = ids[:, : router.config.num_experts_per_tok]  # not the appended shared experts
            loads.append(torch.bincount(routed.reshape(-1).long(), minlength=router.config.n_routed_experts))

        return observe

    observers = [(r, observer(r)) for r in routers]
    for router, observe in observers:
        router.observers.append(observe)
    try:
        yield loads
    finally:
        for router, observe in observers:
            router.observers.remove(observe)


@contextmanager
def count_touched_experts(model: DeepseekForCausalLM) -> Iterator[list[int]]:
    """Collects, per MoE layer of the next eager forward(s), how many distinct experts were hit
    (the list fills when the block ends)."""
    counts: list[int] = []
    with routed_expert_loads(model) as loads:
        yield counts
    counts.extend(int((load > 0).sum()) for load in loads)


def decode_weight_bytes(model: DeepseekForCausalLM, touched: list[int]) -> dict:
    """Weight bytes one decode step reads: the dense weights and the experts it touched."""
    return {"dense_bytes": dense_weight_bytes(model), "expert_bytes": sum(touched) * expert_bytes(model)}
