"""Runs one engine step on the model: build the ForwardBatch, forward, sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from moeserve.cache.kv_cache import MLAKVCache
from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig
from moeserve.core.batch import ForwardBatch, ScheduleBatch, ScheduledRequest
from moeserve.core.outputs import SampledToken
from moeserve.core.request import Request, TokenLogprobs
from moeserve.layers.attention import use_mha_for_extend
from moeserve.layers.sampler import SamplerOutput, SamplingBatch, sample
from moeserve.models.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights and the KV storage on one device."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        engine: EngineConfig,
        num_pages: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.engine = engine
        self.device = device
        self.page_size = engine.page_size
        dtype = next(model.parameters()).dtype
        num_layers = self.config.num_hidden_layers + len(model.mtp)
        self.kv_cache = MLAKVCache(self.config, num_layers, num_pages, self.page_size, dtype, device)
        logger.info("KV cache: %d pages of %d tokens, %.2f GiB", num_pages, self.page_size, self.kv_cache.nbytes / 2**30)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _int32(self, values: list[int]) -> torch.Tensor:
        return self._to_device(np.asarray(values, dtype=np.int32))

    def prepare(self, items: list[ScheduledRequest]) -> ForwardBatch:
        """Flatten scheduled requests (already ordered decodes first) into forward tensors."""
        ids, positions, slots, seq_lens, query_lens, logits_rows = [], [], [], [], [], []
        max_pages = max(len(it.request.page_table) for it in items)
        block_table = np.zeros((len(items), max_pages), dtype=np.int32)
        num_tokens = 0
        for row, it in enumerate(items):
            req, start, n = it.request, it.request.num_computed_tokens, it.num_new_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(req.page_table, dtype=np.int64)
            ids.append(np.asarray(req.all_token_ids[start : start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // self.page_size] * self.page_size + pos % self.page_size)
            block_table[row, : len(table)] = table
            seq_lens.append(start + n)
            query_lens.append(n)
            num_tokens += n
            if it.samples:
                logits_rows.append(num_tokens - 1)
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        fb = ForwardBatch(
            input_ids=self._to_device(np.concatenate(ids)),
            positions=self._to_device(np.concatenate(positions)),
            slot_mapping=self._to_device(np.concatenate(slots)),
            block_table=self._to_device(block_table),
            seq_lens_t=self._int32(seq_lens),
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=num_decodes,
            logits_indices=self._to_device(np.asarray(logits_rows, dtype=np.int64)),
            kv_cache=self.kv_cache,
        )
        if num_decodes < len(items):
            self._describe_extends(fb)
        return fb

    def _describe_extends(self, fb: ForwardBatch) -> None:
        """Fill the extend-row metadata and pick the prefill attention form."""
        ext_q = fb.query_lens[fb.num_decodes :]
        ext_s = fb.seq_lens[fb.num_decodes :]
        ext_p = [s - q for s, q in zip(ext_s, ext_q, strict=True)]
        fb.extend_use_mha = use_mha_for_extend(ext_q, ext_p, self.engine.mha_threshold)
        fb.extend_query_start_loc = self._int32([0, *np.cumsum(ext_q).tolist()])
        fb.extend_kv_start_loc = self._int32([0, *np.cumsum(ext_s).tolist()])
        fb.max_extend_len = max(ext_q)
        fb.max_extend_seq_len = max(ext_s)
        fb.extend_has_prefix = any(ext_p)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        vocab = self.config.vocab_size
        params = [r.sampling_params for r in reqs]
        wanted = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingBatch(
            temperature=tensor([0.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([r.sampling_seed for r in reqs], torch.int64),
            steps=tensor([len(r.output_token_ids) for r in reqs], torch.int64),
            all_greedy=all(p.greedy for p in params),
            needs_sorting=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            needs_min_p=any(not p.greedy and p.min_p > 0 for p in params),
            num_logprobs=max(wanted) if wanted else -1,
        )

    def _ban_stop_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Until min_tokens are out, EOS and stop tokens cannot be sampled (as in vLLM)."""
        for row, r in enumerate(reqs):
            p = r.sampling_params
            if len(r.output_token_ids) >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                logits[row, banned] = float("-inf")

    @staticmethod
    def _unpack(reqs: list[Request], out: SamplerOutput) -> list[SampledToken]:
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = []
        for i, (r, tok) in enumerate(zip(reqs, tokens, strict=True)):
            info = None
            n = r.sampling_params.logprobs
            if n is not None and lps is not None:
                top = tuple(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if top_ids else ()
                info = TokenLogprobs(tok, lps[i], top)
            result.append(SampledToken(r, tok, info))
        return result

    @torch.inference_mode()
    def score(self, req: Request) -> torch.Tensor:
        """Logits at every position of `req`'s tokens (its pages must already be allocated)."""
        fb = self.prepare([ScheduledRequest(req, req.num_tokens)])
        return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))

    @torch.inference_mode()
    def execute(self, batch: ScheduleBatch) -> list[SampledToken]:
        """Run one step; return the tokens sampled for requests that reached their end."""
        items = sorted(batch.items, key=lambda it: it.num_new_tokens != 1)
        fb = self.prepare(items)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        reqs = [it.request for it in items if it.samples]
        if not reqs:
            return []
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        self._ban_stop_tokens(logits, reqs)
        return self._unpack(reqs, sample(logits, self._sampling_batch(reqs)))
