"""What the adaptive budget (engine/speculative/adaptive.py) keeps per request: its decayed acceptance record, its
latest tree's node probabilities and confidence bins, its probe state and drafting interval; and the drafter's own
count of the nodes it is confident in."""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16  # steps a request stays at budget 0 before a probe
MAX_PROBE_INTERVAL = 256  # the longest wait between a request's curve-only drafts when drafting is dear
PROBED, AT_ZERO, CHOSEN = "probed", "at zero", "chosen"  # what counting a budget did to the request's probe state


@dataclass
class RequestRecord:
    accepted: float = 0.0  # decayed sum of drafts accepted
    predicted: float = 0.0  # decayed sum of the q mass that was verified
    node_q: list[float] = field(default_factory=list)  # latest tree: each node's q, best-first (empty: no draft yet)
    node_bins: list[int] = field(default_factory=list)  # each node's confidence bin
    q_total: float = 0.0  # sum of node_q over the first max_budget nodes: bounds the tree's gains (_cannot_pay)
    steps_at_zero: int = 0
    steps_undrafted: int = 0  # steps at budget 0 since the drafter last ran for this request
    draft_interval: int = PROBE_EVERY  # when drafting is not cheap: steps between curve-only drafts
    probe_interval: int = PROBE_EVERY  # steps at zero between probes: doubled by a probe that accepted nothing
    failed_q: float | None = None  # the q mass of the last probe that accepted nothing (None: none since)
    pending: tuple | None = None  # a dry budget() answer: ((version, ahead), budget, effect) for the counted call
    probing: bool = False  # the last counted budget was a probe
    probe_unobserved: bool = False  # a counted probe whose step has not been observed (StepBudgets' explore back-off)
    verified: bool = False  # a tree of the request's own was verified (else its record is the engine's prior)
    gains: tuple | None = None  # (version, its nodes' expected accepted drafts): _gains until the next observation
    best: tuple | None = None  # ((version, threshold), _net_best's answer) worked out for a whole step: value_together


def nodes_above(node_q: list[float], theta: float) -> int:
    """How many leading nodes the drafter itself expects to bring more than theta accepted tokens each (q decreases
    along the best-first order)."""
    chosen = 0
    for q in node_q:
        if q <= theta:
            break
        chosen += 1
    return chosen


def draft_due(stats: RequestRecord | None, cheap: bool, aligned: bool, dry: bool, first: bool = True) -> bool:
    """BudgetController.should_draft() once drafting is allowed, given its cheap_draft(), _aligned() and
    _first_probe_due() (`first`; the same for a whole step: StepBudgets.drafts_of): any request while drafting is
    cheap; a request without a tree on a step where first probes are due (under CUDA graphs every
    FIRST_PROBE_EVERY steps: on a loaded server each admission's own first draft made a draft step, whose host
    work at batch 64 is that of a whole step); else one whose interval has passed, on an aligned step, and the
    interval doubles. dry: not counted."""
    if cheap:
        return True
    if stats is None or not stats.node_q:
        return first
    if stats.steps_undrafted + 1 < stats.draft_interval or not aligned:
        if not dry:
            stats.steps_undrafted += 1
        return False
    if dry:
        return True
    stats.steps_undrafted = 0
    stats.draft_interval = min(2 * stats.draft_interval, MAX_PROBE_INTERVAL)  # reset when a tree is chosen
    return True
