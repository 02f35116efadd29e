"""Typed messages between the front end and the engine process (msgspec over ZeroMQ).

The engine's own dataclasses (SamplingParams, EngineCoreOutput) travel as they are: msgspec
encodes dataclasses and, decoding, runs their __post_init__ validation again.
"""

from __future__ import annotations

import msgspec

from moeserve.core.outputs import EngineCoreOutput
from moeserve.core.sampling_params import SamplingParams

# -- front end -> engine ----------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    """Queue one (child) request in the core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True):
    """Finish these requests with `reason` and free their KV pages."""

    request_ids: list[str]
    reason: str = "abort"


class Shutdown(msgspec.Struct, tag=True):
    """Abort whatever still runs and exit (the front end has already drained)."""


# -- engine -> front end ----------------------------------------------------------------------


class EngineStats(msgspec.Struct):
    """A snapshot of the scheduler and KV pool; the counters are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_pages: int = 0
    kv_num_pages: int = 0
    num_retractions: int = 0
    cuda_graph_padded_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_steps: int = 0


class Ready(msgspec.Struct, tag=True):
    """The engine loaded its model; what the front end needs to validate requests."""

    pid: int
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    num_kv_pages: int
    page_size: int
    device: str
    dtype: str
    model_type: str


class StartupFailed(msgspec.Struct, tag=True):
    """The engine could not start (bad checkpoint, out of memory, ...)."""

    message: str


class StepOutputs(msgspec.Struct, tag=True):
    """What one engine step produced, with the stats after it."""

    outputs: list[EngineCoreOutput]
    decode_batch_size: int
    stats: EngineStats


class Heartbeat(msgspec.Struct, tag=True):
    """Sent while idle (and after handling input) so the front end sees the engine is alive."""

    stats: EngineStats


class AddFailed(msgspec.Struct, tag=True):
    """EngineCore.add_request rejected a request (the front end turns this into HTTP 400)."""

    request_id: str
    message: str


class EngineFailed(msgspec.Struct, tag=True):
    """The engine hit an unexpected error and is exiting."""

    message: str


ToEngine = AddRequest | AbortRequests | Shutdown
FromEngine = Ready | StartupFailed | StepOutputs | Heartbeat | AddFailed | EngineFailed

encode = msgspec.msgpack.encode
engine_decoder = msgspec.msgpack.Decoder(ToEngine)
frontend_decoder = msgspec.msgpack.Decoder(FromEngine)
