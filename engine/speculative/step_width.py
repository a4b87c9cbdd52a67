"""One tree width for a whole step: every request that verifies a tree in a step is laid out at the step's width
(the largest budget), so each pays that many verify rows whatever its own budget (runner layout: one padded width
a step). Budgets chosen request by request price only their own nodes; this picks the width, and which requests
verify at it, that nets the most expected accepted tokens once padding is paid."""
from __future__ import annotations

from itertools import accumulate


def common_width(gains: list[list[float]], budgets: list[int], theta: float,
                 fixed: list[bool] | None = None) -> list[int]:
    """gains[i]: request i's expected accepted tokens per node, best-first; budgets[i]: its own choice (0 = plain
    decoding); theta: expected tokens a verify row must bring (BudgetController.threshold). For each width w among
    the budgets, a request verifies min(budget, w) nodes and pays w rows: it joins when its nodes' gain beats
    theta * w, and the width with the largest summed net wins. fixed[i]: a probe, which keeps its budget (its
    record can only recover by being verified) and whose width every other tree pays. Returns the budgets."""
    fixed = fixed or [False] * len(budgets)
    trees = [i for i, b in enumerate(budgets) if b > 0]
    if len({budgets[i] for i in trees}) <= 1:
        return list(budgets)  # one width already: nothing is padded
    floor = max((budgets[i] for i in trees if fixed[i]), default=0)
    prefix = {i: [0.0, *accumulate(gains[i][:budgets[i]])] for i in trees if not fixed[i]}  # p[n]: n nodes' gain
    best_w, best_net = 0, float("-inf")
    for w in sorted({budgets[i] for i in trees if budgets[i] >= floor}):
        cost = theta * w
        net = 0.0
        for p in prefix.values():
            gain = p[w] if w < len(p) else p[-1]
            if gain > cost:
                net += gain - cost
        if net > best_net:
            best_w, best_net = w, net
    out = list(budgets)
    cost = theta * best_w
    for i, p in prefix.items():
        n = min(best_w, len(p) - 1)
        out[i] = n if p[n] > cost else 0
    return out
