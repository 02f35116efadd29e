"""Between requests and the batched sampler: parameter tensors in, per-request tokens out."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moeserve.core.batch import ScheduledRequest
from moeserve.core.outputs import SampledToken
from moeserve.core.request import TokenLogprobs
from moeserve.layers.sampler import SamplerOutput, SamplingBatch


def sampling_batch(
    items: list[ScheduledRequest], vocab_size: int, to_device: Callable[[np.ndarray], torch.Tensor]
) -> SamplingBatch:
    """Each sampling row's parameters as tensors (none at all when every row is greedy)."""
    params = [it.request.sampling_params for it in items]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    num_logprobs = max(wanted) if wanted else -1
    if all(p.greedy for p in params):
        return SamplingBatch.greedy(num_logprobs)
    floats = to_device(
        np.array([[0.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
                  [p.min_p for p in params]], dtype=np.float32)
    )  # fmt: skip
    ints = to_device(
        np.array([[p.top_k if p.top_k > 0 else vocab_size for p in params],
                  [it.request.sampling_seed for it in items], [it.output_index for it in items]], dtype=np.int64)
    )  # fmt: skip
    return SamplingBatch(
        temperature=floats[0],
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        seeds=ints[1],
        steps=ints[2],
        all_greedy=False,
        needs_sorting=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        needs_min_p=any(not p.greedy and p.min_p > 0 for p in params),
        num_logprobs=num_logprobs,
    )


def ban_stop_tokens(logits: torch.Tensor, items: list[ScheduledRequest]) -> bool:
    """Until min_tokens are out, EOS and stop tokens cannot be sampled (as in vLLM); True if any was."""
    banned_any = False
    for row, it in enumerate(items):
        r, p = it.request, it.request.sampling_params
        if it.output_index >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
        banned = [t for t in banned if t < logits.shape[-1]]
        if banned:
            logits[row, banned] = float("-inf")
            banned_any = True
    return banned_any


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
