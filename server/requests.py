"""The OpenAI-compatible request models of /v1/chat/completions and /v1/completions (/tokenize and /detokenize:
server/tokenize_requests.py).

Requests hand the engine plain sampling values through `to_sampling_kwargs()`, so the engine never imports server
code. Validation policy: wrong types are errors (no "5" -> 5 coercion); a JSON null means "not given"; fields we
know but do not implement (guided_*, beam search, ...) are rejected by name unless they carry their neutral value;
truly unknown fields are accepted and listed by `ignored_fields()` for the app to log. Failures are ProtocolErrors
(server/errors.py), which `parse_request` turns into a 400 envelope. Messages and tools: server/chat_messages.py.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)

from engine.grammar import (GrammarError, check_tool_schema, json_object_grammar, json_schema_grammar,
                            tool_calls_grammar)
from server.chat_messages import ChatMessage, NamedToolChoice, Tool
from server.errors import ApiError, ProtocolError, error_response

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16

Float = Annotated[float, Field(strict=True)]  # strict float still accepts JSON integers
TokenId = Annotated[int, Field(strict=True, ge=0)]


def _schema(replacement: dict[str, Any]):
    """json_schema_extra that documents what a field's validators accept beyond its type (in /openapi.json)."""
    def apply(schema: dict[str, Any]) -> None:
        title = schema.get("title")
        schema.clear()
        schema.update(replacement, **({"title": title} if title else {}))
    return apply


_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_STOP_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS}]}
_PROMPT_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _IDS,
                            {"type": "array", "minItems": 1, "items": _IDS}]}


def parse_request(model: type, body: Any):
    """JSON value -> request model; every failure becomes a 400 envelope (never FastAPI's 422)."""
    try:
        return model.model_validate(body)
    except ValueError as e:  # pydantic's ValidationError and our ProtocolError are ValueErrors
        raise ApiError(error_response(e)) from None


