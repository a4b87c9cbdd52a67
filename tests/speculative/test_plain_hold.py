"""A plain step's decision planned ahead holds at a large batch under CUDA graphs (StepBudgets.count_plain): the
same answers and probe state as asking every request at every step, a fraction of the work, and a tree observed
ends the hold at once."""
from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.cuda_graphs import graph_shape
from engine.plan import ScheduledSeq, StepPlan, StepResult
from engine.request import Request
from engine.speculative import step_budgets
from engine.speculative.adaptive import FIRST_PROBE_EVERY, BudgetController
from engine.speculative.request_record import PROBE_EVERY
from engine.speculative.step_budgets import (HOLD_EVERY, HOLD_MIN_BATCH, MAX_EXPLORE_BACKOFF, MAX_EXPLORE_PERIOD,
                                             PROBE_BUDGET)
from tests.speculative.test_adaptive import confidence, probe_state

BATCH = 32
CURVES = {  # per kind of request, its drafter's cumulative q per node (confidence() makes the node confidence)
    "copying": [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) for j in range(16)],
    "unsure": [0.3 * (j + 1) / 16 for j in range(16)],
    "empty": [0.0] * 16,
}


def engine_like_run(hold: bool, monkeypatch, seed: int = 0, steps: int = 240,
                    churn: int = 0) -> tuple[list, list, int]:
    """Plain steps planned ahead as engine/ahead.py plans them (dry answers, the uniform width, then a tree step or
    count_plain), steady step times, probes that accept now and then; churn: every `churn` steps the oldest
    request finishes and a new one (no tree yet) joins, as on a loaded server. (step kinds, probe states,
    _choose calls)."""
    monkeypatch.setattr(step_budgets, "HOLD_MIN_BATCH", HOLD_MIN_BATCH if hold else 10 ** 9)
    rng = random.Random(seed)
    c = BudgetController(max_budget=16)
    c.pipelined = c.switches_ahead = True
    c.costs.shape_of = graph_shape
    calls = [0]
    choose = c._choose

    def counting_choose(stats, ahead):
        calls[0] += 1
        return choose(stats, ahead)

    c._choose = counting_choose
    ids = [f"r{i}" for i in range(BATCH)]
    kinds = {rid: ("copying", "unsure", "empty")[i % 3] for i, rid in enumerate(ids)}
    for rid in ids:  # a first tree each, verified, mostly rejected: the copying ones' records fall below their q
        c.observe_request(rid, 4, [1] if rng.random() < 0.2 else [], confidence(CURVES[kinds[rid]]))
    kinds_run = []
    for step in range(steps):
        if churn and step % churn == churn - 1:
            c.release(ids.pop(0))
            ids.append(f"new{step}")
            kinds[ids[-1]] = ("copying", "unsure", "empty")[step % 3]
        tree = kinds_run[-1] == "tree" if kinds_run else False
        c.observe_step(BATCH * (5 if tree else 1), 0.0030 if tree else 0.0013, tokens=BATCH + (8 if tree else 0),
                       tree=tree)
        c.costs.observe(BATCH, 5 if tree else 1, 0.0030 if tree else 0.0013)
        dry = c.budgets_of(ids, dry=True, ahead=True)
        if any(dry) and any(c.uniform(ids, dry, [16] * BATCH)):
            counted = [c.budget(rid, ahead=True) for rid in ids]
            kinds_run.append("tree")
            for rid, b in zip(ids, counted):
                if b:
                    accepted = [1, 2][:rng.randint(0, 2)] if kinds[rid] == "copying" and rng.random() < 0.3 else []
                    c.observe_request(rid, b, accepted, confidence(CURVES[kinds[rid]]))
        else:
            c.count_plain(ids)
            kinds_run.append("refused" if any(dry) else "plain")
    return kinds_run, [probe_state(c.requests[rid])[:3] for rid in ids if rid in c.requests], calls[0]


