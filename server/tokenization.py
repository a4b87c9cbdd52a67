"""Text <-> token ids for the HTTP server.

Owns: rendering a chat with the tokenizer's chat template and encoding it, and the token strings/bytes that
logprobs report. Output text (incremental detokenization, stop strings) is the engine's: engine/detokenizer.py.
Works with any Hugging Face tokenizer (transformers 5.x `TokenizersBackend` / `PreTrainedTokenizerFast`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from server.protocol import (ChatCompletionTokenLogprob, ChatMessage, CompletionLogprobs, ProtocolError,
                             TopLogprob, finite_logprob)

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete character


class ChatTemplateError(ProtocolError):
    """The chat template could not render these messages (a client error: 400, param 'messages')."""

    def __init__(self, message: str, loc: tuple = ("messages",)):
        super().__init__(message, loc=loc, code="chat_template_error")


# --------------------------------------------------------------------------------------- chat template

_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                             "return_tensors", "chat_template", "tools", "documents", "continue_final_message"}


def render_chat(tokenizer: Any, messages: Sequence[Union[ChatMessage, Mapping[str, Any]]], *,
                add_generation_prompt: bool = True,
                chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
    """Messages -> prompt text via the tokenizer's chat template. Raises ChatTemplateError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("This model has no chat template; use /v1/completions with a plain prompt.")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if clash:
        raise ChatTemplateError(f"'chat_template_kwargs' may not set {clash}.", loc=("chat_template_kwargs",))
    conversation = [m.to_template_dict() if isinstance(m, ChatMessage) else dict(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # the template is model data: jinja errors and raise_exception() are client errors
        raise ChatTemplateError(f"The chat template could not render these messages: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"The chat template returned {type(text).__name__}, not text.")
    return text


def encode_chat(tokenizer: Any, messages: Sequence[Union[ChatMessage, Mapping[str, Any]]], *,
                add_generation_prompt: bool = True,
                chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
    """Render, then encode without adding special tokens: the template already wrote BOS and friends.
    (transformers 5.x `apply_chat_template(tokenize=True)` returns a BatchEncoding, hence two steps.)"""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       chat_template_kwargs=chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


# -------------------------------------------------------------------------------------------- logprobs

def _byte_level_table() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes (controls, space, a few Latin-1 gaps) are shifted to code points 256 and up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _incomplete_tail(data: bytes) -> int:
    """Number of trailing bytes that start a UTF-8 character whose remaining bytes have not arrived."""
    for k in range(1, min(3, len(data)) + 1):
        b = data[-k]
        if b & 0xC0 == 0x80:  # continuation byte: look further back for the lead byte
            continue
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return k if need > k else 0
    return 0


@dataclass
class TextOffset:
    """Running character offset for legacy `text_offset`, kept across the stream chunks of one choice.
    Counts characters as the lossy decode of the text does (an invalid byte is one U+FFFD); a token that
    ends mid-character leaves its bytes pending until the character completes."""
    chars: int = 0
    pending: bytes = b""

    def advance(self, token_bytes: bytes) -> int:
        """Offset at which this token starts; then move past it."""
        start = self.chars
        data = self.pending + token_bytes
        cut = len(data) - _incomplete_tail(data)
        self.chars += len(data[:cut].decode("utf-8", errors="replace"))
        self.pending = data[cut:]
        return start


class LogprobFormatter:
    """Token strings and UTF-8 bytes as OpenAI logprobs report them, cached per token id.

    `bytes` is exact (byte-level BPE tokens map back through the byte alphabet, `<0xNN>` byte-fallback
    tokens to their byte). `token` is those bytes as text, or OpenAI's `bytes:\\xNN` form when the token
    holds part of a character. Non-finite logprobs become LOGPROB_FLOOR (JSON has no -inf)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self._byte_level = _byte_level_table() if "ByteLevel" in decoder else None
        self._metaspace = "Metaspace" in decoder or '"▁"' in decoder
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes_of(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def _bytes_of(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._tokenizer.decode([token_id]).encode("utf-8")

    def token_str(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self._lookup(token_id)[1]

    def _top(self, top: Optional[Sequence[tuple[int, float]]]) -> list[TopLogprob]:
        return [TopLogprob(token=self.token_str(t), logprob=finite_logprob(lp), bytes=list(self.token_bytes(t)))
                for t, lp in (top or ())]

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float],
                      top_logprobs: Optional[Sequence[Sequence[tuple[int, float]]]] = None
                      ) -> list[ChatCompletionTokenLogprob]:
        """Chat `logprobs.content` entries; top_logprobs[i] holds (token_id, logprob) pairs, best first."""
        tops = top_logprobs or [()] * len(token_ids)
        return [ChatCompletionTokenLogprob(token=self.token_str(t), logprob=finite_logprob(lp),
                                           bytes=list(self.token_bytes(t)), top_logprobs=self._top(top))
                for t, lp, top in zip(token_ids, logprobs, tops)]

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[Optional[float]],
                            top_logprobs: Optional[Sequence[Optional[Sequence[tuple[int, float]]]]] = None,
                            *, offset: Optional[TextOffset] = None) -> CompletionLogprobs:
        """Legacy completions logprobs. Pass the same TextOffset for every chunk of one choice (start it at
        the prompt's length when echoing) so text_offset keeps counting."""
        offset = offset if offset is not None else TextOffset()
        tops = top_logprobs or [None] * len(token_ids)
        out = CompletionLogprobs()
        for t, lp, top in zip(token_ids, logprobs, tops):
            out.tokens.append(self.token_str(t))
            out.token_logprobs.append(None if lp is None else finite_logprob(lp))
            out.top_logprobs.append(None if top is None else
                                    {self.token_str(a): finite_logprob(b) for a, b in top})
            out.text_offset.append(offset.advance(self.token_bytes(t)))
        return out
