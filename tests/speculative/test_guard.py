"""The throughput guard (engine/speculative/guard.py): trees that lose to plain decoding in measured throughput go
off, whatever the cost model said; trees that win stay on at a small cost; a check across a changed batch decides
nothing. Then through the engine: a cost of tree steps that the step timer cannot see."""
from __future__ import annotations

import time

from engine import LLM, SamplingParams
from engine.scheduler import Scheduler
from engine.speculative.adaptive import MIN_GAIN, BudgetController
from engine.speculative.cost_fit import CostFit
from engine.speculative.guard import (BACKOFF, EXPLORE_SHARE, MAX_BACKOFF, MIN_TREE_SHARE, PLAIN_STEPS, SETTLE,
                                     SPARSE_MIN, WINDOW, ThroughputGuard)
from engine.speculative.ngram_device import DeviceNgramDrafter
from engine.speculative.oracle import OracleDrafter
from engine.speculative.speculator import Speculator
from tests.speculative.test_ddtree_e2e import golden_lookup, prompts


def drive(guard: ThroughputGuard, num_steps: int, tree_step, plain_step, batch=lambda step: 16) -> list[bool]:
    """Runs num_steps decoding steps; tree_step(n) / plain_step(n): (tokens, seconds) of a step at batch n. Returns
    whether each step ran trees (whenever the guard allows them)."""
    ran = []
    for step in range(num_steps):
        n, trees = batch(step), guard.allows_trees()
        tokens, seconds = tree_step(n) if trees else plain_step(n)
        guard.observe(n, tokens, seconds, trees)
        ran.append(trees)
    return ran


def plain(n):
    return n, 1e-3


def test_trees_that_lose_to_plain_decoding_go_off_for_a_growing_back_off():
    guard = ThroughputGuard()
    ran = drive(guard, 3000, lambda n: (int(1.2 * n), 1.5e-3), plain)  # 1.2 tokens a request at 1.5x the time
    outcomes, forced = guard.take_outcomes()
    assert outcomes and set(outcomes) == {"lost"}, outcomes
    assert ran[:WINDOW + 1] == [True] * WINDOW + [False]  # the first window, then the check
    first_off = ran.index(False)
    assert not any(ran[first_off:first_off + PLAIN_STEPS + 1 + BACKOFF])  # the check, then the back-off
    assert sum(ran) < 0.1 * len(ran)  # rechecked now and then, each back-off twice the last
    assert forced == len(ran) - sum(ran)


def off_stretches(ran: list[bool]) -> list[int]:
    """Lengths of the runs of steps without trees."""
    runs, n = [], 0
    for trees in ran + [True]:
        if not trees:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def test_trees_that_lose_by_much_stay_off_until_the_loss_is_paid_back():
    """A window whose trees gave half the plain throughput forwent ~WINDOW / 2 steps: trees then stay off long enough
    that this is EXPLORE_SHARE of the time, where a narrow loss backs off BACKOFF steps."""
    lost_half = ThroughputGuard()
    ran = drive(lost_half, 4 * MAX_BACKOFF, lambda n: (n, 2e-3), plain)  # every tree step at half the plain rate
    first = off_stretches(ran)[0] - SETTLE - PLAIN_STEPS  # less the forced plain window and its settling steps
    assert first == round(0.5 * WINDOW / EXPLORE_SHARE), first
    assert sum(ran) * 0.5 <= 1.2 * EXPLORE_SHARE * len(ran)  # steps forgone by the windows: about the share
    narrow = ThroughputGuard()
    ran = drive(narrow, 2000, lambda n: (n, 1.04e-3), plain)  # 4% slower
    assert off_stretches(ran)[0] - SETTLE - PLAIN_STEPS == BACKOFF, off_stretches(ran)


def test_trees_that_win_stay_on_and_the_checks_thin_out():
    guard = ThroughputGuard()
    ran = drive(guard, 6000, lambda n: (2 * n, 1.3e-3), plain)
    outcomes, forced = guard.take_outcomes()
    assert set(outcomes) == {"won"} and len(outcomes) <= 10, outcomes  # intervals 32, 64, ... 1024, 1024, ...
    assert forced < 0.03 * len(ran), forced


