"""Decode CUDA graphs: captured once per batch size, replayed with padding to the next size.

Every decode step of a captured size replays one graph (all layers, the lm_head included), so the
CPU launches one graph instead of hundreds of kernels. Graphs share one memory pool and read
static input buffers that the graph itself fills from one packed copy of the step's inputs;
padded rows write to the scratch KV page and attend only to it, so padding never touches a real
request's cache.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from moeserve import ops
from moeserve.cache.kv_cache import MLAKVCache
from moeserve.core.batch import ForwardBatch
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


def capture_graphs(
    sizes: list[int],
    forward: Callable[[int], None],
    pool: tuple,
    stream: torch.cuda.Stream,
    before_each: Callable[[int], None] | None = None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], int, float]:
    """Capture `forward(size)` for every size, largest first, into one shared pool.

    Each size runs once uncaptured first (kernels compile, allocations settle). -> (graphs by
    size, bytes the reserved memory grew, seconds taken).
    """
    start = time.perf_counter()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    for size in reversed(sizes):
        if before_each is not None:
            before_each(size)
            torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            forward(size)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            forward(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, torch.cuda.memory_reserved() - before, time.perf_counter() - start


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
        # Staged ids may be placeholders for last step's samples; unpacking resolves them.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_pages_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        # A step's inputs travel packed (see ops.unpack_decode_inputs): one copy in, unpacked by
        # the graph's first kernel. Two pinned host buffers alternate, so the host never rewrites
        # one the previous step's copy may still be reading.
        self.staged = torch.zeros(1 + 4 * n + n * max_pages_per_seq, dtype=torch.int32, device=device)
        self.host_staged = [torch.zeros(self.staged.shape, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.turn = 0
        # One output buffer for every graph: per-graph outputs would cost sum(sizes) x vocab floats
        # (26 GB for the +8 set up to 1024), while temporaries are shared through the pool anyway.
        # Logits stay in the lm_head's dtype, as the eager path has them before widening: greedy
        # rows never need float32, whose copy cost 76 us a step at batch 256 (H200).
        self.logits = torch.empty(n, model.config.vocab_size, dtype=model.lm_head.weight.dtype, device=device)
        self.greedy_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    def _batch(self, bs: int, seq_lens: list[int] | None = None) -> ForwardBatch:
        """The size-`bs` graph's batch; host lists for its real rows (`seq_lens`), else all `bs`."""
        n = bs if seq_lens is None else len(seq_lens)
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            block_table=self.block_table[:bs],
            seq_lens_t=self.seq_lens[:bs],
            seq_lens=[1] * bs if seq_lens is None else seq_lens,
            query_lens=[1] * n,
            num_decodes=n,
            logits_indices=self.rows[:bs],
            kv_cache=self.kv_cache,
        )

    def _forward(self, bs: int) -> None:
        fb = self._batch(bs)
        ops.unpack_decode_inputs(self.staged, bs, fb.input_ids, fb.positions, fb.slot_mapping, fb.seq_lens_t,
                                 fb.block_table, self.future_tokens)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        # In place; a GEMV at one row and the skinny GEMM up to 16 (ops.linear), cuBLAS past them.
        ops.linear(hidden, self.model.lm_head.weight, out=self.logits[:bs])
        # Greedy rows need nothing more: their tokens come out of the graph with the logits.
        ops.argmax_rows(self.logits[:bs], out=self.greedy_ids[:bs])

    @torch.inference_mode()
    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        """Capture every size into the shared pool, largest first so the biggest sizes it."""
        empty = np.zeros(0, dtype=np.int64)

        def stage_padding(bs: int) -> None:  # a valid all-padding input for the warm-up and capture
            self.stage(bs, empty, empty, empty, np.zeros((0, 1), dtype=np.int32), empty)

        self.graphs, self.memory_bytes, self.capture_seconds = capture_graphs(
            self.sizes, self._forward, pool, stream, before_each=stage_padding
        )
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

    def stage(
        self, bs: int, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, table: np.ndarray,
        seq_lens: np.ndarray,
    ) -> ForwardBatch:
        """Pack a decode step's inputs for the size-`bs` graph and start their copy to the device.

        Padded rows: token 0 at position 0 with length 1, written to and read from the scratch
        page only. -> the graph's batch, its real rows described for the host.
        """
        n, width = len(ids), table.shape[1]
        host = self.host_staged[self.turn]
        self.turn ^= 1
        buf = host.numpy()
        buf[0] = width
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, 0), (seq_lens, 1))):
            part = buf[1 + k * bs : 1 + (k + 1) * bs]
            part[:n] = values
            part[n:] = pad
        size = 1 + 4 * bs + bs * width
        rows = buf[1 + 4 * bs : size].reshape(bs, width)
        rows[:n] = table
        rows[n:] = 0
        self.staged[:size].copy_(host[:size], non_blocking=True)
        fb = self._batch(bs, seq_lens.tolist())
        fb.graph_size = bs
        return fb

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab] in the model's dtype, their row argmax [n]) for a batch `stage` returned."""
        assert fb.graph_size is not None
        n = fb.num_decodes
        self.graphs[fb.graph_size].replay()
        return self.logits[:n], self.greedy_ids[:n]
