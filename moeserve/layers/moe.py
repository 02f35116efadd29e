"""DeepSeek MoE: a router, routed experts stored stacked, and always-on shared experts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve import ops
from moeserve.config.model_config import ModelConfig
from moeserve.layers.norm import RMSNorm
from moeserve.layers.weight_copy import WeightCopy

# Up to this many tokens the shared experts run inside the fused MoE kernels as extra experts:
# that saves three launches a layer and streams their weights at the MoE kernels' bandwidth.
# Past it, cuBLAS GEMMs on the same stacked weights are faster (V2-Lite layer on H200, tuned
# configs: fused 10 us faster at 1 token, 38 at 256, 80 at 384, 10 slower at 512;
# benchmarks/kernels/check_moe_shared.py).
FUSED_SHARED_MAX_TOKENS = 384


# Up to this many tokens the router GEMM is the Triton GEMV: it loads the router weight before
# waiting on the previous kernel and needs no zeroed fp32 buffer. Up to the second, the skinny
# Triton kernel (K split over 32 SMs); cuBLAS gives a [T, 2048] x [2048, 64] product one program.
GEMV_ROUTER_MAX_TOKENS = 8
SKINNY_ROUTER_MAX_TOKENS = 64
# Up to this many tokens the residual add + RMSNorm before a MoE, its router and the expert
# selection are one kernel (ops.add_norm_route): two launches fewer a layer at decode sizes
# (past 16 the three kernels are faster; see ops/triton/norm_route.py).
NORM_ROUTE_MAX_TOKENS = 16
# In this token range (GPU only) the shared experts run on a second CUDA stream, as dense GEMMs
# that add into the residual, while the first stream routes and runs the routed experts: the
# routing kernels are latency-bound and leave most of the GPU idle, which the shared experts'
# weight stream then fills (instead of taking its turn inside the fused kernels). Decode-graph
# replay on H200 against the fused path: b8 -2.3%, b32 -0.8%, b64 -1.6%, b128 -0.3%, b192 -0.4%;
# b1 +4.4%, b2 +0.4%, b256 +0.4% (benchmarks/ab_decode.py, variant DUAL_STREAM_MAX_TOKENS=0).
DUAL_STREAM_MIN_TOKENS = 8
DUAL_STREAM_MAX_TOKENS = 192
# The shared experts' down projection is one GEMM of K = S * I over a joined copy of their
# weights (11.5 MB a V2-Lite layer) instead of S accumulating GEMMs of K = I, except in this
# token range. cuBLAS on H200, S = 2: 60 -> 39 us at 1,024 tokens, 306 -> 278 at 16K, 2.52 ->
# 2.33 ms at 131K (benchmarks/kernels/prefill_small_ops.py); decode-graph replay on the second
# stream b8 -2.2%, b32 -1.1%, b64 -0.7%, but b128 +0.7%, b192 +0.1% (benchmarks/ab_decode.py).
SPLIT_SHARED_DOWN_MIN_TOKENS = 128
SPLIT_SHARED_DOWN_MAX_TOKENS = 192


@functools.lru_cache(maxsize=8)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of a device (one per process: calls on a device never overlap)."""
    return torch.cuda.Stream(device)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T in float32, as the reference models compute it.

    Products of two bf16 (or fp16) values are exact in float32, so a half-precision GEMM that
    accumulates and writes float32 gives the reference's result without casting either operand.
    """
    rows = x.shape[0]
    half = x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
    if x.is_cuda and half and GEMV_ROUTER_MAX_TOKENS < rows <= SKINNY_ROUTER_MAX_TOKENS:
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=x.device)
        ops.skinny_bmm(x.unsqueeze(0), weight.unsqueeze(0), out.unsqueeze(0))
        return out
    return ops.linear(x, weight, out_dtype=torch.float32)


@dataclass(frozen=True)
class NextProjection:
    """A MoE layer's output already taken through the next layer's residual add, norm and first
    projection (`out`): returned in its place when the caller asks for it (MoE.add_norm_forward's
    `then`), with the residual beside it already the sum."""

    out: torch.Tensor


class Router(nn.Module):
    """Scores experts per token (in float32, as the reference models do) and picks the top-k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        self.config = config
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        # Called with (weights, ids) of every routing this router's layer makes, wherever it ran
        # (here, or inside the experts' kernel): e.g. bench.roofline's count of experts touched.
        self.observers: list[Callable[[torch.Tensor, torch.Tensor], None]] = []

    def report(self, weights: torch.Tensor, ids: torch.Tensor) -> None:
        """Hand one routing (fp32 weights, int32 ids [T, k + S]) to every observer."""
        for observe in self.observers:
            observe(weights, ids)

    def forward(
        self, x: torch.Tensor, num_shared: int = 0, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, ...]:
        """-> (weights fp32 [T, k + S], expert ids [T, k + S]); the S shared experts come last.

        Given `residual` and `norm`, x is not yet normalised: the residual add + norm run with the
        routing (one kernel on the GPU) -> (weights, ids, norm(x + residual), x + residual). Either
        way the routing goes to `observers`.
        """
        if norm is None:
            weights, ids = ops.select_experts(router_logits(x, self.weight), **self.rules(num_shared))
            self.report(weights, ids)
            return weights, ids
        assert residual is not None
        normed, summed, weights, ids = ops.add_norm_route(
            x, residual, norm.weight, norm.eps, self.weight, **self.rules(num_shared)
        )
        self.report(weights, ids)
        return weights, ids, normed, summed

    def rules(self, num_shared: int) -> dict:
        """The expert-selection keywords of `ops.select_experts` for this model."""
        c = self.config
        return dict(
            top_k=c.num_experts_per_tok,
            topk_method=c.topk_method,
            scoring_func=c.scoring_func,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            correction_bias=self.e_score_correction_bias,
            scale_after_norm=c.model_type == "deepseek_v3",
            num_shared=num_shared,
        )


