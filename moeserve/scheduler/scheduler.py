"""FCFS continuous batching with a token budget, chunked prefill and retraction.

Each step: running requests go first, in admission order, each computing its next chunk (one
token once decoding); then waiting requests are admitted in arrival order while the token
budget, the sequence limit and the KV reservation allow. With mixed chunks off, a step that has
prompt work (a chunk in progress or an admissible prompt) runs only that, and decodes wait. If a
running request cannot get a KV page, the youngest running request is retracted: its pages are
released (whole computed pages stay in the prefix cache) and it goes back to the head of the
queue to be recomputed.

Scheduling commits a step at once: computed counts advance and each sampled token is appended
as a placeholder (a negative id naming a slot of the step's future-token buffer). `update` later
writes the real tokens in. This lets the engine schedule step N + 1 while step N still runs on
the GPU (the overlap scheduler): step N + 1 reads step N's tokens on the device.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from moeserve.cache.kv_manager import KVCacheManager
from moeserve.config.engine_config import EngineConfig
from moeserve.core.batch import ScheduleBatch, ScheduledRequest
from moeserve.core.outputs import EngineCoreOutput, SampledToken
from moeserve.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def placeholder(parity: int, future_index: int, max_rows: int) -> int:
    """The id standing for a token that step (parity) samples into row `future_index`."""
    return -1 - (parity * max_rows + future_index)


@dataclass
class SchedulerStats:
    """Counters the metrics endpoint and tests read."""

    num_retractions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    last_decode_batch_size: int = 0
    cuda_graph_padded_tokens: int = 0


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(self, engine: EngineConfig, kv: KVCacheManager) -> None:
        self.engine = engine
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose pages wait for a launched step that still uses them.
        self.releasing: list[Request] = []
        self.new_token_ratio = engine.init_new_token_ratio
        self.stats = SchedulerStats()
        self._steps = 0

    # -- queue management -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request."""
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is; its pages go back once no launched step uses them."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if req.in_flight:
            req.release_pending = True
            self.releasing.append(req)
        else:
            self.kv.release(req)

    def _retract(self, victim: Request) -> None:
        # Pages may be reused at once even if a launched step still writes them: the next step
        # runs after it on the same stream, so its writes land first.
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_retractions += 1
        self.waiting.appendleft(victim)
        self.stats.num_retractions += 1
        self.new_token_ratio = self.engine.init_new_token_ratio
        logger.warning(
            "KV cache full: retracted request %s (%d tokens) back to the queue; it will be recomputed "
            "(retractions so far: %d)",
            victim.request_id,
            victim.num_tokens,
            self.stats.num_retractions,
        )

    # -- scheduling ---------------------------------------------------------------------------

    def _chunk(self, req: Request, budget: int, batch_empty: bool) -> int:
        """Tokens `req` computes this step under the remaining budget (0: not this step)."""
        todo = req.num_uncomputed_tokens
        if self.engine.chunked_prefill:
            return min(todo, self.engine.chunked_prefill_size, budget)
        # Without chunking a prompt runs whole; one that exceeds the budget runs alone.
        return todo if todo <= budget or batch_empty else 0

    def _schedule_running(self, batch: ScheduleBatch, budget: int, prompts_only: bool = False) -> int:
        """Running requests' next chunks in admission order; -> the budget left.

        prompts_only skips decoders (one token to compute) and never retracts: a chunk that finds
        no page ends the pass, and the step falls back to a mixed one if it got nothing.
        """
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decoding = req.num_uncomputed_tokens <= 1
            # A decoder whose last allowed token is already in flight would only sample past its
            # length limit (a whole wasted step when a batch ends together): it waits to finish.
            if decoding and (prompts_only or req.remaining_max_tokens == 0):
                i += 1
                continue
            n = self._chunk(req, budget, not batch.items)
            if n == 0:
                break
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                if prompts_only:
                    return budget
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    break
            else:
                batch.items.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        return budget

    def _reserved_pages(self, req: Request) -> int:
        """Pages `req` is still expected to need: its whole prompt plus a share of max_tokens."""
        future = req.num_tokens + int(req.remaining_max_tokens * self.new_token_ratio + 0.999)
        return max(0, self.kv.pages_for(future) - len(req.page_table))

    def _can_admit(self, req: Request, n: int, reserved: int) -> bool:
        """Whether `req` fits now with `n` tokens, beside the pages running requests have reserved."""
        need_now = max(0, self.kv.pages_for(req.num_computed_tokens + n) - len(req.page_table))
        if not self.running:
            return need_now <= self.kv.available_pages
        return max(need_now, self._reserved_pages(req)) + reserved <= self.kv.available_pages

    def _admit_waiting(self, batch: ScheduleBatch, budget: int) -> None:
        # The running requests' reservations, summed once and grown by each admission: summing
        # them per candidate made admitting a burst of N prompts cost N^2 (5 ms at 128).
        reserved = sum(self._reserved_pages(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.match_prefix(req)
            n = self._chunk(req, budget, not batch.items)
            if n == 0 or not self._can_admit(req, n, reserved) or not self.kv.allocate(req, req.num_computed_tokens + n):
                self.kv.release(req)
                req.num_computed_tokens = 0
                return
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            reserved += self._reserved_pages(req)
            batch.items.append(ScheduledRequest(req, n))
            budget -= n
            if req.num_retractions == 0:
                req.num_cached_tokens = cached
                self.stats.prompt_tokens += len(req.prompt_token_ids)
                self.stats.prefix_queried_tokens += len(req.prompt_token_ids)
                self.stats.prefix_hit_tokens += cached

    def _commit(self, batch: ScheduleBatch) -> None:
        """Advance each scheduled request as if the step had run; sampled tokens are placeholders."""
        rows = 0
        for item in batch.items:
            req = item.request
            req.num_computed_tokens += item.num_new_tokens
            req.in_flight += 1
            if req.num_computed_tokens == req.num_tokens:
                item.output_index = len(req.output_token_ids)
                item.future_index = rows
                req.output_token_ids.append(placeholder(batch.parity, rows, self.engine.max_num_seqs))
                req.num_pending_tokens += 1
                rows += 1

    def schedule(self, max_tokens: int | None = None) -> ScheduleBatch:
        """Pick this step's work (at most `max_tokens` tokens, if less than the engine's budget) and commit it."""
        batch = ScheduleBatch(parity=self._steps % 2)
        self._steps += 1
        budget = self.engine.max_num_batched_tokens
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        retractions_before = self.stats.num_retractions
        mixed = self.engine.enable_mixed_chunk
        if not mixed:
            self._admit_waiting(batch, self._schedule_running(batch, budget, prompts_only=True))
        if not batch.items:
            budget = self._schedule_running(batch, budget)
            # Without mixing, admission was just tried with the whole budget and every page free.
            if mixed and self.stats.num_retractions == retractions_before:
                self._admit_waiting(batch, budget)
        if self.stats.num_retractions == retractions_before:
            self.new_token_ratio = max(
                self.engine.min_new_token_ratio, self.new_token_ratio - self.engine.new_token_ratio_decay
            )
        # Decodes first: the model runner's row order, which the future-token rows follow.
        batch.items.sort(key=lambda it: it.num_new_tokens != 1)
        self._commit(batch)
        self.stats.last_decode_batch_size = batch.num_decodes
        return batch

    # -- results ------------------------------------------------------------------------------

    def _stop_reason(self, req: Request, token: int, num_outputs: int) -> tuple[str, int | None] | None:
        p = req.sampling_params
        if num_outputs >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if len(req.prompt_token_ids) + num_outputs >= req.max_total_tokens:
            return "length", None
        return None

    def _resolve(self, item: ScheduledRequest, s: SampledToken) -> EngineCoreOutput | None:
        """Write a sampled token over its placeholder; finish the request if it stops here."""
        req = item.request
        req.output_token_ids[item.output_index] = s.token_id
        req.num_pending_tokens -= 1
        if req.is_finished:
            return None  # aborted or stopped while this step ran: its token is dropped
        if s.logprobs is not None:
            req.output_logprobs.append(s.logprobs)
        self.stats.generation_tokens += 1
        out = EngineCoreOutput(
            req.request_id,
            [s.token_id],
            [s.logprobs] if s.logprobs is not None else [],
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        stop = self._stop_reason(req, s.token_id, item.output_index + 1)
        if stop is not None:
            # A step launched after this one may already have sampled past the stop: drop that.
            del req.output_token_ids[item.output_index + 1 :]
            req.num_pending_tokens = 0
            self.finish(req, *stop)
            out.finish_reason, out.stop_reason = stop
        return out

    def update(self, batch: ScheduleBatch, sampled: list[SampledToken]) -> list[EngineCoreOutput]:
        """Take in a collected step: real tokens, stops, prefix sharing, deferred releases."""
        by_request = {id(s.request): s for s in sampled}
        outputs = []
        for item in batch.items:
            req = item.request
            req.in_flight -= 1
            s = by_request.get(id(req))
            if s is not None and item.output_index < len(req.output_token_ids):
                out = self._resolve(item, s)
                if out is not None:
                    outputs.append(out)
            if item.num_new_tokens > 1 and not req.is_finished and req.status == RequestStatus.RUNNING:
                self.kv.cache_prefix(req)
            if req.release_pending and req.in_flight == 0:
                req.release_pending = False
                self.releasing.remove(req)
                self.kv.release(req)
        return outputs