@pytest.mark.parametrize("churn", [0, 7])
def test_a_held_plain_decision_answers_as_asking_every_request(monkeypatch, churn):
    """Over steady steps with probes and trees the uniform width refuses, holding gives the same step kinds and
    the same probe state at every request as the full answers, and asks each request's choice a fraction of the
    steps; so it does while requests finish and new ones join (a held decision covers the requests it asked)."""
    held = engine_like_run(True, monkeypatch, churn=churn)
    full = engine_like_run(False, monkeypatch, churn=churn)
    trees = lambda kinds: [k == "tree" for k in kinds]  # noqa: E731 (a held step refused answers no tree at all)
    assert trees(held[0]) == trees(full[0]) and held[1] == full[1]
    kinds = full[0]
    # probes ran, trees were refused by the width's price, most steps were plain
    assert kinds.count("tree") >= 3 and kinds.count("refused") >= 10 and kinds.count("plain") > 100, kinds
    assert held[2] < 0.5 * full[2], (held[2], full[2])


def test_the_hold_ends_with_an_observed_tree_and_at_aligned_steps(monkeypatch):
    """A tree drafted or verified for any request and every step aligned to HOLD_EVERY (where probes and first
    probes fall) are asked in full; a batch that lost requests is not asked, one that gained a request asks it."""
    assert PROBE_EVERY % HOLD_EVERY == 0 and FIRST_PROBE_EVERY % HOLD_EVERY == 0
    c = BudgetController(max_budget=16)
    c.pipelined = c.switches_ahead = True
    c.costs.shape_of = graph_shape
    ids = [f"r{i}" for i in range(HOLD_MIN_BATCH)]
    for rid in ids:
        c.observe_request(rid, 4, [], confidence(CURVES["unsure"]))
    asked = []
    c._answer = lambda rid, dry, ahead, effects=None, answer=c._answer: asked.append(rid) or answer(rid, dry, ahead,
                                                                                                     effects)

    def plain_step() -> int:
        asked.clear()
        c.observe_step(HOLD_MIN_BATCH, 0.0013, tokens=HOLD_MIN_BATCH)
        assert not any(c.budgets_of(ids, dry=True, ahead=True))
        c.count_plain(ids)
        return len(asked)

    while (c.clock + 2) % HOLD_EVERY != 0:  # the step planned after the next observed one starts a window
        plain_step()
    assert plain_step() == 2 * len(ids)  # the window's first step: asked in full (dry, then counted)
    assert [plain_step() for _ in range(HOLD_EVERY - 1)] == [0] * (HOLD_EVERY - 1)
    assert plain_step() == 2 * len(ids)
    c.observe_curve("r3", confidence(CURVES["unsure"]))  # a new tree for one request
    assert plain_step() == 2 * len(ids)
    assert plain_step() == 0
    asked.clear()
    assert not any(c.budgets_of(ids[1:], dry=True, ahead=True)) and not asked  # a request finished
    assert not any(c.budgets_of(ids[1:] + ["new"], dry=True, ahead=True)) and asked == ["new"]  # one admitted


@pytest.mark.parametrize("graphs,batch", [(False, 64), (True, HOLD_MIN_BATCH - 1)])
def test_no_hold_without_graphs_or_below_the_batch(graphs, batch):
    c = BudgetController(max_budget=16)
    c.pipelined = True
    c.costs.shape_of = graph_shape if graphs else None
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        c.observe_request(rid, 4, [], confidence(CURVES["unsure"]))
    for _ in range(8):
        c.observe_step(batch, 0.0013, tokens=batch)
        c.budgets_of(ids, dry=True, ahead=True)
        c.count_plain(ids)
        assert c._hold is None


