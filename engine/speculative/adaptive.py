"""Adaptive speculation: each request's tree budget, step by step, from its own measured acceptance and the
measured cost of a verify row, so that DDTree never costs throughput (0 = plain decoding). The controller is split:
this module observes and chooses per request; tree_value.py values a request's tree, draft_cost.py measures the
drafter, step_budgets.py holds the step-level half (one step's width, the switch into trees, a held plain step).

The model. A best-first tree's nodes come in decreasing draft probability q_1 >= q_2 >= ... (q_j = the drafter's
probability of node j's prefix), and the expected number of accepted drafts of the first b nodes is the sum of
the target's probabilities of those prefixes (DDTree, Prop. 1). The drafter's q are rarely calibrated, so per
request we keep c = (drafts it accepted) / (sum of q over the nodes it verified), as decayed sums, and predict
the gain of node j as c * q_j (c blended with the engine-wide ratio, so a new request starts from what the
drafter has been worth), from the request's latest tree (the runner builds it at the full budget and
returns each node's q and confidence bin). A verify row costs t_row seconds; the engine's throughput is
tokens / T (decayed sums over decoding steps); a row is worth adding when its gain >= t_row * tokens / T. t_row
comes from a decayed least-squares fit of the step time on the rows of decoding steps (a prefill chunk's step is
counted, never fitted: its rows share one weight read), from a prior the first fitted step seeds. The budget is
the best-first order's prefix (every prefix is a tree) with the largest gain net of that threshold, capped by the
configured budget.

One factor per request is not enough: a drafter's confidence is rarely off by the same factor at every level (an
oracle's top-1 chain is always right while its side branches, at q ~ 0.1, never are; with one factor the side
branches inherit the chain's over-delivery and fill the tree). So the engine also keeps a reliability curve:
accepted / predicted per confidence bin (q in [2^-(k+1), 2^-k)), from which nodes of every verified tree were
on the accepted path, each bin blended with the engine-wide ratio (reliability.py: BIN_PRIOR predicted drafts
of it). A node's gain is q_j times its bin's ratio times the request's standing against the engine (c /
engine-wide ratio); with no bins measured it is c * q_j.

Drafting has a cost of its own (t_draft seconds per drafted request, measured: host time on CPU, CUDA events on
the GPU): a tree is verified only when its expected accepted drafts beat its rows' cost by more than the
drafting cost. A new request has no tree of its own yet: its first budget values the tree the drafter last drew
for another request at the engine-wide record (before any tree was verified it is 0, and the step drafts for
the curve only). A request at 0 drafts without verifying (the runner builds its tree for the curve only) every
step while drafting is cheap (an n-gram lookup), so one whose drafter turns confident verifies again the next
step; when drafting is not cheap (a DFlash forward), it drafts only every PROBE_EVERY steps, and the interval
doubles (up to MAX_PROBE_INTERVAL) while those probes keep saying 0, so a drafter that does not pay costs a small
fraction of a step. When the drafter is confident but the request's record says it is wrong, a small tree is
verified every PROBE_EVERY steps, so the record can recover.

Probes and interval drafts fall on engine-wide steps (the step count a multiple of PROBE_EVERY), not on each
request's own phase: a step with any tree in it is a tree step for the whole batch (one padded width; with a
drafter that needs the host, no step run ahead of its predecessor's results), so 64 requests probing at 64
different phases would turn every step into a tree step, while aligned they cost one step in PROBE_EVERY.
"""
from __future__ import annotations

# DECAY: also a request's acceptance, the engine-wide record
from engine.speculative.cost_fit import DECAY, CostFit, SwitchCost
from engine.speculative.draft_cost import DraftCost
from engine.speculative.guard import ThroughputGuard
from engine.speculative.reliability import ReliabilityBins
# PROBE_EVERY: steps a request stays at budget 0 before a probe
from engine.speculative.request_record import (AT_ZERO, CHOSEN, PROBE_EVERY, PROBED, RequestRecord, draft_due,
                                               nodes_above)
