"""The engine core: validates requests, runs scheduler + model runner steps, reports tokens."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from moeserve.cache.kv_manager import KVCacheManager
from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig
from moeserve.core.outputs import EngineCoreOutput
from moeserve.core.request import Request
from moeserve.core.sampling_params import SamplingParams
from moeserve.executor.kv_planner import plan_num_pages
from moeserve.executor.model_runner import ModelRunner
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
        max_len = engine.max_model_len or self.model_config.max_position_embeddings
        num_layers = self.model_config.num_hidden_layers + len(model.mtp)
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        num_pages = plan_num_pages(self.model_config, engine, num_layers, element_bytes, self.device, max_len)
        capacity = num_pages * engine.page_size
        if capacity < max_len:
            logger.warning("KV pool holds %d tokens, less than max_model_len %d: capping it", capacity, max_len)
            max_len = capacity
        self.max_model_len = max_len
        self.runner = ModelRunner(model, engine, num_pages, self.device)
        self.kv = KVCacheManager(num_pages, engine.page_size, engine.enable_prefix_caching)
        self.scheduler = Scheduler(engine, self.kv)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(engine.seed)
        logger.info(
            "engine ready in %.1fs: %s %s on %s, KV %d tokens, max_model_len %d",
            time.monotonic() - start,
            self.model_config.model_type,
            self.dtype,
            self.device,
            capacity,
            max_len,
        )

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
        return self.scheduler.has_unfinished()

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

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report every request's new token."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        sampled = self.runner.execute(batch)
        outputs = self.scheduler.update(batch, sampled)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs
