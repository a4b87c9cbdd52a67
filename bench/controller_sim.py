"""The adaptive budget alone (engine/speculative/adaptive.py's BudgetController) driven as the engine drives it under
CUDA graphs with tree steps launched ahead, no model: a batch of requests, one replaced every --churn steps, each
step planned ahead (dry budgets, the uniform width, then a counted tree round or a counted plain step), a tree round
followed by the root-only round that leaves trees, and steady step times given on the command line. A share of the
requests draft confidently and have their drafts accepted now and then; the rest draft unsure trees. Prints, per
configuration and seed, the tree rounds and the throughput relative to a run of plain steps only. --backoff sets
MAX_EXPLORE_BACKOFF (1: before the explore back-off); --stale-leaving-free prices the leaving round at 0 once its
record goes stale, as before 6da90e8. A cheap way to see what a pricing change does to the rounds chosen; the
device's own behaviour (host-bound rounds, a slow host) is only in the step times given.

    python bench/controller_sim.py --round-ms 4.5 --leave-ms 2.6 --plain-ms 1.46 --backoff 1 4
    python bench/controller_sim.py --copy-share 0.5 --accept 2 4 --backoff 4 --stale-leaving-free
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import SamplingParams  # noqa: E402
from engine.cuda_graphs import graph_shape  # noqa: E402
from engine.plan import ScheduledSeq, StepPlan, StepResult  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.speculative import step_budgets  # noqa: E402
from engine.speculative.adaptive import BudgetController  # noqa: E402
from engine.speculative.confidence import node_confidence  # noqa: E402

NODES = 16
# a drafter's cumulative q over its best-first nodes: a confident one (copying) and an unsure one
COPYING = [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) for j in range(NODES)]
UNSURE = [0.3 * (j + 1) / NODES for j in range(NODES)]


def confidence(cumulative: list[float]) -> list[float]:
    """What the engine hands observe_request for a tree whose nodes' cumulative q is `cumulative`."""
    c = torch.tensor(cumulative, dtype=torch.float64)
    return node_confidence(c.diff(prepend=c.new_zeros(1))[None].numpy())[0].tolist()


def run(args, backoff: int, seed: int) -> tuple[int, float]:
    """(tree rounds, throughput relative to plain steps only) of one simulated run."""
    step_budgets.MAX_EXPLORE_BACKOFF = backoff
    rng = random.Random(seed)
    c = BudgetController(max_budget=NODES)
    c.pipelined = c.switches_ahead = True
    c.costs.shape_of = graph_shape
    if args.stale_leaving_free:  # the leaving round's price before 6da90e8: believed records only, else 0
        c.switch_tokens = lambda n=0: 0.0 if c.last_tree or c._after else \
            c._in_tokens(c.costs.extra(n, 1, leaving=True) or 0.0)
    curves = {True: confidence(COPYING), False: confidence(UNSURE)}
    made = [0]

    def new() -> Request:
        r = Request([1, 2, 3], SamplingParams(max_tokens=10 ** 6), request_id=f"r{made[0]}")
        made[0] += 1
        r.output_token_ids = [5, 6, 7]  # past the warm-up
        r.copying = rng.random() < args.copy_share
        c.observe_curve(r.request_id, curves[r.copying])
        return r

    reqs = [new() for _ in range(args.batch)]
    seconds = tokens = 0.0
    rounds, last_tree = 0, False
    for step in range(args.steps):
        if step % args.churn == args.churn - 1:
            c.release(reqs.pop(0).request_id)
            reqs.append(new())
        ids = [r.request_id for r in reqs]
        with c.planning_after(last_tree):
            dry = c.budgets_of(ids, dry=True, ahead=True)
            tree = any(dry) and any(c.uniform(ids, dry, [NODES] * len(ids)))
            counted = [c.budget(rid, ahead=True) for rid in ids] if tree else None
            if not tree:
                c.count_plain(ids)
        if tree:
            rounds += 1
            accepted = {r.request_id: rng.randint(*args.accept) if r.copying and b and rng.random() < args.accept_prob
                        else 0 for r, b in zip(reqs, counted)}
            plan = StepPlan([ScheduledSeq(r, 1, True, spec_budget=b) for r, b in zip(reqs, counted)])
            result = StepResult(new_token_ids={rid: [7] * (1 + a) for rid, a in accepted.items()},
                                accepted_rows={rid: list(range(1, a + 1)) for rid, a in accepted.items()},
                                curves={r.request_id: curves[r.copying] for r in reqs}, num_drafted=len(reqs))
            steps = [(plan, result, args.round_ms)]
            leaving = StepPlan([ScheduledSeq(r, 1, True, root_on_device=True) for r in reqs])
            steps.append((leaving, StepResult(new_token_ids={rid: [7] for rid in ids}), args.leave_ms))
        else:
            plan = StepPlan([ScheduledSeq(r, 1, True) for r in reqs])
            steps = [(plan, StepResult(new_token_ids={rid: [7] for rid in ids}), args.plain_ms)]
        for plan, result, ms in steps:
            c.observe_engine_step(plan, result, ms / 1e3, 0.0, synchronous=False, uniform_layout=True)
            seconds += ms / 1e3
            tokens += sum(len(t) for t in result.new_token_ids.values())
        last_tree = tree
    return rounds, tokens / seconds / (args.batch / (args.plain_ms / 1e3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--churn", type=int, default=4, help="steps between a request finishing and a new one joining")
    p.add_argument("--round-ms", type=float, default=3.0)
    p.add_argument("--leave-ms", type=float, default=1.8)
    p.add_argument("--plain-ms", type=float, default=1.3)
    p.add_argument("--copy-share", type=float, default=1 / 3, help="share of requests drafting confidently")
    p.add_argument("--accept-prob", type=float, default=0.3, help="chance a confident request's tree accepts")
    p.add_argument("--accept", type=int, nargs=2, default=[1, 2], metavar=("LO", "HI"), help="drafts it accepts")
    p.add_argument("--backoff", type=int, nargs="+", default=[1, 4], help="MAX_EXPLORE_BACKOFF values to run")
    p.add_argument("--stale-leaving-free", action="store_true")
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    for backoff in args.backoff:
        runs = [run(args, backoff, seed) for seed in range(args.seeds)]
        print(f"backoff x{backoff}: rounds {[r for r, _ in runs]}, throughput / plain mean "
              f"{statistics.mean(t for _, t in runs):.4f} (min {min(t for _, t in runs):.4f})", flush=True)


if __name__ == "__main__":
    main()
