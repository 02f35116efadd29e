"""What launch shapes need to know about the GPU: its SM count, cached per device, and what TMA can read."""

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


def tma_readable(t: torch.Tensor) -> bool:
    """Whether Hopper's TMA can read `t` as rows of its last dim: unit last stride, 16-byte row
    strides and a 16-byte-aligned base."""
    strides = t.stride()[:-1]
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in strides)
