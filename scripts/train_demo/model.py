"""Training-time DeepSeek-V3 modules in plain PyTorch: MLA, sigmoid/noaux_tc MoE, one MTP module.

These are separate from the inference engine on purpose: training wants whole padded sequences,
causal SDPA and a dense, sync-free MoE; the engine wants paged caches and sparse dispatch.
Parameter names mirror the Hugging Face checkpoint so export is a rename (see export.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from train_demo.config import DemoConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 like the reference models."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(cfg: DemoConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, rope_dim / 2] of plain RoPE at positions 0..length-1."""
    dim = cfg.qk_rope_head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    freqs = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek-V3 (rope_interleave) does."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class MLA(nn.Module):
    """Multi-head latent attention with q_lora, in its decompressed (training) form."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, t, _ = x.shape
        heads, nope, rope, vdim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, heads, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, heads, nope + vdim).transpose(1, 2)
        k_nope, v = kv.split([nope, vdim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope[:, None], cos, sin).expand(-1, heads, -1, -1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.to(k_nope.dtype)), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.qk_head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * vdim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores, group-limited top-k on score + correction bias (noaux_tc), as DeepSeek-V3."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Not a gradient-trained weight: moved by the aux-loss-free balancing rule after each step.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (dense gate weights [N, E] float32, zero off the chosen experts; chosen ids [N, k])."""
        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores.detach() + self.e_score_correction_bias
        grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        return torch.zeros_like(scores).scatter(1, ids, weights), ids


class Experts(nn.Module):
    """All routed experts, stacked; each token runs through every expert, weighted by its gates.

    At this size computing all experts densely costs little and needs no host sync or dynamic
    shapes; unchosen experts get gate 0, so outputs and gradients equal sparse dispatch.
    """

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))  # gate rows, then up rows
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        e, two_i, h = self.w13_weight.shape
        inter = two_i // 2
        gate_up = F.linear(x, self.w13_weight.reshape(e * two_i, h)).view(-1, e, two_i)
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        act = act * gates.to(act.dtype)[..., None]
        w2 = self.w2_weight.permute(1, 0, 2).reshape(h, e * inter)
        return F.linear(act.reshape(-1, e * inter), w2)


class MoE(nn.Module):
    """Routed experts plus the always-on shared expert; also reports each expert's load."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (output like x, tokens routed to each expert [E])."""
        flat = x.reshape(-1, x.shape[-1])
        gates, ids = self.gate(flat)
        load = (gates > 0).sum(0).float()
        out = self.experts(flat, gates) + self.shared_experts(flat)
        return out.view_as(x), load


class DecoderLayer(nn.Module):
    """Pre-norm attention and pre-norm MLP (dense or MoE), each with a residual."""

    def __init__(self, cfg: DemoConfig, moe: bool) -> None:
        super().__init__()
        self.self_attn = MLA(cfg)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (output, expert loads of an MoE layer or None)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out, None


class SharedHead(nn.Module):
    """The MTP module's own final norm (its output projection is the main model's lm_head)."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPModule(nn.Module):
    """DeepSeek-V3 NextN module: [enorm(emb(t[i+1])); hnorm(h[i])] -> eh_proj -> decoder layer."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg, moe=True)
        self.shared_head = SharedHead(cfg)

    def forward(
        self, hidden: torch.Tensor, next_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (normed hidden state for the shared head, expert loads)."""
        x = self.eh_proj(torch.cat((self.enorm(next_emb), self.hnorm(hidden)), dim=-1))
        x, load = self.layer(x, cos, sin)
        return self.shared_head.norm(x), load


class DemoModel(nn.Module):
    """Main model plus one MTP module sharing its embedding and output head (as DeepSeek-V3)."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, moe=i >= cfg.first_k_dense_replace) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPModule(cfg)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) matrices; output projections scaled down by depth (GPT-2's rule)."""
        depth_scale = 1.0 / math.sqrt(2 * (self.cfg.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            scaled = name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight"))
            nn.init.normal_(p, 0.0, std * depth_scale if scaled else std)

    def moe_layers(self) -> list[MoE]:
        """Every MoE block, the MTP module's last."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Main logits [B, T, V] (next token), MTP logits [B, T-1, V] (token after next), loads."""
        t = ids.shape[1]
        cos, sin = rope_cos_sin(self.cfg, t, ids.device)
        x, loads = self.embed_tokens(ids), []
        for layer in self.layers:
            x, load = layer(x, cos, sin)
            loads.append(load)
        # The MTP module reads the final-normed state, the tensor lm_head reads (as vLLM/SGLang feed it).
        h = self.norm(x)
        mtp_h, load = self.mtp(h[:, :-1], self.embed_tokens(ids[:, 1:]), cos[: t - 1], sin[: t - 1])
        loads.append(load)
        return self.lm_head(h), self.lm_head(mtp_h), torch.stack([ld for ld in loads if ld is not None])

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, T+1] -> (next-token loss, MTP loss on the token after next, expert loads)."""
        logits, mtp_logits, loads = self.logits(tokens[:, :-1])
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, vocab).float(), tokens[:, 2:].reshape(-1))
        return loss, mtp_loss, loads


@torch.no_grad()
def update_routing_bias(model: DemoModel, loads: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing: nudge over-loaded experts' bias down, under-loaded up."""
    for moe, load in zip(model.moe_layers(), loads, strict=True):
        moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
