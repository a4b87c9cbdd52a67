"""Adaptive tree budgets (engine/speculative/adaptive.py) and padded verify rows: the budget falls to 0 for a
drafter that never matches and rises to the whole chain for one that always does; requests with different
budgets share one padded verify width without any padding row ever being accepted, and greedy output stays
identical to plain decoding."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.adaptive import MIN_GAIN, PROBE_BUDGET, PROBE_EVERY, BudgetController
from engine.speculative.request_record import nodes_above
from engine.speculative.confidence import NUM_BINS, node_confidence
from engine.speculative.oracle import OracleDrafter
from engine.speculative.step_costs import StepCosts
from tests.speculative.test_ddtree_e2e import golden_lookup, prompts

MAX_TOKENS = 96


def confidence(curve: list[float]) -> list[float]:
    """A cumulative q curve -> what the engine hands observe_request: node_confidence() of its node q."""
    cumulative = torch.tensor(curve, dtype=torch.float64)
    return node_confidence(cumulative.diff(prepend=cumulative.new_zeros(1))[None].numpy())[0].tolist()


def test_node_confidence_bins_follow_frexp():
    """Bin k holds q in [2^-(k+1), 2^-k) (q = 1 in bin 0), the last bin everything smaller and q = 0: the binary
    exponent as Python's math.frexp defines it, at and around every bin edge."""
    import math

    edges = [2.0 ** -k for k in range(NUM_BINS + 2)]
    qs = [0.0, 1.0, 5e-324, 1e-300] + edges + [math.nextafter(e, 0.0) for e in edges] + [0.3, 0.117, 0.0158]
    got = node_confidence(np.array([qs], dtype=np.float64))[0].tolist()
    assert got[:len(qs)] == qs
    expect = [min(NUM_BINS - 1, max(0, -math.frexp(q)[1])) if q > 0 else NUM_BINS - 1 for q in qs]
    assert got[len(qs):] == expect


def greedy(llm):
    return [o.token_ids for o in llm.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                          ignore_eos=True))]


def chosen_budgets(llm) -> list[list[int]]:
    """Runs the prompts step by step; returns each step's chosen budgets (StepStats.spec_budgets)."""
    core, steps = llm.engine, []
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for p in prompts():
        core.add_request(p, sp)
    while core.has_unfinished():
        core.step()
        if core.last_stats is not None and core.last_stats.spec_budgets:
            steps.append(core.last_stats.spec_budgets)
    return steps


def test_budget_falls_to_zero_for_a_drafter_that_never_matches(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ref = greedy(LLM(folder, dtype="fp32"))
    wrong = [(p + [(t + 1) % 1000 for t in r], len(p)) for p, r in zip(prompts(), ref)]  # confident, always wrong
    oracle = OracleDrafter(golden_lookup(wrong), 1000, horizon=7, check_prefix=False)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    steps = chosen_budgets(llm)
    late = [b for step in steps[len(steps) // 2:] for b in step]
    # drafted before its budget is chosen (engine/draft_first.py) and with no record yet, the first decode step
    # verifies the drafter's confident tree; what it learns there brings the budget down
    assert min(steps[0]) >= 7, steps[0]
    assert late.count(0) >= 0.8 * len(late) and max(late) <= PROBE_BUDGET, late  # plain decoding, with probes
    assert greedy(LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)) == ref


def test_budget_rises_for_a_drafter_that_always_matches(tiny_checkpoints, monkeypatch):
    # the oracle's Python lookups can cost more than a tiny-model step on a busy host, and a verify row of a
    # tiny model on two busy cores can cost about what a token is worth; drafting and row costs have their own
    # tests below (test_controller_threshold_follows_the_measured_row_cost, ...), this one is about acceptance
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)
    monkeypatch.setattr(BudgetController, "threshold", lambda self: MIN_GAIN)
    folder, _ = tiny_checkpoints("llama")
    ref = greedy(LLM(folder, dtype="fp32"))
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(prompts(), ref)]), 1000, horizon=7)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    steps = chosen_budgets(llm)
    middle = [b for step in steps[:len(steps) // 2] for b in step]  # drafted first: the chain from the first step
    assert min(middle) >= 7, middle  # at least the whole 7-deep golden chain every step
    out = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16).generate(
        prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in out] == ref
    assert all(o.stats["spec"]["mean_accept_length"] > 6 for o in out)


def test_controller_threshold_follows_the_measured_row_cost():
    controller = BudgetController(max_budget=16)
    curve = [0.9 * (1 - 0.5 ** (j + 1)) / 0.5 for j in range(16)]  # node j brings 0.9 * 0.5**j
    controller.observe_request("r", 16, [1], confidence(curve))  # calibrated: accepted ~ predicted
    for rows in (10, 20, 40, 80):  # rows are nearly free: T barely grows
        controller.observe_step(rows, 0.010 + 0.00001 * rows, tokens=rows)
    cheap = controller.budget("r")
    for rows in (10, 20, 40, 80):  # now each row costs as much as the whole fixed part
        controller.observe_step(rows, 0.001 * rows, tokens=rows)
    for _ in range(40):
        controller.observe_step(80, 0.08, tokens=80)
        controller.observe_step(10, 0.01, tokens=10)
    dear = controller.budget("r")
    assert cheap > dear and dear <= 1, (cheap, dear)


def test_steps_with_a_prefill_chunk_count_but_do_not_price_rows():
    """A prefill chunk's rows share one weight read, so a step carrying one costs far less a row than a verify
    row of a decoding step; fitted, such steps (many rows, little more time) flattened the slope and kept trees
    that cost throughput (bench/serve.py on CPU at 8 concurrent chats: 51.8 tok/s with trees against 60.3 with
    speculation off, 63.4 once they were left out; docs/BENCHMARKS.md, 2026-12-04)."""
    def decoding(c):
        for _ in range(20):  # a decoding row costs 5 ms beside a 40 ms fixed part
            c.observe_step(24, 0.160, tokens=12)
            c.observe_step(8, 0.080, tokens=8)

    priced, fitted = BudgetController(max_budget=16), BudgetController(max_budget=16)
    decoding(priced)
    decoding(fitted)
    slope, clock = priced.fit.slope(), priced.clock
    for _ in range(10):  # 64 prompt tokens beside the 8 decoding rows, for 30 ms more
        priced.observe_step(72, 0.110, tokens=8, fit=False)
        fitted.observe_step(72, 0.110, tokens=8)
        priced.observe_step(8, 0.080, tokens=8)
        fitted.observe_step(8, 0.080, tokens=8)
    assert priced.clock == clock + 20  # counted: probes and interval drafts follow the step count
    assert priced.fit.slope() == pytest.approx(slope, rel=0.02) and slope == pytest.approx(0.005, rel=0.02)
    assert fitted.fit.slope() < 0.5 * slope and fitted.threshold() < 0.5 * priced.threshold()  # what fitting did


def test_the_threshold_follows_the_engines_throughput_not_the_last_steps():
    """At batch 1 a tree step emits 1 to 8 tokens. Priced at the last step's throughput, the threshold moved ~7x
    from step to step and the budget with it (and each flip between a tree and plain decoding costs a step that
    cannot run ahead of its predecessor); priced at the engine's decayed throughput it holds still."""
    controller = BudgetController(max_budget=16)
    curve = [0.9 * (1 - 0.5 ** (j + 1)) / 0.5 for j in range(16)]  # node j brings 0.9 * 0.5**j
    controller.observe_request("r", 16, [1, 2], confidence(curve))
    after = {}
    for i in range(40):
        tokens, rows = 8 if i % 2 else 1, 8 + i % 3
        controller.observe_step(rows, 0.001 + 0.00002 * rows, tokens)
        after[tokens] = (controller.threshold(), controller.budget("r", dry=True))
    (high, budget_high), (low, budget_low) = after[8], after[1]
    assert 0.02 < low < high < 1.3 * low, after
    assert budget_high == budget_low > 0


def test_engine_prices_rows_only_on_decoding_steps(tiny_checkpoints, monkeypatch):
    folder, _ = tiny_checkpoints("llama")
    seen = []
    observe = BudgetController.observe_step

    def spy(self, rows, seconds, tokens, fit=True, tree=False, synchronous=False):
        seen.append((rows, fit, tree))
        observe(self, rows, seconds, tokens, fit, tree, synchronous)

    monkeypatch.setattr(BudgetController, "observe_step", spy)
    ref = greedy(LLM(folder, dtype="fp32"))
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(prompts(), ref)]), 1000, horizon=7)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    core, sp = llm.engine, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    core.add_request(prompts()[0], sp)
    core.step()  # the prompt
    core.add_request(prompts()[1], sp)
    while core.has_unfinished():
        core.step()
    assert not seen[0][1]  # the first request's prompt
    assert any(not fit for _, fit, _ in seen[1:])  # the second's, beside the first request's decoding
    assert any(fit for _, fit, _ in seen[2:])  # decoding steps, plain or tree, price rows
    assert any(tree for _, fit, tree in seen if fit)  # tree steps are told apart (CostFit.tree_cost)


