"""Messages between the HTTP server process and the engine process (plain picklable dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

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
    # sampling defaults from the checkpoint's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty); a request's own values override them
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # the engine's tokenizer exported with save_pretrained (engine/tokenizer_export.py): the HTTP process
    # tokenizes from these files without transformers; None when the model has no tokenizer
    tokenizer_dir: str | None = None


@dataclass
class Failed:
    message: str  # one line: why the engine could not start or died
    traceback: str = ""  # the engine's full traceback, for the server's log


@dataclass
class RequestError:
    request_id: str
    message: str
    # "invalid": the engine refused the request (bad token ids, does not fit): a 400 for the client;
    # "internal": processing this request failed (the others went on): a 500 for the client
    kind: str = "invalid"


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
    text: str = ""  # detokenized text of new_token_ids, stop strings already cut (when the request detokenizes)
    stop_reason: str | int | None = None  # the stop string or stop token id that finished the request

    @staticmethod
    def joined(deltas: "list[Delta]") -> "Delta":
        """One request's consecutive deltas as one (for a reader that fell behind): their tokens, logprobs and text
        in order, the first one's prompt counts, the last one's finish and everything else. Built once, however
        many (a reader far behind takes dozens: joined pairwise, each copy would grow with the run); a lone delta as
        it is."""
        if len(deltas) == 1:
            return deltas[0]
        first, last = deltas[0], deltas[-1]
        token_ids = [t for d in deltas for t in d.new_token_ids]
        logprobs = None if all(d.new_logprobs is None for d in deltas) else \
            [lp for d in deltas for lp in d.new_logprobs or ()]
        return replace(last, new_token_ids=token_ids, new_logprobs=logprobs, text="".join(d.text for d in deltas),
                       num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens)

    def __reduce__(self):
        # Pickled by position, not as an instance dict: a batch-64 step's deltas load in ~30 us instead of ~70 in
        # the HTTP process's reader (which reads every step) and dump a little faster in the engine's queue feeder.
        return Delta, _DELTA_FIELDS(self)


_DELTA_FIELDS = attrgetter(*(f.name for f in fields(Delta)))


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
    # prefix cache, over the requests admitted this step: prompt tokens looked up, and found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # "replay" when a CUDA graph ran the forward; for a step of only trees "replay: whole round" (the tree build,
    # forward, sampling, walk and compaction replayed: engine/round_graphs.py) or "replay: forward only (<why>)";
    # "eager: <why>" when graphs exist but could not serve the step
    cuda_graph: str = ""
    # asynchronous scheduling (CUDA, one rank): "ahead" when the step was launched before its predecessor's
    # results were read, "synchronous: <why not>" otherwise; "" when asynchronous scheduling is off
    scheduling: str = ""
    # tree budget the scheduler chose for each decoding request this step (0 = plain decoding)
    spec_budgets: list[int] = field(default_factory=list)
    # ext ops that ran their PyTorch reference on a CUDA tensor this step (only with reference kernels allowed)
    kernel_fallbacks: dict[str, int] = field(default_factory=dict)
    # CUDA caching-allocator retries since the last count (an allocation failed, the cache was freed and the
    # allocation retried: a synchronizing slow path; read every ALLOC_CHECK_EVERY steps, 0 in between)
    cuda_alloc_retries: int = 0
    # structured output: requests admitted with a grammar this step, draft nodes the grammars pruned
    num_constrained_requests: int = 0
    num_grammar_pruned: int = 0
    # the drafter's reliability by confidence: per bin of draft probability (named by its lowest q), the tree
    # nodes verified this step that were accepted, and the sum of the draft probabilities of all verified nodes
    draft_confidence: dict[str, tuple[int, float]] = field(default_factory=dict)
    # the throughput guard (engine/speculative/guard.py): its checks decided this step ("won", "lost",
    # "discarded"), and whether it kept this decoding step plain (a plain window or a back-off)
    spec_guard_checks: list[str] = field(default_factory=list)
    spec_guard_plain: int = 0
    # requests the drafter ran for this step (verified trees, or curves only in a plain step)
    num_drafted: int = 0
    num_curve_drafts: int = 0  # requests drafted for their curve only (no tree verified)
    # budgets counted as probes (adaptive.py: a small tree to re-rate a request) since the last step's statistics
    num_probes: int = 0


@dataclass
class StepOutputs:
    deltas: list[Delta]
    stats: StepStats
