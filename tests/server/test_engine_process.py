"""The engine process alone, over its ZeroMQ wire: ready, add, reject, abort, shutdown, bad start."""

from __future__ import annotations

import multiprocessing
import os
import time

import msgspec
import pytest
import zmq

from moeserve.config.engine_config import EngineConfig
from moeserve.core.sampling_params import SamplingParams
from moeserve.server.engine_process import run_engine_process
from moeserve.server.messages import (
    AbortRequests,
    AddFailed,
    AddRequest,
    Heartbeat,
    Ready,
    Shutdown,
    StartupFailed,
    StepOutputs,
    encode,
    frontend_decoder,
)


class Wire:
    """The front end's two sockets, plus the spawned engine process."""

    def __init__(self, tmp_path, model: str) -> None:
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(f"ipc://{tmp_path}/in")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp_path}/out")
        config = EngineConfig(model=model, device="cpu", dtype="float32", max_num_seqs=8)
        args = (config, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", os.getpid(), 0.2, "warning")
        self.proc = multiprocessing.get_context("spawn").Process(target=run_engine_process, args=args)
        self.proc.start()

    def send(self, msg) -> None:
        self.push.send(encode(msg))

    def recv(self, kind: type, until=lambda msg: True, timeout: float = 60):
        """The next message of type `kind` for which `until` holds (others are skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(100):
                msg = frontend_decoder.decode(self.pull.recv())
                if isinstance(msg, kind) and until(msg):
                    return msg
        raise TimeoutError(f"no such {kind.__name__} within {timeout}s")

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


@pytest.fixture
def wire(tmp_path, v3_checkpoint):
    w = Wire(tmp_path, str(v3_checkpoint))
    yield w
    w.close()


def test_engine_process_serves_rejects_aborts_and_shuts_down(wire):
    ready = wire.recv(Ready)
    assert ready.max_model_len == 512 and ready.vocab_size == 384 and ready.kv_capacity_tokens > 0
    # A request the core rejects comes back as AddFailed, naming the problem; the engine goes on.
    wire.send(AddRequest("bad", [1, 2, 999], SamplingParams(max_tokens=4)))
    failed = wire.recv(AddFailed)
    assert failed.request_id == "bad" and "vocabulary" in failed.message
    wire.send(AddRequest("ok", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    tokens = []
    while True:
        step = wire.recv(StepOutputs)
        tokens += [t for o in step.outputs for t in o.new_token_ids]
        if any(o.finished for o in step.outputs):
            break
    assert len(tokens) == 3
    wire.send(AddRequest("long", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)))
    wire.recv(StepOutputs, lambda m: m.stats.kv_used_pages > 0 and m.stats.num_running == 1)
    wire.send(AbortRequests(["long"], "abort"))
    idle = wire.recv(Heartbeat, lambda m: m.stats.num_running == 0 and m.stats.kv_used_pages == 0, timeout=30)
    assert idle.stats.generation_tokens < 3 + 400
    wire.send(Shutdown())
    wire.proc.join(30)
    assert wire.proc.exitcode == 0


def test_engine_process_reports_a_failed_start(tmp_path):
    w = Wire(tmp_path, str(tmp_path / "missing"))
    try:
        failed = w.recv(StartupFailed)
        assert "config.json" in failed.message
        w.proc.join(30)
        assert w.proc.exitcode == 1
    finally:
        w.close()


def test_sampling_params_cross_the_wire_whole():
    params = SamplingParams(n=1, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["a"], stop_token_ids=[7],
                            max_tokens=9, min_tokens=2, ignore_eos=True, logprobs=2)  # fmt: skip
    decoded = msgspec.msgpack.decode(encode(AddRequest("r", [1], params)), type=AddRequest)
    assert decoded.params == params and decoded.params.stop_strings == ("a",)