def test_a_tie_goes_to_plain_decoding():
    guard = ThroughputGuard()
    drive(guard, WINDOW + PLAIN_STEPS + 2, lambda n: (n, 1e-3), plain)  # trees that accept nothing and cost nothing
    assert guard.take_outcomes()[0] == ["lost"]
    assert not guard.allows_trees()


def test_a_window_with_few_tree_steps_is_not_checked():
    """The H100's batch-16 trace: the budget verified 2 trees in a window of 32 steps whose plain steps ran slower
    than the plain window's (step times swing between windows). Nothing the trees did decides that, so no plain
    window is forced (nor are 2 tree steps enough to hold against the plain steps between them); a window with a
    quarter of its steps on trees is checked, and its loss turns trees off."""
    sparse = {1, 30}  # the steps of each window on which the budget picks a tree
    assert len(sparse) < SPARSE_MIN
    guard = ThroughputGuard()
    for step in range(3 * WINDOW):
        tree = step % WINDOW in sparse
        assert guard.allows_trees()
        guard.observe(16, 20 if tree else 16, 1.2e-3, tree)
    assert guard.take_outcomes() == ([], 0)
    # a quarter of the window's steps on trees, which gain 4 tokens each but slow the step to 1.5 ms: a loss
    outcomes = []
    for step in range(WINDOW + PLAIN_STEPS + 4):
        tree = guard.allows_trees() and step % round(1 / MIN_TREE_SHARE) == 0
        guard.observe(16, 20 if tree else 16, 1.5e-3 if tree else 1e-3, tree)
        outcomes += guard.take_outcomes()[0]
    assert outcomes == ["lost"] and not guard.allows_trees()


def sparse_window(guard: ThroughputGuard, tree_step, plain_step, every: int = 8) -> list[str]:
    """One window and a bit in which the budget picks a tree every `every` steps (fewer than a quarter): returns
    the checks' outcomes. tree_step / plain_step(i): (tokens, seconds) at batch 16; plain_step sees the step's
    index, so it can drift or pay for the tree step before it."""
    outcomes = []
    for step in range(WINDOW + 4):
        tree = guard.allows_trees() and step % every == 1
        guard.observe(16, *(tree_step(step) if tree else plain_step(step)), tree)
        outcomes += guard.take_outcomes()[0]
    return outcomes


def test_sparse_trees_are_held_against_the_plain_steps_between_them():
    """Trees the budget picks now and then (1 step in 8, as the CPU's sampled chats picked ~18%) are compared with
    the plain steps around them, which felt the same swings: no forced plain window. Trees that bring 25% more
    tokens for 50% more time lose and go off; trees that bring 25% more for 10% more win and stay on, although
    every plain step ran slower than the first one (a drift a plain window after them would have read as their
    gain or loss)."""
    assert 1 / 8 < MIN_TREE_SHARE and (WINDOW + 4) // 8 >= SPARSE_MIN
    losing = ThroughputGuard()
    assert sparse_window(losing, lambda i: (20, 1.5e-3), lambda i: (16, 1e-3)) == ["lost"]
    assert not losing.allows_trees()
    winning = ThroughputGuard()
    drift = lambda i: (16, 1e-3 * (1 + 0.02 * i))  # plain steps 2% slower each step
    assert sparse_window(winning, lambda i: (20, 1.1e-3 * (1 + 0.02 * i)), drift) == ["won"]
    assert winning.allows_trees()
    assert winning.take_outcomes() == ([], 0)  # no step was kept plain to decide it


def test_a_sparse_tree_step_is_charged_for_the_step_after_it():
    """Under asynchronous scheduling the plain step after a tree step cannot run ahead (it pays the switch out of
    trees). Counted with the plain steps it would make them look slower and the trees better: trees that win
    their own step by 15% but make the next step take twice as long lose."""
    guard = ThroughputGuard()
    plain_after = lambda i: (16, 2e-3 if i % 8 == 2 else 1e-3)  # the step after each tree step (steps 1, 9, ...)
    assert sparse_window(guard, lambda i: (20, 1.1e-3), plain_after) == ["lost"]


