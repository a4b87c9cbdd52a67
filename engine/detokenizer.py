"""Output text inside the engine: incremental detokenization (tokenizers' DecodeStream, one Rust call per
token, or per step's tokens when no stop string can end among them) and stop-string matching, per request.

Stop strings are matched here, in the engine process, so a request that hits one finishes in the same step and
frees its KV blocks at once; the HTTP layer receives text that is already cut. Invariants:
  - the text deltas of a request concatenate to tokenizer.decode(kept output ids, skip_special_tokens=...),
    up to the stop string (prefix-stable decoders: byte-level BPE, Metaspace, byte fallback);
  - a stop string is never emitted (unless include_stop_str_in_output) and the text before it always is;
  - the kept token ids end with the token that completed the stop string (vLLM's behaviour).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

from tokenizers.decoders import DecodeStream


def backend_tokenizer(tokenizer: Any):
    """The `tokenizers.Tokenizer` under a transformers fast tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer


class Detokenizer:
    """Token ids in, text deltas out, for one sequence. Incomplete UTF-8 characters are held until they
    complete, or until flush(), which releases them as U+FFFD exactly as a full decode would."""

    CONTEXT_TOKENS = 4  # prompt tokens given as left context (Metaspace decoders strip a leading space)

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self._skip = skip_special_tokens
        self._context = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=self._context or None, skip_special_tokens=skip_special_tokens)
        self.output_ids: list[int] = []
        self._emitted = 0  # characters emitted so far
        self._held = False  # the last step returned nothing: tokens wait for a character to complete

    def step(self, token_id: int | list[int]) -> str:
        """Append one token (or several: one Rust call for a speculative step's tokens); return the newly
        complete text (possibly "")."""
        if isinstance(token_id, list):
            self.output_ids.extend(token_id)
        else:
            self.output_ids.append(token_id)
        text = self._stream.step(self._backend, token_id)
        self._held = text is None
        text = text or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """End of sequence: whatever is held (an incomplete character decodes to U+FFFD)."""
        if not self._held:
            return ""
        self._held = False
        full = self._decode(self._context + self.output_ids)[len(self._decode(self._context)):]
        rest = full[self._emitted:]
        self._emitted += len(rest)
        return rest

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip) if ids else ""


class StopResult(NamedTuple):
    text: str  # safe to emit now
    stopped: bool
    matched_stop: Optional[str]


class StopStringMatcher:
    """Finds stop strings in streamed text. Text that could still begin a stop string is held back, so a stop
    string is never emitted (unless include_stop_str_in_output) and the text before it always is.

    The sequence stops where the first stop string *ends* (ties: the longer one), which a streaming matcher
    can decide without look-ahead; the result is the same however the text is chunked."""

    def __init__(self, stop: Sequence[str] = (), *, include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched_stop: Optional[str] = None

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True, self.matched_stop)
        if not self.stops:
            return StopResult(text, False, None)
        buf = self._held + text
        best: Optional[tuple[int, int, str]] = None  # (end, -length, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.stopped, self.matched_stop, self._held = True, s, ""
            return StopResult(buf[:end] if self._include else buf[:end + neg_len], True, s)
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return StopResult(buf[:len(buf) - keep], False, None)

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = min(len(buf), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The sequence ended for another reason: held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class OutputText:
    """Detokenizer + stop matcher for one request: push() each committed token, finish() once at the end."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, prompt_ids: Sequence[int] = ()):
        self.detokenizer = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)
        self.matcher = StopStringMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
        self._parts: list[str] = []  # everything emitted so far, joined on demand (no quadratic appends)
        self.pending = ""  # emitted since the last take()

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    @property
    def has_stop_strings(self) -> bool:
        return bool(self.matcher.stops)

    def push(self, token_id: int | list[int]) -> StopResult:
        """One token, or several at once when there are no stop strings (a stop string may end inside them)."""
        if self.matcher.stopped:
            return StopResult("", True, self.matcher.matched_stop)
        assert isinstance(token_id, int) or not self.has_stop_strings
        return self._emit(self.matcher.feed(self.detokenizer.step(token_id)))

    def finish(self) -> StopResult:
        """The engine finished the sequence for another reason (EOS, length, stop token)."""
        if self.matcher.stopped:
            return StopResult("", True, self.matcher.matched_stop)
        result = self.matcher.feed(self.detokenizer.flush())
        if not result.stopped:
            result = StopResult(result.text + self.matcher.flush(), False, None)
        return self._emit(result)

    def take(self) -> str:
        """Text emitted since the last call."""
        out, self.pending = self.pending, ""
        return out

    def _emit(self, result: StopResult) -> StopResult:
        if result.text:
            self._parts.append(result.text)
            self.pending += result.text
        return result
