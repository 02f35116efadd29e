"""The engine process: owns EngineCore, runs the step loop, talks to the front end over ZeroMQ.

It ignores SIGINT/SIGTERM: the front end decides when to stop (a drain must not lose the engine
under it to a signal sent to the whole process group), and it exits by itself when the front end
is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from moeserve.config.engine_config import EngineConfig
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
    engine_decoder,
)

logger = logging.getLogger("moeserve.engine_process")

# Time for the last messages to leave the socket when the process exits.
LINGER_MS = 5000


def run_engine_process(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, heartbeat_interval: float, log_level: str
) -> None:
    """Entry point of the spawned engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, LINGER_MS)
    out.connect(output_addr)
    code = 1
    try:
        core = _start_core(config, out)
        if core is not None:
            code = EngineLoop(core, inp, out, parent_pid, heartbeat_interval).run()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
    sys.exit(code)


def _start_core(config: EngineConfig, out: zmq.Socket):
    """Build EngineCore and send Ready, or send StartupFailed and return None."""
    from moeserve.engine.engine import EngineCore

    try:
        core = EngineCore(config)
    except Exception as e:  # any failure to start is reported, not just the expected ones
        if not isinstance(e, ValueError | FileNotFoundError):
            logger.error("engine start-up failed:\n%s", traceback.format_exc())
        out.send(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        return None
    ready = Ready(
        pid=os.getpid(),
        max_model_len=core.max_model_len,
        vocab_size=core.model_config.vocab_size,
        kv_capacity_tokens=core.kv.num_tokens,
        num_kv_pages=core.kv.num_pages,
        page_size=core.kv.page_size,
        device=str(core.device),
        dtype=str(core.dtype).removeprefix("torch."),
        model_type=core.model_config.model_type,
    )
    out.send(encode(ready))
    return core


class EngineLoop:
    """Input messages in, one engine step at a time, outputs and stats out."""

    def __init__(self, core, inp: zmq.Socket, out: zmq.Socket, parent_pid: int, heartbeat_interval: float) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.heartbeat_interval = heartbeat_interval
        self.last_sent = 0.0
        self.num_steps = 0

    def run(self) -> int:
        """Serve until Shutdown (0), or until the front end dies or a step fails (1)."""
        while True:
            busy = self.core.has_unfinished_requests()
            timeout_ms = 0 if busy else int(self.heartbeat_interval * 1000)
            if self.inp.poll(timeout_ms):
                if not self._drain_input():
                    return 0
                if busy and not self.core.has_unfinished_requests():
                    self._went_idle()
            if os.getppid() != self.parent_pid:
                logger.error("the front end process is gone: exiting")
                return 1
            if self.core.has_unfinished_requests():
                if not self._step():
                    return 1
            elif time.monotonic() - self.last_sent >= self.heartbeat_interval:
                self._send(Heartbeat(self._stats()))

    def _drain_input(self) -> bool:
        """Handle every queued message; False once Shutdown arrived."""
        while True:
            try:
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = engine_decoder.decode(raw)
            except msgspec.ValidationError as e:
                logger.error("dropped a malformed message from the front end: %s", e)
                continue
            if isinstance(msg, AddRequest):
                try:
                    self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
                except ValueError as e:
                    self._send(AddFailed(msg.request_id, str(e)))
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self.core.abort_request(rid, msg.reason)
                # Stats right away: a client that went away should see its KV freed in /metrics.
                self._send(Heartbeat(self._stats()))
            elif isinstance(msg, Shutdown):
                for rid in list(self.core.requests):
                    self.core.abort_request(rid, "abort")
                return False

    def _step(self) -> bool:
        try:
            outputs = self.core.step()
        except Exception:
            message = traceback.format_exc()
            logger.error("engine step failed:\n%s", message)
            self._send(EngineFailed(message.strip().splitlines()[-1]))
            return False
        self.num_steps += 1
        decode_bs = self.core.scheduler.stats.last_decode_batch_size
        self._send(StepOutputs(outputs, decode_bs, self._stats()))
        if not self.core.has_unfinished_requests():
            self._went_idle()
        return True

    def _went_idle(self) -> None:
        # With no request holding pages the pool must add up; say so loudly if it does not.
        try:
            self.core.kv.check_idle_accounting()
        except AssertionError as e:
            logger.error("%s", e)

    def _send(self, msg) -> None:
        self.out.send(encode(msg))
        self.last_sent = time.monotonic()

    def _stats(self) -> EngineStats:
        s = self.core.scheduler.stats
        return EngineStats(
            num_running=len(self.core.scheduler.running),
            num_waiting=len(self.core.scheduler.waiting),
            kv_used_pages=self.core.kv.used_pages,
            kv_num_pages=self.core.kv.num_pages,
            num_retractions=s.num_retractions,
            cuda_graph_padded_tokens=s.cuda_graph_padded_tokens,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_steps=self.num_steps,
        )
