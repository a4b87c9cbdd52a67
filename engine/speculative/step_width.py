"""One tree width for a whole step: every request that verifies a tree in a step is laid out at the step's width
(the largest budget), so each pays that many verify rows whatever its own budget (runner layout: one padded width
a step). Budgets chosen request by request price only their own nodes; this picks the width, and which requests
verify at it, that nets the most expected accepted tokens once padding is paid."""
from __future__ import annotations

from itertools import accumulate

import numpy as np


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


def uniform_width(gains: list[list[float]], caps: list[int], theta: float, draft_cost: float,
                  fixed: list[int] | None = None, switch_cost: float = 0.0,
                  width_costs: list[float] | None = None) -> list[int]:
    """The nodes each request verifies in a step laid out uniformly (CUDA graphs: once a step verifies any tree,
    every decoding request in it is laid out at the step's width, budget 0 or not, so each of the n requests pays
    w rows). gains[i]: request i's expected accepted tokens per node, best-first, over up to caps[i] nodes;
    theta: expected tokens a verify row must bring; draft_cost: tokens of throughput drafting one request costs;
    fixed[i]: a probe's budget (0: none), which the width must hold. The width w (0 = a plain step) maximizes
    sum_i max(0, gain_i(min(w, cap_i)) - draft_cost) - theta * w * n (a probe counts whatever its gain), less
    switch_cost for any w > 0 (tokens a tree step costs beyond its rows: BudgetController.switch_tokens); each
    request then verifies min(w, cap_i) nodes when they beat its drafting cost (a probe always), else none.
    width_costs[w]: what width w costs the whole step in tokens, for w = 0..max(caps), in place of theta * w * n
    (a step's measured price under CUDA graphs: step_costs.py)."""
    n = len(gains)
    fixed = fixed or [0] * n
    floor, top = max(fixed, default=0), max(caps, default=0)
    # rows[i][w]: the gain of request i's first min(w, cap_i) nodes, net of drafting it, for w = 0..top
    # (C-level loops where they can be: at batch 64 this runs on the host's critical path of every graph step)
    rows = []
    for g, cap in zip(gains, caps):
        row = list(accumulate(g[:cap], initial=-draft_cost))
        if len(row) <= top:
            row += [row[-1]] * (top + 1 - len(row))
        rows.append(row)
    best_w, best_net = 0, 0.0 if floor == 0 else float("-inf")
    probes = [i for i in range(n) if fixed[i]]
    for w, column in enumerate(zip(*rows)):
        if w < max(1, floor):
            continue
        cost = theta * w * n if width_costs is None else width_costs[w]
        net = sum(filter((0.0).__lt__, column)) - cost - switch_cost
        if probes:
            net += sum(column[i] for i in probes if column[i] <= 0)
        if net > best_net:
            best_w, best_net = w, net
    if best_w == 0:
        return [0] * n
    return [min(best_w, cap) if probe or row[best_w] > 0 else 0 for row, cap, probe in zip(rows, caps, fixed)]


def uniform_width_array(gains: np.ndarray, caps: list[int], theta: float, draft_cost: float,
                        fixed: list[int] | None = None, switch_cost: float = 0.0,
                        width_costs: list[float] | None = None) -> list[int]:
    """uniform_width over a whole batch's gains at once: gains [n, max(caps)], each row zero past its cap and its
    tree. The same sums in the same order (prefix sums left to right, each width's requests summed in batch order;
    Python's sum of floats compensates its rounding since 3.12, so there two widths within rounding of each
    other may tie differently), in a few numpy passes instead of a Python loop a request and a width (with the
    gains, ~220 us of a batch-64 step's host work on the 2-core CPU, bench/budget_host.py)."""
    n, top = len(caps), max(caps, default=0)
    fixed = fixed or [0] * n
    floor = max(fixed, default=0)
    rows = np.empty((n, top + 1))  # rows[i, w]: the gain of request i's first min(w, cap_i) nodes, net of drafting
    rows[:, 0] = -draft_cost
    rows[:, 1:] = gains[:, :top]
    rows = np.cumsum(rows, axis=1)
    cost = theta * np.arange(top + 1) * n if width_costs is None else np.asarray(width_costs[:top + 1])
    net = np.cumsum(np.where(rows > 0.0, rows, 0.0), axis=0)[-1] - cost - switch_cost  # [top + 1]
    probes = [i for i in range(n) if fixed[i]]
    if probes:  # a probe counts whatever its gain
        held = rows[probes]
        net = net + np.cumsum(np.where(held <= 0.0, held, 0.0), axis=0)[-1]
    low = max(1, floor)
    if low > top:
        return [0] * n
    best_w = low + int(net[low:].argmax())
    if not net[best_w] > (0.0 if floor == 0 else float("-inf")):
        return [0] * n
    chosen = rows[:, best_w].tolist()
    return [min(best_w, cap) if probe or row > 0 else 0 for row, cap, probe in zip(chosen, caps, fixed)]
