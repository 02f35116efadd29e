"""Rotary position embedding, plain or YaRN-scaled as DeepSeek uses it."""

from __future__ import annotations

import math

import torch
from torch import nn

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
    """Inverse frequencies [dim / 2] and the magnitude factor applied to cos/sin."""
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


class RotaryEmbedding(nn.Module):
    """Rotates the rotary part of queries and keys by each token's position."""

    def __init__(self, rope: RopeConfig, dim: int, interleaved: bool) -> None:
        super().__init__()
        inv_freq, self.magnitude = rope_frequencies(rope, dim)
        # A plain attribute, not a buffer: it must survive building the model on the meta device.
        self._inv_freq_cpu = inv_freq
        self._inv_freq: torch.Tensor | None = None
        self.interleaved = interleaved

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return freqs.cos() * self.magnitude, freqs.sin() * self.magnitude

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, dim], k: [T, dim] -> rotated copies."""
        cos, sin = self._cos_sin(positions)
        return self._rotate(q, cos[:, None, :], sin[:, None, :]), self._rotate(k, cos, sin)