def test_cost_fit_tells_the_fixed_cost_of_a_tree_step_from_its_rows():
    """Steps of 1 row (plain) and 3-17 rows (trees), T = 0.05 + 0.002 * rows + 0.04 * [tree]: the two-regressor fit
    recovers t_row and t_tree, where rows alone put the tree cost into the row price. With only one kind of step
    in the window the tree cost is not identifiable (0) and the row price is the rows-only fit."""
    from engine.speculative.cost_fit import CostFit

    fit, rows_only = CostFit(), CostFit()
    for i in range(60):
        rows, tree = (1, False) if i % 3 else (3 + 2 * (i % 8), True)
        seconds = 0.05 + 0.002 * rows + 0.04 * tree
        fit.add(rows, seconds, tree=tree)
        rows_only.add(rows, seconds)
    assert abs(fit.slope() - 0.002) < 1e-6 and abs(fit.tree_cost() - 0.04) < 1e-6
    assert rows_only.tree_cost() == 0.0 and rows_only.slope() > 0.004  # the fixed cost smeared over the rows
    plain = CostFit()
    for rows in (1, 2, 4, 8) * 5:
        plain.add(rows, 0.05 + 0.002 * rows)
    assert plain.tree_cost() == 0.0 and abs(plain.slope() - 0.002) < 1e-6


def test_the_tree_steps_cost_outlives_a_run_of_plain_steps():
    """Once trees stop paying, tree steps become rare. Decayed by every step, their record left the fit within ~20
    plain steps and the next tree re-measured a cost already known; each kind of step now decays by its own, so
    the tree cost stands through 60 plain steps, and is re-measured only when the record has aged (STALE_DECAY)."""
    from engine.speculative.cost_fit import MIN_TREE_WEIGHT, STALE_DECAY, CostFit

    fit = CostFit()
    for rows in (1, 1, 4, 1, 1, 8, 1, 1, 6):  # T = 0.05 + 0.002 * rows + 0.04 * [tree]
        fit.add(rows, 0.05 + 0.002 * rows + 0.04 * (rows > 1), tree=rows > 1)
    for _ in range(60):
        fit.add(1, 0.052)
    assert abs(fit.tree_cost() - 0.04) < 1e-6 and abs(fit.slope() - 0.002) < 1e-6
    num_stale = 1 + int(math.log(MIN_TREE_WEIGHT / fit.tree.n) / math.log(STALE_DECAY))
    for _ in range(num_stale):
        fit.add(1, 0.052)
    assert fit.tree_cost() == 0.0  # aged out: the next tree measures it again


def test_the_budget_is_priced_on_the_tree_the_step_verifies(tiny_checkpoints, monkeypatch):
    """With a cheap drafter on synchronous steps each tree is drafted before its budget is chosen
    (engine/draft_first.py). A drafter that knows the continuation only after an even number of tokens: the
    engine verifies a tree exactly at the even lengths. Priced on the tree drafted after the previous step (the
    context one token shorter), the budgets followed the previous length's parity instead. The step costs are
    pinned (no fixed cost of a tree step, no throughput guard): measured on a busy 2-core CPU, one slow tree step
    priced trees out for the rest of the run in ~1 run in 3."""
    from engine.speculative.cost_fit import CostFit

    monkeypatch.setattr(BudgetController, "threshold", lambda self: MIN_GAIN)
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)  # cheap: drafted first
    monkeypatch.setattr(CostFit, "tree_cost", lambda self: 0.0)
    folder, _ = tiny_checkpoints("llama")
    prompt = prompts()[0]
    ref = greedy(LLM(folder, dtype="fp32"))[0]
    find = golden_lookup([(prompt + ref, len(prompt))])
    oracle = OracleDrafter(lambda req: find(req) if len(req.token_ids) % 2 == 0 else None, 1000, horizon=7)
    core = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16, spec_guard=False).engine
    assert core.draft_first is not None and not core.overlap
    rid = core.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    out, seen = [], []  # (length even, tree verified, tokens left) per decoding step
    while core.has_unfinished():
        request = core.requests[rid]
        length, left = request.num_tokens, MAX_TOKENS - request.num_output_tokens
        out.extend(t for d in core.step() for t in d.new_token_ids)
        if core.last_stats is not None and core.last_stats.spec_budgets:
            seen.append((length % 2 == 0, core.last_stats.spec_budgets[0] > 0, left))
    assert out == ref
    assert all(even for even, tree, _ in seen if tree), seen
    assert all(tree for even, tree, left in seen if even and left > 1), seen
    assert sum(tree for _, tree, _ in seen) >= 5


def test_a_step_whose_trees_do_not_beat_the_fixed_cost_stays_plain():
    """Without graphs a tree step pays a fitted fixed cost beyond its rows (batch 1 on the CPU: a GEMM instead of a
    GEMV). A tree worth a little more than its rows does not pay it and the step stays plain; a strong tree does;
    a probe is verified whatever it costs; under graphs (price_tree_steps False) nothing changes."""
    def controller(price: bool) -> BudgetController:
        c = BudgetController(max_budget=8, prior_row_share=0.2)
        c.price_tree_steps = price
        for i in range(40):  # t_row 2 ms, t_tree 40 ms, a plain step 50 ms: the fixed cost is ~0.8 tokens
            rows, tree = (1, False) if i % 3 else (3 + 2 * (i % 4), True)
            c.observe_step(rows, 0.05 + 0.002 * rows + 0.04 * tree, tokens=1 + 2 * tree, tree=tree)
        for rid, q, accepted in (("mild", 0.3, [1]), ("strong", 0.95, list(range(1, 9)))):
            qs = [q ** (j + 1) for j in range(8)]
            c.observe_request(rid, 8, accepted, confidence([sum(qs[:j + 1]) for j in range(8)]))
        return c

    priced = controller(True)
    assert priced.fit.tree_cost() > 0.03
    mild, strong = priced.budget("mild"), priced.budget("strong")
    assert mild >= 1 and strong >= 4  # each pays its rows and drafting ...
    assert priced.harmonize(["mild"], [mild]) == [0]  # ... the mild one not the step's fixed cost
    assert priced.harmonize(["strong"], [strong]) == [strong]
    priced.requests["mild"].probing = True
    assert priced.harmonize(["mild"], [mild]) == [mild]
    graphs = controller(False)
    assert graphs.fit.tree_cost() == 0.0 and graphs.harmonize(["mild"], [graphs.budget("mild")]) != [0]


