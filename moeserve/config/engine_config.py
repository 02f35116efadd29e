"""Engine knobs: where the model lives, how the KV pool is sized, how steps are batched."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
CUDA_GRAPH_PRESETS = ("x2", "+64", "+8")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model's own config.json."""

    model: str
    dtype: str = "auto"
    device: str | None = None
    load_format: str = "auto"
    seed: int = 0
    # KV cache
    page_size: int = 16
    num_kv_pages: int | None = None
    kv_cache_memory_gb: float | None = None
    mem_fraction_static: float = 0.85
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Decode CUDA graphs: a preset (x2, +64, +8) or comma-separated batch sizes, cut at the max.
    cuda_graph_bs: str = "x2"
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    # Prefill CUDA graphs: token counts (comma-separated, "" for none) at which a step of one
    # fresh prompt replays a graph, padded up; they cut host launch time out of short prompts' TTFT.
    cuda_graph_prefill_tokens: str = "64,128,256,512,1024"
    # Prepare step N + 1 on the CPU while step N runs on the GPU.
    disable_overlap_schedule: bool = False
    # Batching
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 8192
    # With overlap, a step launched while the GPU has nothing in flight (a burst reaching an idle
    # engine) takes at most this many tokens: the GPU starts on it while the host prepares the
    # next, larger step, instead of waiting out the host's preparation of a whole large step
    # (H200, b256 x 1,024-token prompts in 131,072-token steps: 5.39 -> 5.38 s a run).
    idle_step_tokens: int = 16384
    # Off (SGLang's default): a step with prompt work to do runs only that, and decodes wait for
    # it. On (vLLM's policy): decodes share steps with prefill chunks. Off measured faster on one
    # H200 for every burst workload (b256 11,472 vs 11,197 tok/s; offline 1024x 20,652 vs
    # 20,353), since decodes riding along lengthen the prefill phase that every request waits out.
    enable_mixed_chunk: bool = False
    # Prefill attention form: absorbed (MLA) while sum(extend * (extend + prefix)) stays below
    # this, decompressed (MHA) above it. Seed 002's rule; see moeserve.layers.attention.
    mha_threshold: int = 16384
    # Admission reserves this fraction of each running request's remaining max_tokens; it decays
    # towards the minimum while things go well and resets after a retraction (SGLang's scheme).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}"),
            (
                self.cuda_graph_bs in CUDA_GRAPH_PRESETS or all(p.strip().isdigit() for p in self.cuda_graph_bs.split(",")),
                f"cuda_graph_bs must be one of {CUDA_GRAPH_PRESETS} or a comma-separated list of batch sizes",
            ),
            (
                all(p.strip().isdigit() and int(p) > 0 for p in self.cuda_graph_prefill_tokens.split(",") if p.strip()),
                "cuda_graph_prefill_tokens must be a comma-separated list of positive token counts",
            ),
            (self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1"),
            (self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (
                self.kv_cache_dtype != "fp8_e4m3" or self.page_size % 2 == 0,
                "an fp8_e4m3 KV cache stores its slots in pairs: page_size must be even",
            ),
            (self.num_kv_pages is None or self.num_kv_pages >= 1, "num_kv_pages must be >= 1"),
            (0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static must be in (0, 1)"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.idle_step_tokens >= 1, "idle_step_tokens must be >= 1"),
            (self.chunked_prefill_size >= 0, "chunked_prefill_size must be >= 0 (0 disables chunking)"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0, "bad new_token_ratio"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def chunked_prefill(self) -> bool:
        """Whether long prompts are split across steps."""
        return self.chunked_prefill_size > 0
