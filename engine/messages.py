"""Messages between the HTTP server process and the engine process (plain picklable dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import SamplingParams


# server -> engine
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


# engine -> server
@dataclass
class Ready:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int


@dataclass
class Failed:
    message: str  # one line: why the engine could not start or died


@dataclass
class RequestError:
    request_id: str
    message: str  # the engine refused the request (e.g. a token id outside the vocabulary)


@dataclass
class Delta:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    new_logprobs: list | None = None  # per new token: (logprob, [(token_id, logprob), ...])
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds from arrival in the engine to first scheduled (set when finished)
    accept_lengths: list[int] = field(default_factory=list)  # tokens per step under speculation (when finished)


@dataclass
class StepStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    batch_size: int
    num_preemptions: int  # preemptions during this step
    timings: dict[str, float]  # phase -> seconds (schedule, draft, tree_build, verify, accept, forward, sample)
    # speculation, per request of this step that ran a tree
    accept_lengths: list[int] = field(default_factory=list)  # tokens produced per request (accepted + bonus)
    tree_nodes: list[int] = field(default_factory=list)  # draft nodes verified per request
    accepted_per_position: list[int] = field(default_factory=list)  # index d: drafts accepted at depth d+1


@dataclass
class StepOutputs:
    deltas: list[Delta]
    stats: StepStats