def test_one_padded_width_for_the_step():
    """Every tree of a step is verified at the largest budget's width, so a request's small tree costs the big one's
    rows. common_width picks the width with the most net expected tokens and drops the trees that do not pay it."""
    from engine.speculative.step_width import common_width

    strong = [0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35]  # worth a wide tree
    weak = [0.5]  # one good node, then nothing
    # theta 0.3: the strong request wants 8 (every node beats 0.3), the weak 1; at width 8 the weak one's 0.5 does
    # not pay 8 rows (2.4), so it drops out and the strong keeps 8
    assert common_width([strong, weak], [8, 1], 0.3) == [8, 0]
    # four weak requests and one mildly wide: width 1 for all (4 x 0.2 net) beats width 3 for one (0.15 net)
    mild = [0.5, 0.3, 0.25]
    assert common_width([weak] * 4 + [mild], [1, 1, 1, 1, 3], 0.3) == [1, 1, 1, 1, 1]
    # one width already, or one tree: unchanged
    assert common_width([strong, strong], [4, 4], 0.3) == [4, 4]
    assert common_width([strong, []], [8, 0], 0.3) == [8, 0]
    # a probe keeps its budget and sets the floor: the weak request cannot pay width 4, the strong one can
    assert common_width([weak, strong, [0.1] * 4], [1, 8, 4], 0.3, fixed=[False, False, True]) == [0, 8, 4]
    assert common_width([weak, [0.1] * 4], [1, 4], 0.3, fixed=[False, True]) == [0, 4]


def test_harmonize_uses_each_requests_gains_and_keeps_probes():
    controller = BudgetController(max_budget=8, prior_row_share=0.2)
    for _ in range(30):  # a row costs 2 ms beside a 64 ms fixed part; 100 tokens a second: theta ~0.2
        controller.observe_step(8, 0.08, tokens=8)
        controller.observe_step(16, 0.096, tokens=8)
    strong = [0.9 ** (j + 1) for j in range(8)]
    for rid, qs, accepted in (("strong", strong, list(range(1, 9))), ("weak", [0.5] + [0.01] * 7, [1])):
        curve = [sum(qs[:j + 1]) for j in range(8)]
        controller.observe_request(rid, 8, accepted, confidence(curve))
    theta = controller.threshold()
    assert 0.01 < theta < 0.5
    wanted = [controller.budget("strong"), controller.budget("weak")]
    assert wanted[0] > wanted[1] >= 1
    got = controller.harmonize(["strong", "weak"], wanted)
    gains = [controller._gains(controller.requests[r], None, b) for r, b in zip(("strong", "weak"), wanted)]
    from engine.speculative.step_width import common_width
    assert got == common_width(gains, wanted, theta) and got[0] == wanted[0]
    assert got[1] != wanted[1]
    controller.requests["weak"].probing = True  # a probe is verified whatever the others' width
    assert controller.harmonize(["strong", "weak"], wanted)[1] == wanted[1]
    # a step planned ahead harmonizes dry answers before they are counted: a dry probe is a probe too
    weak = controller.requests["weak"]
    weak.probing, weak.pending = False, ((controller.version, True), wanted[1], "probed")
    assert controller.harmonize(["strong", "weak"], wanted)[1] == wanted[1]
    weak.pending = ((controller.version, True), wanted[1], "chosen")
    assert controller.harmonize(["strong", "weak"], wanted)[1] == got[1]


def test_side_branches_that_are_never_accepted_drop_out_of_the_tree(monkeypatch):
    """bench/e2e.py's oracle: its top-1 chain (q = 0.865^d) is always accepted, its second and third choices never
    are. One calibration factor per request credits the side branches with the chain's over-delivery (7 accepted
    for ~4.1 of q once the tree is the chain: a side branch at q = 0.117 looks worth 0.2 tokens, above a 0.1
    threshold) and verifies most of the 16 nodes every step; the reliability per confidence bin learns that side
    branches bring nothing and the tree shrinks to the chain, which verifies the same drafts with 9 fewer rows."""
    monkeypatch.setattr(BudgetController, "threshold", lambda self: 0.1)
    chain = [(0.865 ** d, True) for d in range(1, 8)]
    side = [(0.117 * 0.865 ** d, False) for d in range(7)] + [(0.0158 * 0.865 ** d, False) for d in range(2)]
    nodes = sorted(chain + side, reverse=True)  # best-first order
    curve = [sum(q for q, _ in nodes[:j + 1]) for j in range(len(nodes))]
    on_chain = [j + 1 for j, (_, accepted) in enumerate(nodes) if accepted]
    controller, budgets = BudgetController(max_budget=len(nodes)), []
    for _ in range(30):
        budget = controller.budget("r") if controller.requests else len(nodes)
        budgets.append(budget)
        controller.observe_request("r", budget, [row for row in on_chain if row <= budget], confidence(curve))
    assert on_chain == list(range(1, 8)) and budgets[0] == 16
    assert budgets[-10:] == [7] * 10, budgets
    single_factor = controller.calibration(controller.requests["r"])  # what the request's record alone says
    assert nodes_above([q * single_factor for q, _ in nodes], 0.1) >= 10  # side branches at q >= 0.06: > 0.1
    # what the metrics show (bins named by their lowest q): the chain's bins over-deliver, the side branches' none
    counts = controller.take_confidence_counts()
    assert counts["0.5"][0] >= counts["0.5"][1] > 0 and counts["0.25"][0] >= counts["0.25"][1] > 0
    assert counts["0.0625"][0] == 0 < counts["0.0625"][1] and counts["0.03125"][0] == 0
    assert controller.take_confidence_counts() == {}  # taken: counted once


def test_a_new_request_starts_from_its_neighbours_tree():
    """Before any tree was verified a request's first decode step drafts without verifying; after that, when
    drafting is not cheap (here: steps run ahead of their predecessors), its first budget comes from the tree
    the drafter last drew for another request, at the engine-wide record: a tree at once where the drafter has
    been right, none where it has been wrong. While drafting is cheap (an n-gram lookup) the first step drafts
    the request's own tree instead: in-process on the CPU, 16 chats decoding together went from 82.5 / 73.8 to
    86.0 / 87.3 tok/s, 8 chats from 62.2 / 58.8 to 68.6 / 61.9 (docs/BENCHMARKS.md, 2026-12-04 22:00)."""
    curve = [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) + 0.01 * max(0, j - 6) for j in range(16)]
    right, wrong = BudgetController(max_budget=16), BudgetController(max_budget=16)
    right.pipelined = wrong.pipelined = True
    for controller, accepted in ((right, [1, 2, 3, 4, 5, 6, 7]), (wrong, [])):
        controller.observe_step(8, 0.010, tokens=8)
        assert controller.budget("first") == 0
        for _ in range(5):
            controller.observe_request("old", 7, accepted, confidence(curve))
            controller.observe_step(8, 0.010, tokens=8)
    assert right.budget("new") == right.budget("old") == 7
    assert wrong.budget("new") == 0
    right.pipelined = False  # a curve-only draft is cheap again: the new request drafts its own tree first
    assert right.budget("newer") == 0 and right.should_draft("newer")


