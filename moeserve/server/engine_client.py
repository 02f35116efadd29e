"""The front end's side of the engine: spawns the engine process, sends requests, routes outputs.

Runs the OutputProcessor (detokenisation, stop strings) as vLLM v1 does in its front end; a stop
string found here finishes the request in the core with reason "stop".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.output_processor import OutputProcessor, RequestDelta
from moeserve.engine.tokenizer import Tokenizer
from moeserve.server.config import ServerConfig
from moeserve.server.engine_process import run_engine_process
from moeserve.server.errors import APIError, EngineDeadError
from moeserve.server.messages import (
    AbortRequests,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineStats,
    Heartbeat,
    Ready,
    Shutdown,
    StartupFailed,
    StepOutputs,
    encode,
    frontend_decoder,
)
from moeserve.server.metrics import ServerMetrics
from moeserve.server.request_group import Prompt, RequestGroup

logger = logging.getLogger("moeserve.server")

# How often the front end looks at the engine process while no message arrives.
POLL_MS = 250
# How long a Shutdown may take before the engine process is killed.
ENGINE_EXIT_TIMEOUT_S = 10.0


def check_prompt(token_ids: list[int], params: SamplingParams, info: Ready) -> None:
    """The core's validation, done before anything is sent (ValueError names the problem)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    vocab = info.vocab_size
    bad = [t for t in token_ids if t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (valid ids: 0..{vocab - 1})")
    n, limit = len(token_ids), info.max_model_len
    if n >= limit:
        raise ValueError(f"the prompt has {n} tokens, but the context length is {limit}: no room is left to generate")
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise ValueError(
            f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
            f"tokens, more than the context length ({limit})"
        )


@dataclass
class _Child:
    """One engine request of a group, with its timing for the latency metrics."""

    group: RequestGroup
    index: int
    arrival: float
    last_token: float | None = None


class EngineClient:
    """Owns the engine process and the ZeroMQ sockets to it; all methods run on the event loop."""

    def __init__(self, config: ServerConfig, tokenizer: Tokenizer | None, metrics: ServerMetrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.processor = OutputProcessor(tokenizer)
        self.children: dict[str, _Child] = {}
        self.info: Ready | None = None
        self.state = "starting"  # -> ready -> draining -> stopped, or -> dead
        self.failure: str | None = None
        self.stats = EngineStats()
        self.last_message = time.monotonic()
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._dir = tempfile.mkdtemp(prefix="moeserve-")
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.bind(f"ipc://{self._dir}/input")
        self._pull = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/output")
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._on_ready: Callable[[Ready], None] = lambda info: None
        self._on_dead: Callable[[str], None] = lambda message: None

    # -- process ---------------------------------------------------------------------------------

    def start(self, on_ready: Callable[[Ready], None], on_dead: Callable[[str], None]) -> None:
        """Spawn the engine process and route its messages in the background (call in the loop)."""
        ctx = multiprocessing.get_context("spawn")
        args = (
            self.config.engine,
            f"ipc://{self._dir}/input",
            f"ipc://{self._dir}/output",
            os.getpid(),
            self.config.heartbeat_interval,
            self.config.log_level,
        )
        self.proc = ctx.Process(target=run_engine_process, args=args, name="moeserve-engine")
        self.proc.start()
        self._on_ready, self._on_dead = on_ready, on_dead
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        """Route engine messages until the engine is stopped or dies."""
        assert self.proc is not None
        deadline = time.monotonic() + self.config.engine_start_timeout
        while self.state not in ("stopped", "dead"):
            if await self._pull.poll(POLL_MS):
                self._handle(frontend_decoder.decode(await self._pull.recv()))
            elif self.state == "stopped":
                break
            elif not self.proc.is_alive():
                self._fail(f"the engine process exited unexpectedly (exit code {self.proc.exitcode})")
            elif self.state == "starting" and time.monotonic() > deadline:
                self._fail(f"the engine did not start within {self.config.engine_start_timeout:g}s")

    def _handle(self, msg) -> None:
        self.last_message = time.monotonic()
        if isinstance(msg, StepOutputs):
            self.stats = msg.stats
            self.metrics.observe_engine(msg.stats, msg.decode_batch_size)
            self._route(msg)
        elif isinstance(msg, Heartbeat):
            self.stats = msg.stats
            self.metrics.observe_engine(msg.stats)
        elif isinstance(msg, AddFailed):
            self._add_failed(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            if self.state == "starting":
                self.state = "ready"
            self._on_ready(msg)
        elif isinstance(msg, StartupFailed):
            self._fail(f"the engine failed to start: {msg.message}")
        elif isinstance(msg, EngineFailed):
            self._fail(f"the engine failed: {msg.message}")

    def _fail(self, message: str) -> None:
        """The engine is gone: every waiting request gets an error, new ones get 503."""
        self.state, self.failure = "dead", message
        for cid, child in list(self.children.items()):
            child.group.fail(cid, EngineDeadError(message))
        self.children.clear()
        self._idle.set()
        self._on_dead(message)

    async def shutdown(self) -> None:
        """Stop the engine process (politely when it is up) and release the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        was_up = self.state in ("ready", "draining")
        if self.state != "dead":
            self.state = "stopped"
        proc, loop = self.proc, asyncio.get_running_loop()
        if proc is not None and proc.is_alive():
            if was_up:
                self._send(Shutdown())
                await loop.run_in_executor(None, proc.join, ENGINE_EXIT_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                await loop.run_in_executor(None, proc.join, ENGINE_EXIT_TIMEOUT_S)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pull.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests --------------------------------------------------------------------------------

    def check_available(self) -> None:
        """Raise a 503 unless the engine takes requests now."""
        if self.state == "ready":
            return
        reasons = {
            "starting": ("the engine is still starting", "starting"),
            "draining": ("the server is shutting down", "shutting_down"),
            "stopped": ("the server is shutting down", "shutting_down"),
        }
        message, code = reasons.get(self.state, (f"the engine is not running: {self.failure}", "engine_dead"))
        raise APIError(503, message, code=code)

    def add(self, prompts: list[Prompt], params: SamplingParams, arrival: float) -> RequestGroup:
        """Queue n completions of every prompt as one group (ValueError for bad input)."""
        self.check_available()
        assert self.info is not None
        for prompt in prompts:
            check_prompt(prompt.token_ids, params, self.info)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        base, n = str(next(self._ids)), params.n
        group = RequestGroup(self, base, prompts, n)
        for p, prompt in enumerate(prompts):
            for i in range(n):
                # Like LLM.generate: child i samples with seed + i, so n > 1 gives n different texts.
                child = params if n == 1 else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                cid = f"{base}-{p}-{i}"
                self.processor.add_request(cid, prompt.text, prompt.token_ids, child)
                self.children[cid] = _Child(group, p * n + i, arrival)
                group.unfinished.add(cid)
                self._send(AddRequest(cid, prompt.token_ids, child))
        self._idle.clear()
        return group

    def abort(self, child_ids: list[str], reason: str = "abort") -> None:
        """Finish these requests now (client gone, shutdown) and free their KV in the engine."""
        live = [cid for cid in child_ids if cid in self.children]
        if not live:
            return
        self._send(AbortRequests(live, reason))
        now = time.monotonic()
        for cid in live:
            state = self.processor.abort(cid)
            if state is None:
                self.children.pop(cid, None)
                continue
            # Held-back text (a stop string that never completed) is real output: flush it.
            text = state.text[state.sent_text_len :]
            state.sent_text_len = len(state.text)
            self._deliver(cid, RequestDelta(state, [], text, []), now)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, wait up to `timeout` for running ones, abort the rest; return how many."""
        if self.state in ("starting", "ready"):
            self.state = "draining"
        if self.children:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)
        left = list(self.children)
        self.abort(left)
        return len(left)

    def health(self) -> tuple[int, dict]:
        """Status code and body for /health."""
        silent = time.monotonic() - self.last_message
        status = self.state
        if status == "ready" and silent > self.config.health_stall_timeout:
            status = "stalled"
        body = {
            "status": "ok" if status == "ready" else status,
            "num_requests_running": self.stats.num_running,
            "num_requests_waiting": self.stats.num_waiting,
            "engine_steps": self.stats.num_steps,
            "seconds_since_engine_message": round(silent, 3),
        }
        if self.failure:
            body["error"] = self.failure
        return (200 if status == "ready" else 503), body

    # -- routing ---------------------------------------------------------------------------------

    def _send(self, msg) -> None:
        try:
            self._push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            # No engine connected (it died or never started): the watcher reports that.
            logger.warning("could not send %s to the engine", type(msg).__name__)

    def _route(self, msg: StepOutputs) -> None:
        deltas, stopped = self.processor.process(msg.outputs)
        if stopped:
            self._send(AbortRequests(stopped, "stop"))
        now = time.monotonic()
        for delta in deltas:
            self._deliver(delta.state.request_id, delta, now)

    def _deliver(self, cid: str, delta: RequestDelta, now: float) -> None:
        child = self.children.get(cid)
        if child is None:
            return
        if delta.new_token_ids:
            if child.last_token is None:
                self.metrics.ttft.observe(now - child.arrival)
            else:
                # Several tokens in one step (speculative decoding) share the step's gap.
                gap = (now - child.last_token) / len(delta.new_token_ids)
                for _ in delta.new_token_ids:
                    self.metrics.itl.observe(gap)
            child.last_token = now
        child.group.put(cid, child.index, delta)
        if delta.state.finished:
            del self.children[cid]
            self.metrics.request_finished(delta.state.finish_reason, now - child.arrival)
            if not self.children:
                self._idle.set()

    def _add_failed(self, msg: AddFailed) -> None:
        child = self.children.pop(msg.request_id, None)
        self.processor.abort(msg.request_id)
        if child is not None:
            child.group.fail(msg.request_id, ValueError(msg.message))
        if not self.children:
            self._idle.set()

    def release(self, group: RequestGroup) -> None:
        """Abort whatever of `group` still runs (the client is done with it)."""
        self.abort(sorted(group.unfinished))
