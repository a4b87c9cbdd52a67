"""The request models of /tokenize and /detokenize (vLLM's extensions), under server/requests.py's validation policy."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field, StrictBool, StrictStr, model_validator

from server.chat_messages import ChatMessage
from server.errors import ProtocolError
from server.requests import TokenId, _check_ids, _Request


class TokenizeRequest(_Request):
    """Either `prompt` (text) or `messages` (rendered with the chat template), as vLLM's /tokenize."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(None, json_schema_extra={"minItems": 1})
    add_special_tokens: Optional[StrictBool] = None  # default: True for prompt, False for messages
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("Provide exactly one of 'prompt' or 'messages'.", loc=("prompt",))
        if self.messages is not None and not self.messages:
            raise ProtocolError("'messages' must contain at least one message.", loc=("messages",))
        return self

    @property
    def use_special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(_Request):
    model: Optional[StrictStr] = None
    tokens: list[TokenId]

    def check_token_ids(self, vocab_size: int) -> None:
        _check_ids(self.tokens, vocab_size, ("tokens",))
