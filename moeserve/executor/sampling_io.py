"""Between requests and the batched sampler: parameter tensors in, per-request tokens out."""

from __future__ import annotations

import torch

from moeserve.core.batch import ScheduledRequest
from moeserve.core.outputs import SampledToken
from moeserve.core.request import TokenLogprobs
from moeserve.layers.sampler import SamplerOutput, SamplingBatch


def sampling_batch(items: list[ScheduledRequest], vocab_size: int, device: torch.device) -> SamplingBatch:
    """Each sampling row's parameters as tensors."""
    reqs = [it.request for it in items]
    params = [r.sampling_params for r in reqs]
    wanted = [p.logprobs for p in params if p.logprobs is not None]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    all_greedy = all(p.greedy for p in params)
    return SamplingBatch(
        temperature=tensor([0.0 if p.greedy else p.temperature for p in params], torch.float32),
        top_k=tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
        top_p=tensor([p.top_p for p in params], torch.float32),
        min_p=tensor([p.min_p for p in params], torch.float32),
        seeds=tensor([r.sampling_seed for r in reqs], torch.int64),
        steps=tensor([it.output_index for it in items], torch.int64),
        all_greedy=all_greedy,
        needs_sorting=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        needs_min_p=any(not p.greedy and p.min_p > 0 for p in params),
        num_logprobs=max(wanted) if wanted else -1,
    )


def ban_stop_tokens(logits: torch.Tensor, items: list[ScheduledRequest]) -> None:
    """Until min_tokens are out, EOS and stop tokens cannot be sampled (as in vLLM)."""
    for row, it in enumerate(items):
        r, p = it.request, it.request.sampling_params
        if it.output_index >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
        banned = [t for t in banned if t < logits.shape[-1]]
        if banned:
            logits[row, banned] = float("-inf")


def unpack(items: list[ScheduledRequest], out: SamplerOutput) -> list[SampledToken]:
    """One SampledToken per sampling row (host copies of the sampler's outputs)."""
    reqs = [it.request for it in items]
    tokens = out.token_ids.tolist()
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result = []
    for i, (r, tok) in enumerate(zip(reqs, tokens, strict=True)):
        info = None
        n = r.sampling_params.logprobs
        if n is not None and lps is not None:
            top = tuple(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if top_ids else ()
            info = TokenLogprobs(tok, lps[i], top)
        result.append(SampledToken(r, tok, info))
    return result
