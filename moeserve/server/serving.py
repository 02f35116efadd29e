"""From a parsed request to a response: prompts, the engine group, streamed or collected output."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.output_processor import RequestDelta, RequestState
from moeserve.engine.tokenizer import Tokenizer
from moeserve.server.chat import ChatTemplate
from moeserve.server.engine_client import EngineClient
from moeserve.server.errors import bad_request, from_value_error
from moeserve.server.protocol import ChatCompletionRequest, ChatMessage
from moeserve.server.request_group import Prompt, RequestGroup
from moeserve.server.responses import ResponseContext, full_response
from moeserve.server.streaming import stream_response

# What proxies (nginx) must not buffer for streaming to stay streaming.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def completion_prompts(tokenizer: Tokenizer | None, prompt: str | list) -> list[Prompt]:
    """A completions `prompt` (text, token ids, or a list of either) as Prompts."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("the prompt is empty", "prompt")
    prompts = []
    for item in items:
        if not isinstance(item, str):
            prompts.append(Prompt(None, list(item)))
            continue
        if not item:
            raise bad_request("the prompt is empty", "prompt")
        if tokenizer is None:
            raise bad_request("this model has no tokenizer.json: send prompts as token ids", "prompt")
        prompts.append(Prompt(item, tokenizer.encode(item)))
    return prompts


def render_chat(
    tokenizer: Tokenizer | None,
    template: ChatTemplate | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    extra: dict | None = None,
) -> Prompt:
    """A conversation rendered with the checkpoint's chat template, then tokenized."""
    if tokenizer is None or template is None:
        raise bad_request("this model has no chat template (tokenizer_config.json has no chat_template)", "messages")
    try:
        text = template.render([m.to_template() for m in messages], add_generation_prompt, continue_final_message, extra)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    # The template writes the special tokens it wants (BOS included), as transformers assumes.
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer: Tokenizer | None, template: ChatTemplate | None, req: ChatCompletionRequest) -> Prompt:
    """The prompt of a chat completion request."""
    return render_chat(
        tokenizer, template, req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
    )


async def collect(group: RequestGroup, item: tuple[int, RequestDelta] | None) -> dict[int, RequestState]:
    """Every choice's final state (for a non-streamed response)."""
    states: dict[int, RequestState] = {}
    while item is not None:
        index, delta = item
        if delta.state.finished:
            states[index] = delta.state
        item = await group.next()
    return states


async def respond(
    client: EngineClient,
    request: Request,
    ctx: ResponseContext,
    prompts: list[Prompt],
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
    arrival: float | None = None,
) -> Response:
    """Run the request in the engine and answer it, streamed (SSE) or as one JSON body."""
    try:
        group = client.add(prompts, params, arrival or time.monotonic())
    except ValueError as e:
        raise from_value_error(e) from None
    group.watch_disconnect(request.receive)
    try:
        # Wait for the first output before answering: a request the core rejects still gets a 400.
        first = await group.next()
    except ValueError as e:
        group.close()
        raise from_value_error(e) from None
    except BaseException:
        group.close()
        raise
    if stream:
        body = stream_response(ctx, group, first, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        states = await collect(group, first)
    except ValueError as e:
        raise from_value_error(e) from None
    finally:
        group.close()
    return JSONResponse(full_response(ctx, group, states))
