"""Rotary position embedding frequencies, plain or YaRN-scaled as DeepSeek uses them."""

from __future__ import annotations

import math

import torch

from moeserve.config.model_config import RopeConfig, yarn_mscale


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[int, int]:
    """Dimensions below `low` keep their frequency, above `high` are fully interpolated."""

    def dim_for(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = math.floor(dim_for(rope.beta_fast))
    high = math.ceil(dim_for(rope.beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] (float32, CPU) and the magnitude factor applied to cos/sin."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolated = 1.0 / base
    if rope.type != "yarn":
        return extrapolated, 1.0
    interpolated = 1.0 / (rope.factor * base)
    low, high = _yarn_correction_range(rope, dim)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 0.001)
    keep = 1.0 - ramp.clamp(0.0, 1.0)
    inv_freq = interpolated * (1.0 - keep) + extrapolated * keep
    if rope.attention_factor is not None:
        factor = float(rope.attention_factor)
    else:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return inv_freq, factor


class RotaryFrequencies:
    """Per-device cache of the inverse frequencies (kept off the module tree on purpose, so that
    building the model on the meta device does not lose them)."""

    def __init__(self, rope: RopeConfig, dim: int, interleaved: bool) -> None:
        self._cpu, self.magnitude = rope_frequencies(rope, dim)
        self._on_device: torch.Tensor | None = None
        self.interleaved = interleaved

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies on `device`."""
        if self._on_device is None or self._on_device.device != device:
            self._on_device = self._cpu.to(device)
        return self._on_device