from engine.speculative.step_budgets import PROBE_BUDGET, StepBudgets
from engine.speculative.step_costs import StepCosts
from engine.speculative.tree_value import PRIOR_WEIGHT, TreeValue

FIRST_PROBE_EVERY = 4  # under CUDA graphs, a request's first probe waits for a step aligned to this (_first_probe_due)
PRIOR_MIN_ROWS = 256  # the prior prices a row as if the first step had at least this many
MIN_GAIN = 0.02  # a row is never free: below this many expected accepted tokens a node is not verified
CHEAP_DRAFT = 0.02  # tokens of throughput a curve-only draft may cost to run every step at budget 0
# the longest wait between probes of a request whose probes keep failing: a probe costs more than its rows under
# asynchronous scheduling when the drafter needs the host (its step and the one after cannot run ahead: on the
# H200 at batch 16, T = 1, probes every 16 steps cost ~15% before tree steps ran ahead of plain ones), yet a
# drafter that turns right must not wait long to be believed
MAX_PROBE_BACKOFF = 4 * PROBE_EVERY
# ... unless the drafter grows surer: a tree whose first PROBE_BUDGET nodes expect this many more accepted drafts
# than the failed probe's restores the interval (without it, a reply that turned to copying waited up to 64 steps:
# the embedded model at batch 1, T = 0, 79 steps for 128 tokens against 66 with no back-off, on the CPU)
CONFIDENCE_RISE = 0.5


