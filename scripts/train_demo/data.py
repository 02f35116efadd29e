"""Corpus to tokens: train the byte-level BPE tokenizer, encode documents, sample batches."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer, so runs of indentation become tokens), BOS prepended."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # With the template in tokenizer.json, transformers' tokenizer adds BOS the way moeserve's does.
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json naming BOS/EOS/PAD and a chat template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(
    tok: Tokenizer, docs: Iterator[str], chunk_bytes: int = 8 << 20, deadline: float | None = None
) -> tuple[np.ndarray, int]:
    """One token stream `<bos> doc <eos> <bos> doc <eos> ...` (int32) and the bytes it covers.

    Encodes in parallel chunks; stops early once `deadline` (time.monotonic()) has passed.
    """
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    parts: list[np.ndarray] = []
    total_bytes = 0
    batch: list[str] = []
    batch_bytes = 0

    def flush() -> None:
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            parts.append(np.asarray([bos, *enc.ids, eos], dtype=np.int32))

    for doc in docs:
        batch.append(doc)
        batch_bytes += len(doc.encode())
        if batch_bytes >= chunk_bytes:
            flush()
            total_bytes += batch_bytes
            batch, batch_bytes = [], 0
            if deadline is not None and time.monotonic() > deadline:
                break
    if batch:
        flush()
        total_bytes += batch_bytes
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream, total_bytes


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from a token stream kept on the device."""

    def __init__(
        self, stream: np.ndarray, seq_len: int, batch_size: int, device: torch.device, seed: int
    ) -> None:
        if len(stream) <= seq_len + 1:
            raise ValueError(f"the corpus has {len(stream)} tokens, too few for windows of {seq_len + 1}")
        self.data = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.offsets = torch.arange(seq_len + 1, device=device)
        self.batch_size = batch_size
        self.high = len(stream) - seq_len - 1
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def next(self) -> torch.Tensor:
        """[batch_size, seq_len + 1] token ids."""
        starts = torch.randint(
            0, self.high, (self.batch_size, 1), generator=self.gen, device=self.data.device
        )
        return self.data[starts + self.offsets]


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int, device: torch.device) -> torch.Tensor:
    """Consecutive, non-overlapping windows [N, seq_len + 1] of a held-out stream."""
    n = min(max_windows, len(stream) // (seq_len + 1))
    return torch.from_numpy(stream[: n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1).to(device)