def test_a_request_specific_drafter_lends_no_tree_to_a_new_request():
    """With borrow off (the n-gram rule: a tree comes from the request's own text) a request without a tree of its
    own gets no first budget from its neighbour's and fills no width beside trees at a uniform step; it drafts
    its own first. With borrow on the same neighbour would give it 7 nodes and a place in the width."""
    from engine.cuda_graphs import graph_shape

    curve = [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) + 0.01 * max(0, j - 6) for j in range(16)]
    answers = {}
    for borrow in (True, False):
        controller = BudgetController(max_budget=16)
        controller.pipelined, controller.borrow = True, borrow
        controller.costs.shape_of = graph_shape
        for _ in range(6):
            controller.observe_request("old", 7, [1, 2, 3, 4, 5, 6, 7], confidence(curve))
            controller.observe_step(8, 0.010, tokens=8)
        gains, _ = controller._step_gains(["old", "new"], [7, 0], [16, 16])
        answers[borrow] = (controller.budget("new"), bool(gains[1]), controller.budget("old"))
    assert answers[True] == (7, True, 7)
    assert answers[False] == (0, False, 7)


def test_the_engine_lends_no_n_gram_tree(tiny_checkpoints):
    """The engine turns borrowing off for the n-gram drafter (request_specific) and leaves it on for others."""
    folder, _ = tiny_checkpoints("llama")
    assert not LLM(folder, dtype="fp32", drafter="ngram").engine.budgets.borrow
    oracle = OracleDrafter(lambda *_: None, 1000, horizon=4)
    assert LLM(folder, dtype="fp32", drafter=oracle).engine.budgets.borrow


@pytest.mark.parametrize("graphs", [False, True])
def test_a_new_request_probes_its_own_tree_soon(graphs):
    """After a run of failing requests the engine-wide record rates the drafter's confident nodes low, so a new
    request's first budget is 0; once it has drafted a tree of its own it verifies a probe soon instead of
    waiting for the engine's next probe step (up to two probe intervals at budget 0: on the H200 a batch of 64
    new requests decoded 30 steps plainly behind an oracle right three times in four). Without CUDA graphs at
    once; under them on the next step aligned to FIRST_PROBE_EVERY, so new requests' first probes share a tree
    round (each at its own step, on an H100 1-18 requests' trees made the first 30 steps of a batch-64 run rounds
    at twice a plain step's time)."""
    from engine.cuda_graphs import graph_shape
    from engine.speculative.adaptive import FIRST_PROBE_EVERY

    curve = [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) + 0.01 * max(0, j - 6) for j in range(16)]
    controller = BudgetController(max_budget=16)
    controller.costs.shape_of = graph_shape if graphs else None
    for _ in range(10):
        controller.observe_request("failing", 7, [], confidence(curve))
        controller.observe_step(8, 0.010, tokens=1)
    assert controller.budget("new") == 0  # the neighbour's tree at the engine's record: not worth verifying
    controller.observe_request("new", 0, [], confidence(curve))  # its first draft (a curve, nothing verified)
    controller.observe_step(8, 0.010, tokens=1)
    assert controller.clock % PROBE_EVERY != 0 and controller.clock % FIRST_PROBE_EVERY != 0
    waited = 0
    while controller.budget("new") != PROBE_BUDGET:
        assert controller.budget("failing") == 0  # a request with a record of its own waits for the probe step
        controller.observe_step(8, 0.010, tokens=1)
        waited += 1
    if graphs:
        assert controller.clock % FIRST_PROBE_EVERY == 0 and 0 < waited < FIRST_PROBE_EVERY
    else:
        assert waited == 0


def test_a_probe_is_not_repeated_in_the_step_planned_ahead_of_it():
    """Under asynchronous scheduling the step after a probe is planned before the probe's results are read, and it
    probed again: on the H100 at batch 16, T = 1, every probe ran twice, each time a ~0.5 ms tree step for all 16
    requests (bench/step_kinds.py trace, 2026-12-05). The step planned ahead of a probe now leaves the request
    plain; once the probe is observed the request is priced as usual (here: it failed, so it waits its probe
    interval)."""
    curve = [sum(0.9 ** d for d in range(1, min(j + 1, 7) + 1)) + 0.01 * max(0, j - 6) for j in range(16)]
    controller = BudgetController(max_budget=16)
    for _ in range(10):
        controller.observe_request("failing", 7, [], confidence(curve))
        controller.observe_step(8, 0.010, tokens=1)
    controller.observe_request("new", 0, [], confidence(curve))  # a tree of its own, never verified: probes
    controller.observe_step(8, 0.010, tokens=1)
    assert controller.budget("new", dry=True, ahead=True) == PROBE_BUDGET
    assert controller.budget("new", ahead=True) == PROBE_BUDGET  # counted: the step in flight carries the probe
    assert controller.budget("new", dry=True, ahead=True) == 0  # the step after it, planned ahead
    assert controller.budget("new", ahead=True) == 0
    controller.observe_request("new", PROBE_BUDGET, [], confidence(curve))  # the probe's outcome: nothing accepted
    controller.observe_step(8 * 5, 0.012, tokens=1, tree=True)
    assert controller.requests["new"].verified and controller.budget("new", ahead=True) == 0  # waits its interval
    assert controller.budget("new") == 0 and not controller.requests["new"].probing


def test_the_engine_wide_record_decays_by_the_step_not_by_the_request():
    """At batch 64 a record decayed per observed request spans the last ~10 requests: ten failing probes after a
    step of 64 right trees outweighed it. Decayed per step, the record weighs a step's trees together."""
    curve = [sum(0.9 ** d for d in range(1, min(j + 1, 4) + 1)) for j in range(4)]
    controller = BudgetController(max_budget=4)
    for i in range(64):
        controller.observe_request(f"right{i}", 4, [1, 2, 3, 4], confidence(curve))
    controller.observe_step(320, 0.010, tokens=320)
    for i in range(10):
        controller.observe_request(f"failing{i}", 4, [], confidence(curve))
    controller.observe_step(50, 0.010, tokens=10)
    ratio = controller.accepted / controller.predicted
    assert ratio > 1.0, ratio  # 64 trees right (4 accepted of 3.1 predicted each), 10 wrong; per request: 0.45
    assert min(controller._bin_reliability()[:2]) > 0.8


def test_uniform_width_prices_the_width_for_every_request():
    """Under the CUDA-graph layout every decoding request pays the step's width once any tree is verified: the
    width is chosen for the batch (theta per row per request), every request whose nodes beat its drafting cost
    fills it, and a step in which no width pays stays plain."""
    from engine.speculative.step_width import uniform_width

    strong, weak = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], [0.3, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05]
    # n = 3, theta 0.1, drafting 0.2: w = 7 nets (4.2 - 0.2) + (0.8 - 0.2) - 2.1 = 2.5 (w = 6 and 8: 2.45)
    assert uniform_width([strong, weak, []], [8, 8, 8], 0.1, 0.2) == [7, 7, 0]
    # the weak request's nodes never beat a dear draft (0.9): it rides root-only; w = 6 and 7 tie at 1.2, the
    # smaller kept
    assert uniform_width([strong, weak, []], [8, 8, 8], 0.1, 0.9) == [6, 0, 0]
    # caps (remaining tokens, the context) bound each request, not the width
    assert uniform_width([strong, weak], [2, 8], 0.01, 0.0) == [2, 8]
    # every row priced for every request: weak drafts alone never pay a step of trees
    assert uniform_width([weak] * 8, [8] * 8, 0.35, 0.0) == [0] * 8
    # a probe holds its width whatever its gain, and counts whatever it brings
    assert uniform_width([[0.01] * 4, []], [4, 4], 0.5, 0.0, fixed=[4, 0]) == [4, 0]


