"""Parameter counts by component and the weight bytes each GPU holds under a layout."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.planner.layout import DTYPE_BYTES, Layout, Precision
from moeserve.planner.model_shape import ModelShape


@dataclass(frozen=True)
class Params:
    """Parameter counts of the whole model, by component (MTP layers excluded)."""

    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    embedding: int
    lm_head: int

    @property
    def total(self) -> int:
        """All parameters."""
        return (
            self.attention + self.dense_mlp + self.routed_experts + self.shared_experts
            + self.router + self.embedding + self.lm_head
        )


def count_params(shape: ModelShape) -> Params:
    """Parameter counts from the shape; norms and biases are left out (well under 0.1%)."""
    h = shape.hidden_size
    return Params(
        attention=shape.num_layers * shape.attention_params_per_layer(),
        dense_mlp=shape.num_dense_layers * 3 * h * shape.dense_intermediate_size,
        routed_experts=shape.num_moe_layers * shape.num_experts * shape.expert_params(),
        shared_experts=shape.num_moe_layers * 3 * h * shape.shared_intermediate_size,
        router=shape.num_moe_layers * h * shape.num_experts,
        embedding=shape.vocab_size * h,
        lm_head=0 if shape.tie_word_embeddings else shape.vocab_size * h,
    )


def active_params_per_token(shape: ModelShape) -> int:
    """Parameters one decode token multiplies through (embedding lookup excluded)."""
    p = count_params(shape)
    routed = shape.num_moe_layers * shape.experts_per_token * shape.expert_params()
    lm_head = p.lm_head or p.embedding
    return p.attention + p.dense_mlp + routed + p.shared_experts + p.router + lm_head


@dataclass(frozen=True)
class WeightsPerGpu:
    """Weight bytes resident on one GPU, by component."""

    attention: float
    dense_mlp: float
    routed_experts: float
    shared_experts: float
    router: float
    embedding: float
    lm_head: float

    @property
    def total(self) -> float:
        """All weight bytes on the GPU."""
        return (
            self.attention + self.dense_mlp + self.routed_experts + self.shared_experts
            + self.router + self.embedding + self.lm_head
        )

    @property
    def read_per_step(self) -> float:
        """Bytes every decode step reads whatever the batch (routed experts and embedding rows excluded)."""
        # A tied model's lm_head is its embedding matrix.
        head = self.lm_head or self.embedding
        return self.attention + self.dense_mlp + self.shared_experts + self.router + head


def weights_per_gpu(shape: ModelShape, layout: Layout, prec: Precision) -> WeightsPerGpu:
    """Experts split over EP (and over TP when the instance is wider); attention split by TP or replicated.

    Under DP attention every GPU holds all attention weights and the input embedding; dense MLPs,
    shared experts and the lm_head stay split over the TP group, as in SGLang's DP-attention mode.
    """
    p = count_params(shape)
    dense, experts, emb = (DTYPE_BYTES[d] for d in (prec.dense, prec.experts, prec.embedding))
    return WeightsPerGpu(
        attention=p.attention * dense / layout.attn_tp,
        dense_mlp=p.dense_mlp * dense / layout.tp,
        routed_experts=p.routed_experts * experts / layout.instance_gpus,
        shared_experts=p.shared_experts * dense / layout.tp,
        router=p.router * DTYPE_BYTES["bf16"] / layout.attn_tp,
        embedding=p.embedding * emb / (1 if layout.dp_attention else layout.tp),
        lm_head=p.lm_head * emb / layout.tp,
    )
