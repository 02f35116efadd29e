"""Reference rotary embedding and MLA's per-token KV preparation (norm, rotate, store)."""

from __future__ import annotations

import torch

from moeserve.ops.reference.attention import store_kv
from moeserve.ops.reference.norm import rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of `x` (float32 math) by the angles whose cos/sin are given per pair."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, magnitude: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim / 2] of each position's angles, scaled by the YaRN magnitude."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * magnitude, freqs.sin() * magnitude


def mla_rope_norm_store(
    positions: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    magnitude: float,
    interleaved: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
    *,
    q_nope: torch.Tensor | None = None,
    w_uk: torch.Tensor | None = None,
    q_latent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare MLA's new tokens in one step.

    `kv` is kv_a_proj_with_mqa's output [T, rank + rope_dim]. Normalises the latent, rotates the
    rotary key and `q_rope` [T, heads, rope_dim] (in place), and writes latent + rotary key into the
    paged cache. Returns (normalised latent [T, rank], rotated rotary key [T, rope_dim]).

    Given `q_nope` [D, heads, nope] (the first D <= T tokens' non-rotary queries) and `w_uk`
    [heads, nope, rank], also writes the absorbed queries q_nope @ w_uk per head into `q_latent`
    [D, heads, rank], summed in float32.
    """
    if q_nope is not None:
        assert w_uk is not None and q_latent is not None
        absorbed = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
        q_latent.copy_(absorbed)
    rank = norm_weight.shape[0]
    latent = rms_norm(kv[:, :rank], norm_weight, eps)
    cos, sin = rope_cos_sin(positions, inv_freq, magnitude)
    k_rope = rotate(kv[:, rank:], cos, sin, interleaved)
    q_rope.copy_(rotate(q_rope, cos[:, None, :], sin[:, None, :], interleaved))
    store_kv(kv_cache, slot_mapping, latent, k_rope, kv_scale)
    return latent, k_rope