# Known fields we do not implement -> the value that means "feature not used" (accepted silently).
_NO_NEUTRAL = object()
_UNSUPPORTED_COMMON: dict[str, Any] = {
    "guided_json": _NO_NEUTRAL, "guided_regex": _NO_NEUTRAL,
    "guided_choice": _NO_NEUTRAL, "guided_grammar": _NO_NEUTRAL, "structured_outputs": _NO_NEUTRAL,
    "use_beam_search": False, "length_penalty": _NO_NEUTRAL, "prompt_logprobs": _NO_NEUTRAL,
    "logits_processors": _NO_NEUTRAL, "allowed_token_ids": _NO_NEUTRAL, "bad_words": [],
    "truncate_prompt_tokens": _NO_NEUTRAL, "spaces_between_special_tokens": True, "best_of": 1,
}
_UNSUPPORTED_CHAT: dict[str, Any] = {
    **_UNSUPPORTED_COMMON, "functions": _NO_NEUTRAL, "function_call": "none", "audio": _NO_NEUTRAL, "modalities": ["text"],
    "prediction": _NO_NEUTRAL, "web_search_options": _NO_NEUTRAL, "reasoning_effort": _NO_NEUTRAL,
    "echo": False, "continue_final_message": False, "add_generation_prompt": True, "chat_template": _NO_NEUTRAL,
    "documents": _NO_NEUTRAL, "store": False,
}
_UNSUPPORTED_COMPLETION: dict[str, Any] = {**_UNSUPPORTED_COMMON, "suffix": _NO_NEUTRAL}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage on every chunk (vLLM/SGLang extension)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    unsupported_fields: ClassVar[Mapping[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}  # null == not given (OpenAI fields are nullable)
        for name, neutral in cls.unsupported_fields.items():
            if name not in data:
                continue
            if data[name] != neutral and not (name == "best_of" and data[name] == data.get("n", 1)):
                raise ProtocolError(f"Unsupported parameter: '{name}' is not supported by this server.",
                                    loc=(name,), code="unsupported_parameter")
            del data[name]  # known and neutral: not an "ignored unknown field"
        return data

    def ignored_fields(self) -> list[str]:
        """Unknown fields that were accepted and ignored (for the app to log, as vLLM does)."""
        return sorted(self.model_extra or ())


class _SamplingRequest(_Request):
    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[Float] = Field(None, ge=0, le=2)
    top_p: Optional[Float] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)  # -1 and 0 both mean "disabled"
    min_p: Optional[Float] = Field(None, ge=0, le=1)
    seed: Optional[StrictInt] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: list[StrictStr] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                  json_schema_extra=_schema(_STOP_SCHEMA))
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    repetition_penalty: Optional[Float] = Field(None, gt=0)
    logit_bias: dict[StrictStr, Annotated[float, Field(strict=True, ge=-100, le=100)]] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})  # token ids
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)  # extension: EOS and stop tokens are masked until this many
    user: Optional[StrictStr] = None
    skip_special_tokens: StrictBool = True  # extension, applied by the detokenizer
    include_stop_str_in_output: StrictBool = False  # extension, applied by the stop-string matcher
    response_format: Optional[dict[StrictStr, Any]] = Field(  # text | json_object | json_schema (structured output)
        None, json_schema_extra=_schema({"oneOf": [
            {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                    "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}]}))

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Optional[dict]) -> Optional[dict]:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ProtocolError(f"Invalid 'response_format.type' {kind!r}: expected 'text', 'json_object' or "
                                f"'json_schema'.", loc=("type",))
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ProtocolError("'response_format.json_schema' must be an object with a string 'name' and "
                                    "a 'schema'.", loc=("json_schema",))
            if "schema" not in spec:
                raise ProtocolError("'response_format.json_schema.schema' is required.", loc=("json_schema",))
        return v

    _grammar: Optional[str] = PrivateAttr(None)

    @model_validator(mode="after")
    def _compile_grammar(self) -> "_SamplingRequest":
        self._grammar = self._make_grammar()
        return self

    def _make_grammar(self) -> Optional[str]:
        """The llguidance grammar response_format asks for, or None; a schema that does not compile is a 400
        naming the problem. Subclasses add tool calls."""
        v = self.response_format
        if v is None or v["type"] == "text":
            return None
        if v["type"] == "json_object":
            return json_object_grammar()
        try:
            return json_schema_grammar(v["json_schema"]["schema"], "Invalid JSON schema in 'response_format'")
        except GrammarError as e:
            raise ProtocolError(str(e), loc=("response_format", "json_schema", "schema")) from None

    def grammar(self) -> Optional[str]:
        """What the engine constrains the output to (compiled at validation)."""
        return self._grammar

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v
        if isinstance(v, list) and any(s == "" for s in v):
            raise ProtocolError("Stop strings must not be empty.")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        v = {str(k) if type(k) is int else k: x for k, x in v.items()}
        for key in v:
            if not isinstance(key, str) or not key.isascii() or not key.isdigit():
                raise ProtocolError(f"Invalid key {key!r} in 'logit_bias': keys must be token ids (integers "
                                    f"as strings); biasing by token text is not supported.")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("'stream_options' is only allowed when 'stream' is true.", loc=("stream_options",))
        limit = self._max_new_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ProtocolError(f"'min_tokens' ({self.min_tokens}) exceeds the maximum number of new tokens "
                                f"({limit}).", loc=("min_tokens",))
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _logprobs_count(self) -> Optional[int]:
        raise NotImplementedError

    def to_sampling_kwargs(self, defaults: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Plain-Python sampling fields for the engine's SamplingParams. `defaults` (e.g. from the model's
        generation_config) fills fields the client left out; OpenAI's defaults fill the rest.
        max_tokens None means "up to the context limit" (the app resolves it); top_k 0 means disabled;
        logprobs None means none, 0 means the sampled token only, k adds the top-k alternatives."""
        d = dict(defaults or {})

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        top_k = pick("top_k", 0)
        return {
            "n": self.n, "max_tokens": self._max_new_tokens() or d.get("max_tokens"),
            "temperature": float(pick("temperature", 1.0)), "top_p": float(pick("top_p", 1.0)),
            "top_k": 0 if top_k in (None, -1) else int(top_k), "min_p": float(pick("min_p", 0.0)),
            "seed": self.seed, "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "presence_penalty": float(self.presence_penalty), "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(pick("repetition_penalty", 1.0)),
            "logit_bias": {int(k): float(v) for k, v in self.logit_bias.items()},
            "logprobs": self._logprobs_count(), "grammar": self.grammar(),
        }

    def check_token_ids(self, vocab_size: int) -> None:
        """Reject token ids the model does not have (the schema alone cannot know the vocabulary)."""
        _check_ids(self.stop_token_ids, vocab_size, ("stop_token_ids",))
        _check_ids([int(k) for k in self.logit_bias], vocab_size, ("logit_bias",), per_item=False)


def _check_ids(ids: list[int], vocab_size: int, loc: tuple, per_item: bool = True) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ProtocolError(f"Token id {t} is out of range (vocabulary size {vocab_size}).",
                                loc=loc + (i,) if per_item else loc)


class ChatCompletionRequest(_SamplingRequest):
    unsupported_fields = _UNSUPPORTED_CHAT
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[StrictStr, Any] = Field(default_factory=dict)  # extension, e.g. enable_thinking
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: StrictBool = True

    @field_validator("messages")
    @classmethod
    def _nonempty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ProtocolError("'messages' must contain at least one message.", code="empty_array")
        return v

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("'top_logprobs' requires 'logprobs' to be true.", loc=("top_logprobs",))
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ProtocolError("'max_tokens' and 'max_completion_tokens' disagree; send only "
                                "'max_completion_tokens'.", loc=("max_completion_tokens",))
        return self

    def _make_grammar(self) -> Optional[str]:
        """Tool checks, then: "required" or a named tool_choice constrains the output to tool calls."""
        choice = self.tool_choice
        if self.tools is not None and not self.tools:
            raise ProtocolError("'tools' must not be empty; omit it instead.", loc=("tools",))
        if choice not in (None, "none") and not self.tools:
            raise ProtocolError("'tool_choice' requires 'tools'.", loc=("tool_choice",))
        for i, tool in enumerate(self.tools or ()):
            try:
                check_tool_schema(tool.model_dump(), i)
            except GrammarError as e:
                raise ProtocolError(str(e), loc=("tools", i, "function", "parameters")) from None
        forced = self.forced_tools()
        if forced is None:
            return super()._make_grammar()
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ProtocolError("'response_format' cannot be combined with a 'tool_choice' that requires a tool "
                                "call.", loc=("response_format",))
        return tool_calls_grammar([t.model_dump() for t in forced],
                                  parallel=self.parallel_tool_calls and choice == "required")

    def forced_tools(self) -> Optional[list[Tool]]:
        """The tools the output must call (tool_choice "required" or named), or None."""
        choice = self.tool_choice
        if choice == "required":
            return list(self.tools or ())
        if isinstance(choice, NamedToolChoice):
            name = choice.function.get("name")
            match = [t for t in self.tools or () if t.function.name == name]
            if not match:
                known = ", ".join(t.function.name for t in self.tools or ())
                raise ProtocolError(f"'tool_choice' names function {name!r}, which is not in 'tools' ({known}).",
                                    loc=("tool_choice", "function", "name"))
            return match
        return None

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools the chat template renders (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def _logprobs_count(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = Union[StrictStr, list[StrictStr], list[TokenId], list[list[TokenId]]]


class CompletionRequest(_SamplingRequest):
    unsupported_fields = _UNSUPPORTED_COMPLETION
    prompt: PromptInput = Field(json_schema_extra=_schema(_PROMPT_SCHEMA))
    max_tokens: Optional[StrictInt] = Field(16, ge=1)  # the legacy endpoint's OpenAI default
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ProtocolError("'prompt' must not be empty.")
            return v
        # Checked by hand for the same reason as message content: clear errors instead of per-branch ones.
        if not isinstance(v, list) or not v:
            raise ProtocolError("'prompt' must be a non-empty string, array of strings, array of token ids or "
                                "array of token-id arrays.", code="invalid_type")
        kinds = {"str" if isinstance(x, str) else "ids" if isinstance(x, list) else
                 "int" if type(x) is int else "bad" for x in v}
        if len(kinds) != 1 or "bad" in kinds:
            raise ProtocolError("'prompt' array must hold only strings, only token ids, or only token-id "
                                "arrays.", code="invalid_type")
        for i, x in enumerate(v):
            ids = x if isinstance(x, list) else [x] if type(x) is int else None
            if not x and x != 0:
                raise ProtocolError("'prompt' must not contain an empty prompt.", loc=(i,))
            if ids is not None and any(type(t) is not int or t < 0 for t in ids):
                raise ProtocolError("Token ids in 'prompt' must be non-negative integers.", loc=(i,),
                                    code="invalid_type")
        return v

    @model_validator(mode="after")
    def _completion_checks(self) -> "CompletionRequest":
        if self.echo and self.logprobs is not None:
            raise ProtocolError("'echo' together with 'logprobs' (prompt logprobs) is not supported.", loc=("echo",),
                                code="unsupported_value")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list; each is text or token ids. Choice index = prompt_index * n + j."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def _logprobs_count(self) -> Optional[int]:
        return self.logprobs

    def check_token_ids(self, vocab_size: int) -> None:
        super().check_token_ids(vocab_size)
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], int):
            _check_ids(self.prompt, vocab_size, ("prompt",))  # type: ignore[arg-type]
        for i, prompt in enumerate(self.prompts() if isinstance(self.prompt[0], list) else ()):
            _check_ids(prompt, vocab_size, ("prompt", i), per_item=False)  # type: ignore[arg-type]