class BudgetController(StepBudgets, TreeValue):
    def __init__(self, max_budget: int, enabled: bool = True, prior_row_share: float = 0.5, guard: bool = True):
        """prior_row_share: before measurements, the share of a plain step's time one row is assumed to cost
        relative to the average row (1 = fully compute-bound, 0 = rows are free). guard: trees answer to measured
        throughput against plain windows (guard.py)."""
        self.max_budget, self.enabled, self.prior_row_share = max_budget, enabled, prior_row_share
        self.guarded = guard
        # a request without a tree of its own is valued by the latest one verified for another request; off for a
        # drafter whose trees come from each request's own text (the n-gram rule: request_specific)
        self.borrow = True
        self.pipelined = False  # the engine schedules steps ahead of their predecessors' results
        self.switches_ahead = False  # ... tree steps too, after any decoding step (no switch is synchronous)
        # a step with any tree pays a fitted fixed cost beyond its rows (without CUDA graphs; under graphs the
        # uniform width prices the whole batch, and tree steps are not fitted apart)
        self.price_tree_steps = True
        self.costs = StepCosts()  # measured step times per graph shape (its shape_of set under CUDA graphs)
        self.reset()

    def reset(self) -> None:
        """Forgets every measurement (acceptance, step and drafting costs, probe state): a fresh engine's prior.
        Benchmarks call it between runs so that one run's requests do not set the next run's calibration."""
        self.requests: dict[str, RequestRecord] = {}
        self.fit = CostFit()
        self.costs.reset()
        self._widths: tuple | None = None  # ((version, batch, top, synchronous), width costs in tokens): _width_costs
        self.last_rows, self.last_seconds = 0, 0.0
        self.tokens = self.seconds = 0.0  # decayed sums over decoding steps: the engine's throughput
        self.drafting = DraftCost()
        self.accepted = self.predicted = 0.0  # decayed sums over every request: a new request's calibration
        self.bins = ReliabilityBins()
        self._costs: tuple[float, float] | None = None  # (threshold, draft_tokens) until the next observation
        self._stacks: list[tuple] = []  # (node_q lists, q, bins) of the last records valued together (TreeValue)
        self.latest: RequestRecord | None = None  # the last request whose tree was verified: a new one's guess
        self.clock = 0  # engine steps observed: probes and interval drafts wait for a multiple of PROBE_EVERY
        self.switch = SwitchCost()  # under asynchronous scheduling: what a step that cannot run ahead costs more
        self.last_tree = False  # the last observed step verified a tree
        self._after: bool | None = None  # planning ahead: whether the step in flight verifies a tree
        self.version = 0  # observations so far: a dry budget() answer stands until the next one
        self.events = 0  # trees observed (verified or drafted): a held plain step stands until the next one
        self._hold: tuple | None = None  # StepBudgets.count_plain's held decision
        self.batch = 0  # decoding requests of the step being planned (budgets_of, drafts_of): explore_period's
        self._period: tuple | None = None  # ((version, batch), explore_period) until either changes
        self.num_probes = 0  # counted budgets that were probes, since the last take_probes()
        self.probes_unobserved = 0  # counted probes whose steps have not been observed (observe_engine_step)
        self.explore_backoff = 1  # explore_period's factor: doubled by a probe round that did not pay its cost
        self.guard = ThroughputGuard(self.guarded)

    def release(self, request_id: str) -> None:
        stats = self.requests.pop(request_id, None)
        if stats is not None and stats.probe_unobserved:
            self.probes_unobserved -= 1

    # -------------------------------------------------------------------------------------------- observing

    def observe_step(self, rows: int, seconds: float, tokens: int, fit: bool = True, tree: bool = False,
                     synchronous: bool = False) -> None:
        """One engine step: rows through the target, its wall time, tokens it produced. fit=False: the step is
        counted (probes follow the step count) but neither prices rows nor seeds the prior (the engine's steps with
        a prefill chunk). synchronous: under asynchronous scheduling, the step could not run ahead of its
        predecessor's results (its time includes its scheduling)."""
        self.clock += 1
        self.version += 1
        self._costs = None
        # the engine-wide record decays by the step, not by the request: at batch 64 it spans the last ~10
        # steps' trees, where decayed by observation it was the last ~10 requests' (and one request's failing
        # probes could outweigh the batch that came before it)
        self.accepted, self.predicted = DECAY * self.accepted, DECAY * self.predicted
        self.bins.decay(DECAY)
        if rows <= 0 or seconds <= 0:
            return
        if self.fit.n == 0 and fit:  # the prior, from the first step that prices rows: t_row = share * T / rows
            # (optimistic, so the first trees get verified and the fit learns from them. Seeded by a decoding step's
            # few rows it priced a row at half that step, and no tree ever ran: plain steps of one width never
            # move the slope. A prompt found in the prefix cache makes the first step such a one, hence at least
            # PRIOR_MIN_ROWS: on the H200 batch 16's 16 rows gave a threshold of 1.9 tokens a row, none verified.
            # Not from a prefill step: its pseudo-steps sat at the prompt's rows and time, and against the decoding
            # steps that followed they read as a row cost of a prefill's time by its rows. On the H100 at batch 16
            # the slope climbed from 0.1 to 18 us a row over 23 plain steps after trees had measured ~0, and the
            # threshold from 0.02 to 0.31 tokens, above the drafter's first nodes, so no probe ran)
            t_row = self.prior_row_share * seconds / max(rows, PRIOR_MIN_ROWS)
            # two pseudo-steps on either side of this one, as far: while the steps that follow have its width, they
            # give the prior's slope whatever their time (asymmetric, a first step slower than the next ones
            # read as a steep slope)
            spread = max(1, rows // 2)
            self.fit.seed([(r, seconds + t_row * (r - rows)) for r in (rows - spread, rows + spread)], PRIOR_WEIGHT / 2)
        if not fit:
            return
        if self.pipelined and not self.switches_ahead:  # (switches ahead: no switch is priced, switch_tokens)
            self.switch.observe(seconds - self.fit.predict(rows, tree and self.price_tree_steps), synchronous)
        self.last_tree = tree
        self.fit.add(rows, seconds, tree=tree and self.price_tree_steps)
        self.last_rows, self.last_seconds = rows, seconds
        self.tokens, self.seconds = DECAY * self.tokens + tokens, DECAY * self.seconds + seconds

    def observe_draft(self, num_requests: int, seconds: float) -> None:
        """The drafter ran for num_requests requests this step and took `seconds`."""
        self.version += 1
        self._costs = None
        self.drafting.observe(num_requests, seconds)

    def draft_tokens(self) -> float:
        """Throughput one drafted request costs, in tokens: t_draft * tokens per second of the last step."""
        return self._step_costs()[1]

    def _step_costs(self) -> tuple[float, float]:
        """(threshold, draft_tokens), computed once between observations: every request's budget asks for both."""
        if self._costs is None:
            self._costs = (self._threshold(), self._draft_tokens())
        return self._costs

    def _in_tokens(self, seconds: float) -> float:
        """Tokens the engine's decayed decoding throughput makes in `seconds` (0 before any decoding step)."""
        return seconds * self.tokens / self.seconds if self.seconds > 0 else 0.0

    def cheap_draft(self) -> bool:
        """A draft for a request at budget 0 may run every step: it costs next to nothing and no step runs ahead of
        its predecessor's results (it needs the request's newest token on the host)."""
        return self.draft_tokens() <= CHEAP_DRAFT and not self.pipelined

    def _draft_tokens(self) -> float:
        per_request = self.drafting.per_request()
        if per_request is None or self.last_seconds <= 0:
            return 0.0  # too few measurements: drafting counts as free until then
        return self._in_tokens(per_request)

    def observe_request(self, request_id: str, budget: int, accepted_rows: list[int],
                        confidence: list[float] | tuple[list[float], list[int]], trees: list | None = None) -> None:
        """A tree step of one request: the budget it verified, the tree rows of its accepted drafts (row j >= 1 is
        the j-th node of the best-first order), and its full-budget tree's node confidence as _set_tree takes
        it. trees: where a step's verified trees gather for the reliability bins, which take them at once
        (observe_engine_step); None: taken now."""
        self.version += 1
        stats = self._set_tree(request_id, confidence)
        accepted = len(accepted_rows)
        predicted = sum(stats.node_q[:budget]) if budget > 0 else 0.0
        stats.accepted = DECAY * stats.accepted + accepted
        stats.predicted = DECAY * stats.predicted + predicted
        if accepted:
            stats.probe_interval, stats.failed_q = PROBE_EVERY, None
        elif 0 < budget <= PROBE_BUDGET and predicted > 0:  # a probe's size (or as small), nothing accepted:
            # probe less often. A probe chosen on an older tree whose own tree came out without mass tested
            # nothing (the H100 at batch 16, T = 0: such probes kept doubling the wait while the text turned to
            # copying)
            stats.probe_interval = min(2 * stats.probe_interval, MAX_PROBE_BACKOFF)
            stats.failed_q = predicted
        if predicted > 0:
            stats.verified = True
            self.accepted += accepted  # decayed by the step (observe_step)
            self.predicted += predicted
            tree = (stats.node_q, stats.node_bins, budget, accepted_rows)
            if trees is None:
                self.bins.observe([tree])
            else:
                trees.append(tree)
            self.latest = stats

    def observe_curve(self, request_id: str, confidence: tuple[list[float], list[int]]) -> None:
        """The request's full-budget tree for its coming step, drafted before its budget is asked (engine/
        draft_first.py), as confidence_rows() split it: its budget prices this tree."""
        stats = self._set_tree(request_id, confidence)
        stats.gains = stats.pending = None  # both were worked out from the previous tree

    def _set_tree(self, request_id: str, confidence: list[float] | tuple[list[float], list[int]]) -> RequestRecord:
        """The request's latest tree from its node confidence: the two split (confidence.confidence_rows, what the
        engine's results carry; kept as they are, never modified), or one node_confidence() row, B node
        probabilities q then their B bins (the tests' and bench/controller_sim.py's form)."""
        self.events += 1
        stats = self.requests.get(request_id)
        if stats is None:
            stats = self.requests[request_id] = RequestRecord()
        if isinstance(confidence, tuple):  # (q, int bins): confidence_rows, the engine's results
            stats.node_q, stats.node_bins = confidence
        else:
            num_nodes = len(confidence) // 2
            stats.node_q, stats.node_bins = confidence[:num_nodes], list(map(int, confidence[num_nodes:]))
        stats.best = None  # (value_together's, of the previous tree)
        stats.q_total = sum(stats.node_q[:self.max_budget])
        if stats.failed_q is not None and sum(stats.node_q[:PROBE_BUDGET]) > stats.failed_q + CONFIDENCE_RISE:
            # the drafter is surer than when its probe failed (a reply that starts copying): probe at once again
            stats.probe_interval, stats.failed_q = PROBE_EVERY, None
        return stats

    def take_probes(self) -> int:
        """Counted budgets that were probes (a small tree verified to re-rate a request whose record says its
        confident drafter is wrong, or a new request's first) since the last call: for metrics."""
        n, self.num_probes = self.num_probes, 0
        return n

    def take_confidence_counts(self) -> dict[str, tuple[int, float]]:
        """Per confidence bin verified since the last call (ReliabilityBins.take_counts): for metrics."""
        return self.bins.take_counts()

    # ----------------------------------------------------------------------------------------------- choosing

    def threshold(self) -> float:
        """Expected accepted tokens a verify row must bring: t_row * throughput of the last step."""
        return self._step_costs()[0]

    def _threshold(self) -> float:
        if self.last_seconds <= 0:
            return MIN_GAIN
        # the throughput a row's time would have bought: decayed over steps, not the last step's (at batch 1 a
        # step emits 1 to 8 tokens, and the threshold followed it step by step, the budget flapping with it)
        return max(MIN_GAIN, self._in_tokens(self._row_seconds()))

    def _row_seconds(self) -> float:
        """A verify row's fitted cost (before any fit: the prior's share of the last step's time a row)."""
        t_row = self.fit.slope()
        if t_row is None:
            t_row = self.prior_row_share * self.last_seconds / max(1, self.last_rows)
        return t_row

    def budget(self, request_id: str, dry: bool = False, ahead: bool = False) -> int:
        """This step's tree budget for the request (before the scheduler's caps). dry: what it would be, without
        counting the step (asynchronous scheduling asks before it decides whether the next step can run
        ahead; the counted call that follows, with no observation in between, reuses that answer instead of
        working it out again: at batch 64 both ran on the host's critical path). ahead: asked for the step after
        the one in flight, before that one is observed (see _aligned)."""
        if not self.enabled or self.max_budget == 0:  # (budgets_of: the same checks, once for a whole step)
            return self.max_budget
        if not self.guard.allows_trees():
            return 0
        return self._answer(request_id, dry, ahead)

    def _answer(self, request_id: str, dry: bool, ahead: bool, effects: list | None = None) -> int:
        """budget() once trees are allowed (StepBudgets.budgets_of asks for a whole step's requests). effects: where
        a counted answer that changes the request's probe state appends (its id, its record, that effect)."""
        stats = self.requests.get(request_id)
        if stats is None or not stats.node_q:
            return self._first_budget()
        if stats.q_total == 0.0:  # a tree without mass: _choose's (0, None) whatever the probe state
            if dry:
                stats.pending = ((self.version, ahead), 0, None)
            else:
                stats.pending, stats.probing = None, False
            return 0
        key = (self.version, ahead)
        if stats.pending is not None and stats.pending[0] == key:
            chosen, effect = stats.pending[1:]
        else:
            chosen, effect = self._choose(stats, ahead)
        if dry:
            stats.pending = (key, chosen, effect)
            return chosen
        stats.pending = None
        stats.probing = effect == PROBED
        if effects is not None and effect is not None:
            effects.append((request_id, stats, effect))
        if effect == PROBED:
            stats.steps_at_zero = 0
            self.num_probes += 1
            if not stats.probe_unobserved:
                stats.probe_unobserved = True
                self.probes_unobserved += 1
        elif effect == AT_ZERO:
            stats.steps_at_zero += 1
        elif effect == CHOSEN:
            stats.steps_at_zero = 0
            stats.draft_interval = stats.probe_interval = PROBE_EVERY
        return chosen

    def _choose(self, stats: RequestRecord, ahead: bool) -> tuple[int, str | None]:
        """(the request's budget, what counting it does to its probe state)."""
        theta = self.threshold()
        if stats.best is not None and stats.best[0] == (self.version, theta):
            chosen = stats.best[1]  # (worked out for the whole step, StepBudgets.value_step: 0 where it cannot pay)
        elif self._cannot_pay(stats, theta):
            return 0, None
        else:
            chosen = self._net_best(stats, theta)
        if chosen == 0 and nodes_above(stats.node_q[:self.max_budget], theta):
            # the drafter is confident but this request's record says it is wrong: verify a small tree now
            # and then, in case it has become right; at once when that record is only the engine's prior (a
            # new request after a run of failing ones would otherwise wait up to two probe intervals); not in the
            # step planned ahead of the one that carries its probe, whose outcome that step cannot know (on the
            # H100 at batch 16, T = 1, each probe ran twice, every request paying a ~0.5 ms tree step for it)
            if ahead and stats.probing:
                return 0, AT_ZERO
            if (not stats.verified and self._first_probe_due(ahead)) or \
                    (stats.steps_at_zero + 1 >= stats.probe_interval and self._aligned(ahead)):
                return min(PROBE_BUDGET, self.max_budget), PROBED
            return 0, AT_ZERO
        return chosen, CHOSEN if chosen else None

    def _first_budget(self) -> int:
        """A request without a draft of its own: the tree the drafter last drew for another request, valued at the
        engine-wide record (a request's first tree is no worse a guess than its neighbour's); 0 before any tree
        was verified, while drafting is cheap (this step then drafts without verifying, the runner watching
        budget 0, and the next one values the request's own tree), and for a drafter whose trees come from each
        request's own text (borrow off: the n-gram rule, whose trees say nothing about another request's text; on
        an H100 at batch 64 the first round after the guard let trees back in gave 31 requests budget 16 for 12
        tokens beyond a plain step's, most likely requests admitted meanwhile valued at a neighbour's tree:
        docs/BENCHMARKS.md, 2026-12-07)."""
        lender = self._lender()
        if lender is None or self.cheap_draft():
            return 0
        return self._net_best(lender, self.threshold(), standing=1.0)

    def _lender(self) -> RequestRecord | None:
        """The tree a request without one of its own is valued by: the latest verified, unless borrow is off."""
        return self.latest if self.borrow else None

    @staticmethod
    def _is_probe(stats: RequestRecord) -> bool:
        """The request's budget this step is a probe: the counted answer's, or (a step planned ahead) the dry
        answer about to be counted."""
        return stats.pending[2] == PROBED if stats.pending else stats.probing

    def _aligned(self, ahead: bool = False) -> bool:
        """This step is one where probes and interval drafts may run (the same for every request). A step is
        numbered by the steps observed before it; a step planned ahead of its predecessor's results is asked
        about before that predecessor is observed, hence `ahead`. Without it the dry question (may the next
        step run ahead?) and the real one (scheduling it after the predecessor) straddled a clock tick: the
        dry one saw the aligned step and kept the step synchronous, the real one saw the next and said 0, so
        under asynchronous scheduling no probe or interval draft ever ran."""
        return (self.clock + ahead) % max(PROBE_EVERY, self.explore_period()) == 0

    def _first_probe_due(self, ahead: bool) -> bool:
        """A request whose record is only the engine's prior probes at once without CUDA graphs; under them on a
        step aligned to FIRST_PROBE_EVERY, where new requests' first probes share one tree round (each at its own
        step, 1-18 requests' trees made the first 30 steps of a batch-64 run on an H100 rounds at twice a plain
        step's time). A new request's first draft waits for the same steps (request_record.draft_due)."""
        return self.costs.shape_of is None or \
            (self.clock + ahead) % max(FIRST_PROBE_EVERY, self.explore_period()) == 0

    def should_draft(self, request_id: str, dry: bool = False, ahead: bool = False) -> bool:
        """Whether a decoding request at budget 0 drafts this step (curve only, no verify rows). dry, ahead: as
        budget().
        Under asynchronous scheduling (`pipelined`) a draft is never cheap: it needs the request's newest token
        on the host, so the step cannot run ahead of the previous one's results."""
        if not self.guard.allows_trees():  # a plain window drafts nothing, as --drafter none would
            return False
        return draft_due(self.requests.get(request_id), self.cheap_draft(), self._aligned(ahead), dry,
                         self._first_probe_due(ahead))
