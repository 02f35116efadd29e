"""The engine core: validates requests, runs scheduler + model runner steps, reports tokens."""

from __future__ import annotations

import gc
import json
import logging
import random
import time
from pathlib import Path

import torch

from moeserve.cache.kv_manager import KVCacheManager
from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig
from moeserve.core.batch import ScheduleBatch
from moeserve.core.outputs import EngineCoreOutput
from moeserve.core.request import Request
from moeserve.core.sampling_params import SamplingParams
from moeserve.executor.kv_planner import MemoryPlan, plan_kv_pool
from moeserve.executor.model_runner import ModelRunner, StepHandle
from moeserve.models.loader import load_model
from moeserve.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    """The requested device, or CUDA when present, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' means bfloat16 on GPU and float32 on CPU (where bfloat16 matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' stores the cache in the model's dtype; fp8_e4m3 halves it (bf16 -> 1 byte)."""
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    if kv_cache_dtype == "bf16":
        return torch.bfloat16
    return model_dtype


def _eos_token_ids(path: Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    gen = path / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(value, int):
            return (value,)
        if value:
            return tuple(value)
    return config.eos_token_ids


class EngineCore:
    """Token-level engine: requests in, per-step new tokens out. No text, no HTTP."""

    def __init__(self, engine: EngineConfig, model_config: ModelConfig | None = None) -> None:
        start = time.monotonic()
        self.engine = engine
        path = Path(engine.model)
        self.model_config = model_config or ModelConfig.from_path(path)
        self.device = resolve_device(engine.device)
        self.dtype = resolve_dtype(engine.dtype, self.device)
        model = load_model(self.model_config, path, self.dtype, self.device, engine.load_format, engine.seed)
        self.eos_token_ids = _eos_token_ids(path, self.model_config) if path.is_dir() else self.model_config.eos_token_ids
        self.runner = ModelRunner(model, engine, self.device)
        self.max_model_len, self.memory = self._plan_memory()
        self.kv = KVCacheManager(self.memory.num_pages, engine.page_size, engine.enable_prefix_caching)
        self.scheduler = Scheduler(engine, self.kv)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(engine.seed)
        self._in_flight: tuple[ScheduleBatch, StepHandle] | None = None
        self._unfrozen_requests = False  # added since the last freeze
        # Everything built so far lives as long as the engine: frozen, a full collection no
        # longer walks it (on the V2-Lite GPU engine a gen-2 pass took 150 ms, once mid-benchmark).
        gc.collect()
        gc.freeze()
        self.startup_seconds = time.monotonic() - start
        self._log_startup()

    def _plan_memory(self) -> tuple[int, MemoryPlan]:
        """Size the KV pool (profiling activations on GPU), allocate it, capture the CUDA graphs."""
        engine, runner = self.engine, self.runner
        max_len = engine.max_model_len or self.model_config.max_position_embeddings
        kv_dtype = resolve_kv_dtype(engine.kv_cache_dtype, self.dtype)
        activation = graph_reserve = 0
        if self.device.type == "cuda":
            activation = runner.profile_activation_peak(engine.max_num_batched_tokens)
            # The graphs' shared pool holds one decode step's activations at the largest size
            # (a decode token needs far less than a prefill token: a quarter of the prefill peak
            # is generous) plus the graphs' bf16 logits buffer and a sampler's float32 copy of it.
            max_bs = engine.cuda_graph_max_bs or min(engine.max_num_seqs, 512)
            logits = max_bs * self.model_config.vocab_size * 6
            graph_reserve = 0 if engine.disable_cuda_graph else activation // 4 + logits
        element_bytes = torch.empty((), dtype=kv_dtype).element_size()
        plan = plan_kv_pool(
            self.model_config, engine, runner.num_layers, element_bytes, self.device, max_len, activation, graph_reserve
        )
        capacity = plan.num_pages * engine.page_size
        if capacity < max_len:
            logger.warning("KV pool holds %d tokens, less than max_model_len %d: capping it", capacity, max_len)
            max_len = capacity
        runner.allocate_kv(plan.num_pages, kv_dtype)
        if self.device.type == "cuda":
            runner.warm_up_moe()
            runner.warm_up_prefix_attention(max_len)
        if self.device.type == "cuda" and not engine.disable_cuda_graph:
            runner.capture_cuda_graphs(max_len)
        return max_len, plan

    def _log_startup(self) -> None:
        d = self.describe()
        logger.info(
            "engine ready in %.1f s: %s %s on %s; weights %.2f GiB, activation peak %.2f GiB, "
            "graphs %d (%.0f MiB), KV pool %.2f GiB = %d tokens (%s), max %d requests at context %d",
            self.startup_seconds, self.model_config.model_type, self.dtype, self.device, d["weights_gib"],
            d["activation_peak_gib"], d["cuda_graphs"], d["cuda_graph_mib"], d["kv_pool_gib"], d["kv_tokens"],
            d["kv_cache_dtype"], d["max_requests_at_context"], self.max_model_len,
        )  # fmt: skip

    def describe(self) -> dict:
        """The engine's configuration and memory plan, for logs and benchmark records."""
        graphs, prefill, kv = self.runner.graphs, self.runner.prefill_graphs, self.runner.kv_cache
        assert kv is not None
        weights = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        tokens = self.memory.num_pages * self.engine.page_size
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(kv.dtype).removeprefix("torch."),
            "page_size": self.engine.page_size,
            "weights_gib": round(weights / 2**30, 3),
            "activation_peak_gib": round(self.memory.activation_bytes / 2**30, 3),
            "kv_pool_gib": round(kv.nbytes / 2**30, 3),
            "kv_tokens": tokens,
            "max_requests_at_context": tokens // self.max_model_len,
            "cuda_graphs": len(graphs.graphs) if graphs else 0,
            "cuda_graph_sizes": graphs.sizes if graphs else [],
            "cuda_graph_mib": round(graphs.memory_bytes / 2**20, 1) if graphs else 0.0,
            "cuda_graph_capture_s": round(graphs.capture_seconds, 2) if graphs else 0.0,
            "prefill_graph_tokens": prefill.sizes if prefill else [],
            "prefill_graph_mib": round(prefill.memory_bytes / 2**20, 1) if prefill else 0.0,
            "startup_s": round(self.startup_seconds, 2),
            "max_model_len": self.max_model_len,
        }

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError naming what is wrong; return the request's total token limit."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (valid ids: 0..{vocab - 1})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the context length is {self.max_model_len}: "
                "no room is left to generate"
            )
        if params.max_tokens is None:
            return self.max_model_len
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                f"tokens, more than the context length ({self.max_model_len})"
            )
        return n + params.max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request; a bad one raises ValueError and changes nothing."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        total = self.validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=total,
            sampling_seed=seed,
        )
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        self._unfrozen_requests = True
        return req

    def abort_request(self, request_id: str, reason: str = "abort") -> EngineCoreOutput | None:
        """Stop a request wherever it is and free its pages; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, reason)
        return EngineCoreOutput(request_id, [], finish_reason=reason, num_prompt_tokens=len(req.prompt_token_ids))

    def has_unfinished_requests(self) -> bool:
        """Whether a step would do anything."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def score(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32, CPU) at every prompt position, e.g. for evaluation.

        Runs on its own fresh pages, bypassing and not filling the prefix cache.
        """
        self.validate(prompt_token_ids, SamplingParams(max_tokens=1))
        req = Request("score", list(prompt_token_ids), SamplingParams(max_tokens=1))
        if not self.kv.allocate(req, len(prompt_token_ids)):
            raise RuntimeError("not enough free KV pages to score this prompt now")
        try:
            return self.runner.score(req).cpu()
        finally:
            self.kv.release(req)  # nothing is marked computed, so nothing is cached

    def _freeze_new_requests(self) -> None:
        """Move requests added since the last call (and all else alive) out of the collector's walks.

        A request's token lists are containers of thousands of items that live as long as it
        does; while they sit in the collected generations every older-generation pass walks them
        (H200, b256 latency run: about 20 ms of gen-1 passes and a 24 ms gen-2 pass, which stalled
        a decode step). The frozen are still freed by reference counting; cyclic garbage alive
        at a freeze would be kept for good, so a collection over what is not yet frozen (what
        came since the last freeze) goes first. Called after a launch, so the GPU hides it.
        """
        if self._unfrozen_requests:
            gc.collect()
            gc.freeze()
            self._unfrozen_requests = False

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; report every request's new token.

        With overlap (the default) this launches step N + 1 before collecting step N, so the
        CPU's scheduling and bookkeeping hide behind the GPU's work and outputs arrive one step
        late; without it each step is launched and collected in turn.
        """
        overlap = not self.engine.disable_overlap_schedule
        batch = self.scheduler.schedule(self.engine.idle_step_tokens if overlap and self._in_flight is None else None)
        handle = self.runner.launch(batch) if batch.items else None
        if handle is not None:
            self.scheduler.stats.cuda_graph_padded_tokens += self.runner.last_padded_tokens
        self._freeze_new_requests()
        if not overlap:
            outputs = self.scheduler.update(batch, self.runner.collect(handle)) if handle else []
        else:
            outputs = []
            if self._in_flight is not None:
                done_batch, done_handle = self._in_flight
                outputs = self.scheduler.update(done_batch, self.runner.collect(done_handle))
            self._in_flight = (batch, handle) if handle else None
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs
