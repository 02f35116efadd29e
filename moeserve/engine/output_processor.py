"""Turns the core's token outputs into text: incremental detokenisation and stop strings.

It runs where the tokenizer lives (in-process for `LLM`, in the HTTP front end for the server),
as in vLLM v1. A stop string ends the request here; the caller then finishes it in the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core.outputs import EngineCoreOutput
from moeserve.core.request import TokenLogprobs
from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class RequestState:
    """Everything produced so far for one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """Whether nothing more will come."""
        return self.finish_reason is not None


@dataclass
class RequestDelta:
    """What one request gained in one step (for streaming)."""

    state: RequestState
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]


class OutputProcessor:
    """Tracks request states and applies stop strings."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestState:
        """Start tracking a request the core has accepted."""
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        decoder = self.tokenizer.decode_stream(params.skip_special_tokens) if self.tokenizer else None
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, decoder)
        self.states[request_id] = state
        return state

    def _apply_stop_strings(self, state: RequestState, new_text_start: int) -> bool:
        """Truncate at the first stop string in the new text; return whether one was found."""
        p = state.params
        if not p.stop_strings or len(state.token_ids) < p.min_tokens:
            return False
        longest = max(len(s) for s in p.stop_strings)
        search_from = max(0, new_text_start - longest + 1)
        hits = [(state.text.find(s, search_from), s) for s in p.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        state.text = state.text[: index + len(stop)] if p.include_stop_str_in_output else state.text[:index]
        state.finish_reason, state.stop_reason = "stop", stop
        return True

    def _emit(self, state: RequestState) -> tuple[str, list[int], list[TokenLogprobs]]:
        # While a stop string could still be forming at the end, hold those characters back.
        hold = 0 if state.finished else max((len(s) - 1 for s in state.params.stop_strings), default=0)
        end = max(state.sent_text_len, len(state.text) - hold)
        new_text = state.text[state.sent_text_len : end]
        state.sent_text_len = end
        new_ids = state.token_ids[state.sent_tokens :]
        new_lps = state.logprobs[state.sent_tokens :] if state.logprobs else []
        state.sent_tokens = len(state.token_ids)
        return new_text, new_ids, new_lps

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestDelta], list[str]]:
        """Apply core outputs; return per-request deltas and the ids a stop string finished."""
        deltas, stopped = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or state.finished:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            text_start = len(state.text)
            for tok in out.new_token_ids:
                state.token_ids.append(tok)
                if state.decoder is not None:
                    state.text += state.decoder.step(tok)
            state.logprobs.extend(out.new_logprobs)
            if self._apply_stop_strings(state, text_start):
                stopped.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            new_text, new_ids, new_lps = self._emit(state)
            deltas.append(RequestDelta(state, new_ids, new_text, new_lps))
            if state.finished:
                self.states.pop(out.request_id, None)
        return deltas, stopped

    def abort(self, request_id: str) -> RequestState | None:
        """Stop tracking a request that was aborted from outside."""
        state = self.states.pop(request_id, None)
        if state is not None and not state.finished:
            state.finish_reason = "abort"
        return state
