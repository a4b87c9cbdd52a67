"""Host time of the adaptive budget's per-step work at a batch size, outside any engine: what a plain step planned
ahead asks (the dry budgets_of, then the counted one) and, when some request wants a tree, the step's uniform
width on top, what a plain step costs under CUDA graphs, where its decision holds (StepBudgets.count_plain), and
what observing a step costs (observe_engine_step: a plain step, one that drafted every request's curve, a round).
The state: every request holds a 16-node tree with mass (acceptance rates drawn from a few levels)
after 40 observed steps, so no request is answered by a shortcut; each timed step observes one step first (the
controller's answers are cached per observation, as in the engine).

    python bench/budget_host.py --batch 64 16
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.cuda_graphs import graph_shape  # noqa: E402
from engine.speculative.adaptive import BudgetController  # noqa: E402
from engine.plan import ScheduledSeq, StepPlan  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.speculative.confidence import node_confidence  # noqa: E402
from engine.step_results import StepResult  # noqa: E402

NODES = 16


def confidence_rows(node_q: np.ndarray) -> list:
    """Each row's node confidence as the engine's results carry it (a tree older than its split: the whole row)."""
    try:
        from engine.speculative.confidence import confidence_rows as split
    except ImportError:
        return node_confidence(node_q).tolist()
    return split(node_q)


def controller_at(batch: int, seed: int = 0) -> tuple[BudgetController, list[str]]:
    rng = random.Random(seed)
    budgets = BudgetController(max_budget=NODES)
    ids = [f"r{i}" for i in range(batch)]
    curves = {}
    for rid in ids:
        rate = rng.choice([0.3, 0.6, 0.9, 0.97])
        q = torch.tensor([[rate ** (j + 1) for j in range(NODES)]], dtype=torch.float64)
        curves[rid] = confidence_rows(q.numpy())[0]
    for step in range(40):
        budgets.observe_step(batch, 0.0013, tokens=batch)
        for rid in ids:
            verified = step % 4 == 0
            accepted = [1, 2][: rng.randint(0, 2)] if verified else []
            budgets.observe_request(rid, 4 if verified else 0, accepted, curves[rid])
    return budgets, ids


def per_step_us(fn, steps: int = 500) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    args = p.parse_args()
    for batch in args.batch:
        budgets, ids = controller_at(batch)
        caps = [NODES] * batch

        def plain_step():
            budgets.observe_step(batch, 0.0013, tokens=batch)
            budgets.budgets_of(ids, dry=True, ahead=True)
            budgets.budgets_of(ids, ahead=True)

        def priced_step():
            budgets.observe_step(batch, 0.0013, tokens=batch)
            budgets.uniform(ids, budgets.budgets_of(ids, dry=True, ahead=True), caps)

        held, _ = controller_at(batch)
        held.costs.shape_of = graph_shape  # under CUDA graphs a plain decision holds (count_plain)

        def held_step():
            held.observe_step(batch, 0.0013, tokens=batch)
            held.budgets_of(ids, dry=True, ahead=True)
            held.count_plain(ids)

        observed, _ = controller_at(batch)
        observed.costs.shape_of = graph_shape
        plan, plain_result, curve_result = observed_step(ids)
        round_plan, round_result = observed_round(ids)

        def observe_plain():
            observed.observe_engine_step(plan, plain_result, 0.0013, 0.0, False, True)

        def observe_curves():
            observed.observe_engine_step(plan, curve_result, 0.0013, 0.0001, False, True)

        def observe_round():
            observed.observe_engine_step(round_plan, round_result, 0.0025, 0.0001, False, True)

        print(f"batch {batch}: dry + counted budgets_of {per_step_us(plain_step):.0f} us a step; "
              f"dry budgets_of + uniform {per_step_us(priced_step):.0f} us a step; "
              f"dry budgets_of + count_plain under graphs {per_step_us(held_step):.0f} us a step (held 3 steps in 4); "
              f"observe_engine_step of a plain step {per_step_us(observe_plain):.0f} us, of one that drafted "
              f"every request's curve {per_step_us(observe_curves):.0f} us, of a round that verified every "
              f"request's 4-node tree {per_step_us(observe_round):.0f} us")


def observed_step(ids: list[str]) -> tuple[StepPlan, StepResult, StepResult]:
    """A decoding step of these requests at budget 0 under CUDA graphs (each 10 tokens into its output), and its
    results: plain, and with every request's curve drafted (16 nodes of mass)."""
    plan = StepPlan()
    for rid in ids:
        request = Request([1, 2, 3], SamplingParams(max_tokens=64), request_id=rid)
        request.output_token_ids = list(range(10))
        plan.seqs.append(ScheduledSeq(request, 1, True, num_ahead=1))
    plain = StepResult(new_token_ids={rid: [7] for rid in ids})
    curve = confidence_rows(np.array([[0.6 ** (j + 1) for j in range(NODES)]] * len(ids)))
    curves = StepResult(new_token_ids={rid: [7] for rid in ids}, curves=dict(zip(ids, curve)),
                        num_drafted=len(ids), num_curve_drafts=len(ids))
    return plan, plain, curves


def observed_round(ids: list[str]) -> tuple[StepPlan, StepResult]:
    """A tree round of these requests under CUDA graphs, each verifying 4 nodes of its 16-node tree and accepting
    0-2 of them."""
    plan, _, result = observed_step(ids)
    for s in plan.seqs:
        s.spec_budget = s.chosen_budget = 4
    result.accepted_rows = {rid: [1, 2][: i % 3] for i, rid in enumerate(ids)}
    result.new_token_ids = {rid: [7] * (1 + i % 3) for i, rid in enumerate(ids)}
    return plan, result


if __name__ == "__main__":
    main()