def test_reset_forgets_what_the_controller_learned():
    """After a run whose drafter was always wrong, reset() starts the next run from a fresh controller's prior."""
    curve = [0.9 * (1 - 0.5 ** (j + 1)) / 0.5 for j in range(16)]
    fresh, used = BudgetController(max_budget=16), BudgetController(max_budget=16)
    for controller in (fresh, used):
        controller.observe_step(10, 0.01, tokens=10)
    for i in range(60):  # every tree rejected: the engine-wide calibration falls towards 0
        used.observe_request(f"old-{i}", 16, accepted_rows=[], confidence=confidence(curve))
        used.observe_step(17, 0.012, tokens=1)
    used.reset()
    used.observe_step(10, 0.01, tokens=10)
    for controller in (fresh, used):
        controller.observe_request("new", 16, accepted_rows=[1], confidence=confidence(curve))
    assert used.budget("new") == fresh.budget("new") > 0
    assert used.calibration(used.requests["new"]) == fresh.calibration(fresh.requests["new"])


def test_mixed_budgets_share_one_padded_width_and_padding_is_never_accepted(tiny_checkpoints, monkeypatch):
    """Four requests verify 1, 3, 7 and 16 nodes in the same step (width 17): every accepted row lies inside its
    own request's tree, and greedy output equals plain decoding."""
    from engine.speculative import speculator

    folder, _ = tiny_checkpoints("qwen3")
    ref = greedy(LLM(folder, dtype="fp32"))
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(prompts(), ref)]), 1000, horizon=7,
                           noise=0.3, noise_rank=2, seed=5)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    fixed = {}
    llm.engine.scheduler.budget_of = lambda req: fixed.setdefault(req.request_id, [1, 3, 7, 16][len(fixed) % 4])
    llm.engine.scheduler.width_of = lambda requests, budgets: budgets  # as pinned (no width harmonizing)
    llm.engine.scheduler.fill_trees = False  # the narrow trees keep their padding rows
    walks, widths = [], []
    walk = speculator.Speculator.walk

    def spy(batch, targets):
        result = walk(batch, targets)
        widths.append(batch.width)
        walks.append((torch.tensor(batch.budgets), result.accepted_nodes.clone()))
        return result

    monkeypatch.setattr(speculator.Speculator, "walk", staticmethod(spy))
    assert greedy(llm) == ref
    assert 17 in widths
    for budgets, nodes in walks:
        assert bool((nodes <= budgets[:, None]).all()), (budgets, nodes)  # rows past b are padding
    assert any(bool((nodes[:, 1:] > 0).any()) for _, nodes in walks)  # drafts were accepted at all


def test_a_drafter_with_nothing_to_propose_costs_no_verify_rows(tiny_checkpoints):
    """The n-gram drafter on text without repeats proposes only padding (draft probability ~0): requests keep
    drafting for the curve, and no tree is ever verified."""
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32", drafter="ngram", spec_budget=16)
    core = llm.engine
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for p in prompts():
        core.add_request(list(dict.fromkeys(p)), sp)  # no token twice: nothing for an n-gram to match
    budgets = []
    while core.has_unfinished():
        core.step()
        budgets += core.last_stats.spec_budgets if core.last_stats else []
    assert budgets and set(budgets) == {0}


def test_drafting_cost_counts_against_the_tree_and_dear_drafting_backs_off():
    """A tree must pay for its drafting too; at budget 0 a dear drafter runs only at doubling intervals, a cheap one
    every step."""
    from engine.speculative.request_record import MAX_PROBE_INTERVAL, PROBE_EVERY

    curve = [0.6 * (1 - 0.5 ** (j + 1)) / 0.5 for j in range(16)]  # ~1.2 expected accepted drafts in all
    cheap, dear = BudgetController(max_budget=16), BudgetController(max_budget=16)
    for c in (cheap, dear):
        c.observe_request("r", 16, accepted_rows=[1], confidence=confidence(curve))
        c.observe_draft(1, 5.0)  # the first call's one-time costs are not the drafter's
    for _ in range(8):
        for c in (cheap, dear):
            c.observe_step(1, 0.010, tokens=1)
            c.observe_step(17, 0.011, tokens=2)
        cheap.observe_draft(1, 0.0001)  # an n-gram lookup: 1% of a step
        dear.observe_draft(1, 0.015)  # a drafter forward: 1.5 steps, more than the tree could bring
    assert cheap.budget("r") > 0 and dear.budget("r") == 0
    assert all(cheap.should_draft("r") for _ in range(50))
    drafted = [i for i in range(2000) if dear.should_draft("r")]
    gaps = [b - a for a, b in zip([-1] + drafted, drafted)]
    assert gaps[0] == PROBE_EVERY and gaps[1] == 2 * PROBE_EVERY and max(gaps) == MAX_PROBE_INTERVAL, gaps
    assert len(drafted) < 2000 / 40


def test_probes_of_many_requests_fall_on_the_same_steps():
    """64 requests whose confident drafter keeps being wrong, arriving one per step: their probes (small trees)
    and interval drafts happen on shared steps, so at most one step in PROBE_EVERY carries a tree or a draft,
    instead of nearly every step once the requests' phases spread."""
    from engine.speculative.adaptive import PROBE_EVERY

    c = BudgetController(max_budget=16)
    c.pipelined = True  # drafting is never cheap: interval drafts
    confident = [0.9 * (j + 1) for j in range(16)]
    busy_steps, active = [], []
    for step in range(400):
        if step < 64:
            rid = f"r{step}"
            c.observe_request(rid, 4, accepted_rows=[], confidence=confidence(confident))  # one wrong probe on record
            active.append(rid)
        wants = [c.budget(r) > 0 or c.should_draft(r) for r in active]
        if any(wants):
            busy_steps.append(step)
        c.observe_step(len(active), 0.004, tokens=len(active))
        c.observe_draft(sum(wants), 0.002 * sum(wants))
    late = [s for s in busy_steps if s >= 100]
    assert late and len(late) <= 300 / PROBE_EVERY + 1, late
    assert len({s % PROBE_EVERY for s in late}) == 1, late


def test_a_dry_budget_answer_serves_the_counted_call_after_it(monkeypatch):
    """Asynchronous scheduling asks each request's budget dry (may the next step run ahead?) and then counted: the
    counted call reuses the dry answer (one choice per request per step) and leaves the same probe state as
    asking once, through probes, steps at zero and chosen trees; an observation in between voids the answer."""
    from engine.speculative.adaptive import PROBE_EVERY

    twice, once = BudgetController(max_budget=16), BudgetController(max_budget=16)
    choices = []
    choose = BudgetController._choose
    monkeypatch.setattr(BudgetController, "_choose", lambda self, *a: choices.append(self) or choose(self, *a))
    wrong = confidence([0.9 * (j + 1) for j in range(16)])  # confident, never accepted: probes
    right = confidence([0.95 ** (j + 1) for j in range(16)])  # accepted: trees chosen
    seen = {twice: [], once: []}
    for step in range(6 * PROBE_EVERY):
        for c in (twice, once):
            c.observe_request("wrong", 4, accepted_rows=[], confidence=wrong)
            c.observe_request("right", 16, accepted_rows=list(range(1, 9)), confidence=right)
            c.observe_step(9, 0.004, tokens=10)
            c.observe_draft(2, 0.0001)
        for rid in ("wrong", "right"):
            dry = twice.budget(rid, dry=True, ahead=True)
            seen[twice].append(twice.budget(rid, ahead=True))
            assert dry == seen[twice][-1]
            seen[once].append(once.budget(rid, ahead=True))
    assert seen[twice] == seen[once]
    assert 0 < seen[once][0::2].count(min(4, 16)) and seen[once][0::2].count(0) > 4 * PROBE_EVERY
    assert min(seen[once][1::2]) > 0
    assert choices.count(twice) == choices.count(once) == len(seen[once])
    twice.budget("wrong", dry=True)
    twice.observe_step(9, 0.004, tokens=10)  # a new observation: the dry answer no longer stands
    twice.budget("wrong")
    assert choices.count(twice) == len(seen[once]) + 2


