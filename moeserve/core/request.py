"""A request as the engine tracks it: tokens, KV pages, progress and stop state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from moeserve.cache.radix_cache import RadixNode


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Prefill and decode are the same operation here: each step computes KV for the tokens from
    `num_computed_tokens` on; when that reaches the end of `all_token_ids` the step samples the
    next token. A retracted request simply restarts with `num_computed_tokens = 0`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0
    sampling_seed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    cache_node: RadixNode | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_retractions: int = 0
    # Overlap scheduling: a sampled token is a placeholder (negative id) until its step is
    # collected; `in_flight` counts launched steps not yet collected that include this request.
    num_pending_tokens: int = 0
    in_flight: int = 0
    release_pending: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by everything generated so far."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1 of prompt + outputs, without joining the whole of both."""
        lp = len(self.prompt_token_ids)
        if start >= lp:
            return self.output_token_ids[start - lp : end - lp]
        if end <= lp:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - lp]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        """Leading tokens whose ids are known (placeholders of in-flight samples excluded)."""
        return self.num_tokens - self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def remaining_max_tokens(self) -> int:
        """How many more tokens this request may still generate."""
        limit = self.max_total_tokens - len(self.prompt_token_ids)
        return max(0, limit - len(self.output_token_ids))

    @property
    def is_finished(self) -> bool:
        """Whether the request will produce nothing more."""
        return self.status == RequestStatus.FINISHED
