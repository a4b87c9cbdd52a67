"""The messages and tools of a /v1/chat/completions request: message content (text parts), assistant tool calls,
"tool" results, and the function tools and tool_choice forms. ChatMessage.to_template_dict() is what the chat
template sees. Failures are ProtocolErrors (server/errors.py), which parse_request turns into a 400 envelope."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from server.errors import ProtocolError, type_name


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One input message. Content is a string or a list of text parts; an assistant message may carry tool_calls
    (then content may be null), a "tool" message answers one of them (tool_call_id)."""
    # replayed SDK messages carry refusal/annotations: null. The schema says what the validator enforces: content
    # is required unless an assistant message carries tool_calls.
    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"role": {"enum": ["system", "user", "assistant", "developer"]}}},
        {"required": ["content", "tool_call_id"], "properties": {"role": {"const": "tool"}}},
        {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"}}}]})
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[TextContentPart]] = ""
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("function_call", "audio"):
                if data.get(name):
                    raise ProtocolError(f"Unsupported parameter: '{name}' in messages is not supported by this "
                                        f"server.", loc=(name,), code="unsupported_parameter")
            if data.get("role") == "function":
                raise ProtocolError("Unsupported role 'function' (deprecated by OpenAI): use 'tool' messages.",
                                    loc=("role",))
            if data.get("role") == "tool" and not isinstance(data.get("tool_call_id"), str):
                raise ProtocolError("A 'tool' message needs the 'tool_call_id' it answers.", loc=("tool_call_id",))
            if data.get("content") is None and (data.get("role") != "assistant" or not data.get("tool_calls")):
                raise ProtocolError("'content' is required (only an assistant message with tool_calls may omit "
                                    "it).", loc=("content",))
            data = {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        # Checked by hand: a failed Union would report one error per branch, with branch names in the path.
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ProtocolError(f"Invalid type for content: expected a string or an array of text parts (got "
                                f"{type_name(v)}).", code="invalid_type")
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise ProtocolError(f"Invalid content part: expected an object (got {type_name(part)}).",
                                    loc=(i,), code="invalid_type")
            if part.get("type") != "text":
                raise ProtocolError(f"Unsupported content part type {part.get('type')!r}; only 'text' parts are "
                                    f"supported.", loc=(i, "type"), code="unsupported_value")
            if not isinstance(part.get("text"), str):
                raise ProtocolError("A text content part needs a string 'text'.", loc=(i, "text"),
                                    code="invalid_type")
        return v

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        # HF chat templates know "system" but rarely "developer", which OpenAI defines as its successor.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # templates (Qwen's, Llama's) read arguments as a mapping
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ...
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[StrictStr, Any]] = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[StrictStr, StrictStr]  # {"name": ...}
