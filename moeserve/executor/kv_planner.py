"""How many KV pages to allocate on this device."""

from __future__ import annotations

import logging

import torch

from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Without a GPU the pool only has to hold what the batch limits allow, capped so that test
# machines with little memory are not asked for gigabytes they will never use.
CPU_KV_CAP_BYTES = 1 << 30
# Kept free on the GPU beyond the static fraction for activations until issue 4's profile run.
GPU_ACTIVATION_RESERVE_BYTES = 2 << 30


def bytes_per_page(config: ModelConfig, engine: EngineConfig, num_layers: int, element_bytes: int) -> int:
    """Bytes one KV page takes over all layers."""
    return engine.page_size * config.kv_cache_dim * num_layers * element_bytes


def plan_num_pages(
    config: ModelConfig,
    engine: EngineConfig,
    num_layers: int,
    element_bytes: int,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Pages for the KV pool: explicit count, explicit memory, GPU memory fraction, or CPU default."""
    page_bytes = bytes_per_page(config, engine, num_layers, element_bytes)
    if engine.num_kv_pages is not None:
        return engine.num_kv_pages
    if engine.kv_cache_memory_gb is not None:
        budget = int(engine.kv_cache_memory_gb * (1 << 30))
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        static_budget = int(total * engine.mem_fraction_static) - torch.cuda.memory_allocated(device)
        budget = min(static_budget, free - GPU_ACTIVATION_RESERVE_BYTES)
    else:
        wanted = engine.max_num_seqs * max_model_len * page_bytes // engine.page_size
        budget = min(wanted, CPU_KV_CAP_BYTES)
    pages = budget // page_bytes
    if pages < 1:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB)")
    return int(pages)