def test_drafting_is_checked_like_trees():
    """Steps that only drafted (curves for requests at budget 0, no tree verified) pay the drafter's host work: a
    window that drafted in a quarter of its steps or more is checked against a forced plain window, which drafts
    nothing, and loses when the drafts cost more than their trees bring. Fewer drafting steps are held against the
    plain steps between them, with the steps that paid for them: under asynchronous scheduling the step before a
    drafting step pays its launch, which the engine reports (`paying`)."""
    every_other = ThroughputGuard()
    outcomes = []
    for step in range(WINDOW + PLAIN_STEPS + 4):
        drafted = every_other.allows_trees() and step % 2 == 0
        every_other.observe(16, 16, 1.3e-3 if drafted else 1e-3, tree=False, drafted=drafted)
        outcomes += every_other.take_outcomes()[0]
    assert outcomes == ["lost"] and not every_other.allows_trees()

    sparse = ThroughputGuard()
    outcomes = []
    for step in range(WINDOW + 4):  # the step before each of 1 in 8 drafting steps pays its launch
        paying = sparse.allows_trees() and step % 8 == 0
        drafted = sparse.allows_trees() and step % 8 == 1
        sparse.observe(16, 16, 1.6e-3 if paying else 1e-3, tree=False, drafted=drafted, paying=paying)
        outcomes += sparse.take_outcomes()[0]
    assert outcomes == ["lost"] and not sparse.allows_trees()

    # trees that win their own step (20 tokens at 1.1x) but whose drafting, launched ahead, made the step before
    # take 1.6x: charged with that step they lose (counted with the plain steps, they would have won)
    paid_ahead = ThroughputGuard()
    outcomes = []
    for step in range(WINDOW + 4):
        allowed = paid_ahead.allows_trees()
        paying, tree = allowed and step % 8 == 0, allowed and step % 8 == 1
        paid_ahead.observe(16, 20 if tree else 16, 1.6e-3 if paying else 1.1e-3 if tree else 1e-3, tree=tree,
                           drafted=tree, paying=paying)
        outcomes += paid_ahead.take_outcomes()[0]
    assert outcomes == ["lost"]

    free = ThroughputGuard()  # drafting that costs nothing and brings nothing: a tie, which plain decoding takes
    for step in range(WINDOW + PLAIN_STEPS + 4):
        free.observe(16, 16, 1e-3, tree=False, drafted=free.allows_trees() and step % 2 == 0)
    assert free.take_outcomes()[0] == ["lost"]


def test_drafts_alone_that_lose_stay_off_as_long_as_their_loss_takes_to_pay_back():
    """A window that lost with drafts alone (no tree verified) stays off for the steps that pay its loss back, and
    the back-off does not double with each repeat (as a tree window's does): drafting's cost is measured, and a
    back-off grown to thousands of steps would miss the text turning to what the drafter predicts."""
    guard, allowed = ThroughputGuard(), []
    for step in range(4000):
        drafting = guard.allows_trees() and step % 2 == 0  # every other step drafts, at 1.3x a plain step's time
        guard.observe(16, 16, 1.3e-3 if drafting else 1e-3, tree=False, drafted=drafting)
        allowed.append(guard.allows_trees())
    stretches = off_stretches(allowed)[:-1]  # (the last may be cut short by the end of the run)
    assert len(stretches) >= 4 and len(set(stretches)) == 1, stretches
    assert stretches[0] > PLAIN_STEPS + BACKOFF  # the loss's pay-back: longer than the least back-off
    assert set(guard.take_outcomes()[0]) == {"lost"}


def test_a_check_across_a_changed_batch_decides_nothing():
    guard = ThroughputGuard()
    # trees at batch 16 lose per request to a plain window at batch 4, which a batch this different cannot tell
    drive(guard, WINDOW + PLAIN_STEPS + 2, lambda n: (int(1.2 * n), 2e-3), plain,
          batch=lambda step: 16 if step <= WINDOW else 4)
    assert guard.take_outcomes()[0] == ["discarded"]
    assert guard.allows_trees()


