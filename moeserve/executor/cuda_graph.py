"""Decode CUDA graphs: captured once per batch size, replayed with padding to the next size.

Every decode step of a captured size replays one graph (all layers, the lm_head included), so the
CPU launches one graph instead of hundreds of kernels. Graphs share one memory pool and read
static input buffers that each step refills; padded rows write to the scratch KV page and attend
only to it, so padding never touches a real request's cache.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from moeserve.cache.kv_cache import MLAKVCache
from moeserve.core.batch import ForwardBatch
from moeserve.executor.sampling_io import resolve_placeholders
from moeserve.layers.sampler import argmax_rows
from moeserve.models.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)


def batch_size_set(spec: str, max_bs: int) -> list[int]:
    """Sizes to capture: a preset (seed 003's x2, +64, +8) or an explicit list, cut at `max_bs`.

    All presets share 1, 2, 4, 8 and steps of 8 up to 128; above that x2 doubles to 2048, +64 steps
    by 64 and +8 by 8. `max_bs` itself is always included, so every batch up to it has a graph.
    """
    small = [1, 2, 4, 8, *range(16, 129, 8)]
    if spec == "x2":
        sizes = small + [256, 512, 1024, 2048]
    elif spec == "+64":
        sizes = small + list(range(192, 2049, 64))
    elif spec == "+8":
        sizes = small + list(range(136, 2049, 8))
    else:
        sizes = [int(p) for p in spec.split(",") if p.strip()]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    """Owns the static decode buffers and one captured graph per batch size."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_cache: MLAKVCache,
        sizes: list[int],
        max_pages_per_seq: int,
        device: torch.device,
        future_tokens: torch.Tensor,
    ) -> None:
        self.model = model
        self.future_tokens = future_tokens
        self.kv_cache = kv_cache
        self.sizes = sizes
        self.max_bs = sizes[-1]
        n = self.max_bs
        # Raw ids: placeholders for last step's samples are resolved inside the graph.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_pages_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        # One output buffer for every graph: per-graph outputs would cost sum(sizes) x vocab floats
        # (26 GB for the +8 set up to 1024), while temporaries are shared through the pool anyway.
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)
        self.greedy_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            block_table=self.block_table[:bs],
            seq_lens_t=self.seq_lens[:bs],
            seq_lens=[1] * bs,
            query_lens=[1] * bs,
            num_decodes=bs,
            logits_indices=self.rows[:bs],
            kv_cache=self.kv_cache,
        )

    def _forward(self, bs: int) -> None:
        fb = self._batch(bs)
        ids = resolve_placeholders(fb.input_ids, self.future_tokens)
        self.logits[:bs].copy_(self.model.lm_head(self.model(ids, fb.positions, fb)))
        # Greedy rows need nothing more: their tokens come out of the graph with the logits.
        self.greedy_ids[:bs].copy_(argmax_rows(self.logits[:bs]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the shared pool is sized by the biggest."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            with torch.cuda.stream(stream):
                self._forward(bs)  # compile kernels and settle allocations outside capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.memory_bytes = torch.cuda.memory_reserved() - before
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.0f MiB (%.1f MiB per graph)",
            len(self.graphs),
            self.sizes[0],
            self.max_bs,
            self.capture_seconds,
            self.memory_bytes / 2**20,
            self.memory_bytes / 2**20 / max(1, len(self.graphs)),
        )

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of `n` decodes replays, or None when it is too big."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab], their row argmax [n]) for an all-decode batch with raw input ids."""
        n = fb.num_decodes
        bs = self.padded_size(n)
        assert bs is not None and n == len(fb.seq_lens)
        width = fb.block_table.shape[1]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.slot_mapping[:n].copy_(fb.slot_mapping)
        self.block_table[:n, :width].copy_(fb.block_table)
        self.seq_lens[:n].copy_(fb.seq_lens_t)
        if bs > n:
            # Padded rows: token 0 at position 0, written to and read from the scratch page only.
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()
            self.block_table[n:bs, 0].zero_()
            self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[:n], self.greedy_ids[:n]
