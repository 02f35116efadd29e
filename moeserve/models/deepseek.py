"""DeepSeek-V2 / V3 causal LM (also R1, Kimi-K2, Moonlight shapes) with optional MTP layers."""

from __future__ import annotations

import torch
from torch import nn

from moeserve import ops
from moeserve.config.model_config import ModelConfig
from moeserve.core.batch import ForwardBatch
from moeserve.layers.attention import MLAAttention
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe import MoE, NextProjection
from moeserve.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP (dense or MoE), each with a residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | NextProjection,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        next_layer: DecoderLayer | None = None,
    ) -> tuple[torch.Tensor | NextProjection, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it); the caller adds them.

        Deferring each residual add into the next norm lets one fused op do add + norm. A MoE's
        output may be its per-expert parts [T, slots, H]: that op sums them too. Given `next_layer`, the
        MLP (MoE or, at one token, dense) may return that layer's input already through its add,
        norm and first projection (a NextProjection, with the summed residual), which the next layer
        then starts from.
        """
        if isinstance(hidden, NextProjection):
            assert residual is not None
            hidden = self.self_attn.attend(positions, hidden.out, batch)
        elif residual is None:
            residual = hidden
            hidden = self.self_attn(positions, self.input_layernorm(hidden), batch)
        else:
            hidden, residual = self.self_attn.add_norm_forward(positions, hidden, residual, self.input_layernorm, batch)
        then = None if next_layer is None else (next_layer.input_layernorm, next_layer.self_attn.fused_qkv_a_proj)
        return self.mlp.add_norm_forward(hidden, residual, self.post_attention_layernorm, then)


class DeepseekModel(nn.Module):
    """Embedding, decoder stack, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        layers = list(self.layers)
        # The embedding goes straight through the first layer's norm and first projection: at one
        # token on the GPU that is one kernel, where a decode step would otherwise start with three.
        norm, proj = layers[0].input_layernorm, layers[0].self_attn.fused_qkv_a_proj
        out, residual = ops.embed_norm_linear(
            input_ids, self.embed_tokens.weight, norm.weight, norm.eps, proj.weight, proj.bias
        )
        hidden: torch.Tensor | NextProjection = NextProjection(out)
        for layer, next_layer in zip(layers, [*layers[1:], None], strict=True):
            hidden, residual = layer(positions, hidden, residual, batch, next_layer)
        assert not isinstance(hidden, NextProjection)  # the last layer has no next one
        return self.norm.add_and_norm(hidden, residual)[0]


class SharedHead(nn.Module):
    """The MTP module's own final norm and output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction module: predicts the token after next.

    It combines the main model's last hidden state at position i with the embedding of token
    i + 1 and runs one more decoder layer (KV layer index `num_hidden_layers + j`).
    """

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        layer_idx = config.num_hidden_layers + index
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config, layer_idx)
        self.shared_head = SharedHead(config)

    def forward(
        self, next_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits of the token after next, this module's hidden state for chaining)."""
        x = torch.cat((self.enorm(self.embed_tokens(next_ids)), self.hnorm(prev_hidden)), dim=-1)
        hidden, residual = self.layer(positions, self.eh_proj(x), None, batch)
        normed, hidden = self.shared_head.norm.add_and_norm(hidden, residual)
        return self.shared_head.head(normed).float(), hidden


class DeepseekForCausalLM(nn.Module):
    """The full model: parameter names follow the Hugging Face checkpoints."""

    def __init__(self, config: ModelConfig, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(config, j) for j in range(num_mtp_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [T, hidden] for every input token."""
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) for the given hidden states."""
        return self.lm_head(hidden).float()

    def build_weight_copies(self) -> None:
        """Build every layer's derived weight copies now rather than at first use (MoE's and
        MLAAttention's build_weight_copies)."""
        for module in self.modules():
            if isinstance(module, MoE | MLAAttention):
                module.build_weight_copies()
