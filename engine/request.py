"""A generation request inside the engine: its sampling parameters, token ids, how many of them have KV in the
cache (num_computed_tokens), its KV block table, its detokenized text (stop strings are matched here, in the
engine, so a stopped request frees its KV at once), and why it finished."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top log-probs to return per generated token (0 = only the chosen token's)
    stop: list[str] = field(default_factory=list)  # stop strings, matched in the detokenized output
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the detokenized text
    detokenize: bool = True  # produce text (needs the model's tokenizer); stop strings need it
    grammar: str | None = None  # structured output: an llguidance grammar (engine/grammar.py builds them)

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be an llguidance grammar string (engine.grammar)")
        if vocab_size is not None:
            for t in list(self.stop_token_ids) + list((self.logit_bias or {}).keys()):
                if not 0 <= int(t) < vocab_size:
                    raise ValueError(f"token id {t} is outside the vocabulary (size {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class TokenView(Sequence):
    """A request's committed tokens, prompt then output, as one read-only sequence over the two lists (live: it
    sees tokens appended after it was made). Concatenated, they cost a copy of the whole context per request and
    step: 2.3 us at 2k tokens, growing with the context, on the host's critical path at every drafted step."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __iter__(self):
        return itertools.chain(self.prompt, self.output)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return joined_slice(self.prompt, self.output, start, stop) if step == 1 else list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        num_prompt = len(self.prompt)
        return self.prompt[index] if index < num_prompt else self.output[index - num_prompt]


def joined_slice(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """(prompt + output)[start:stop] for 0 <= start <= stop, without building the whole list."""
    num_prompt = len(prompt)
    if stop <= num_prompt:
        return prompt[start:stop]
    if start >= num_prompt:
        return output[start - num_prompt:stop - num_prompt]
    return prompt[start:] + output[:stop - num_prompt]


_ids = itertools.count()


def next_request_id() -> str:
    """A process-unique id for a request that did not bring one."""
    return f"req-{next(_ids)}"


@dataclass(eq=False)  # identity: the scheduler's list.remove() must not compare every field
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    request_id: str = field(default_factory=next_request_id)
    output_token_ids: list[int] = field(default_factory=list)
    # per generated token: (chosen token's logprob, [(token_id, logprob), ...] top-n); only when logprobs is set
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache digests of the full blocks
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    seed: int = 0  # the sampling seed (the request's own, or one the engine drew): noise = f(seed, output index)
    text: Any = None  # engine.detokenizer.OutputText when the request detokenizes
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # speculative-decoding bookkeeping: steps, accepted tokens per step
    accept_lengths: list[int] = field(default_factory=list)
    constraint: Any = None  # engine.structured.Constraint when the sampling has a grammar
    _stop_ids: frozenset | None = field(default=None, repr=False)

    @property
    def stop_ids(self) -> frozenset:
        """Token ids that stop the request once min_tokens are out: its stop_token_ids, and EOS unless
        ignore_eos."""
        if self._stop_ids is None:
            eos = () if self.sampling.ignore_eos else self.eos_token_ids
            self._stop_ids = frozenset(self.sampling.stop_token_ids) | frozenset(eos)
        return self._stop_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def committed(self) -> "TokenView":
        """all_token_ids as a view, without the copy (drafters read its length, last token and new tail each step)."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the step path calls this per request)."""
        return joined_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
