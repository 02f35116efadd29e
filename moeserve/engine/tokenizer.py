"""A checkpoint's tokenizer (tokenizer.json + tokenizer_config.json) via the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode prompts, decode outputs, and stream text without splitting UTF-8 characters."""

    def __init__(self, path: Path) -> None:
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.chat_template: str | None = self.config.get("chat_template")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer in a checkpoint folder, or None when it has no tokenizer.json."""
        path = Path(path)
        return cls(path) if (path / "tokenizer.json").is_file() else None

    def _special_id(self, key: str) -> int | None:
        text = _token_text(self.config.get(key))
        return self._tok.token_to_id(text) if text else None

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`, with BOS when the checkpoint asks for it."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for a list of token ids."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A decoder that turns tokens into text one at a time."""
        return IncrementalDecoder(self._tok, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary entry of a token (for logprob displays)."""
        return self._tok.id_to_token(token_id) or ""


class IncrementalDecoder:
    """Appends tokens and returns only the new, complete text (never half a UTF-8 character)."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Text newly completed by `token_id` (may be empty)."""
        return self._stream.step(self._tok, token_id) or ""