@pytest.mark.parametrize("graphs", [False, True])
def test_new_requests_first_drafts_share_aligned_steps_under_graphs(graphs):
    """A request without a tree drafts for its first curve at once without CUDA graphs; under them (and the
    pipeline) on a step aligned to FIRST_PROBE_EVERY, so admissions a few steps apart share one draft step (each
    had its own: on an H100 at batch 64 under load, a draft step's host work is about a plain step's)."""
    c = BudgetController(max_budget=16)
    c.pipelined = c.switches_ahead = True
    if graphs:
        c.costs.shape_of = graph_shape
    due = []
    for step in range(2 * FIRST_PROBE_EVERY):
        due.append(c.drafts_of([f"new{step}"], ahead=False)[0] and c.should_draft(f"new{step}"))
        c.observe_step(16, 0.001, 16)
    if graphs:
        assert due == [step % FIRST_PROBE_EVERY == 0 for step in range(2 * FIRST_PROBE_EVERY)]
    else:
        assert all(due)


@pytest.mark.parametrize("batch,round_ms,every", [(64, 1.31, FIRST_PROBE_EVERY), (64, 2.3, MAX_EXPLORE_PERIOD),
                                                   (8, 2.3, 8), (1, 1.0, FIRST_PROBE_EVERY)])
def test_first_drafts_and_probes_come_as_seldom_as_a_round_at_the_batch_costs(batch, round_ms, every):
    """Under CUDA graphs a step that probes, or drafts new requests' first curves, costs the whole batch: a tree round
    at the probe's width (and the root-only round leaving it), or the drafter's launches. Such steps come every
    explore period, long enough that a round's measured extra is at most PROBE_SHARE of the steps it recurs over at
    FULL_BATCH requests: at batch 64 a round measured at 2.3 ms against 1.3 for a plain step (as on an H100 with the
    embedded model) waits MAX_EXPLORE_PERIOD steps (there, with first probes and drafts aligned to
    FIRST_PROBE_EVERY, the n-gram default's tree rounds and curve steps cost it 5-8% against speculation off on a
    loaded server); a round that costs 1% more keeps FIRST_PROBE_EVERY (and re-probes PROBE_EVERY). At fewer
    requests a probe step re-rates more of the batch and may cost more in proportion: the same dear round at batch
    8 waits 8 steps, and at batch 1 (a round 0.3 ms beyond a 0.69 ms step on an H100, the n-gram default 3.7-4.1x
    off on the self-repeating prompt) first drafts keep FIRST_PROBE_EVERY."""
    c = BudgetController(max_budget=16)
    c.pipelined = c.switches_ahead = True
    c.costs.shape_of = graph_shape
    plain_ms = 0.69 if batch == 1 else 1.3
    for _ in range(4):
        c.costs.observe(batch, 1, plain_ms / 1e3)
        c.costs.observe(batch, PROBE_BUDGET + 1, round_ms / 1e3)
    ids = [f"r{i}" for i in range(batch - 1)]
    due, aligned = [], []
    for step in range(2 * MAX_EXPLORE_PERIOD):
        due.append(c.drafts_of(ids + [f"new{step}"], ahead=False)[-1])
        aligned.append(c._aligned())
        c.observe_step(batch, plain_ms / 1e3, batch)
    assert [s for s, d in enumerate(due) if d] == list(range(0, 2 * MAX_EXPLORE_PERIOD, every))
    assert [s for s, a in enumerate(aligned) if a] == list(range(0, 2 * MAX_EXPLORE_PERIOD, max(PROBE_EVERY, every)))
    period = c.explore_period()
    for _ in range(200):  # the round's record goes stale (a width's price falls back to its rows): the period holds
        c.costs.observe(batch, 1, plain_ms / 1e3)
    c.observe_step(batch, plain_ms / 1e3, batch)
    assert c.explore_period() == period and max(period, FIRST_PROBE_EVERY) == every


