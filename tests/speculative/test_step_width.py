"""step_width.uniform_width against its definition written out request by request: the width w >= max(1,
largest probe) that maximizes the summed positive net gains less theta * w * n and the switch cost (probes counted
whatever their gain), the first of equal widths, 0 when none nets more than 0 and no probe holds it open."""
from __future__ import annotations

import random

from engine.speculative.step_width import uniform_width


def by_definition(gains, caps, theta, draft_cost, fixed, switch_cost):
    n, top = len(gains), max(caps, default=0)

    def net_gain(i, w):  # request i's first min(w, cap_i) nodes, net of drafting it
        total = -draft_cost
        for j in range(min(w, caps[i], len(gains[i]))):
            total += gains[i][j]
        return total

    floor = max(fixed, default=0)
    best_w, best = 0, (0.0 if floor == 0 else float("-inf"))
    for w in range(max(1, floor), top + 1):
        value = 0
        for i in range(n):
            if net_gain(i, w) > 0.0:
                value += net_gain(i, w)
        value = value - theta * w * n - switch_cost
        for i in range(n):
            if fixed[i] and net_gain(i, w) <= 0.0:
                value += net_gain(i, w)
        if value > best:
            best_w, best = w, value
    if best_w == 0:
        return [0] * n
    return [min(best_w, caps[i]) if fixed[i] or net_gain(i, best_w) > 0.0 else 0 for i in range(n)]


def test_uniform_width_follows_its_definition():
    rng = random.Random(7)
    for case in range(600):
        n = rng.randint(0, 12)
        caps = [rng.choice([0, 1, 3, 8, 16]) for _ in range(n)]
        gains = [[round(rng.random() ** 2, 2) for _ in range(rng.randint(0, 16))] for _ in range(n)]
        fixed = [rng.choice([0, 0, 0, 4]) if caps[i] else 0 for i in range(n)]
        theta, draft = rng.choice([0.0, 0.02, 0.1, 0.3]), rng.choice([0.0, 0.05, 0.5])
        switch = rng.choice([0.0, 0.5, 3.0])
        got = uniform_width(gains, caps, theta, draft, fixed, switch)
        assert got == by_definition(gains, caps, theta, draft, fixed, switch), (case, gains, caps, fixed)


def test_equal_widths_take_the_narrowest():
    """Nodes past the first gain nothing and cost nothing: widths 1-4 net the same, and the first is taken."""
    assert uniform_width([[1.0, 0.0, 0.0, 0.0]] * 3, [4] * 3, 0.0, 0.0) == [1, 1, 1]
    assert uniform_width([[0.01]] * 3, [1] * 3, 0.1, 0.0) == [0, 0, 0]  # nothing pays: plain
    # a probe holds its width; a request whose node does not beat its drafting stays out
    assert uniform_width([[0.01]] * 2, [4, 4], 0.1, 0.05, fixed=[0, 4]) == [0, 4]
