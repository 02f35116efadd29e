"""One API request as the engine sees it: n completions of each prompt, deltas in one queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moeserve.engine.output_processor import RequestDelta

if TYPE_CHECKING:
    from moeserve.server.engine_client import EngineClient

logger = logging.getLogger("moeserve.server")


@dataclass(frozen=True)
class Prompt:
    """A prompt as text (when given as text) and as token ids."""

    text: str | None
    token_ids: list[int]


class RequestGroup:
    """The child requests of one API request; choice index i is prompt i // n, sample i % n."""

    def __init__(self, client: EngineClient, request_id: str, prompts: list[Prompt], n: int) -> None:
        self.client = client
        self.request_id = request_id
        self.prompts = prompts
        self.n = n
        self.unfinished: set[str] = set()
        self._queue: asyncio.Queue[tuple[int, RequestDelta] | BaseException] = asyncio.Queue()
        self._watcher: asyncio.Task | None = None

    @property
    def num_choices(self) -> int:
        """How many choices the response carries."""
        return len(self.prompts) * self.n

    def put(self, cid: str, index: int, delta: RequestDelta) -> None:
        """Called by the client for each delta of a child."""
        self._queue.put_nowait((index, delta))
        if delta.state.finished:
            self.unfinished.discard(cid)

    def fail(self, cid: str, error: BaseException) -> None:
        """Called by the client when a child cannot go on (engine error or death)."""
        self.unfinished.discard(cid)
        self._queue.put_nowait(error)

    async def next(self) -> tuple[int, RequestDelta] | None:
        """The next (choice index, delta), or None once every child finished; raises a child's error."""
        if not self.unfinished and self._queue.empty():
            return None
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def watch_disconnect(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Abort the children when the HTTP client goes away (ASGI `receive` says http.disconnect)."""
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self.unfinished:
                    logger.info("client of request %s went away: aborting it", self.request_id)
                    self.client.release(self)
                return

    def close(self) -> None:
        """Stop watching and abort whatever still runs; call once the response is done."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self.unfinished:
            self.client.release(self)
