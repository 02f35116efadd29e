"""Server-Sent Events: `data: {json}` chunks, an optional usage chunk, then `data: [DONE]`.

Text comes from the OutputProcessor's deltas, which never split a UTF-8 character and hold back
what could still become a stop string. An error after the stream started becomes an error chunk
followed by [DONE], as vLLM does.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec

from moeserve.engine.output_processor import RequestDelta, RequestState
from moeserve.server.errors import APIError, EngineDeadError, from_value_error
from moeserve.server.request_group import RequestGroup
from moeserve.server.responses import ResponseContext, usage

logger = logging.getLogger("moeserve.server")

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class ChunkBuilder:
    """Turns deltas into stream chunks, remembering per choice what was already sent."""

    def __init__(self, ctx: ResponseContext, include_usage: bool) -> None:
        self.ctx = ctx
        self.include_usage = include_usage
        self.role_sent: set[int] = set()
        self.text_offset: dict[int, int] = {}

    def _chunk(self, choice: dict) -> dict:
        chunk = self.ctx.envelope([choice], chunk=True)
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk but the last carries usage: null
        return chunk

    def chunks(self, index: int, delta: RequestDelta) -> list[dict]:
        """The chunks one delta of choice `index` produces (none when it adds nothing)."""
        ctx, state, out = self.ctx, delta.state, []
        if ctx.kind == "chat" and index not in self.role_sent:
            self.role_sent.add(index)
            role = {"role": "assistant", "content": ""}
            out.append(self._chunk({"index": index, "delta": role, "logprobs": None, "finish_reason": None}))
        if not (delta.new_text or delta.new_logprobs or state.finished):
            return out
        choice: dict = {"index": index}
        if ctx.kind == "chat":
            choice["delta"] = {"content": delta.new_text} if delta.new_text else {}
        else:
            choice["text"] = delta.new_text
        offset = self.text_offset.get(index, 0)
        choice["logprobs"] = ctx.logprobs(delta.new_logprobs, offset) if delta.new_logprobs else None
        self.text_offset[index] = offset + len(delta.new_text)
        choice["finish_reason"] = state.finish_reason if state.finished else None
        choice["stop_reason"] = state.stop_reason if state.finished else None
        out.append(self._chunk(choice))
        return out


def _error_chunk(e: Exception) -> bytes:
    if isinstance(e, APIError):
        return sse(e.body())
    if isinstance(e, ValueError):
        return sse(from_value_error(e).body())
    if isinstance(e, EngineDeadError):
        return sse(APIError(500, str(e), code="engine_dead").body())
    logger.exception("error while streaming")
    return sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())


async def stream_response(
    ctx: ResponseContext, group: RequestGroup, first: tuple[int, RequestDelta] | None, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion or chat completion."""
    builder = ChunkBuilder(ctx, include_usage)
    finished: dict[int, RequestState] = {}
    try:
        item = first
        while item is not None:
            index, delta = item
            for chunk in builder.chunks(index, delta):
                yield sse(chunk)
            if delta.state.finished:
                finished[index] = delta.state
            item = await group.next()
        if include_usage:
            yield sse({**ctx.envelope([], chunk=True), "usage": usage(group, finished)})
    except Exception as e:
        yield _error_chunk(e)
    finally:
        group.close()
    yield DONE
