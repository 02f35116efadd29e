"""Runs one engine step on the model: build the ForwardBatch, forward (graph or eager), sample."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.cache.kv_cache import MLAKVCache
from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig
from moeserve.core.batch import ForwardBatch, ScheduleBatch, ScheduledRequest
from moeserve.core.outputs import SampledToken
from moeserve.core.request import Request
from moeserve.executor.cuda_graph import CudaGraphRunner, batch_size_set
from moeserve.executor.prefill_graph import PrefillGraphRunner, prefill_graph_sizes
from moeserve.executor.sampling_io import ban_stop_tokens, sampling_batch, unpack
from moeserve.layers.attention import use_mha_for_extend
from moeserve.layers.moe import MoE
from moeserve.layers.sampler import SamplerOutput, sample
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.ops.reference.decode_inputs import resolve_placeholders

logger = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step: its sampling rows and the (possibly still copying) sampler output."""

    rows: list[ScheduledRequest]
    output: SamplerOutput | None


class ModelRunner:
    """Owns the model weights, the KV storage and the decode graphs on one device.

    Lifecycle: construct (weights loaded), `profile_activation_peak` (GPU), `allocate_kv`,
    `warm_up_moe`, `warm_up_prefix_attention` and `capture_cuda_graphs` (GPU), then `execute` every step.
    """

    def __init__(self, model: DeepseekForCausalLM, engine: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.engine = engine
        self.device = device
        self.page_size = engine.page_size
        self.dtype = next(model.parameters()).dtype
        self.num_layers = self.config.num_hidden_layers + len(model.mtp)
        self.kv_cache: MLAKVCache | None = None
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        self.last_padded_tokens = 0
        # Two alternating buffers of sampled tokens, read by the following step's inputs.
        self.future_tokens = torch.zeros(2, engine.max_num_seqs, dtype=torch.int64, device=device)
        # Sampled tokens go to the host from a side stream, reading them from the future-token
        # buffer, so the next step's input copy and graph do not queue behind that copy (about
        # 6 us a decode step on an H200); the event says when a parity's row may be rewritten.
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._host_copied: list[torch.cuda.Event | None] = [None, None]

    def allocate_kv(self, num_pages: int, kv_dtype: torch.dtype, kv_scale: float = 1.0) -> None:
        """Create the paged latent cache."""
        self.kv_cache = MLAKVCache(
            self.config, self.num_layers, num_pages, self.page_size, kv_dtype, self.device, kv_scale
        )

    @torch.inference_mode()
    def profile_activation_peak(self, num_tokens: int) -> int:
        """Peak bytes a prefill step of `num_tokens` allocates beyond the weights (GPU only).

        Runs the heavier prefill form (MHA) on a throwaway one-page cache; every token writes the
        scratch slot, which is all a memory measurement needs.
        """
        saved, self.kv_cache = self.kv_cache, MLAKVCache(
            self.config, self.num_layers, 1, self.page_size, self.dtype, self.device
        )
        # Weight copies built on first use stay for good: built first, they count once, as
        # weights, not again as part of the activation peak (0.3 GB on V2-Lite).
        self.model.build_weight_copies()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._forward_scratch(0, num_tokens, use_mha=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = saved
        torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def warm_up_moe(self) -> None:
        """Compile every fused-MoE variant a step of up to max_num_batched_tokens can pick (GPU)."""
        moe = next((m for m in self.model.modules() if isinstance(m, MoE)), None)
        if moe is None or self.device.type != "cuda":
            return
        start = time.perf_counter()
        sizes = moe.warm_up(self.engine.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        logger.info("fused MoE warmed up at %d token counts in %.1f s", len(sizes), time.perf_counter() - start)

    @torch.inference_mode()
    def warm_up_prefix_attention(self, max_model_len: int) -> None:
        """Compile the kernels of prefill over a cached prefix, and of eager decode-size steps,
        before serving (GPU only).

        A first prefix-cache hit or second prefill chunk would otherwise compile them inside a
        request, a 0.3-2 s stall. Covered: the absorbed form with its keys split (a short tail
        after a long prefix) and unsplit (a long chunk), and the MHA form over a gathered prefix.
        """
        assert self.kv_cache is not None
        prefix = min(1024, max_model_len // 2)
        wide = max(1, min(4096, self.engine.max_num_batched_tokens, max_model_len - prefix))
        # 16 new tokens also compile the decode-size dense projections (the skinny GEMM serves 3-16
        # rows with one variant), which decode graphs of up to 8 rows may not have needed.
        for new, use_mha in ((1, False), (min(16, wide), False), (wide, False), (min(64, wide), True)):
            self._forward_scratch(prefix, new, use_mha)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # else graph capture's memory reading nets out these blocks

    def _forward_scratch(self, prefix: int, new: int, use_mha: bool) -> None:
        """One extend row of `new` tokens after `prefix` cached ones, all on the scratch page."""
        assert self.kv_cache is not None
        total = prefix + new
        zeros = np.zeros(new, dtype=np.int64)
        pages = -(-total // self.page_size)
        fb = ForwardBatch(
            input_ids=self._to_device(zeros),
            positions=self._to_device(np.arange(prefix, total)),
            slot_mapping=self._to_device(zeros),
            block_table=self._to_device(np.zeros((1, pages), dtype=np.int32)),
            seq_lens_t=self._int32([total]),
            seq_lens=[total],
            query_lens=[new],
            num_decodes=0,
            logits_indices=self._to_device(np.asarray([new - 1])),
            kv_cache=self.kv_cache,
            extend_use_mha=use_mha,
            extend_query_start_loc=self._int32([0, new]),
            extend_kv_start_loc=self._int32([0, total]),
            max_extend_len=new,
            max_extend_seq_len=total,
            extend_kv_total=total,
            extend_has_prefix=prefix > 0,
        )
        fb.extend_block_table, fb.extend_seq_lens_t = fb.block_table, fb.seq_lens_t
        self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb)[fb.logits_indices])

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs for the configured batch sizes, then the prefill graphs."""
        assert self.kv_cache is not None
        engine = self.engine
        max_bs = engine.cuda_graph_max_bs or min(engine.max_num_seqs, 512)
        sizes = batch_size_set(engine.cuda_graph_bs, max_bs)
        max_pages = -(-max_model_len // self.page_size)
        # One pool for every graph: only one replays at a time, all on the capture stream's order.
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.graphs = CudaGraphRunner(self.model, self.kv_cache, sizes, max_pages, self.device, self.future_tokens)
        self.graphs.capture(pool, stream)
        budget = min(engine.max_num_batched_tokens, engine.chunked_prefill_size or engine.max_num_batched_tokens)
        prefill_sizes = prefill_graph_sizes(engine.cuda_graph_prefill_tokens, min(budget, max_model_len))
        if prefill_sizes:
            self.prefill_graphs = PrefillGraphRunner(self.model, self.kv_cache, prefill_sizes, self.device)
            self.prefill_graphs.capture(pool, stream)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array to the device without making the CPU wait for queued GPU work.

        A copy from pageable memory blocks until the stream drains, which would serialise the
        overlap scheduler; going through pinned memory keeps it asynchronous.
        """
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _int32(self, values: list[int]) -> torch.Tensor:
        return self._to_device(np.asarray(values, dtype=np.int32))

    def _input_ids(self, ids: np.ndarray) -> torch.Tensor:
        """Token ids on the device, placeholders replaced by last step's samples."""
        tokens = self._to_device(ids)
        if (ids < 0).any():
            tokens = resolve_placeholders(tokens, self.future_tokens)
        return tokens

    def _graph_size(self, num_decodes: int, count: int, samples: np.ndarray) -> int | None:
        """The decode graph a batch replays: all rows decode and sample, and a size fits."""
        if self.graphs is None or num_decodes != count or not samples.all():
            return None
        return self.graphs.padded_size(count)

    @staticmethod
    def _token_ids(items: list[ScheduledRequest]) -> np.ndarray:
        """Each item's new tokens, without concatenating whole prompt and output lists."""
        ids: list[int] = []
        for it in items:
            req, s, n = it.request, it.start, it.num_new_tokens
            lp = len(req.prompt_token_ids)
            if s >= lp:
                ids.extend(req.output_token_ids[s - lp : s - lp + n])
            else:
                ids.extend(req.prompt_token_ids[s : s + n])
                if s + n > lp:
                    ids.extend(req.output_token_ids[: s + n - lp])
        return np.asarray(ids, dtype=np.int64)

    @staticmethod
    def _block_table(items: list[ScheduledRequest]) -> np.ndarray:
        lens = np.fromiter((len(it.request.page_table) for it in items), dtype=np.int64, count=len(items))
        table = np.zeros((len(items), int(lens.max())), dtype=np.int32)
        flat = itertools.chain.from_iterable(it.request.page_table for it in items)
        table[np.arange(table.shape[1])[None, :] < lens[:, None]] = np.fromiter(flat, dtype=np.int32, count=int(lens.sum()))
        return table

    def prepare(self, items: list[ScheduledRequest]) -> ForwardBatch:
        """Flatten scheduled requests (decodes first) into forward tensors, vectorised on the host."""
        assert self.kv_cache is not None
        count = len(items)
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=count)
        new = np.fromiter((it.num_new_tokens for it in items), dtype=np.int64, count=count)
        ends = np.cumsum(new)
        block_table = self._block_table(items)
        rows = np.repeat(np.arange(count), new)
        positions = np.repeat(starts, new) + np.arange(int(ends[-1])) - np.repeat(ends - new, new)
        slots = block_table[rows, positions // self.page_size].astype(np.int64) * self.page_size
        slots += positions % self.page_size
        samples = np.fromiter((it.samples for it in items), dtype=bool, count=count)
        query_lens = new.tolist()
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), count)
        seq_lens = starts + new
        graph_size = self._graph_size(num_decodes, count, samples)
        if graph_size is not None:
            assert self.graphs is not None  # raw ids: the graph resolves placeholders itself
            return self.graphs.stage(graph_size, self._token_ids(items), positions, slots, block_table, seq_lens)
        fb = ForwardBatch(
            input_ids=self._input_ids(self._token_ids(items)),
            positions=self._to_device(positions),
            slot_mapping=self._to_device(slots),
            block_table=self._to_device(block_table),
            seq_lens_t=self._to_device(seq_lens.astype(np.int32)),
            seq_lens=seq_lens.tolist(),
            query_lens=query_lens,
            num_decodes=num_decodes,
            logits_indices=self._to_device(ends[samples] - 1),
            kv_cache=self.kv_cache,
        )
        if num_decodes < count:
            self._describe_extends(fb, block_table, seq_lens)
            if self.prefill_graphs is not None:
                fb.prefill_graph_size = self.prefill_graphs.padded_size(fb, bool(samples.all()))
        return fb

    def _describe_extends(self, fb: ForwardBatch, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Fill the extend-row metadata and pick the prefill attention form."""
        nd = fb.num_decodes
        if nd:
            fb.extend_block_table = self._to_device(block_table[nd:])
            fb.extend_seq_lens_t = self._to_device(seq_lens[nd:].astype(np.int32))
        else:
            fb.extend_block_table, fb.extend_seq_lens_t = fb.block_table, fb.seq_lens_t
        ext_q = fb.query_lens[fb.num_decodes :]
        ext_s = fb.seq_lens[fb.num_decodes :]
        ext_p = [s - q for s, q in zip(ext_s, ext_q, strict=True)]
        fb.extend_use_mha = use_mha_for_extend(ext_q, ext_p, self.engine.mha_threshold)
        fb.extend_query_start_loc = self._int32([0, *np.cumsum(ext_q).tolist()])
        fb.extend_kv_start_loc = self._int32([0, *np.cumsum(ext_s).tolist()])
        fb.max_extend_len = max(ext_q)
        fb.max_extend_seq_len = max(ext_s)
        fb.extend_kv_total = int(sum(ext_s))
        fb.extend_has_prefix = any(ext_p)

    def _logits(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the sampling rows, their argmax when a decode graph computed it)."""
        if fb.graph_size is not None:
            assert self.graphs is not None
            self.last_padded_tokens = fb.graph_size - fb.num_decodes
            return self.graphs.replay(fb)
        if fb.prefill_graph_size is not None:
            assert self.prefill_graphs is not None
            self.last_padded_tokens = fb.prefill_graph_size - fb.query_lens[0]
            return self.prefill_graphs.replay(fb, fb.prefill_graph_size), None
        self.last_padded_tokens = 0
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden[fb.logits_indices]), None

    @torch.inference_mode()
    def score(self, req: Request) -> torch.Tensor:
        """Logits at every position of `req`'s tokens (its pages must already be allocated)."""
        fb = self.prepare([ScheduledRequest(req, req.num_tokens, start=0)])
        return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))

    @torch.inference_mode()
    def launch(self, batch: ScheduleBatch) -> StepHandle:
        """Enqueue one step's forward and sampling on the device; return without waiting.

        Sampled tokens also go to the step's future-token buffer, from which the next step's
        inputs are read, so the next step can be launched before this one is collected.
        """
        items = batch.items  # the scheduler orders decodes first
        fb = self.prepare(items)
        logits, greedy = self._logits(fb)
        rows = [it for it in items if it.samples]
        if not rows:
            return StepHandle(rows, None)
        if ban_stop_tokens(logits, rows):
            greedy = None  # the graph's argmax predates the bans
        out = sample(logits, sampling_batch(rows, self.config.vocab_size, self._to_device), greedy)
        # Sampling rows were numbered 0..N-1 in this order when the step was committed.
        future = self.future_tokens[batch.parity, : len(rows)]
        copied = self._host_copied[batch.parity]
        if copied is not None:  # the host copy two steps back read this row
            torch.cuda.current_stream(self.device).wait_event(copied)
        future.copy_(out.token_ids)
        out.token_ids = future
        host = out.to_host(self.copy_stream)
        self._host_copied[batch.parity] = host.ready
        return StepHandle(rows, host)

    def collect(self, handle: StepHandle) -> list[SampledToken]:
        """Wait for a launched step; return its sampled tokens."""
        if handle.output is None:
            return []
        handle.output.wait()
        return unpack(handle.rows, handle.output)

    def execute(self, batch: ScheduleBatch) -> list[SampledToken]:
        """Launch one step and wait for it."""
        return self.collect(self.launch(batch))