@pytest.mark.parametrize("graphs", [False, True])
def test_an_expensive_drafter_that_does_not_pay_stays_out_of_the_way(tiny_checkpoints, graphs):
    """A drafter that costs several plain steps per call and is always wrong: the engine decodes plainly and
    calls it for a small fraction of the steps; greedy output is unchanged. With CUDA graphs (emulated on CPU)
    budget-0 requests ride as root-only trees, and still are not drafted for."""
    import time

    folder, _ = tiny_checkpoints("llama")
    ref = greedy(LLM(folder, dtype="fp32"))
    wrong = [(p + [(t + 1) % 1000 for t in r], len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(wrong), 1000, horizon=7, check_prefix=False)
    calls = []
    propose = oracle.propose

    def slow(batch, top_k):
        calls.append(len(batch))
        time.sleep(0.02)  # tiny-model plain steps take a few ms
        return propose(batch, top_k)

    oracle.propose = slow
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)
    if graphs:
        llm.engine.enable_graphs(emulate=True)
    steps = chosen_budgets(llm)
    assert len(calls) < 0.25 * len(steps), (len(calls), len(steps))
    assert greedy(LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16)) == ref


def test_budget_zero_requests_beside_a_tree_are_not_drafted_for_under_graphs(tiny_checkpoints, monkeypatch):
    """With CUDA graphs (emulated on CPU) a step that verifies one request's tree lays every decoding request out
    as a tree; the requests whose budget is 0 ride as root-only trees and the drafter is not run for them (only
    at their probe intervals). One request's drafts always match, the others' never do."""
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 1.0)  # drafting costs: back off
    # ... and prices that do not follow the host's timing: measured on a loaded CPU they made trees of the matching
    # request rare (6-8 steps of 13), so the others' probe-interval drafts outnumbered them and the check below failed
    monkeypatch.setattr(BudgetController, "threshold", lambda self: 0.05)
    monkeypatch.setattr(BudgetController, "switch_tokens", lambda self, num_seqs=0: 0.0)
    monkeypatch.setattr(StepCosts, "width_seconds", lambda self, num_seqs, top, row_seconds, synchronous=False: None)
    folder, _ = tiny_checkpoints("llama")
    ref = greedy(LLM(folder, dtype="fp32"))
    golden = [(p + (r if i == 0 else [(t + 1) % 1000 for t in r]), len(p))
              for i, (p, r) in enumerate(zip(prompts(), ref))]
    oracle = OracleDrafter(golden_lookup(golden), 1000, horizon=7, check_prefix=False)
    step_drafts: set[str] = set()
    propose = oracle.propose

    def counting(batch, top_k):
        step_drafts.update(r.request_id for r in batch)
        return propose(batch, top_k)

    oracle.propose = counting
    # about which requests are drafted for, not whether the trees pay on the CPU (the guard measures that)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=16, spec_guard=False)
    llm.engine.enable_graphs(emulate=True)
    core, sp = llm.engine, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ids = [core.add_request(p, sp) for p in prompts()]
    outputs, tree_steps, others_drafted = {i: [] for i in ids}, 0, 0
    while core.has_unfinished():
        step_drafts.clear()
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        if ids[0] in step_drafts and core.last_stats.cuda_graph.startswith("replay"):
            tree_steps += 1
            others_drafted += len(step_drafts - {ids[0]})
    assert [outputs[i] for i in ids] == ref
    assert tree_steps >= 5, tree_steps  # the matching request verified trees through graph replays
    assert others_drafted <= tree_steps, (others_drafted, tree_steps)  # not 3 per step: probes only


def test_the_budget_learns_only_from_the_nodes_it_chose():
    """A tree filled to the step's width verifies more nodes than the adaptive budget chose; its record counts the
    chosen ones and the accepted drafts among them (the prefix of the accepted path the chosen tree alone would
    have accepted), so filling never moves what the controller learns."""
    from types import SimpleNamespace

    from engine.plan import ScheduledSeq, StepPlan, StepResult
    from engine.request import Request
    from engine.speculative.step_budgets import StepBudgets

    seen = []
    budgets = SimpleNamespace(observe_step=lambda *a, **k: None, observe_draft=lambda *a: None, enabled=True,
                              observe_request=lambda *args: seen.append(args[:4]), probes_unobserved=0,
                              guard=SimpleNamespace(observe=lambda *args, **kwargs: None))
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=50), request_id=r) for r in ("filled", "own")]
    plan = StepPlan([ScheduledSeq(requests[0], 1, True, 6, chosen_budget=2), ScheduledSeq(requests[1], 1, True, 6)])
    result = StepResult(new_token_ids={"filled": [7] * 5, "own": [7] * 3}, curves={"filled": [0.5], "own": [0.5]},
                        accepted_rows={"filled": [1, 2, 4, 6], "own": [1, 3]})
    StepBudgets.observe_engine_step(budgets, plan, result, 0.01, 0.0, synchronous=False, uniform_layout=False)
    assert seen == [("filled", 2, [1, 2], [0.5]), ("own", 6, [1, 3], [0.5])]


def test_a_first_step_of_few_rows_seeds_an_optimistic_prior():
    """Plain steps of one width never move the fitted slope, so the prior decides whether a first tree is ever
    verified. Seeded by a decoding step's 16 rows (prompts found in the prefix cache: the H200 at batch 16), it
    priced a row at half that step, a threshold of ~1.9 tokens a row, and no tree ran; seeded as if that step had
    PRIOR_MIN_ROWS rows, a confident request verifies its tree."""
    from engine.speculative.adaptive import PRIOR_MIN_ROWS

    controller = BudgetController(max_budget=16)
    controller.observe_step(16, 0.0025, tokens=16)  # the first step: the prompts came from the prefix cache
    for _ in range(50):
        controller.observe_step(16, 0.0008, tokens=16)
    qs = [0.8 ** (j + 1) for j in range(16)]
    controller.observe_curve("r", confidence([sum(qs[:j + 1]) for j in range(16)]))
    assert controller.threshold() < 0.2 and controller.budget("r") >= 4
    assert 0.5 * 0.0025 / 16 * 16 / 0.0008 > 1.5 > 0.5 * 0.0025 / PRIOR_MIN_ROWS * 16 / 0.0008  # (what it was)


