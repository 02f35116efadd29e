"""The two batch levels: what the scheduler holds and what the forward pass reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moeserve.core.request import Request

if TYPE_CHECKING:
    from moeserve.cache.kv_cache import MLAKVCache


@dataclass
class ScheduledRequest:
    """A request and how many of its uncomputed tokens this step computes."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens and so samples one more."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class ScheduleBatch:
    """The scheduler's view of one step: which requests run and how far each advances."""

    items: list[ScheduledRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, over all requests."""
        return sum(item.num_new_tokens for item in self.items)

    @property
    def num_decodes(self) -> int:
        """Requests advancing by one token that continues a cached sequence."""
        return sum(1 for it in self.items if it.num_new_tokens == 1 and it.request.num_computed_tokens > 0)


@dataclass
class ForwardBatch:
    """Flat tensors for one forward pass.

    Rows (requests) are ordered decodes first: the first `num_decodes` rows compute one token
    each against their cached prefix; the rest are extends (prefill chunks) whose tokens follow.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot each new token writes
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: list[int]  # per row, cached + new tokens
    query_lens: list[int]  # per row, new tokens
    num_decodes: int
    extend_use_mha: bool  # prefill form for the extend rows (see layers.attention)
    logits_indices: torch.Tensor  # [N] token index of each row that samples
    kv_cache: MLAKVCache

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decode rows (one each)."""
        return self.num_decodes

    @property
    def extend_prefix_lens(self) -> list[int]:
        """Cached tokens before each extend row's new ones."""
        rows = range(self.num_decodes, len(self.seq_lens))
        return [self.seq_lens[i] - self.query_lens[i] for i in rows]