def test_the_step_after_a_switch_is_not_measured():
    guard = ThroughputGuard()
    seen = []

    def plain_after_switch(n):  # the first two plain steps pay the switch out of trees: 20 times a step
        seen.append(n)
        return n, 20e-3 if len(seen) <= 2 else 1e-3

    # trees that lose (1.25 tokens a request at 1.5x the time): counted, the switch would have made them win
    drive(guard, WINDOW + PLAIN_STEPS + 2, lambda n: (int(1.25 * n), 1.5e-3), plain_after_switch)
    assert guard.take_outcomes()[0] == ["lost"]


def test_a_disabled_guard_never_interferes():
    guard = ThroughputGuard(enabled=False)
    assert all(drive(guard, 500, lambda n: (n, 5e-3), plain))
    assert guard.take_outcomes() == ([], 0)


MAX_TOKENS = 240


def tree_steps(llm) -> tuple[list[bool], list[str]]:
    """Runs the prompts to the end; per decoding step, whether it verified a tree; the guard's checks."""
    core, steps, checks = llm.engine, [], []
    for p in prompts():
        core.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    while core.has_unfinished():
        core.step()
        if core.last_stats is not None and core.last_stats.spec_budgets:
            steps.append(any(core.last_stats.spec_budgets))
            checks += core.last_stats.spec_guard_checks
    return steps, checks


def test_the_engine_turns_off_trees_whose_cost_its_step_timer_cannot_see(tiny_checkpoints, monkeypatch):
    """A drafter that is always right, and tree steps that cost 30 ms of host time after the step's results (in
    the scheduler's update, outside the step time the cost model fits): the cost model keeps verifying, the guard
    measures the loss and keeps the steps plain for its back-off; the output is the same either way."""
    # a model that would verify whatever the timings (as test_adaptive's test_budget_rises...): only the guard
    # can turn these trees off
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)
    monkeypatch.setattr(BudgetController, "threshold", lambda self: MIN_GAIN)
    monkeypatch.setattr(CostFit, "tree_cost", lambda self: 0.0)  # (nor a noisy tree step's fitted fixed cost)
    monkeypatch.setattr(BudgetController, "switch_tokens", lambda self, num_seqs=0: 0.0)
    folder, _ = tiny_checkpoints("llama")
    ref = [o.token_ids for o in LLM(folder, dtype="fp32").generate(
        prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))]
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(prompts(), ref)]), 1000, horizon=2)
    update = Scheduler.update

    def slow_after_trees(self, plan, result, **kwargs):
        if any(s.spec_budget for s in plan.seqs):
            time.sleep(0.03)
        return update(self, plan, result, **kwargs)

    monkeypatch.setattr(Scheduler, "update", slow_after_trees)
    blind, blind_checks = tree_steps(LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16, spec_guard=False))
    guarded_llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    guarded, checks = tree_steps(guarded_llm)
    # the model alone: trees throughout (3 tokens a request a step; a request one token from its end steps plain)
    assert sum(blind) > 0.9 * len(blind) and not blind_checks, blind
    assert len(guarded) > WINDOW + PLAIN_STEPS + 1 + BACKOFF, len(guarded)
    assert all(guarded[:WINDOW]) and checks[0] == "lost", (guarded, checks)
    assert not any(guarded[WINDOW:WINDOW + PLAIN_STEPS + 1 + BACKOFF])  # the check, then the back-off
    out = guarded_llm.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in out] == ref