class Experts(nn.Module):
    """Every expert's weights as two stacked tensors, the layout fused kernels want.

    Rows 0 .. E - 1 are the routed experts; the shared experts follow as S more experts of the
    same width (a shared MLP of width S * I is exactly the sum of S MLPs of width I, so the
    checkpoint's one wide shared MLP is stored as S slices).
    """

    def __init__(self, num_routed: int, num_shared: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_routed = num_routed
        self.num_shared = num_shared
        self.intermediate_size = intermediate_size
        total = num_routed + num_shared
        self.w13_weight = nn.Parameter(torch.empty(total, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(total, hidden_size, intermediate_size))
        self._shared_down = WeightCopy("the shared experts' joined down weights")

    def add_shared(self, x: torch.Tensor, base: torch.Tensor, in_place: bool = True) -> torch.Tensor:
        """base + the shared experts' output, through dense GEMMs on their stacked slices: written
        into `base`, or with in_place False into a new tensor (the down GEMM adds `base`)."""
        e, s, inter = self.num_routed, self.num_shared, self.intermediate_size
        gate_up = F.linear(x, self.w13_weight[e:].reshape(s * 2 * inter, x.shape[1]))
        act = ops.silu_and_mul(gate_up.view(-1, 2 * inter)).view(x.shape[0], s * inter)
        if not SPLIT_SHARED_DOWN_MIN_TOKENS <= x.shape[0] <= SPLIT_SHARED_DOWN_MAX_TOKENS:
            down = self.shared_down_weight().t()
            return base.addmm_(act, down) if in_place else torch.addmm(base, act, down)
        act = act.view(x.shape[0], s, inter)
        out = base if in_place else torch.addmm(base, act[:, 0], self.w2_weight[e].t())
        for j in range(0 if in_place else 1, s):
            out.addmm_(act[:, j], self.w2_weight[e + j].t())
        return out

    def shared_down_weight(self) -> torch.Tensor:
        """The shared experts' down projections side by side, [H, S * I] (a copy, rebuilt whenever
        w2_weight is written), so that their down projection is one GEMM of K = S * I."""
        def join(w2: torch.Tensor) -> torch.Tensor:
            shared = w2[self.num_routed :]
            return shared.permute(1, 0, 2).reshape(shared.shape[1], -1)

        joined = self._shared_down.get(self.w2_weight, join)
        assert joined is not None
        return joined


class MoE(nn.Module):
    """Routed experts weighted by the router, plus the shared experts every token uses."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        self.gate = Router(config)
        self.experts = Experts(
            config.n_routed_experts, config.n_shared_experts, config.hidden_size, config.moe_intermediate_size
        )

    def build_weight_copies(self) -> None:
        """Build now the weight copies kernels read (the shared experts' joined down weights), which
        would otherwise be built at first use, so that a memory profile counts them as weights."""
        if self.experts.num_shared:
            self.experts.shared_down_weight()

    def forward(self, x: torch.Tensor, sum_slots: bool = True) -> torch.Tensor:
        """[T, H]; with sum_slots False it may instead return the per-expert parts [T, slots, H]
        (or their float32 sum, one slot), for a caller whose next op sums them anyway (the fused
        add + RMSNorm)."""
        shared = self._shared_in_kernels(x)
        weights, ids = self.gate(x, self.experts.num_shared if shared else 0)
        return self._experts(x, weights, ids, shared, sum_slots)

    def add_norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, then: tuple[RMSNorm, nn.Linear] | None = None
    ) -> tuple[torch.Tensor | NextProjection, torch.Tensor]:
        """(forward(norm(x + residual), sum_slots=False), x + residual); up to NORM_ROUTE_MAX_TOKENS
        the add + norm, router and expert selection are one kernel.

        In the dual-stream range the pair is (routed experts' parts, x + residual + shared experts'
        output): the same sum for the next add + norm, with the shared part on the second stream.
        Given `then` (the next layer's norm and first projection), the pair is instead
        (NextProjection(proj(next_norm(out + residual))), out + residual), out being the first
        pair's sum: at one token on the GPU, the experts' kernel computes it in the same launch.
        """
        dual = self._dual_stream(x)
        shared = not dual and self._shared_in_kernels(x)
        if then is not None and not dual and x.shape[0] <= NORM_ROUTE_MAX_TOKENS and (shared or not self.experts.num_shared):
            return self._forward_through(x, residual, norm, then, shared)
        route = None
        if x.shape[0] > NORM_ROUTE_MAX_TOKENS:
            normed, residual = norm.add_and_norm(x, residual)
        else:
            *route, normed, residual = self.gate(x, self.experts.num_shared if shared else 0, residual, norm)
        if dual:
            parts, residual = self._dual_stream_forward(normed, residual, route)
        elif route is None:
            parts = self(normed, sum_slots=False)
        else:
            parts = self._experts(normed, *route, shared, sum_slots=False)
        if then is None:
            return parts, residual
        next_norm, proj = then
        out, residual = ops.add_norm_linear(parts, residual, next_norm.weight, next_norm.eps, proj.weight, proj.bias)
        return NextProjection(out), residual

    def _forward_through(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, then: tuple[RMSNorm, nn.Linear], shared: bool
    ) -> tuple[NextProjection, torch.Tensor]:
        """add_norm_forward with `then`, where the add + norm, routing, experts and the next layer's
        add + norm + projection are one op (at one token on the GPU, one kernel)."""
        experts, (next_norm, proj) = self.experts, then
        num_shared = experts.num_shared if shared else 0
        out, residual, weights, ids = ops.routed_moe_add_norm_linear(
            x, residual, norm.weight, norm.eps, self.gate.weight, experts.w13_weight, experts.w2_weight,
            next_norm.weight, next_norm.eps, proj.weight, proj.bias, fixed_tail=num_shared,
            **self.gate.rules(num_shared),
        )
        self.gate.report(weights, ids)
        return NextProjection(out), residual

    def _dual_stream(self, x: torch.Tensor) -> bool:
        tokens = x.shape[0]
        return x.is_cuda and bool(self.experts.num_shared) and DUAL_STREAM_MIN_TOKENS <= tokens <= DUAL_STREAM_MAX_TOKENS

    def _dual_stream_forward(
        self, x: torch.Tensor, residual: torch.Tensor, route: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed experts on this stream, shared experts (added into the residual) on the side one."""
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        # The side stream starts after x and the residual exist, and this stream goes on only
        # once it is done: every tensor either stream touches is alive and final in between.
        side.wait_stream(main)
        with torch.cuda.stream(side):
            residual = self.experts.add_shared(x, residual, in_place=False)
        weights, ids = route if route is not None else self.gate(x)
        e = self.experts.num_routed
        parts = ops.fused_moe(x, self.experts.w13_weight[:e], self.experts.w2_weight[:e], weights, ids, sum_slots=False)
        main.wait_stream(side)
        return parts, residual

    def _shared_in_kernels(self, x: torch.Tensor) -> bool:
        return bool(self.experts.num_shared) and x.shape[0] <= FUSED_SHARED_MAX_TOKENS

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool, sum_slots: bool
    ) -> torch.Tensor:
        experts = self.experts
        if shared or not experts.num_shared:
            return ops.fused_moe(x, experts.w13_weight, experts.w2_weight, weights, ids, sum_slots=sum_slots,
                                 fixed_tail=experts.num_shared if shared else 0)
        e = experts.num_routed
        out = ops.fused_moe(x, experts.w13_weight[:e], experts.w2_weight[:e], weights, ids)
        return experts.add_shared(x, out)

    def warm_up(self, max_tokens: int) -> list[int]:
        """Run once at every token count where the fused kernels' config changes (GPU only), so
        Triton compiles each variant now, not inside a request; -> the counts run."""
        if not self.experts.w13_weight.is_cuda:
            return []
        from moeserve.ops.triton.moe_config import warm_up_sizes

        experts, k = self.experts, self.gate.config.num_experts_per_tok
        w, routed = experts.w13_weight, experts.w13_weight[: experts.num_routed]
        fused = min(max_tokens, FUSED_SHARED_MAX_TOKENS) if experts.num_shared else 0
        sizes = warm_up_sizes(w, k + experts.num_shared, 1, fused) if fused else []
        sizes += warm_up_sizes(routed, k, fused + 1, max_tokens)
        # The router's kernel changes at other counts: GEMV, then the skinny GEMM's row blocks.
        router = (1, GEMV_ROUTER_MAX_TOKENS + 1, 17, 33, SKINNY_ROUTER_MAX_TOKENS + 1)
        sizes = sorted(set(sizes) | {t for t in router if t <= max_tokens})
        # The dual-stream range runs the routed experts alone (their own configs) beside the shared GEMMs.
        dual_hi = min(max_tokens, DUAL_STREAM_MAX_TOKENS) if experts.num_shared else 0
        dual = warm_up_sizes(routed, k, DUAL_STREAM_MIN_TOKENS, dual_hi) if dual_hi >= DUAL_STREAM_MIN_TOKENS else []
        x = torch.randn(max([*sizes, *dual], default=0), w.shape[2], dtype=w.dtype, device=w.device)
        for tokens in sizes:
            self(x[:tokens])
        norm = RMSNorm(w.shape[2]).to(w.device, w.dtype)
        if sizes:  # one variant serves every token count of the add + norm + route kernel
            self.add_norm_forward(x[:1], x[:1], norm)
        for tokens in dual:
            self.add_norm_forward(x[:tokens], x[:tokens], norm)
        return sorted(set(sizes) | set(dual))
