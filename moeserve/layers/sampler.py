"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Randomness comes from a counter-based hash of (request seed, output position, token id), turned
into Gumbel noise: a request's draws do not depend on what else is in the batch, on retraction
or on the device, so the same seed gives the same output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] float32, 0 for greedy rows
    top_k: torch.Tensor  # [N] int64, vocab size when off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64, index of the token being sampled in the request's output
    all_greedy: bool
    needs_sorting: bool  # some row uses top-k or top-p
    needs_min_p: bool
    num_logprobs: int  # most top logprobs any row asked for; -1 when no row wants logprobs

    @classmethod
    def greedy(cls, num_logprobs: int = -1) -> SamplingBatch:
        """A batch where every row takes the argmax: no per-row tensors needed."""
        return cls(None, None, None, None, None, None, True, False, False, num_logprobs)  # type: ignore[arg-type]


@dataclass
class SamplerOutput:
    """Sampled tokens and, when asked, their logprobs."""

    token_ids: torch.Tensor  # [N]
    logprobs: torch.Tensor | None = None  # [N] logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [N, k]
    top_logprobs: torch.Tensor | None = None  # [N, k]
    ready: torch.cuda.Event | None = None

    def to_host(self, stream: torch.cuda.Stream | None = None) -> SamplerOutput:
        """Start copying every tensor to (pinned) host memory; `wait` before reading them.

        With `stream` the copies run there once the current stream's work so far is done, so
        the current stream's next work does not queue behind them.
        """
        if not self.token_ids.is_cuda:
            return self
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if stream is not None:
                t.record_stream(stream)  # not reused by the allocator before the copy has read it
            return host.copy_(t, non_blocking=True)

        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            out = SamplerOutput(copy(self.token_ids), copy(self.logprobs), copy(self.top_ids), copy(self.top_logprobs))
            out.ready = torch.cuda.Event()
            out.ready.record()
        return out

    def wait(self) -> None:
        """Block until the host copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [N, vocab] from a murmur3-style hash of (seed, step, token id)."""
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = (seeds[:, None] * 0x9E3779B1 + steps[:, None] * 0x85EBCA77 + token[None, :] * 0xC2B2AE3D) & _MASK32
    # int64 products may wrap; only the low 32 bits are kept, and those wrap correctly.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) / float(1 << 24)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    # Keep a token while the mass before it is below top_p: the nucleus always holds the first.
    sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch, greedy_tokens: torch.Tensor | None = None) -> SamplerOutput:
    """Pick one token per row of `logits` [N, vocab] (`greedy_tokens`: its argmax, if known).

    Half-precision logits (a decode graph's) are widened to float32, exactly, only where a row
    samples or logprobs are wanted: an all-greedy step with its argmax known never touches them.
    """
    if greedy_tokens is None or not batch.all_greedy or batch.num_logprobs >= 0:
        logits = logits.float()
    if greedy_tokens is None:
        greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        scaled = logits / temperature[:, None]
        if batch.needs_sorting:
            scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        if batch.needs_min_p:
            probs = scaled.softmax(dim=-1)
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(batch.seeds, batch.steps, logits.shape[-1])))
        sampled = (scaled + gumbel).argmax(dim=-1)
        tokens = torch.where(batch.temperature > 0, sampled, greedy_tokens)
    out = SamplerOutput(token_ids=tokens)
    if batch.num_logprobs >= 0:
        # Like vLLM, logprobs describe the model's own distribution, before temperature or filters.
        logprobs = logits.log_softmax(dim=-1)
        out.logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
        if batch.num_logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(batch.num_logprobs, dim=-1)
    return out
