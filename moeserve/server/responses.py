"""Response bodies and stream chunks of the OpenAI API, built from the engine's request states."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from moeserve.core.request import TokenLogprobs
from moeserve.engine.output_processor import RequestState
from moeserve.engine.tokenizer import Tokenizer
from moeserve.server.request_group import RequestGroup


def new_id(prefix: str) -> str:
    """A response id like OpenAI's (`cmpl-...`, `chatcmpl-...`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """A token as text for logprob displays (`token_id:N` without a tokenizer, as vLLM does)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer | None, lps: list[TokenLogprobs], offset: int = 0) -> dict:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens = [token_text(tokenizer, lp.token_id) for lp in lps]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer | None, lps: list[TokenLogprobs]) -> dict:
    """The chat `logprobs` object ({"content": [{token, logprob, bytes, top_logprobs}]})."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


@dataclass
class ResponseContext:
    """What every body and chunk of one response shares."""

    kind: str  # "completions" or "chat"
    model: str
    tokenizer: Tokenizer | None
    want_logprobs: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    @property
    def object(self) -> str:
        """The `object` of a full response."""
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        """The `object` of a stream chunk."""
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def logprobs(self, lps: list[TokenLogprobs], offset: int = 0) -> dict | None:
        """The choice's logprobs object, or None when not asked for."""
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.tokenizer, lps)
        return completion_logprobs(self.tokenizer, lps, offset)

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        """The fields around `choices`."""
        obj = self.chunk_object if chunk else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def usage(group: RequestGroup, states: dict[int, RequestState]) -> dict:
    """Token counts; prompts count once each (n samples share them), cached tokens from sample 0."""
    prompt_tokens = sum(len(p.token_ids) for p in group.prompts)
    completion_tokens = sum(len(s.token_ids) for s in states.values())
    cached = sum(states[p * group.n].num_cached_tokens for p in range(len(group.prompts)) if p * group.n in states)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def full_choice(ctx: ResponseContext, index: int, state: RequestState) -> dict:
    """One choice of a non-streamed response."""
    choice: dict = {"index": index}
    if ctx.kind == "chat":
        choice["message"] = {"role": "assistant", "content": state.text}
    else:
        choice["text"] = state.text
    choice["logprobs"] = ctx.logprobs(state.logprobs)
    choice["finish_reason"] = state.finish_reason
    choice["stop_reason"] = state.stop_reason
    return choice


def full_response(ctx: ResponseContext, group: RequestGroup, states: dict[int, RequestState]) -> dict:
    """A non-streamed response body."""
    choices = [full_choice(ctx, i, states[i]) for i in sorted(states)]
    return {**ctx.envelope(choices), "usage": usage(group, states)}
