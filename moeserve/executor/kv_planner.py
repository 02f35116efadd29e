"""How many KV pages to allocate on this device (the memory planner).

On a GPU, SGLang's definition: `mem_fraction_static` of the card holds the weights and the KV pool.
The pool is also capped so that what stays free covers the measured activation peak of the
largest step (a profile run) plus the decode CUDA graphs' pool and a safety margin.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Without a GPU the pool only has to hold what the batch limits allow, capped so that test
# machines with little memory are not asked for gigabytes they will never use.
CPU_KV_CAP_BYTES = 1 << 30
# Headroom beyond the measured peaks: allocator fragmentation, NCCL/cuBLAS workspaces, sampling.
GPU_SAFETY_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers behind the KV pool size (bytes), for the start-up log."""

    num_pages: int
    page_bytes: int
    weights_bytes: int = 0
    activation_bytes: int = 0
    graph_reserve_bytes: int = 0
    total_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pool."""
        return self.num_pages * self.page_bytes


def bytes_per_page(config: ModelConfig, page_size: int, num_layers: int, element_bytes: int) -> int:
    """Bytes one KV page takes over all layers."""
    return page_size * config.kv_cache_dim * num_layers * element_bytes


def plan_kv_pool(
    config: ModelConfig,
    engine: EngineConfig,
    num_layers: int,
    element_bytes: int,
    device: torch.device,
    max_model_len: int,
    activation_bytes: int = 0,
    graph_reserve_bytes: int = 0,
) -> MemoryPlan:
    """Pages for the KV pool: explicit count, explicit memory, GPU memory plan, or CPU default."""
    page_bytes = bytes_per_page(config, engine.page_size, num_layers, element_bytes)
    if engine.num_kv_pages is not None:
        return MemoryPlan(engine.num_kv_pages, page_bytes)
    if engine.kv_cache_memory_gb is not None:
        return MemoryPlan(int(engine.kv_cache_memory_gb * 2**30) // page_bytes, page_bytes)
    if device.type != "cuda":
        wanted = engine.max_num_seqs * max_model_len * page_bytes // engine.page_size
        return MemoryPlan(max(1, min(wanted, CPU_KV_CAP_BYTES) // page_bytes), page_bytes)
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    static_budget = int(total * engine.mem_fraction_static) - weights
    headroom_budget = free - activation_bytes - graph_reserve_bytes - GPU_SAFETY_BYTES
    pages = min(static_budget, headroom_budget) // page_bytes
    if pages < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {weights / 2**30:.1f} GiB of weights, "
            f"{activation_bytes / 2**30:.1f} GiB activation peak, {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB; raise mem_fraction_static or lower max_num_batched_tokens"
        )
    return MemoryPlan(int(pages), page_bytes, weights, activation_bytes, graph_reserve_bytes, total)
