"""Prefill CUDA graphs: one fresh prompt's whole forward, captured at a few padded token counts.

A short prompt's prefill is bound by the host, not the GPU: a 1024-token V2-Lite prefill is about
320 kernel launches whose Python and driver cost exceeds the GPU's own work, so time to first
token tracked the CPU (22-48 ms between runs on one H200). Replaying a graph launches it once.

The graph covers a step of exactly one prompt with nothing cached, as the first step of a new
request at low load is. Its tokens are padded at the end of the same sequence: attention is
causal, so the real tokens never see the padding, which writes only the scratch KV page.
"""

from __future__ import annotations

import bisect
import logging

import torch

from moeserve.cache.kv_cache import MLAKVCache
from moeserve.core.batch import ForwardBatch
from moeserve.executor.cuda_graph import capture_graphs
from moeserve.models.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)


def prefill_graph_sizes(spec: str, max_tokens: int) -> list[int]:
    """Token counts to capture from a comma-separated list, cut at the step's token budget."""
    return sorted({int(p) for p in spec.split(",") if p.strip() and int(p) <= max_tokens})


class PrefillGraphRunner:
    """Static buffers and one captured single-prompt prefill graph per token count."""

    def __init__(
        self, model: DeepseekForCausalLM, kv_cache: MLAKVCache, sizes: list[int], device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sizes
        n = sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.last_index = torch.zeros(1, dtype=torch.int64, device=device)
        # Per size: [0, T] as query/key start offsets and [T] as the row's length.
        self.starts = {t: torch.tensor([0, t], dtype=torch.int32, device=device) for t in sizes}
        self.lengths = {t: torch.tensor([t], dtype=torch.int32, device=device) for t in sizes}
        self.no_pages = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self.logits = torch.empty(1, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    def _batch(self, t: int) -> ForwardBatch:
        fb = ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t],
            block_table=self.no_pages,
            seq_lens_t=self.lengths[t],
            seq_lens=[t],
            query_lens=[t],
            num_decodes=0,
            logits_indices=self.last_index,
            kv_cache=self.kv_cache,
            extend_use_mha=True,
            extend_query_start_loc=self.starts[t],
            extend_kv_start_loc=self.starts[t],
            max_extend_len=t,
            max_extend_seq_len=t,
            extend_kv_total=t,
        )
        fb.extend_block_table, fb.extend_seq_lens_t = fb.block_table, fb.seq_lens_t
        return fb

    def _forward(self, t: int) -> None:
        fb = self._batch(t)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        self.logits.copy_(self.model.compute_logits(hidden[self.last_index]))

    @torch.inference_mode()
    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        """Capture every size into the shared pool, largest first."""
        self.graphs, self.memory_bytes, self.capture_seconds = capture_graphs(self.sizes, self._forward, pool, stream)
        logger.info(
            "captured %d prefill CUDA graphs (%s tokens) in %.1f s, %.0f MiB",
            len(self.graphs), ",".join(map(str, self.sizes)), self.capture_seconds, self.memory_bytes / 2**20,
        )  # fmt: skip

    def padded_size(self, fb: ForwardBatch, samples: bool) -> int | None:
        """The graph a step replays: one sampling prompt row, nothing cached, and a size fits."""
        if len(fb.query_lens) != 1 or fb.num_decodes or not samples or fb.seq_lens[0] != fb.query_lens[0]:
            return None
        i = bisect.bisect_left(self.sizes, fb.query_lens[0])
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, fb: ForwardBatch, t: int) -> torch.Tensor:
        """Logits [1, vocab] of the prompt's last token; `fb.input_ids` must hold resolved ids."""
        n = fb.query_lens[0]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.slot_mapping[:n].copy_(fb.slot_mapping)
        self.last_index.copy_(fb.logits_indices)
        if t > n:
            # Padding: token 0 at position 0 into the scratch slot, after the real tokens.
            self.input_ids[n:t].zero_()
            self.positions[n:t].zero_()
            self.slot_mapping[n:t].zero_()
        self.graphs[t].replay()
        return self.logits
