"""What launch shapes need to know about the GPU: its SM count, cached per device."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal count for CPU (interpreter) tensors."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
