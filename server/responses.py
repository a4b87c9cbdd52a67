"""The OpenAI-compatible response models: chat completions and their stream chunks, legacy completions, usage,
logprobs, /v1/models, /tokenize and /detokenize; and the server-sent-event framing of a stream, with the templates
that render a stream's plain content chunks (most of its events) without building models."""
from __future__ import annotations

import math
import time
import uuid
from json.encoder import encode_basestring as encode_json_string  # json.dumps(s, ensure_ascii=False) for a str
from typing import Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, Field, model_serializer

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; what a fully masked token reports instead

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finite_logprob(x: float) -> float:
    return float(x) if math.isfinite(x) else LOGPROB_FLOOR


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> "Usage":
        details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[ChatCompletionTokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[Union[int, str]] = None  # vLLM extension: the matched stop string or token id


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class _OmitNone(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallFunctionDelta(_OmitNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(_OmitNone):
    """A streamed tool call: the first delta of a call has its id, type and name; later ones add arguments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: ToolCallFunctionDelta


class ChatCompletionDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # A delta names only what changed: {"role":"assistant","content":""}, {"content":"x"}, or {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatCompletionDelta = Field(default_factory=ChatCompletionDelta)
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[Union[int, str]] = None


class Completion(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"  # OpenAI streams legacy completions under this name
    created: int
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ddtree"
    root: Optional[str] = None
    max_model_len: Optional[int] = None
    speculative_config: Optional[dict[str, Any]] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: Optional[int] = None


class DetokenizeResponse(BaseModel):
    prompt: str


SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One server-sent event; a mid-stream error is sse_event(ErrorResponse) followed by SSE_DONE."""
    return f"data: {payload.model_dump_json()}\n\n"


class EventTemplate:
    """An SSE event rendered once by pydantic with marker values in its holes, as a %-format filled per event: the
    same bytes as sse_event() of the model with the values in place of the markers (a string hole takes the json
    module's encoding of the string, which escapes as pydantic's serializer does: tests/server/
    test_stream_templates.py), at a fraction of the cost of building and serializing the models for every token."""

    def __init__(self, payload: BaseModel, markers: tuple[Union[str, int], ...]):
        rest, parts = sse_event(payload), []
        for marker in markers:  # in the order they occur; each must occur exactly once
            mark = encode_json_string(marker) if isinstance(marker, str) else str(marker)
            if rest.count(mark) != 1:
                raise ValueError(f"template marker {mark} found {rest.count(mark)} times in {rest!r}")
            head, rest = rest.split(mark)
            parts += [head.replace("%", "%%"), "%s" if isinstance(marker, str) else "%d"]
        parts.append(rest.replace("%", "%%"))
        self.pattern = "".join(parts)  # %s: a string hole's JSON encoding; %d: an integer hole


def unused_markers(rendered: str, count: int) -> tuple[str, list[int]]:
    """A string and `count` integers whose renderings occur nowhere in `rendered` (the event with zeros and an
    empty string in its holes), so that each occurs, rendered with them, exactly at its hole."""
    text = "\x00text\x00"
    while encode_json_string(text) in rendered:
        text += "\x00"
    numbers, n = [], 9_000_000_001
    while len(numbers) < count:
        if str(n) not in rendered:
            numbers.append(n)
        n += 1
    return text, numbers


class ContentEvents:
    """A stream's plain content chunk (one choice's new text; no logprobs, no finish reason), with or without the
    usage so far, as `make(index, text, usage)` renders it."""

    def __init__(self, make: Callable[[int, str, Optional[Usage]], BaseModel]):
        text, (index, prompt, completion, total) = unused_markers(sse_event(make(0, "", Usage())), 4)
        self._bare = EventTemplate(make(index, text, None), (index, text)).pattern
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)
        self._with_usage = EventTemplate(make(index, text, usage), (index, text, prompt, completion, total)).pattern

    def event(self, index: int, text: str, usage: Optional[tuple[int, int]] = None) -> str:
        """usage: (prompt tokens, completion tokens so far), or None for a chunk without usage."""
        if usage is None:
            return self._bare % (index, encode_json_string(text))
        return self._with_usage % (index, encode_json_string(text), usage[0], usage[1], usage[0] + usage[1])
