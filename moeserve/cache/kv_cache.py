"""Storage of MLA's compressed KV: one latent + rotary key per token per layer, in pages."""

from __future__ import annotations

import torch

from moeserve.config.model_config import ModelConfig


class MLAKVCache:
    """[layers, pages + 1, page_size, kv_lora_rank + qk_rope_head_dim] (page 0 is scratch)."""

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_scale: float = 1.0,
    ) -> None:
        self.page_size = page_size
        self.kv_lora_rank = config.kv_lora_rank
        # FP8 caches store value / kv_scale; 1.0 (no calibration) as in vLLM and SGLang defaults.
        self.kv_scale = kv_scale
        self.dtype = dtype
        self.buffer = torch.zeros(
            num_layers, num_pages + 1, page_size, config.kv_cache_dim, dtype=dtype, device=device
        )

    def layer(self, layer_idx: int) -> torch.Tensor:
        """One layer's paged cache: [pages + 1, page_size, dim]."""
        return self.buffer[layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the cache occupies."""
        return self.buffer.numel() * self.buffer.element_size()