def _explore_round(c: BudgetController, tag: str, accepted: int, probe: bool = True, batch: int = 64) -> int:
    """A batch of new requests whose drafter is confident where the engine's record says it is wrong: plain steps
    up to the next step where first probes are due, their budgets counted there (all probes), and that round
    observed with `accepted` drafts accepted by each (probe=False: the same round with no probe counted, as chosen
    trees). The explore period after it."""
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=500), request_id=f"{tag}{i}") for i in range(batch)]
    ids = [r.request_id for r in requests]
    for r in requests:
        r.output_token_ids = [5, 6, 7]  # past the warm-up
        c.observe_curve(r.request_id, confidence(CURVES["copying"]))
    plain = StepPlan([ScheduledSeq(r, 1, True) for r in requests])
    one_each = StepResult(new_token_ids={rid: [7] for rid in ids})
    c.budgets_of(ids, dry=True)  # (the batch being planned)
    for _ in range(4 * MAX_EXPLORE_BACKOFF * MAX_EXPLORE_PERIOD):
        if c._first_probe_due(False):
            break
        c.observe_engine_step(plain, one_each, 1.3e-3, 0.0, synchronous=False, uniform_layout=True)
    if probe:
        assert c.budgets_of(ids) == [PROBE_BUDGET] * batch
        c.budgets_of(ids)  # counted again before the step is observed (as after a launch that failed)
        assert c.probes_unobserved == batch  # each request's probe flagged once
    rows = list(range(1, accepted + 1))
    round_plan = StepPlan([ScheduledSeq(r, 1, True, spec_budget=PROBE_BUDGET) for r in requests])
    result = StepResult(new_token_ids={rid: [7] * (1 + accepted) for rid in ids},
                        accepted_rows={rid: rows for rid in ids},
                        curves={rid: confidence(CURVES["copying"]) for rid in ids}, num_drafted=batch)
    c.observe_engine_step(round_plan, result, 2.3e-3, 0.0, synchronous=False, uniform_layout=True)
    for rid in ids:
        c.release(rid)
    return c.explore_period()


def test_probe_rounds_that_do_not_pay_come_less_often_until_one_does():
    """Under CUDA graphs a round that carried probes and accepted fewer drafts than it cost beyond a plain step (with
    the root-only round leaving it) in tokens of throughput doubles the explore period, up to MAX_EXPLORE_BACKOFF
    times its price; a probe round that paid restores it. (On an H100 with a slow host at batch 64, T = 1, rounds
    3.1 ms beyond a 1.46 ms plain step brought ~6 tokens each, and one every 64 steps still cost the n-gram default
    ~4.6% against speculation off.) A round without probes (chosen trees) does not move it."""
    c = BudgetController(max_budget=16)
    c.pipelined = c.switches_ahead = True
    c.costs.shape_of = graph_shape
    for _ in range(4):  # a round 1 ms beyond a plain step at batch 64: the period's price is MAX_EXPLORE_PERIOD
        c.costs.observe(64, 1, 1.3e-3)
        c.costs.observe(64, PROBE_BUDGET + 1, 2.3e-3)
    for _ in range(2):  # the engine's record: the drafter's confident trees were never accepted
        c.observe_request("old", 16, [], confidence(CURVES["copying"]))
    c.release("old")
    c.batch = 64
    assert c.explore_period() == MAX_EXPLORE_PERIOD
    assert _explore_round(c, "a-", accepted=0) == 2 * MAX_EXPLORE_PERIOD
    assert _explore_round(c, "chosen-", accepted=0, probe=False) == 2 * MAX_EXPLORE_PERIOD
    periods = [_explore_round(c, f"b{k}-", accepted=0) for k in range(2)]
    assert periods == [MAX_EXPLORE_BACKOFF * MAX_EXPLORE_PERIOD] * 2
    # 4 drafts accepted by each of 64 requests: 256 tokens against ~1 ms of throughput (~45 tokens)
    assert _explore_round(c, "paid-", accepted=4) == MAX_EXPLORE_PERIOD
    assert c.probes_unobserved == 0