def test_the_engine_stops_drafting_whose_cost_no_budget_sees(tiny_checkpoints, monkeypatch):
    """Under asynchronous scheduling and (emulated) CUDA graphs, as on the GPU: curves drafted ahead at every step for
    requests whose trees never pay, each draft costing 20 ms of host time that the budget does not price (on the GPU
    it prices a draft by its device time, while the launches cost a batch-64 step about its own time): the budget
    alone drafts on; the guard counts the drafting steps as speculation, loses its check and keeps the engine
    plain, drafting nothing, for its back-off. The output is the same either way."""
    monkeypatch.setattr(BudgetController, "threshold", lambda self: 1e9)  # no tree ever pays
    # ... but every request drafts its curve at every step while the guard allows it
    monkeypatch.setattr(BudgetController, "should_draft", lambda self, rid, dry=False, ahead=False:
                        self.guard.allows_trees())
    monkeypatch.setattr(BudgetController, "drafts_of", lambda self, ids, dry=False, ahead=False:
                        [self.guard.allows_trees()] * len(ids))
    curves, calls = Speculator.curves, [0]

    def slow_curves(self, *args, **kwargs):
        calls[0] += 1
        time.sleep(0.02)
        return curves(self, *args, **kwargs)

    monkeypatch.setattr(Speculator, "curves", slow_curves)
    folder, _ = tiny_checkpoints("llama")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def drafting_steps(guard: bool) -> tuple[list[bool], list[str], list[list[int]], int]:
        llm = LLM(folder, dtype="fp32", drafter="ngram", spec_guard=guard)
        core = llm.engine  # the GPU's layout and drafter (bench/step_kinds.py --emulate does the same)
        core.speculator.drafter = DeviceNgramDrafter(core.vocab_size, horizon=core.speculator.horizon)
        core.speculator.use_staging(core.runner.staging)
        core.enable_graphs(emulate=True)
        core.overlap = True
        ids = [core.add_request(p, sampling) for p in prompts()]
        drafted, checks, outputs, curve_steps = [], [], {rid: [] for rid in ids}, 0
        while core.has_unfinished():
            before = calls[0]
            for delta in core.step():
                outputs[delta.request_id] += delta.new_token_ids
            stats = core.last_stats
            if stats is not None and stats.spec_budgets:
                assert not any(stats.spec_budgets)
                drafted.append(calls[0] > before)
                checks += stats.spec_guard_checks
                curve_steps += stats.num_curve_drafts > 0  # (what the server counts: spec_decode_curve_draft_steps)
        return drafted, checks, [outputs[rid] for rid in ids], curve_steps

    blind, blind_checks, blind_out, blind_curve_steps = drafting_steps(False)
    assert sum(blind) > 0.9 * len(blind) and not blind_checks
    assert blind_curve_steps >= sum(blind) - 1  # (each call drafts the step it launches ahead)
    guarded, checks, out, curve_steps = drafting_steps(True)
    assert curve_steps <= sum(guarded) + 1
    assert len(guarded) > WINDOW + PLAIN_STEPS + 2 + BACKOFF, len(guarded)
    assert all(guarded[2:WINDOW]) and checks[0] == "lost", (guarded, checks)
    first_off = guarded.index(False, 2)
    assert not any(guarded[first_off:first_off + PLAIN_STEPS + BACKOFF])  # the check, then the back-off
    assert out == blind_out


def test_each_batch_size_keeps_its_own_verdict():
    """Trees that lose at batch 16 stay off there; at one request they run (and are checked on their own), and
    back at 16 the back-off goes on. A batch wavering across a bucket's edge (16, 17) stays in one bucket."""
    guard = ThroughputGuard()
    lose = lambda n: (int(1.2 * n), 1.5e-3)  # noqa: E731
    drive(guard, WINDOW + PLAIN_STEPS + 2, lose, plain, batch=lambda step: 16 + step % 2)
    assert guard.take_outcomes()[0] == ["lost"] and not guard.allows_trees()
    win_alone = lambda n: (2 * n, 1.2e-3) if n == 1 else lose(n)  # noqa: E731
    ran = drive(guard, WINDOW + PLAIN_STEPS + 2, win_alone, plain, batch=lambda step: 1)
    # (the first step at batch 1 was planned on the last verdict seen, batch 16's)
    assert all(ran[1:WINDOW]) and guard.take_outcomes()[0] == ["won"]
    assert not any(drive(guard, 10, lose, plain)[1:])  # batch 16 again: its back-off
