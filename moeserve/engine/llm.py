"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from moeserve.config.engine_config import EngineConfig
from moeserve.core.outputs import CompletionOutput, RequestOutput
from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.engine import EngineCore
from moeserve.engine.output_processor import OutputProcessor, RequestState
from moeserve.engine.tokenizer import Tokenizer

PromptType = str | list[int]


def _normalise_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """Load a model once, then generate for batches of prompts."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self.engine_config = EngineConfig(model=model, **engine_kwargs)
        self.core = EngineCore(self.engine_config)
        self.tokenizer = Tokenizer.load(model) if self.engine_config.load_format != "dummy" else None
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as token id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _add(self, prompt: PromptType, params: SamplingParams, added: list[str]) -> list[str]:
        """Queue one prompt (n completions of it); return its request ids, also noted in `added`."""
        text, ids = self._tokenize(prompt)
        base, group = str(next(self._ids)), []
        for i in range(params.n):
            child = params if params.n == 1 else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            rid = base if params.n == 1 else f"{base}-{i}"
            added.append(rid)
            self.processor.add_request(rid, text, ids, child)
            self.core.add_request(rid, ids, child)
            group.append(rid)
        return group

    def _run(self, pending: set[str], states: dict[str, RequestState]) -> None:
        # Keep stepping after the last output: a step launched ahead (overlap) must be collected
        # so that its pages come back.
        while pending or self.core.has_unfinished_requests():
            deltas, stopped = self.processor.process(self.core.step())
            for rid in stopped:
                self.core.abort_request(rid, reason="stop")
            for d in deltas:
                if d.state.finished:
                    states[d.state.request_id] = d.state
                    pending.discard(d.state.request_id)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A bad prompt or parameter raises ValueError before anything runs (requests queued by this
        call are withdrawn), and the engine stays ready for the next call.
        """
        prompt_list = _normalise_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or one per prompt")
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                groups.append(self._add(prompt, params, added))
        except Exception:
            for rid in added:
                self.core.abort_request(rid)
                self.processor.abort(rid)
            raise
        states: dict[str, RequestState] = {}
        self._run(set(itertools.chain.from_iterable(groups)), states)
        return [self._to_output(group, states) for group in groups]

    @staticmethod
    def _to_output(group: list[str], states: dict[str, RequestState]) -> RequestOutput:
        first = states[group[0]]
        completions = [
            CompletionOutput(
                index=i,
                text=s.text,
                token_ids=s.token_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
            )
            for i, s in enumerate(states[rid] for rid in group)
        ]
        return RequestOutput(
            request_id=group[0].split("-")[0],
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
        )
