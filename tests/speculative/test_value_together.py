"""A step's trees valued together (TreeValue.value_together through StepBudgets.value_step): a whole step's budgets
asked at once equal the same requests asked one by one, answer for answer and probe state for probe state, over
random states: trees shorter and longer than the budget, bins that over-deliver (gains capped at one token), dear
and free drafting, trees without mass, requests that come and go, steps that observe no tree (their stacked
arrays reused) and trees drafted before their budgets are asked (no observation in between). The uniform width
over the batch in numpy equals the width request by request; a step's verified trees reach the reliability
bins at once as they did one by one."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.speculative import step_budgets, tree_value
from engine.speculative.confidence import node_confidence
from engine.speculative.step_width import uniform_width, uniform_width_array
from engine.speculative.adaptive import BudgetController
from tests.speculative.test_adaptive import probe_state, random_step


def test_a_steps_budgets_valued_together_equal_the_requests_asked_one_by_one(monkeypatch):
    rng = random.Random(7)
    together, apart = BudgetController(max_budget=16), BudgetController(max_budget=16)
    valued, chosen, widths = [], 0, 0
    value = tree_value.TreeValue.value_together

    def counting(self, records, theta):
        if self is together:
            valued.append(len(records))
        return value(self, records, theta)

    monkeypatch.setattr(tree_value.TreeValue, "value_together", counting)
    requests = [f"r{i}" for i in range(40)]
    for step in range(300):
        if step % 4 == 3:  # a step that observed no tree: the same lists, the arrays kept
            for c in (together, apart):
                c.observe_step(64, 0.004, tokens=70)
        else:
            random_step(rng, requests, (together, apart), num_nodes=lambda rng: rng.choice([16, 16, 16, 5, 1, 20]))
        if step % 25 == 24:  # one request leaves, another comes (no tree of its own yet)
            for c in (together, apart):
                c.release(requests[10])
            requests[10] = f"new{step}"
        ahead = step % 3 == 0
        mine = together.budgets_of(requests, dry=True, ahead=ahead) if step % 2 else None
        theirs = [apart.budget(rid, dry=True, ahead=ahead) for rid in requests] if step % 2 else None
        assert mine == theirs, step
        if step % 7 == 6:  # each request's next tree drafted first (engine/draft_first.py): no observation between
            for rid in requests:
                scale = rng.choice([0.0, 0.05, 1.0])
                curve = node_confidence(np.array([sorted((scale * rng.random() for _ in range(16)), reverse=True)]))
                for c in (together, apart):
                    c.observe_curve(rid, curve[0].tolist())
        # counted: after the dry answers (reused) or alone (worked out), as budgets_of and as count_plain
        if step % 7 == 6:  # (one by one, as the synchronous scheduler asks: the trees valued before are stale)
            theirs = [apart.budget(rid, ahead=ahead) for rid in requests]
            assert [together.budget(rid, ahead=ahead) for rid in requests] == theirs, step
        elif step % 5 == 0:
            together.count_plain(requests)
            theirs = [apart.budget(rid, ahead=True) for rid in requests]
        else:
            theirs = [apart.budget(rid, ahead=ahead) for rid in requests]
            assert together.budgets_of(requests, ahead=ahead) == theirs, step
        chosen += sum(1 for b in theirs if b)
        caps = [rng.choice([0, 3, 16, 16, 16]) for _ in requests]
        with monkeypatch.context() as m:  # the width one request at a time, as at a small batch
            m.setattr(step_budgets, "VALUE_TOGETHER", 10 ** 9)
            width = apart.uniform(requests, theirs, caps)
        assert together.uniform(requests, theirs, caps) == width, step
        widths += any(width)
        assert together.requests.keys() == apart.requests.keys()
        for rid, record in apart.requests.items():
            assert probe_state(together.requests[rid]) == probe_state(record), (step, rid)
    assert chosen > 300 and sum(valued) > 2000 and widths > 50, (chosen, sum(valued), widths)
    assert sum(1 for n in valued if n >= tree_value.VALUE_TOGETHER) > 100


def test_the_batch_width_equals_the_width_request_by_request():
    """uniform_width_array against uniform_width over random batches: trees shorter than their caps, caps of 0,
    probes (whose width every tree pays) with and without gain, widths priced by rows and by measured costs, a
    switch cost, dear and free drafting."""
    rng = random.Random(3)
    trees = 0
    for trial in range(3000):
        n = rng.choice([1, 2, 10, 40, 64])
        caps = [rng.choice([0, 2, 8, 16, 16]) for _ in range(n)]
        top = max(caps)
        gains = []
        for cap in caps:
            scale = rng.choice([0.0, 0.01, 0.2, 1.0])
            gains.append([min(1.0, scale * rng.random()) for _ in range(min(cap, rng.choice([1, 5, 16])))])
        array = np.zeros((n, top))
        for i, row in enumerate(gains):
            array[i, :len(row)] = row
        fixed = [rng.choice([0] * 12 + [2, 4]) if cap >= 4 else 0 for cap in caps]
        theta = rng.choice([0.02, 0.1, 0.3])
        costs = None if trial % 2 else sorted(rng.uniform(0, 0.5 * n) for _ in range(top + 1))
        args = (caps, theta, rng.choice([0.0, 0.01, 0.2]), fixed, rng.choice([0.0, 1.0]), costs)
        expected = uniform_width(gains, *args)
        assert uniform_width_array(array, *args) == expected, trial
        trees += any(expected)
    assert 500 < trees < 2900, trees


def test_a_steps_trees_reach_the_reliability_bins_at_once_as_one_by_one():
    """ReliabilityBins.observe takes a step's verified trees at once (observe_engine_step gathers them): its sums
    per bin, decayed and undecayed, equal those of the trees taken one by one up to rounding (the step's q are
    summed per bin before they are added), and so does the curve the budget reads; accepted counts are exact."""
    from engine.speculative.reliability import ReliabilityBins

    rng = random.Random(5)
    at_once, one_by_one = ReliabilityBins(), ReliabilityBins()
    for step in range(200):
        trees = []
        for _ in range(rng.choice([1, 3, 64])):
            q = sorted((rng.random() ** 3 for _ in range(16)), reverse=True)
            conf = node_confidence(np.array([q]))[0].tolist()
            budget = rng.choice([0, 1, 4, 16])
            accepted = sorted(rng.sample(range(1, 17), rng.randint(0, 4)))  # some past the budget: not counted
            trees.append((conf[:16], list(map(int, conf[16:])), budget, accepted))
        for bins in (at_once, one_by_one):
            bins.decay(0.9)
        at_once.observe(trees)
        for tree in trees:
            one_by_one.observe([tree])
        assert at_once.accepted == one_by_one.accepted and at_once.step_accepted == one_by_one.step_accepted
        assert np.allclose(at_once.predicted, one_by_one.predicted, rtol=1e-12, atol=0)
        assert np.allclose(at_once.curve(0.7), one_by_one.curve(0.7), rtol=1e-12, atol=0)
    counts, expected = at_once.take_counts(), one_by_one.take_counts()
    assert counts.keys() == expected.keys() and len(counts) >= 6
    for label, (accepted, predicted) in counts.items():
        assert accepted == expected[label][0] and predicted == pytest.approx(expected[label][1], rel=1e-12)
    assert sum(a for a, _ in counts.values()) > 500


def test_an_engine_steps_trees_reach_the_reliability_bins():
    """observe_engine_step hands the bins every verified tree of the step (the nodes each request chose and the
    accepted rows among them), once: the counts the metrics take equal those of the trees taken one by one."""
    from engine.plan import ScheduledSeq, StepPlan, StepResult
    from engine.request import Request, SamplingParams
    from engine.speculative.reliability import ReliabilityBins

    rng = random.Random(9)
    controller, expected = BudgetController(max_budget=16), ReliabilityBins()
    plan, result = StepPlan(), StepResult()
    for i in range(12):
        rid = f"r{i}"
        request = Request([1, 2, 3], SamplingParams(max_tokens=64), request_id=rid)
        chosen = rng.choice([0, 2, 4])
        plan.seqs.append(ScheduledSeq(request, 1, True, 4, chosen_budget=chosen))
        conf = node_confidence(np.array([sorted((rng.random() for _ in range(16)), reverse=True)]))[0].tolist()
        result.curves[rid], result.accepted_rows[rid] = conf, [1, 2, 3][:rng.randint(0, 3)]
        result.new_token_ids[rid] = [7] * (len(result.accepted_rows[rid]) + 1)
        kept = [r for r in result.accepted_rows[rid] if r <= chosen]
        expected.observe([(conf[:16], list(map(int, conf[16:])), chosen, kept)])
    controller.observe_engine_step(plan, result, 0.01, 0.001, synchronous=False, uniform_layout=False)
    counts, wanted = controller.take_confidence_counts(), expected.take_counts()
    assert counts.keys() == wanted.keys() and counts
    for label, (accepted, predicted) in counts.items():
        assert accepted == wanted[label][0] and predicted == pytest.approx(wanted[label][1], rel=1e-12)


def test_a_tree_split_on_arrival_is_kept_as_its_list_form_would_be():
    """The engine's results carry each tree split (confidence_rows: its q, its bins as ints, one numpy pass a step);
    the budget keeps the same tree, bins and mass from them as from node_confidence's row, and answers alike."""
    from engine.speculative.confidence import confidence_rows

    rng = random.Random(2)
    split, listed = BudgetController(max_budget=16), BudgetController(max_budget=16)
    for step in range(60):
        q = np.array([sorted((rng.choice([0.0, 0.05, 1.0]) * rng.random() for _ in range(16)), reverse=True)
                      for _ in range(6)])
        for i, (row, pair) in enumerate(zip(node_confidence(q).tolist(), confidence_rows(q))):
            assert pair == (row[:16], [int(k) for k in row[16:]]) and all(type(k) is int for k in pair[1])
            split.observe_request(f"r{i}", step % 5, [1][:step % 2], pair)
            listed.observe_request(f"r{i}", step % 5, [1][:step % 2], row)
        for c in (split, listed):
            c.observe_step(40, 0.01, tokens=48)
        for rid, record in listed.requests.items():
            mine = split.requests[rid]
            assert (mine.node_q, mine.node_bins, mine.q_total) == (record.node_q, record.node_bins, record.q_total)
            assert split.budget(rid) == listed.budget(rid)
    assert split.bins.predicted == listed.bins.predicted
