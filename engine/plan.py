"""StepPlan and StepResult: the only contract between the scheduler and the runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # known tokens fed this step: a prefill chunk, or the last sampled token when decoding
    sample: bool  # the fed tokens reach the end of what is known, so the next token is produced this step
    spec_budget: int = 0  # tree nodes this request may verify this step (0 = plain decoding)
    # of those, the nodes the adaptive budget chose; the rest fill the step's padded width for free (None: all)
    chosen_budget: int | None = None
    # asynchronous scheduling: tokens this step runs past the request's committed state (1 for a request scheduled
    # before the previous step's token reached the host, decoding or just past its prompt; that token is fed from
    # the device, at the position past the host's tokens: engine.inputs.first_position)
    num_ahead: int = 0
    # a decoding request at budget 0 scheduled ahead that drafts this step for its curve only, from the token
    # fed from the device (a drafter that drafts from the device: Speculator.cannot_draft_ahead)
    watched: bool = False
    # asynchronous scheduling: a tree step (root-only ones included) launched before its predecessor's results;
    # the request's root, its position and its output index come from that step's results, still on the device
    # (the request's host state lags by that step)
    root_on_device: bool = False

    @property
    def decodes(self) -> bool:
        """Feeds only its last token and samples the next (scheduled ahead: the token the step in flight samples,
        also right after its prompt's last chunk, when its host count of computed tokens lags by that chunk)."""
        if not (self.sample and self.num_new_tokens == 1):
            return False
        return self.num_ahead > 0 or self.request.num_computed_tokens == self.request.num_tokens - 1


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests whose KV was dropped this step
    prefix_cache_queries: int = 0  # prompt tokens of the requests admitted this step (first admission only)
    prefix_cache_hits: int = 0  # of those, tokens whose KV came from the prefix cache
    spec_budgets: list[int] = field(default_factory=list)  # tree budget chosen per decoding request (0 = plain)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.spec_budget for s in self.seqs)


@dataclass
class StepResult:
    # request_id -> tokens produced this step, in order (one when decoding plainly; accepted + bonus under DDTree)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> per produced token (chosen logprob, [(token_id, logprob), ...]); only for requests asking for it
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # request_id -> tokens verified in the tree this step (draft nodes, root excluded); only under speculation
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> tree rows of the accepted draft nodes (root excluded; row j is the j-th node in best-first
    # order), whose KV now sits in place; only under speculation
    accepted_rows: dict[str, list[int]] = field(default_factory=dict)
    # step statistics for metrics, over the requests that ran a tree
    accept_lengths: list[int] = field(default_factory=list)  # tokens produced per request (accepted + bonus)
    tree_nodes: list[int] = field(default_factory=list)  # draft nodes verified per request
    accepted_per_position: list[int] = field(default_factory=list)  # index d: drafts accepted at depth d + 1
    # request_id -> its full-budget tree's node confidence: (B draft probabilities q, their B confidence bins)
    # (engine.speculative.confidence.confidence_rows, on the host; adaptive budgets)
    curves: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    # "replay" (a CUDA graph ran the forward), "eager: <why>" where graphs exist but could not serve the step,
    # "" without graphs
    cuda_graph: str = ""
    # phase -> seconds spent this step (schedule, draft, tree_build, verify, accept, forward, sample)
    timings: dict[str, float] = field(default_factory=dict)
    num_drafted: int = 0  # requests the drafter ran for this step (verified or curves only)
    num_curve_drafts: int = 0  # ... of which curves only (no tree verified: a request at budget 0)
    draft_seconds: float = 0.0  # the drafter's time this step (device time on CUDA)
    num_grammar_pruned: int = 0  # draft-tree nodes dropped because the request's grammar forbids them
