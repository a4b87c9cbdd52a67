"""Text <-> token ids for the HTTP server, with `tokenizers` (the Rust tokenizer under transformers) and `jinja2`
only: the HTTP process never imports transformers or torch.

Owns: `Tokenizer`, loaded from the folder the engine exported its own transformers tokenizer into
(engine/tokenizer_export.py: tokenizer.json, tokenizer_config.json, chat_template.jinja), so encoding, decoding
and special tokens are the engine's; the chat template rendered as transformers' apply_chat_template renders it
(sandboxed Jinja, trim_blocks/lstrip_blocks, loopcontrols, tojson, raise_exception, strftime_now, the special
tokens as variables); `--chat-template`; and the token strings/bytes that logprobs report. Output text is
engine/detokenizer.py's incremental detokenization: in the engine for a request with stop strings (it ends
there), in server/generation.py for the others.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from server.errors import ProtocolError
from server.responses import ChatCompletionTokenLogprob, CompletionLogprobs, TopLogprob, finite_logprob
from server.tool_calls import adapt_for_template

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the chat template sees each one that is set
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ProtocolError):
    """The chat template could not render these messages (a client error: 400, param 'messages')."""

    def __init__(self, message: str, loc: tuple = ("messages",)):
        super().__init__(message, loc=loc, code="chat_template_error")


# --------------------------------------------------------------------------------------- chat template

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body as is."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' own: Jinja's tojson would escape HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a readable file's contents, else (if it has a Jinja character) the
    template itself with its backslash escapes decoded. ValueError for an unreadable path or invalid Jinja."""
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read "
                             f"({getattr(e, 'strerror', None) or e})") from None
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e} (line {e.lineno})") from None
    return text


# ------------------------------------------------------------------------------------------- tokenizer

def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """transformers' `special_tokens_map`: the named special tokens that are set, then model-specific ones
    (other `*_token` strings, a dict of `extra_special_tokens`, `model_specific_special_tokens`)."""
    extra = {k: v for k, v in config.items() if k.endswith("_token") and k not in SPECIAL_TOKENS}
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), dict):
            extra.update(config[key])
    out = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    out.update({name: _token_text(value) for name, value in extra.items()})
    return {name: text for name, text in out.items() if text is not None}


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """One model's tokenizer: `tokenizers` for the ids, its tokenizer_config.json for the special tokens and
    decoding options, and its chat template (or `chat_template`, which replaces it)."""

    def __init__(self, folder: str, chat_template: Optional[str] = None):
        self.folder = folder
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (the server needs the model's fast tokenizer)")
        self.backend = RustTokenizer.from_file(path)
        self.backend.no_truncation()  # transformers turns both off before every call
        self.backend.no_padding()
        # the streams' incremental detokenization runs on the event loop (server/generation.py) while `backend`
        # encodes in the tokenize thread: an instance of its own, so no tokenizer is called from two threads
        self.decoding = RustTokenizer.from_file(path)
        config_path = os.path.join(folder, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.special_tokens_map = _special_tokens_map(config)
        bpe = type(self.backend.model).__name__ == "BPE"  # transformers never cleans up BPE output
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            not bpe or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self.chat_template = chat_template if chat_template is not None else self._model_template(folder, config)

    @staticmethod
    def _model_template(folder: str, config: Mapping[str, Any]) -> Optional[str]:
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        template = config.get("chat_template")
        if isinstance(template, list):  # the legacy form of several named templates
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.backend.id_to_token(int(token_id))

    def added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
                            tools: Optional[list[dict]] = None, documents: Optional[list[dict]] = None,
                            **kwargs: Any) -> str:
        """The rendered prompt text, as transformers' apply_chat_template(tokenize=False) returns it."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = {**self.special_tokens_map, **kwargs}  # kwargs override special tokens, as in transformers
        return compile_template(self.chat_template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **variables)


_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                             "return_tensors", "chat_template", "tools", "documents", "continue_final_message"}


def render_chat(tokenizer: Tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                tools: Optional[list[dict[str, Any]]] = None) -> str:
    """Messages (request ChatMessages or dicts) -> prompt text via the chat template. Raises ChatTemplateError."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("This model has no chat template; use /v1/completions with a plain prompt.")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if clash:
        raise ChatTemplateError(f"'chat_template_kwargs' may not set {clash}.", loc=("chat_template_kwargs",))
    conversation = [m.to_template_dict() if hasattr(m, "to_template_dict") else dict(m) for m in messages]
    conversation, tools = adapt_for_template(tokenizer.chat_template, conversation, tools)
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **extra)
    except Exception as e:  # the template is model data: jinja errors and raise_exception() are client errors
        raise ChatTemplateError(f"The chat template could not render these messages: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"The chat template returned {type(text).__name__}, not text.")
    return text


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Render, then encode without adding special tokens: the template already wrote BOS and friends."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       chat_template_kwargs=chat_template_kwargs, tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


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

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        decoder = repr(tokenizer.backend.decoder)
        self._byte_level = _byte_level_table() if "ByteLevel" in decoder else None
        self._metaspace = "Metaspace" in decoder or '"▁"' in decoder
        self._added = tokenizer.added_tokens()
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
        piece = self._tokenizer.id_to_token(token_id)
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
