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
    """A request and the tokens this step computes for it: positions start .. start + n - 1.

    When the step reaches the end of the request's tokens it samples one more, which lands at
    `output_index` of the request's outputs (a placeholder until the step is collected).
    """

    request: Request
    num_new_tokens: int
    start: int = -1
    output_index: int = -1
    future_index: int = -1

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step samples a token for the request."""
        return self.output_index >= 0


@dataclass
class ScheduleBatch:
    """The scheduler's view of one step: which requests run and how far each advances."""

    items: list[ScheduledRequest] = field(default_factory=list)
    # Which of the two future-token buffers this step's samples go to (steps alternate).
    parity: int = 0

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
    Device tensors feed the kernels; the Python lists and ints describe the same batch to the
    host (launch sizes, reference ops) without a device sync.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot each new token writes
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens_t: torch.Tensor  # [B] int32, cached + new tokens per row
    seq_lens: list[int]
    query_lens: list[int]
    num_decodes: int
    logits_indices: torch.Tensor  # [N] token index of each row that samples
    kv_cache: MLAKVCache
    # Extend rows only (empty when the batch is all decodes):
    extend_use_mha: bool = False  # prefill form for the extend rows (see layers.attention)
    extend_query_start_loc: torch.Tensor | None = None  # [E + 1] int32, into the extend tokens
    extend_kv_start_loc: torch.Tensor | None = None  # [E + 1] int32, cumulative extend seq_lens
    max_extend_len: int = 0
    max_extend_seq_len: int = 0
    extend_kv_total: int | None = None  # sum of the extend rows' seq_lens when known on the host
    extend_has_prefix: bool = False
    # The extend rows' block table and seq_lens in their own allocations: slices past the decode
    # rows would start at unaligned addresses, for which Triton compiles other kernel variants.
    extend_block_table: torch.Tensor | None = None
    extend_seq_lens_t: torch.Tensor | None = None
    # The decode CUDA graph this batch replays (input_ids then hold raw placeholders), or None.
    graph_size: int | None = None
    # The prefill CUDA graph (padded token count) a one-prompt batch replays, or None.
    prefill_graph_size: int | None = None

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decode rows (one each)."""
        return self.num_decodes
