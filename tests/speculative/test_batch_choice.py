"""BudgetController.prepare (engine/speculative/batch_choice.py): the budgets it works out for a batch at once are
the scalar choice's, answer for answer and effect for effect, over random controller states (records, trees,
reliability curves, thresholds, probe states), so prepare() changes no budget, only what it costs."""
from __future__ import annotations

import random

import pytest

from engine.speculative.adaptive import PROBE_EVERY, BudgetController
from engine.speculative.batch_choice import MIN_BATCH
from engine.speculative.confidence import NUM_BINS


def random_controller(rng: random.Random, num_requests: int, max_budget: int) -> BudgetController:
    """A controller after a random history: steps observed (the row cost fit, the throughput), drafts timed, and
    requests with trees of random length and confidence, some verified (their records and the bins)."""
    c = BudgetController(max_budget)
    for _ in range(rng.randrange(2, 30)):
        rows = rng.randrange(1, 400)
        c.observe_step(rows, 1e-3 + rows * rng.uniform(0, 2e-5), rng.randrange(1, 100), tree=rng.random() < 0.5)
        if rng.random() < 0.5:
            c.observe_draft(rng.randrange(1, 64), rng.uniform(0, 1e-3))
    for i in range(num_requests):
        nodes = rng.randrange(1, max_budget + 3)  # trees shorter and longer than the budget
        q = sorted((rng.random() ** rng.choice([1, 3, 8]) for _ in range(nodes)), reverse=True)
        bins = [rng.randrange(NUM_BINS) for _ in range(nodes)]
        if rng.random() < 0.7:
            budget = rng.randrange(0, max_budget + 1)
            accepted = sorted(rng.sample(range(1, nodes + 1), rng.randrange(0, min(nodes, budget) + 1)))
            c.observe_request(f"r{i}", budget, accepted, q + bins)
        else:
            c.observe_curve(f"r{i}", q + bins)
        stats = c.requests[f"r{i}"]
        stats.steps_at_zero = rng.randrange(0, 3 * PROBE_EVERY)
    c.clock = rng.randrange(0, 4 * PROBE_EVERY)
    return c


@pytest.mark.parametrize("seed", range(40))
def test_prepared_budgets_equal_the_scalar_choice(seed):
    rng = random.Random(seed)
    num_requests, max_budget = rng.choice([MIN_BATCH, 17, 64]), rng.choice([1, 4, 16, 31])
    ahead = rng.random() < 0.5
    c = random_controller(rng, num_requests, max_budget)
    ids = [f"r{i}" for i in range(num_requests)]
    expected = [c._choose(c.requests[r], ahead) for r in ids]
    c.prepare(ids, ahead=ahead)
    assert [c.requests[r].pending[1:] for r in ids] == expected
    assert all(c.requests[r].pending[0] == (c.version, ahead) for r in ids)


def test_prepared_answers_are_what_budget_counts():
    """Counted budget() calls after prepare() answer and move the probe state as they do without it."""
    a, b = random_controller(random.Random(7), 32, 8), random_controller(random.Random(7), 32, 8)
    ids = [f"r{i}" for i in range(32)]
    for step in range(3 * PROBE_EVERY):
        b.prepare(ids, ahead=step % 2 == 0)
        got = [b.budget(r, ahead=step % 2 == 0) for r in ids]
        assert got == [a.budget(r, ahead=step % 2 == 0) for r in ids]
        for c in (a, b):
            c.observe_step(64, 2e-3, 64)
        assert [s.steps_at_zero for s in a.requests.values()] == [s.steps_at_zero for s in b.requests.values()]


def test_small_batches_keep_the_scalar_choice():
    c = random_controller(random.Random(3), MIN_BATCH - 1, 8)
    c.prepare([f"r{i}" for i in range(MIN_BATCH - 1)])
    assert all(s.pending is None for s in c.requests.values())
