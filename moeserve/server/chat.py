"""Chat templates from tokenizer_config.json, rendered with jinja2 the way transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise ValueError(message)


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content") or ""
    return value or ""


def _pick_template(raw: Any) -> str | None:
    """The template source; newer configs may hold a list of named templates."""
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return raw


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, tokenizer_config: dict[str, Any]) -> None:
        # Sandboxed like transformers: templates come with checkpoints, which are not always trusted.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        self.template = env.from_string(source)
        self.special = {
            key: _token_text(tokenizer_config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }

    @classmethod
    def from_tokenizer_config(cls, config: dict[str, Any]) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        source = _pick_template(config.get("chat_template"))
        return cls(source, config) if source else None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation; template errors raise ValueError."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        context = {**self.special, **(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            text = self.template.render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from None
        if continue_final_message:
            # Let the model carry on the last message: cut everything the template put after it.
            last = messages[-1].get("content") or ""
            index = text.rfind(last) if last else -1
            if index >= 0:
                text = text[: index + len(last)]
        return text
