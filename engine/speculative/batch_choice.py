"""The adaptive budget's choice for many requests at once: BudgetController._choose (adaptive.py) over a batch's
latest trees as numpy arrays, the same float64 operations in the same order, so each answer equals the scalar
one exactly (tests/speculative/test_batch_choice.py). At batch 64 the scalar choice, asked for every request on
every step, took ~0.35 ms of host time a step on the H100's host (bench/step_kinds.py --host-times), enough to
make the n-gram engine's plain steps host-bound where speculation off was bound by the GPU.

Used through BudgetController.prepare(), which stores each answer as the request's dry answer (its `pending`), so
the budget() calls that follow take it as they take any dry answer."""
from __future__ import annotations

import numpy as np

# below this many requests the scalar choice is cheaper than numpy's per-call overhead
MIN_BATCH = 8
# what counting a budget does to the request's probe state (BudgetController._choose)
PROBED, AT_ZERO, CHOSEN = "probed", "at zero", "chosen"


def choose_many(controller, stats: list, ahead: bool, probe_budget: int,
                prior_weight: float) -> list[tuple[int, str | None]]:
    """(budget, effect) of controller._choose(s, ahead) for each request's stats s (each with a tree: node_q
    non-empty); probe_budget: a probe's budget; prior_weight: adaptive.PRIOR_WEIGHT (calibration())."""
    num, num_nodes = len(stats), controller.max_budget
    theta, draft_tokens = controller.threshold(), controller.draft_tokens()
    q, bins, valid = _trees(stats, num_nodes)  # [R, B] each
    reliability = np.asarray(controller._bin_reliability())  # [num_bins]
    gains = q * reliability[bins] * _standing(controller, stats, prior_weight)[:, None]  # as _gains: (q * r) * s
    totals = np.cumsum(np.where(valid, gains, -np.inf), axis=1)  # left to right, as accumulate()
    net = totals - theta * np.arange(1, num_nodes + 1)  # [R, B]
    best = np.argmax(net, axis=1)  # the first of equal maxima: _net_best keeps a node only when strictly better
    best_net = net[np.arange(num), best]
    chosen = np.where((best_net > 0.0) & (best_net > draft_tokens), best + 1, 0).tolist()
    confident = (q[:, 0] > theta).tolist()  # _nodes_above(): the drafter expects its first node to pay
    out = []
    for s, c, sure in zip(stats, chosen, confident):
        if c:
            out.append((c, CHOSEN))
        elif not sure:
            out.append((0, None))
        elif not s.verified or (s.steps_at_zero + 1 >= s.probe_interval and controller._aligned(ahead)):
            out.append((probe_budget, PROBED))  # confident, but the record says no: probe now and then
        else:
            out.append((0, AT_ZERO))
    return out


def _trees(stats: list, num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The requests' first num_nodes nodes: q [R, B] float64, bins [R, B] int64, valid [R, B] (the node exists)."""
    if all(len(s.node_q) == num_nodes == len(s.node_bins) for s in stats):  # full trees: the usual case
        q = np.array([s.node_q for s in stats], dtype=np.float64)
        return q, np.array([s.node_bins for s in stats], dtype=np.int64), np.ones(q.shape, dtype=bool)
    q, bins = np.zeros((len(stats), num_nodes)), np.zeros((len(stats), num_nodes), dtype=np.int64)
    valid = np.zeros((len(stats), num_nodes), dtype=bool)
    for i, s in enumerate(stats):
        n = min(len(s.node_q), len(s.node_bins), num_nodes)
        q[i, :n], bins[i, :n], valid[i, :n] = s.node_q[:n], s.node_bins[:n], True
    return q, bins, valid


def _standing(controller, stats: list, prior_weight: float) -> np.ndarray:
    """[R] controller._standing(s, None) of each request: its calibration() over the engine-wide ratio."""
    accepted = np.array([s.accepted for s in stats], dtype=np.float64)
    predicted = np.array([s.predicted for s in stats], dtype=np.float64)
    if controller.predicted > 0:
        accepted = accepted + prior_weight * controller.accepted / controller.predicted
        predicted = predicted + prior_weight
    with np.errstate(divide="ignore", invalid="ignore"):
        calibration = np.where(predicted > 0, accepted / predicted, 1.0)
    engine = controller._engine_ratio()
    return calibration / engine if engine > 0 else np.zeros(len(stats))