def test_a_prefill_step_does_not_seed_the_prior():
    """The prior's pseudo-steps sit at the step that seeds them. Seeded by a prompt's prefill (81 rows, 9.7 ms),
    they read, beside the decoding steps that followed, as the row cost of a prefill: on the H100 at batch 16
    (`bench/gpu_serving.py`'s flow, graphs on, so tree steps are fitted as rows) the slope climbed from 0.1 to 18
    us a row over 23 plain steps after two tree steps had measured ~0, and the threshold from 0.02 to 0.31 tokens:
    above the drafter's first nodes, so for a request whose first tree had failed no probe ran. The steps below
    are that run's first 31, as the trace logged them."""
    controller = BudgetController(max_budget=16)
    controller.pipelined, controller.price_tree_steps = True, False
    # rows, ms, tokens, fit, tree, synchronous
    trace = [(81, 9.683, 1, 0, 0, 1), (1, 4.927, 1, 1, 0, 1), (1, 0.805, 1, 1, 0, 0), (1, 1.672, 1, 1, 0, 0),
             (4, 1.661, 4, 1, 1, 0), (16, 4.341, 16, 1, 0, 1), (96, 2.528, 16, 1, 1, 0), (256, 1.697, 16, 1, 1, 0)]
    trace += [(16, 0.84, 16, 1, 0, 0)] * 23
    for rows, ms, tokens, fit, tree, synchronous in trace:
        controller.observe_step(rows, ms / 1e3, tokens, fit=bool(fit), tree=bool(tree), synchronous=bool(synchronous))
    # the tree steps' own slope: 96 rows in 2.5 ms and 256 in 1.7 beside 16 in ~0.84 (the first, synchronous,
    # pays its switch), a few us a row at most
    assert controller.fit.slope() < 5e-6 and controller.threshold() < 0.1


def test_under_asynchronous_scheduling_a_switch_into_trees_pays_its_synchronous_step():
    """A tree step after a plain one cannot run ahead of its predecessor's results (nor can the plain step after the
    trees): on the H200 at batch 1 such a step took ~1.9 ms against 0.83 ms run ahead, and sporadic trees of ~0.7
    accepted drafts each lost to plain decoding (T = 1: 0.93x). Measured as the synchronous steps' time beyond
    the fit's prediction, that switch is priced when entering trees: a mild tree stays plain after a plain step, a
    strong one does not, and once a tree step ran (the next can run ahead) the mild one is verified too."""
    controller = BudgetController(max_budget=8)
    controller.pipelined = True
    controller.observe_step(64, 0.002, tokens=1, fit=False)  # (the prompt)
    for i in range(60):  # batch 1: ahead steps 0.83 ms; every 6th a synchronous one, 1.1 ms more
        synchronous = i % 6 == 0
        controller.observe_step(1, 0.00083 + 0.0011 * synchronous, tokens=1, synchronous=synchronous)
    assert controller.switch.seconds() == pytest.approx(0.0011, rel=0.15)
    assert controller.switch_tokens() == pytest.approx(1.3, rel=0.2)  # 1.1 ms at ~1,000 tokens a second
    mild = [0.6, 0.3, 0.15] + [0.01] * 5  # ~1 token beyond its rows
    strong = [0.95 ** (j + 1) for j in range(8)]
    for rid, qs in (("mild", mild), ("strong", strong)):
        controller.observe_curve(rid, confidence([sum(qs[:j + 1]) for j in range(8)]))
    assert controller.uniform(["mild"], [3], [8]) == [0]
    assert controller.uniform(["strong"], [8], [8]) != [0]
    with controller.planning_after(tree=True):  # planned ahead after a tree step in flight: no switch
        assert controller.switch_tokens() == 0.0 and controller.uniform(["mild"], [3], [8]) != [0]
    assert controller.switch_tokens() > 1.0
    controller.observe_step(9, 0.0012, tokens=4, tree=True)  # a tree step: the next one runs ahead
    assert controller.switch_tokens() == 0.0 and controller.uniform(["mild"], [3], [8]) != [0]
    controller.observe_step(1, 0.00083, tokens=1)
    assert controller.switch_tokens() > 1.0
    controller.switches_ahead = True  # an engine whose tree steps run ahead of plain ones: no switch to pay
    assert controller.switch_tokens() == 0.0 and controller.uniform(["mild"], [3], [8]) != [0]


def test_failing_probes_back_off_and_an_accepted_one_restores_them():
    """A request whose drafter is confident and whose record says it is wrong verifies a small probe tree now and
    then; under asynchronous scheduling a probe's step and the one after cannot run ahead (on the H200 at batch 16,
    T = 1, probes every 16 steps cost ~15%), so each probe that accepted nothing doubles the wait, up to
    MAX_PROBE_BACKOFF steps; one that accepted a draft brings it back to PROBE_EVERY, and so does a drafter grown
    surer than at the failed probe (a reply that turns to copying: on the CPU at batch 1, T = 0, the back-off alone
    took 79 steps for 128 tokens, none 66, with the reset 55)."""
    from engine.speculative.adaptive import MAX_PROBE_BACKOFF, PROBE_BUDGET, PROBE_EVERY

    controller = BudgetController(max_budget=8)
    for _ in range(5):
        controller.observe_step(8, 0.01, tokens=8)
    qs = [0.6 ** (j + 1) for j in range(8)]
    curve = confidence([sum(qs[:j + 1]) for j in range(8)])

    def probes_in(num_steps: int) -> list[int]:
        """The steps (of the next num_steps) at which the request probed; every probe accepts nothing."""
        seen = []
        for i in range(num_steps):
            budget = controller.budget("r")
            if budget:
                seen.append(i)
                controller.observe_request("r", budget, [], curve)
            controller.observe_step(8, 0.01, tokens=8)
        return seen

    controller.observe_request("r", 8, [], curve)  # its own tree, verified: nothing accepted
    seen = probes_in(400)
    # each probe counted once (the server's spec_decode_probes_total), then the count starts over
    assert controller.take_probes() == len(seen) > 3 and controller.take_probes() == 0
    gaps = [b - a for a, b in zip(*(lambda p: (p, p[1:]))(seen))]
    assert gaps[:3] == [2 * PROBE_EVERY, MAX_PROBE_BACKOFF, MAX_PROBE_BACKOFF], gaps
    controller.observe_request("r", PROBE_BUDGET, [1], curve)  # a probe accepted a draft
    assert controller.requests["r"].probe_interval == PROBE_EVERY
    probes_in(200)
    assert controller.requests["r"].probe_interval == MAX_PROBE_BACKOFF
    controller.observe_curve("r", curve)  # as sure as when its probes failed: still backing off
    assert controller.requests["r"].probe_interval == MAX_PROBE_BACKOFF
    surer = [0.95 ** (j + 1) for j in range(8)]
    controller.observe_curve("r", confidence([sum(surer[:j + 1]) for j in range(8)]))
    assert controller.requests["r"].probe_interval == PROBE_EVERY


def test_a_probe_whose_tree_held_no_mass_does_not_back_off():
    """A probe is chosen on the request's latest tree, which under asynchronous scheduling may be many steps old;
    the tree drafted for the probe's own step can hold nothing (on the H100 at batch 16, T = 0, the probes of a
    request whose first tree failed came out empty and doubled its wait each time). Such a probe tested nothing:
    the wait stays, and a probe whose tree held mass and accepted nothing still doubles it."""
    from engine.speculative.adaptive import PROBE_EVERY

    controller = BudgetController(max_budget=8)
    for _ in range(5):
        controller.observe_step(8, 0.01, tokens=8)
    qs = [0.6 ** (j + 1) for j in range(8)]
    curve = confidence([sum(qs[:j + 1]) for j in range(8)])
    empty = confidence([0.0] * 8)
    controller.observe_request("r", 8, [], curve)  # its own tree failed
    assert controller.requests["r"].probe_interval == PROBE_EVERY
    controller.observe_request("r", PROBE_BUDGET, [], empty)
    assert controller.requests["r"].probe_interval == PROBE_EVERY
    controller.observe_request("r", PROBE_BUDGET, [], curve)
    assert controller.requests["r"].probe_interval == 2 * PROBE_EVERY


