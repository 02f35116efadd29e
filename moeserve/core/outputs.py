"""What the engine hands back: per-step deltas from the core and finished results for users."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core.request import Request, TokenLogprobs


@dataclass
class SampledToken:
    """The token a request got in one step, with its logprobs when asked."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass
class EngineCoreOutput:
    """New tokens of one request from one engine step (token level, no text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated sequence, as vLLM's CompletionOutput."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and its completion(s), as vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        """Text of the first completion."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids of the first completion."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """Why the first completion stopped: 'stop', 'length' or 'abort'."""
        return self.outputs[0].finish_reason
