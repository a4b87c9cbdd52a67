"""The step-level half of the adaptive budget (engine/speculative/adaptive.py's BudgetController inherits it): what
an engine step teaches it, one step's requests' budgets put to the width the step lays out (harmonized trees
without CUDA graphs, one uniform width under them), the fixed cost of a tree step, and under asynchronous
scheduling the switch into trees. Everything per request (gains, probes, thresholds, costs) is the controller's."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from engine.speculative.request_record import AT_ZERO, PROBED, draft_due
from engine.speculative.step_width import common_width, uniform_width, uniform_width_array
from engine.speculative.tree_value import VALUE_TOGETHER


class StepBudgets:
    def observe_engine_step(self, plan, result, seconds: float, draft_seconds: float, synchronous: bool,
                            uniform_layout: bool, cycle_seconds: float | None = None,
                            unpriced_drafts: tuple[bool, bool] = (False, False)) -> None:
        """What the budget learns from one engine step (an engine.plan StepPlan and its StepResult): its rows and
        time, its drafting, and each tree's acceptance. uniform_layout: a tree step lays every decoding request
        out at the step's width (CUDA graphs). synchronous: as observe_step's. cycle_seconds: the host's time from
        the previous step's results to this one's, everything in between included (the guard's throughput;
        default `seconds`). unpriced_drafts: whether the step drafted, and whether its time holds the drafting of the
        step launched ahead while it ran, where the budget does not price a draft's cost (asynchronous scheduling):
        the guard's speculation and what paid for it."""
        width = max(s.spec_budget for s in plan.seqs) + 1  # verify rows per tree request (padded)
        # the cost fit prices one more verify row of a decoding step; a step with a prefill chunk would flatten it
        # (a chunk's rows share one weight read, so each costs a fraction of a decoding row)
        decoding = all(s.num_new_tokens == 1 for s in plan.seqs)
        if decoding and width > 1 and uniform_layout:
            rows = width * len(plan.seqs)
        else:
            rows = sum(width if s.spec_budget else s.num_new_tokens for s in plan.seqs)
        tokens = sum(len(t) for t in result.new_token_ids.values())
        warm_up = _warming_up(plan)
        # under CUDA graphs a plain step that drafted curves took the drafter's host work too (at batch 64 on an
        # H100 1-4 ms beside 1.3): priced as rows, it flattened the fit to ~0 a row, and trees 9 wide ran for a few
        # requests. (Without graphs a request at budget 0 drafts at every step while drafting is cheap: those steps
        # are most of the plain ones, and their drafting is measured on the host apart, DraftCost)
        curves_only = uniform_layout and width == 1 and result.num_drafted > 0
        measured = not warm_up and not curves_only
        self.observe_step(rows, seconds, tokens, fit=decoding and measured, tree=width > 1, synchronous=synchronous)
        if uniform_layout and measured and (decoding or synchronous):
            # a synchronous step is measured with its prefill chunks (an admission's): the steps it is priced
            # against, plain or with trees, hold them alike
            leaving = width == 1 and plan.seqs[0].root_on_device  # a root-only round: trees' predecessor in flight
            self.costs.observe(len(plan.seqs), width, seconds, leaving, synchronous)
        if decoding:
            self.guard.observe(len(plan.seqs), tokens, seconds if cycle_seconds is None else cycle_seconds, width > 1,
                               *unpriced_drafts)
        self.observe_draft(result.num_drafted, draft_seconds)
        probed = self._probed(plan) if self.probes_unobserved else False
        if probed and uniform_layout and decoding and width > 1 and measured:
            self._judge_exploration(len(plan.seqs), tokens, seconds)
        trees: list = []  # the step's verified trees, for the reliability bins at once
        for s in plan.seqs if result.curves else ():  # (no curves: no request drafted)
            rid = s.request.request_id
            if rid in result.curves and not s.request.finished:  # (finished while a step ran ahead: released)
                # only the nodes it chose: the rest filled the step's width (the accepted path's prefix among
                # them is what the chosen tree alone would have accepted)
                chosen = s.spec_budget if s.chosen_budget is None else s.chosen_budget
                accepted = [r for r in result.accepted_rows.get(rid, []) if r <= chosen]
                self.observe_request(rid, chosen, accepted, result.curves[rid], trees)
        if trees:
            self.bins.observe(trees)

    def _probed(self, plan) -> bool:
        """Whether the step carried a counted probe (each request's flag is consumed here)."""
        probed = False
        for s in plan.seqs:
            stats = self.requests.get(s.request.request_id)
            if stats is not None and stats.probe_unobserved:
                stats.probe_unobserved, probed = False, True
                self.probes_unobserved -= 1
        return probed

    def _judge_exploration(self, num_seqs: int, tokens: int, seconds: float) -> None:
        """A tree round that carried probes, under CUDA graphs: when the drafts it accepted (all of its requests')
        fall short of what it cost beyond a plain step at this batch, with the root-only round that leaves trees, in
        tokens of throughput, explore_period doubles (up to MAX_EXPLORE_BACKOFF times its price); a round that paid
        restores it."""
        plain, _, leaving = self.costs.round_extra(num_seqs)
        if plain is None:
            return
        cost = self._in_tokens(max(0.0, seconds - plain) + leaving)
        if tokens - num_seqs >= cost:
            self.explore_backoff = 1
        else:
            self.explore_backoff = min(2 * self.explore_backoff, MAX_EXPLORE_BACKOFF)

    def budgets_of(self, request_ids: list[str], dry: bool = False, ahead: bool = False) -> list[int]:
        """budget() of each of a step's requests, the checks that hold for the whole step made once (at batch 64 the
        calls' own overhead was most of a plain step's budget work)."""
        if not self.enabled or self.max_budget == 0:
            return [self.max_budget] * len(request_ids)
        if not self.guard.allows_trees():
            return [0] * len(request_ids)
        self.batch = len(request_ids)
        held = self._held() if dry and ahead else None
        if held is not None:  # a request the held decision does not cover (just admitted) is asked
            return [0 if rid in held[1] else self._answer(rid, dry, ahead) for rid in request_ids]
        self.value_step(request_ids, ahead)
        return [self._answer(rid, dry, ahead) for rid in request_ids]

    def count_plain(self, request_ids: list[str]) -> None:
        """Counts the budgets of a step planned ahead that stays plain (its dry answers, budgets_of(dry=True,
        ahead=True), wanted no tree its width pays for). At HOLD_MIN_BATCH requests or more under CUDA graphs the
        decision then holds for those requests: until a tree is observed (verified or drafted: `events`) or a
        step aligned to HOLD_EVERY comes (every probe falls on one), their dry answers are 0 without asking each,
        and counting a held step adds one step at zero to each request the full count put there, as the full
        count would. A request's answer does not depend on the others, so the hold outlives requests that finish,
        and one admitted meanwhile is asked as usual. Asked in full at every step, 64 requests whose trees hold
        mass cost 0.3-0.5 ms of a 1.3 ms plain step on an H100's host (docs/BENCHMARKS.md), and the answer hardly
        ever changed. (A hold that ended with any change of the batch was rebuilt every few steps while a batch
        drained: on the 2-core CPU 25 us a step against 16 now.)"""
        if not self.enabled or self.max_budget == 0 or not self.guard.allows_trees():
            return
        self.batch = len(request_ids)
        held = self._held()
        if held is None:
            self.value_step(request_ids, True)
        effects: list = []  # (request id, record, effect) of the requests whose probe state counting changed
        for rid in request_ids:
            if held is None or rid not in held[1]:
                self._answer(rid, False, True, effects)
            elif rid in held[2]:
                held[2][rid].steps_at_zero += 1
        if held is not None:
            return
        self._hold = None
        if len(request_ids) >= HOLD_MIN_BATCH and self.costs.shape_of is not None and \
                all(effect != PROBED for _, _, effect in effects):
            at_zero = {rid: stats for rid, stats, effect in effects if effect == AT_ZERO}
            self._hold = ((self.events, (self.clock + 1) // HOLD_EVERY), set(request_ids), at_zero)

    def value_step(self, request_ids: list[str], ahead: bool) -> None:
        """Before a step's requests are answered one by one (_choose): the own trees with mass of those without a dry
        answer standing for this step valued at once, their `best` 0 where the tree cannot pay (_cannot_pay, whose
        answer is then _choose's whatever the probe state: its first node is below the threshold) and the others
        valued together (TreeValue.value_together), when there are enough of them."""
        if len(request_ids) < VALUE_TOGETHER or not self.enabled or not self.guard.allows_trees():
            return
        key, theta = (self.version, ahead), self.threshold()
        best = ((self.version, theta), 0)
        records = []
        for rid in request_ids:
            stats = self.requests.get(rid)
            if stats is None or not stats.node_q or stats.q_total == 0.0 or \
                    (stats.pending is not None and stats.pending[0] == key):
                continue
            if self._cannot_pay(stats, theta):
                stats.best = best
            else:
                records.append(stats)
        self.value_together(records, theta)

    def _held(self) -> tuple | None:
        """count_plain's held decision when it stands for the step planned ahead now: (its key, the request ids it
        covers, {request id: record} of those it keeps at zero); else None."""
        hold = self._hold
        return hold if hold is not None and hold[0] == (self.events, (self.clock + 1) // HOLD_EVERY) else None

    def drafts_of(self, request_ids: list[str], dry: bool = False, ahead: bool = False) -> list[bool]:
        """should_draft() of each of a step's requests, as budgets_of."""
        if not self.guard.allows_trees():  # a plain window drafts nothing, as --drafter none would
            return [False] * len(request_ids)
        self.batch = len(request_ids)
        cheap, aligned, first = self.cheap_draft(), self._aligned(ahead), self._first_probe_due(ahead)
        return [draft_due(self.requests.get(rid), cheap, aligned, dry, first) for rid in request_ids]

    def harmonize(self, request_ids: list[str], budgets: list[int]) -> list[int]:
        """The counted budgets of one step's decoding requests, at one padded width (step_width.common_width),
        for a step that pads only its trees (without CUDA graphs): a request whose nodes do not pay for the width
        the others want falls to 0; probes keep theirs; and when the trees together do not beat the fixed cost of
        a tree step (fitted: CostFit.tree_cost), every budget falls to 0 (~0.18 ms for 64 requests of 16 nodes on
        the 2-core CPU). Also for the dry answers of a step planned ahead (their counted calls follow the plan)."""
        if not self.enabled:
            return budgets
        gains, probes = self._step_gains(request_ids, budgets, budgets)
        fixed = [bool(p) for p in probes]
        out = common_width(gains, budgets, self.threshold(), fixed)
        if any(fixed) or not any(out) or self._trees_pay(gains, out):
            return out
        return [0] * len(out)

    def _trees_pay(self, gains: list[list[float]], budgets: list[int]) -> bool:
        """The step's trees (at one padded width) bring more expected tokens, net of their rows and drafting, than
        the fixed cost of a tree step (CostFit.tree_cost, in tokens of throughput)."""
        fixed = self._in_tokens(self.fit.tree_cost())
        if fixed <= 0:
            return True
        theta, draft, width = self.threshold(), self.draft_tokens(), max(budgets)
        net = sum(sum(g[:b]) - theta * width - draft for g, b in zip(gains, budgets) if b)
        return net > fixed

    def uniform(self, request_ids: list[str], budgets: list[int], caps: list[int],
                synchronous: bool = False) -> list[int]:
        """The nodes each of one step's decoding requests verifies when the step is laid out uniformly (CUDA
        graphs: a step with any tree lays every request out at its width, so the width is priced for all of them
        and every request whose nodes beat its drafting cost fills it: step_width.uniform_width). budgets: the
        counted (or dry, for a step planned ahead) answers of budget(); caps: each request's most nodes. A step
        in which no request wants a tree stays plain: each request's own choice priced its rows alone, and a
        uniform step's width costs every request at least that. synchronous: the step is scheduled after its
        predecessor's results, priced at what such steps measured under asynchronous scheduling."""
        if not self.enabled or not any(budgets):
            return budgets
        caps = [max(0, c) for c in caps]
        n = len(request_ids)
        # (from VALUE_TOGETHER requests on, the gains and the width in numpy passes over the whole batch)
        gains, probes = (self._step_gain_rows if n >= VALUE_TOGETHER else self._step_gains)(request_ids, budgets, caps)
        width = uniform_width_array if n >= VALUE_TOGETHER else uniform_width
        return width(gains, caps, self.threshold(), self.draft_tokens(), probes, self.switch_tokens(n),
                     self._width_costs(n, max(caps, default=0), synchronous and self.pipelined))

    def _width_costs(self, num_seqs: int, top: int, synchronous: bool = False) -> list[float] | None:
        """What each width 0..top costs a step of num_seqs requests in tokens, as measured per graph shape
        (step_costs.py; None: priced by rows, theta a row), for a step launched ahead or (synchronous) after its
        predecessor's results. Kept until the next observation."""
        key = (self.version, num_seqs, top, synchronous)
        if self._widths is None or self._widths[0] != key:
            seconds = self.costs.width_seconds(num_seqs, top, self._row_seconds(), synchronous)
            if seconds is None:
                tokens = None
            elif self.seconds <= 0:
                # no decoding step's throughput yet to put seconds in tokens (every price would read 0 and the widest
                # tree win: a batch-64 run's first probes went out 16 nodes wide, every request filling them): only
                # probes run, each at its own width
                tokens = [w * UNPRICED_TOKENS for w in range(top + 1)]
            else:
                tokens = [self._in_tokens(s) for s in seconds]
            self._widths = (key, tokens)
        return self._widths[1]

    def explore_period(self) -> int:
        """Under CUDA graphs, the steps between those where probes and first drafts may run (a power of two, at least 1;
        the caller's own cadence is the floor), priced at the batch being planned (`batch`): a probe's step lays the
        whole batch out at the probe's width and then leaves trees through a root-only round, so the period is long
        enough that their measured extra (StepCosts.round_extra; before any round at this batch, the probe width's
        price, width_seconds) is at most PROBE_SHARE of the plain steps it recurs over at FULL_BATCH requests
        (FULL_BATCH / batch times that at fewer), up to MAX_EXPLORE_PERIOD. On an H100 at batch 64 under load the n-gram
        default's tree rounds (2.3-2.7 ms against 1.3, 15-49 in a run of ~900 steps, 0.2-0.55 drafts accepted each) and
        curve steps cost it 5-8% against speculation off, first probes and first drafts falling on every 4th step
        (docs/BENCHMARKS.md, 2026-12-07); at batch 1 the period stays at the caller's. 1 without graphs or before a
        plain step at this batch is measured (the caller's cadence then). Times explore_backoff: while probe rounds
        do not pay for themselves, exploring finds nothing worth its price, and it comes up to MAX_EXPLORE_BACKOFF
        times less often (_judge_exploration)."""
        key = (self.version, self.batch)
        if self._period is None or self._period[0] != key:
            self._period = (key, self._priced_period() * self.explore_backoff)
        return self._period[1]

    def _priced_period(self) -> int:
        n = self.batch
        plain, extra, leaving = self.costs.round_extra(n) if n > 0 else (None, None, 0.0)
        if plain is None:
            return 1
        if extra is None:  # no round measured at this batch: priced as a probe's width would be (optimistic)
            width = min(PROBE_BUDGET, self.max_budget)
            extra = self.costs.width_seconds(n, width, self._row_seconds())[width]
        extra += leaving
        share = min(1.0, PROBE_SHARE * FULL_BATCH / n)
        period = 1
        while period < MAX_EXPLORE_PERIOD and extra > share * period * plain:
            period *= 2
        return period

    def switch_tokens(self, num_seqs: int = 0) -> float:
        """Tokens of throughput a tree step after a plain one costs beyond its rows, priced once at the switch into
        trees. Under asynchronous scheduling a tree step that cannot run ahead of its predecessor's results (its
        scheduling and drafting leave the device idle) costs more, and so does the plain step after the trees
        (SwitchCost). When the engine launches tree steps ahead of any decoding step (`switches_ahead`: a drafter
        that drafts from the device, under CUDA graphs) no switch is synchronous, but trees are left by a
        root-only round, whose measured extra at this batch (step_costs.py) the entering step pays: its mean however
        long ago (StepCosts.round_extra). Priced at 0 once its record went stale (~70 plain steps at the batch),
        entering trees looked a whole leaving round cheaper than it is (~1.2 ms beside a 1.46 ms plain step on an
        H100 at batch 64); and the leaving round needs no re-measuring: it is measured whenever trees are left."""
        after_tree = self.last_tree if self._after is None else self._after
        if not self.pipelined or after_tree:
            return 0.0
        if self.switches_ahead:
            return self._in_tokens(self.costs.round_extra(num_seqs)[2])
        return self._in_tokens(self.switch.seconds())

    @contextmanager
    def planning_after(self, tree: bool):
        """Answers asked while a step is planned ahead of its predecessor's results: that predecessor (in flight,
        not yet observed) decides whether a tree would switch into trees (switch_tokens), not the last observed
        step. Without it the dry plan (after a tree step) and the counted one (after the step before) disagreed,
        and steps that could have run ahead ran synchronously."""
        saved, self._after = self._after, tree
        try:
            yield
        finally:
            self._after = saved

    def _step_gain_rows(self, request_ids: list[str], budgets: list[int], caps: list[int]
                        ) -> tuple[np.ndarray, list[int]]:
        """_step_gains as an [n, max(caps)] array, zero past each cap: the trees of the requests' own valued
        together (TreeValue.gain_rows), a borrowed tree's gains row by row."""
        top = max(caps, default=0)
        gains = np.zeros((len(request_ids), top))
        records = [self.requests.get(rid) for rid in request_ids]
        own = [i for i, stats in enumerate(records) if stats is not None and stats.node_q]
        if own and top:
            rows = self.gain_rows([records[i] for i in own])[:, :top]
            gains[own, :rows.shape[1]] = rows
        lender = self._lender()
        probes = []
        for i, (stats, budget, cap) in enumerate(zip(records, budgets, caps)):
            if stats is None or not stats.node_q:
                if lender is not None and cap > 0:
                    row = self._gains(lender, 1.0, cap)
                    gains[i, :len(row)] = row
                probes.append(0)
            else:
                probes.append(budget if budget and self._is_probe(stats) else 0)
        return np.where(np.arange(top) < np.asarray(caps)[:, None], gains, 0.0), probes

    def _step_gains(self, request_ids: list[str], budgets: list[int], lengths: list[int]
                    ) -> tuple[list[list[float]], list[int]]:
        """Per request, the expected accepted tokens of its first `lengths` nodes (its own latest tree, else the
        one the drafter last drew for another request at the engine-wide record, unless borrow is off: none), and
        its budget if that is a probe (else 0)."""
        gains, probes = [], []
        for rid, budget, length in zip(request_ids, budgets, lengths):
            stats = self.requests.get(rid)
            own = stats is not None and bool(stats.node_q)
            source, standing = (stats, None) if own else (self._lender(), 1.0)
            gains.append(self._gains(source, standing, length) if length > 0 and source is not None else [])
            probes.append(budget if budget and own and self._is_probe(stats) else 0)
        return gains, probes


PROBE_BUDGET = 4  # nodes a probe verifies (a request whose record says its confident drafter is wrong)
# under CUDA graphs a step that probes costs at most this share of the steps between probe steps (explore_period) at
# FULL_BATCH requests, and at fewer that much more in proportion: each probe step then re-rates a larger share of the
# batch, and at batch 1 the request that pays is the one whose trees may pay it back (on the self-repeating prompt
# the n-gram default ran 3.7-4.1x off at batch 1 on an H100, its rounds 0.3 ms beyond a 0.69 ms step)
PROBE_SHARE = 0.02
FULL_BATCH = 64
MAX_EXPLORE_PERIOD = 64
# ... times up to this while probe rounds do not pay for themselves (_judge_exploration): on an H100 with a slow host
# at batch 64, T = 1, rounds cost 3.1 ms beyond a 1.46 ms plain step and brought ~6 tokens each; one every 64 steps
# (with the root-only round after it) still cost the n-gram default ~4.6% against speculation off (docs/BENCHMARKS.md,
# 2026-12-07 16:06)
MAX_EXPLORE_BACKOFF = 4

# a plain step's decision planned ahead holds (count_plain) at this many requests or more, until a step aligned to
# HOLD_EVERY (a multiple of it: probes and first probes fall there)
HOLD_MIN_BATCH = 16
HOLD_EVERY = 4

UNPRICED_TOKENS = 1e9  # a node of width in a step priced before any throughput was measured (_width_costs)

WARM_UP_TOKENS = 3  # a request with fewer output tokens is still warming up (its drafter just took in its prompt)


def _warming_up(plan) -> bool:
    """A batch's first steps: 8 or more requests, a quarter of them with fewer than WARM_UP_TOKENS output tokens.
    Their time is the drafter taking in the prompts (on an H100 a batch-64 plain step took 8-11 ms there against
    1.3 later), so they neither price rows nor count as a shape's step time."""
    n = len(plan.seqs)
    if n < 8:
        return False
    young = sum(1 for s in plan.seqs if len(s.request.output_token_ids) < WARM_UP_TOKENS)
    return 4 * young >= n