def random_step(rng: random.Random, requests: list[str], controllers, num_nodes=lambda rng: 16) -> None:
    """One step's observations, the same for each controller: r0-r3 confident and never right (probed; one step
    in five their drafter finds nothing), r4 unsure and always right (its bins over-deliver, its few nodes just
    pay), r5 confident and right, the rest mixed (trees with and without mass); a random step time, size and
    drafting cost. num_nodes(rng): each tree's nodes."""
    events = []
    for i, rid in enumerate(requests):
        if i < 4:
            scale = 1.0 if rng.random() < 0.8 else 0.0
        else:
            scale = (0.01, 1.0)[i - 4] if i < 6 else rng.choice([0.0, 0.0, 0.002, 0.05, 0.3, 1.0])
        node_q = sorted((scale * rng.random() ** 2 for _ in range(num_nodes(rng))), reverse=True)
        conf = node_confidence(np.array([node_q], dtype=np.float64))[0].tolist()
        budget = rng.choice([0, 0, 4, 16])
        right = i in (4, 5) or (i >= 6 and rng.random() < 0.6)
        accepted = list(range(1, rng.randint(0, budget) + 1)) if right else []
        events.append((rid, budget, accepted, conf))
    rows, seconds, tokens = rng.randint(12, 200), rng.uniform(0.002, 0.02), rng.randint(12, 40)
    draft = rng.choice([1e-7, 1e-4, 2e-3])
    for c in controllers:
        for rid, budget, accepted, conf in events:
            c.observe_request(rid, budget, accepted, conf)
        c.observe_step(rows, seconds, tokens)
        c.observe_draft(len(requests), draft * len(requests))


class FullChoice(BudgetController):
    """The budget without its shortcuts: every request's choice works out its gains (_net_best), a tree without
    mass included; counts those choices."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = 0

    def _cannot_pay(self, stats, theta: float) -> bool:
        return False

    def _set_tree(self, request_id: str, confidence: list[float]):
        stats = super()._set_tree(request_id, confidence)
        stats.q_total = math.nan  # never exactly 0: _answer's shortcut for a tree without mass is not taken
        return stats

    def _net_best(self, *args, **kwargs) -> int:
        self.choices += 1
        return super()._net_best(*args, **kwargs)


def test_the_shortcuts_past_the_gains_never_change_a_budget():
    """At batch 64 a drafter that found nothing left every request's choice working out 16 gains it could not
    use (~360 us a step on the host's critical path, docs/BENCHMARKS.md 2026-12-05 20:00): a tree without mass is
    answered 0 at once, and _cannot_pay answers 0 from an upper bound of the tree's gains. Over random states
    (drafters right and wrong, reliability bins above and below 1, dear and free drafting, trees with and without
    mass) the answers and probe states equal those of the full choice, step by step, and the shortcuts decide a
    share of them."""
    rng = random.Random(0)
    pruned, full = FullChoice(max_budget=16), FullChoice(max_budget=16)
    pruned._cannot_pay = lambda stats, theta: BudgetController._cannot_pay(pruned, stats, theta)
    pruned._set_tree = lambda rid, confidence: BudgetController._set_tree(pruned, rid, confidence)
    probes = 0
    requests = [f"r{i}" for i in range(12)]
    for step in range(400):
        random_step(rng, requests, (pruned, full))
        for rid in requests:
            ahead = step % 3 == 0
            assert pruned.budget(rid, dry=True, ahead=ahead) == full.budget(rid, dry=True, ahead=ahead), (step, rid)
            assert pruned.budget(rid, ahead=ahead) == full.budget(rid, ahead=ahead), (step, rid)
            mine, theirs = pruned.requests[rid], full.requests[rid]
            probes += mine.probing
            assert (mine.steps_at_zero, mine.probe_interval, mine.probing) == (
                theirs.steps_at_zero, theirs.probe_interval, theirs.probing)
    assert probes > 10 and any(pruned.requests[rid].q_total > 0 for rid in requests)
    assert 0.2 < 1 - pruned.choices / full.choices < 0.95, (pruned.choices, full.choices)
    assert max(pruned.bins.ceiling(pruned._engine_ratio()), 0) > 1.0  # some bin over-delivers: the bound scales


def test_the_bound_holds_where_it_is_tight(monkeypatch):
    """One node, in a confidence bin that over-delivers, of a request at the engine's standing: the bound equals
    the node's gain, so across q it must let through every node the full choice verifies (a bound short by a
    fraction of the threshold would drop nodes that pay)."""
    monkeypatch.setattr(BudgetController, "threshold", lambda self: 0.1)
    one_node = lambda q: node_confidence(np.array([[q]], dtype=np.float64))[0].tolist()
    pruned, full = BudgetController(max_budget=1), BudgetController(max_budget=1)
    full._cannot_pay = lambda stats, theta: False
    for c in (pruned, full):
        for step in range(40):  # a node of q 0.012 accepted one step in eight: its bin brings ~10x what it says
            c.observe_request("trained", 1, [1] if step % 8 == 0 else [], one_node(0.012))
            c.observe_step(32, 0.01, tokens=32)
    chosen = []
    for i in range(400):
        q = 0.0079 + 0.0076 * i / 400  # within the trained bin, below the threshold itself
        for c in (pruned, full):
            c.observe_curve("new", one_node(q))
        chosen.append(full.budget("new"))
        assert pruned.budget("new") == chosen[-1], q
    assert chosen[0] == 0 and chosen[-1] == 1, chosen


def probe_state(record) -> tuple:
    return (record.steps_at_zero, record.probe_interval, record.probing, record.pending, record.steps_undrafted,
            record.draft_interval)


def test_a_steps_budgets_and_drafts_at_once_equal_the_calls_one_by_one():
    """The asynchronous plain step asks budgets_of / drafts_of for its whole batch (dry, then counted; the checks
    that hold for the step made once): over random states, with cheap and dear drafting, on and off probe steps,
    the answers and every request's probe and drafting state equal those of budget() / should_draft() asked
    request by request in the same order."""
    rng = random.Random(1)
    batch, single = BudgetController(max_budget=16), BudgetController(max_budget=16)
    requests = [f"r{i}" for i in range(12)]
    drafted = chosen = 0
    for step in range(400):
        for c in (batch, single):
            c.pipelined = step >= 200  # drafts dear under asynchronous scheduling: intervals and probe steps
        random_step(rng, requests, (batch, single))
        ids = requests + ["new"]  # one without a tree of its own
        ahead = step % 3 == 0
        for dry in (True, False):
            budgets = batch.budgets_of(ids, dry=dry, ahead=ahead)
            drafts = batch.drafts_of(ids, dry=dry, ahead=ahead)
            assert budgets == [single.budget(rid, dry=dry, ahead=ahead) for rid in ids], (step, dry)
            assert drafts == [single.should_draft(rid, dry=dry, ahead=ahead) for rid in ids], (step, dry)
        drafted, chosen = drafted + sum(drafts), chosen + sum(b > 0 for b in budgets)
        assert [probe_state(batch.requests[r]) for r in requests] == [probe_state(single.requests[r]) for r in requests]
    assert 0 < drafted < 400 * len(ids) and chosen > 100, (drafted, chosen)
