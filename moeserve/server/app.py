"""The FastAPI application: OpenAI routes, health, metrics, tokenize/detokenize."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from moeserve import __version__
from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.tokenizer import Tokenizer
from moeserve.server.chat import ChatTemplate
from moeserve.server.config import ServerConfig
from moeserve.server.engine_client import EngineClient
from moeserve.server.errors import (
    APIError,
    bad_request,
    from_validation_error,
    from_value_error,
    install_handlers,
)
from moeserve.server.metrics import CONTENT_TYPE, ServerMetrics
from moeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from moeserve.server.responses import ResponseContext
from moeserve.server.serving import chat_prompt, completion_prompts, render_chat, respond


@dataclass
class ServerState:
    """What the routes share."""

    config: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    metrics: ServerMetrics
    started: int = 0


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes, 400 for another content type or bad JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body ({length} bytes) is larger than the limit ({limit} bytes)", code="request_too_large")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {content_type or 'none'!r}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than the limit ({limit} bytes)", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body against a request model (400 naming the field)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def check_model(config: ServerConfig, name: str | None) -> None:
    """404 unless `name` is the served model (or not given)."""
    if name is not None and name != config.model_name:
        message = f"the model {name!r} does not exist (served: {config.model_name!r})"
        raise APIError(404, message, param="model", code="model_not_found")


async def body_of(request: Request, config: ServerConfig, model: type[BaseModel]) -> Any:
    """The parsed, size-checked body of a /v1 request for the served model."""
    req = parse(model, await read_json(request, config.max_request_bytes))
    check_model(config, req.model)
    return req


def _api_key_check(config: ServerConfig):
    def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {config.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")

    return check_api_key


def _generation_routes(v1: APIRouter, state: ServerState) -> None:
    config, client = state.config, state.client

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": config.model_name, "object": "model", "created": state.started, "owned_by": "moeserve", "root": config.engine.model}
        if client.info is not None:
            card["max_model_len"] = client.info.max_model_len
        return {"object": "list", "data": [card]}

    async def _generation_request(request: Request, model: type[BaseModel]) -> tuple[Any, SamplingParams]:
        """Checks shared by both generation endpoints: engine up, body valid, parameters valid."""
        client.check_available()
        req = await body_of(request, config, model)
        try:
            return req, req.to_sampling_params()
        except ValueError as e:
            raise from_value_error(e) from None

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req, params = await _generation_request(request, CompletionRequest)
        prompts = completion_prompts(state.tokenizer, req.prompt)
        ctx = ResponseContext("completions", config.model_name, state.tokenizer, req.logprobs is not None)
        return await respond(client, request, ctx, prompts, params, req.stream, req.include_usage, arrival)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req, params = await _generation_request(request, ChatCompletionRequest)
        prompt = chat_prompt(state.tokenizer, state.chat_template, req)
        ctx = ResponseContext("chat", config.model_name, state.tokenizer, req.logprobs)
        return await respond(client, request, ctx, [prompt], params, req.stream, req.include_usage, arrival)


def _tokenizer_routes(v1: APIRouter, state: ServerState) -> None:
    config, tokenizer = state.config, state.tokenizer

    @v1.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req: TokenizeRequest = await body_of(request, config, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if req.messages is not None:
            ids = render_chat(tokenizer, state.chat_template, req.messages, req.add_generation_prompt).token_ids
        elif tokenizer is None:
            raise bad_request("this model has no tokenizer.json")
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        info = state.client.info
        return {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len if info else None}

    @v1.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = await body_of(request, config, DetokenizeRequest)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer.json")
        vocab = state.client.info.vocab_size if state.client.info else tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (valid ids: 0..{vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = state.client.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}


def build_app(state: ServerState) -> FastAPI:
    """The application: /v1 (behind --api-key when set), /health, /metrics; every error OpenAI-shaped."""
    app = FastAPI(title="moeserve", version=__version__)
    install_handlers(app)
    state.started = int(time.time())
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(state.config))])
    _generation_routes(v1, state)
    _tokenizer_routes(v1, state)
    app.include_router(v1)
    _ops_routes(app, state)
    return app
