"""Request bodies of the OpenAI API (the fields moeserve understands), as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; known fields moeserve cannot honour
(penalties, logit_bias, tools, echo, ...) are rejected with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from moeserve.core.sampling_params import SamplingParams
from moeserve.server.errors import bad_request

TokenIds = list[StrictInt]


class OpenAIModel(BaseModel):
    """Base of every request body."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    """`stream_options`: ask for a final usage chunk."""

    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Reject known fields that would change the output if moeserve ignored them."""
        if self.frequency_penalty:
            raise bad_request("frequency_penalty is not supported (only 0)", "frequency_penalty")
        if self.presence_penalty:
            raise bad_request("presence_penalty is not supported (only 0)", "presence_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (ValueError names a bad field)."""
        self.check_supported()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for each prompt of this request."""
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (leave it unset or equal to n)", "best_of")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ContentPart(OpenAIModel):
    """One part of a message's content; only text parts are understood."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    """One message of a conversation."""

    role: str
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it (content parts joined into one string)."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise bad_request(f"content parts of type {part.type!r} are not supported (only text)", "messages")
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for this conversation."""
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class TokenizeRequest(OpenAIModel):
    """POST /v1/tokenize: text, or a conversation rendered with the chat template."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    """POST /v1/detokenize."""

    model: str | None = None
    tokens: TokenIds


Endpoint = Literal["completions", "chat"]
