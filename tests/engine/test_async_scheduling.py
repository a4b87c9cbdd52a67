"""Asynchronous scheduling (EngineCore.overlap): a plain decoding step launched before the previous step's results
reach the host, its input token fed from the device. On the CPU every launch runs synchronously, so these tests
switch it on to check the bookkeeping: output identical to stepping synchronously (greedy, seeded sampling with
min_tokens and logprobs, stop tokens and max_tokens finishing requests while a step runs ahead of them), aborts
and arrivals while a step is in flight, requests whose sampling needs the newest token on the host (penalties,
grammars) never run ahead, and the adaptive budget's probes still happen. The GPU test replays real graphs
(tests/ext/test_engine_gpu.py)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.speculative.adaptive import BudgetController
from tests.engine.test_cuda_graphs import prompts

MAX_TOKENS = 20


def answer_with(controller, budget=None, should_draft=None) -> None:
    """Replaces the adaptive budget's per-request answers (budget(rid, dry, ahead), should_draft(rid, dry, ahead))
    on this controller, and its whole-step ones (budgets_of, drafts_of) with the same answers asked request by
    request."""
    if budget is not None:
        controller.budget = budget
        controller.budgets_of = lambda ids, dry=False, ahead=False: [budget(r, dry, ahead) for r in ids]
    if should_draft is not None:
        controller.should_draft = should_draft
        controller.drafts_of = lambda ids, dry=False, ahead=False: [should_draft(r, dry, ahead) for r in ids]


def run(core, ps, params) -> tuple[list[list[int]], list[list], int]:
    """Steps the core to the end; (tokens, logprobs per request, steps that launched a step ahead)."""
    params = params if isinstance(params, list) else [params] * len(ps)
    ids = [core.add_request(p, sp) for p, sp in zip(ps, params)]
    tokens, logprobs, finished = {i: [] for i in ids}, {i: [] for i in ids}, set()
    ahead, scheduled = 0, []
    while core.has_unfinished():
        for d in core.step():
            assert d.request_id not in finished  # nothing after a request's final delta
            tokens[d.request_id].extend(d.new_token_ids)
            logprobs[d.request_id].extend(d.new_logprobs or [])
            if d.finished:
                finished.add(d.request_id)
        ahead += core.inflight is not None
        if core.last_stats is not None:
            scheduled.append(core.last_stats.scheduling)
    assert finished == set(ids)
    if core.overlap:  # every step says how it was scheduled; as many ran ahead as were launched ahead
        assert all(s == "ahead" or s.startswith("synchronous: ") for s in scheduled[1:]), scheduled
        assert scheduled.count("ahead") == ahead - (core.inflight is not None)
    else:
        assert set(scheduled) <= {""}
    return [tokens[i] for i in ids], [logprobs[i] for i in ids], ahead


def engine(folder, overlap: bool, graphs: bool = False, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 32)
    llm = LLM(folder, dtype="fp32" if folder else None, **kwargs)
    if graphs:
        llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = llm.engine.budgets.pipelined = overlap
    return llm


def test_async_scheduling_is_a_cuda_feature(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    assert EngineConfig().async_scheduling
    assert not LLM(folder, dtype="fp32").engine.overlap  # CPU: launches are synchronous, nothing to overlap


@pytest.mark.parametrize("batch,graphs", [(1, False), (3, True), (17, True)])
def test_greedy_output_equals_synchronous_steps(tiny_checkpoints, batch, graphs):
    folder, _ = tiny_checkpoints("qwen3")
    ps = prompts(batch)
    # different lengths: requests finish while the step after their last one is already in flight
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 5, temperature=0, ignore_eos=True) for i in range(batch)]
    ref, _, ahead_off = run(engine(folder, False, graphs).engine, ps, params)
    out, _, ahead = run(engine(folder, True, graphs).engine, ps, params)
    assert out == ref and ahead_off == 0
    assert ahead >= MAX_TOKENS - 6  # nearly every decoding step ran ahead of its predecessor's results
    assert [len(o) for o in out] == [p.max_tokens for p in params]


def steps_ahead_while_waiting(core) -> tuple[list[str], list[int]]:
    """Spies on core.step: (every step's scheduling, [the steps that ran ahead while a request waited, every seat
    taken], filled as the core steps). Requests are all queued before the first step and only leave the queue, so one still waiting after a
    step also waited while that step was planned."""
    seen, step = [], core.step
    count = [0]

    def spy():
        deltas = step()
        stats = core.last_stats
        if stats is not None:
            seen.append(stats.scheduling)
            count[0] += stats.scheduling == "ahead" and bool(core.scheduler.waiting)
        return deltas

    core.step = spy
    return seen, count


def admission_plans(core) -> dict[str, int]:
    """Spies on the scheduler: how many of its plans admitted a request, scheduled after their predecessor's
    results ("synchronous") or ahead of them (plain decoding beside: "ahead"; trees: "ahead beside trees"),
    filled as the core steps."""
    counts = {"synchronous": 0, "ahead": 0, "ahead beside trees": 0}
    schedule, schedule_ahead = core.scheduler.schedule, core.scheduler.schedule_ahead
    schedule_ahead_trees = core.scheduler.schedule_ahead_trees

    def spy_schedule():
        plan = schedule()
        counts["synchronous"] += plan.prefix_cache_queries > 0  # prompt tokens of requests admitted by the plan
        return plan

    def spy_ahead(previous):
        plan = schedule_ahead(previous)
        counts["ahead"] += not isinstance(plan, str) and plan.prefix_cache_queries > 0
        return plan

    def spy_ahead_trees(previous, *args):
        plan = schedule_ahead_trees(previous, *args)
        counts["ahead beside trees"] += not isinstance(plan, str) and plan.prefix_cache_queries > 0
        return plan

    core.scheduler.schedule, core.scheduler.schedule_ahead = spy_schedule, spy_ahead
    core.scheduler.schedule_ahead_trees = spy_ahead_trees
    return counts


@pytest.mark.parametrize("graphs", [False, True])
def test_a_full_batch_runs_ahead_while_requests_wait(tiny_checkpoints, graphs):
    """A server under load: more requests than seats (max_num_seqs). While every seat is taken the queue cannot
    join, so the running requests still decode ahead of their predecessor's results; a freed seat is taken by a
    step launched ahead too: the queue's head joins with its prompt's chunk (known on the host) beside the
    running requests' decodes (fed from the device). Output equals stepping synchronously."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(6)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(6)]
    ref, _, _ = run(engine(folder, False, graphs, max_num_seqs=2).engine, ps, params)
    core = engine(folder, True, graphs, max_num_seqs=2).engine
    seen, ahead_waiting = steps_ahead_while_waiting(core)
    admitted = admission_plans(core)
    out, _, ahead = run(core, ps, params)
    assert out == ref
    assert ahead_waiting[0] >= 10, (ahead_waiting, seen)
    assert admitted["ahead"] >= 3 and "synchronous: waiting requests" not in seen, (admitted, seen)


@pytest.mark.parametrize("graphs", [False, True])
def test_admissions_ahead_of_prompts_served_by_the_prefix_cache(tiny_checkpoints, graphs):
    """One prompt for all (its blocks cached after the first): an admitted request computes only its prompt's last
    token, a decoding-shaped row whose token comes from the host beside the running requests' tokens fed from the
    device; output equals stepping synchronously."""
    folder, _ = tiny_checkpoints("llama")
    ps = [prompts(1)[0][:1] * 33] * 6  # two full blocks of 16 cached, then one token
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(6)]
    ref, _, _ = run(engine(folder, False, graphs, max_num_seqs=2, block_size=16).engine, ps, params)
    core = engine(folder, True, graphs, max_num_seqs=2, block_size=16).engine
    plans, schedule_ahead = [], core.scheduler.schedule_ahead

    def spy(previous):
        plan = schedule_ahead(previous)
        plans.append(plan)
        return plan

    core.scheduler.schedule_ahead = spy
    out, _, _ = run(core, ps, params)
    assert out == ref
    one_row = [s for p in plans if not isinstance(p, str) for s in p.seqs if not s.num_ahead]
    assert one_row and all(s.num_new_tokens == 1 for s in one_row), one_row


def test_seats_freed_apart_are_filled_by_one_admission_step(tiny_checkpoints):
    """--admission-wait-steps: a waiting request takes a free seat only once a seat has been free that many steps,
    so requests finishing a few steps apart are replaced in one admission step (each costs its prompt pieces'
    replays beside the decoding step); the steps in between run ahead. The first requests are admitted at once
    (nothing runs), and output equals admitting at once."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(10)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True) for i in range(10)]

    def admissions(wait: int) -> tuple[list[list[int]], int, list[int]]:
        core = engine(folder, True, True, max_num_seqs=4, admission_wait_steps=wait).engine
        admitted = admission_plans(core)
        running, step = [], core.step

        def spy():
            deltas = step()
            running.append(len(core.scheduler.running))
            return deltas

        core.step = spy
        out, _, _ = run(core, ps, params)
        return out, sum(admitted.values()), running

    at_once, steps_at_once, _ = admissions(0)
    out, steps, running = admissions(3)
    assert out == at_once
    assert 1 < steps < steps_at_once, (steps, steps_at_once)  # the first admission, then fewer
    assert min(running[:3]) == 4 and min(running) < 4  # the first four at once; later seats stayed free a while
    with pytest.raises(ValueError, match="admission_wait_steps"):
        EngineConfig(admission_wait_steps=-1)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_step_after_a_prompt_runs_ahead(tiny_checkpoints, graphs):
    """A request's first decoding step runs ahead of the step that ends its prompt (it feeds the token that step
    samples, at the prompt's length): for a prompt in one chunk, in several (the chunks before the last are
    synchronous: nothing is sampled yet), and one partly served by the prefix cache. Greedy and seeded sampling
    (the output index of each draw) equal stepping synchronously."""
    folder, _ = tiny_checkpoints("llama")
    long = list(range(5, 75))  # 70 tokens: chunks of at most 24
    ps = [long, long[:40] + [1, 2, 3], prompts(1)[0]]  # the second shares 40 tokens (two blocks) with the first
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, min_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)]
    want = []
    for p, sp in zip(ps, params):
        want += run(engine(folder, False, graphs, max_num_batched_tokens=24).engine, [p], sp)[0]
    core = engine(folder, True, graphs, max_num_batched_tokens=24).engine
    got, seen, modes = [], [], []
    for p, sp in zip(ps, params):  # one request at a time: the prefix cache serves the second's first blocks
        core.add_request(p, sp)
        tokens = []
        while core.has_unfinished():
            for d in core.step():
                tokens.extend(d.new_token_ids)
            seen.append(core.last_stats.scheduling if core.last_stats else None)
            modes.append(core.last_stats.cuda_graph if core.last_stats else None)
        got.append(tokens)
    assert got == want
    # the first request: two synchronous chunks after the first, then every step ahead (the last chunk's too)
    assert seen[1:3] == ["synchronous: after a prefill or tree step"] * 2 and seen[3] == "ahead", seen
    assert seen.count("ahead") >= sum(sp.max_tokens for sp in params) - 6, seen
    if graphs:  # the step after the last chunk decodes like the rest: a graph replay, not an eager mixed step
        assert modes[3].startswith("replay"), modes


def test_a_step_run_ahead_for_finished_requests_reports_nothing(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    core = engine(folder, True).engine
    rid = core.add_request(prompts(1)[0], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[0]))
    while core.inflight is None:
        core.step()
    core.abort(rid)  # the step in flight was launched for it
    assert not core.has_unfinished() and core.inflight is not None
    rid2 = core.add_request(prompts(2)[1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert core.step() == [] and core.last_stats is None  # the dropped step: no deltas, no step statistics
    # the request that arrived meanwhile was admitted by a step launched ahead of the dropped one
    assert [s.request.request_id for s in core.inflight.plan.seqs] == [rid2]
    tokens = [t for _ in range(3) for d in core.step() for t in d.new_token_ids]
    assert len(tokens) == 2 and not core.has_unfinished()


def test_stop_tokens_and_seeded_sampling_equal_synchronous_steps(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref, _, _ = run(engine(folder, False).engine, ps, greedy)
    # a stop token met in the middle of each output: the step already launched after it is discarded
    stops = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[r[len(r) // 2]]) for r in ref]
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=s,
                              min_tokens=6, logprobs=3, ignore_eos=False) for s in range(4)]
    params = stops + sampled
    want_tokens, want_logprobs, _ = run(engine(folder, False).engine, ps + ps, params)
    got_tokens, got_logprobs, ahead = run(engine(folder, True).engine, ps + ps, params)
    assert got_tokens == want_tokens and ahead > 0
    for r, out in zip(ref, got_tokens[:4]):
        assert out == r[:r.index(r[len(r) // 2]) + 1]
    assert_same_logprobs(want_logprobs, got_logprobs)


def assert_same_logprobs(want: list[list], got: list[list]) -> None:
    """Per request, the chosen tokens' logprobs (to 4 places) and the top tokens' ids agree."""
    for w, g in zip(want, got, strict=True):
        assert [(round(c, 4), [t for t, _ in top]) for c, top in g] == \
               [(round(c, 4), [t for t, _ in top]) for c, top in w]


def test_abort_and_arrival_while_a_step_is_in_flight(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref, _, _ = run(engine(folder, False).engine, ps, sp)
    core = engine(folder, True).engine
    ids = [core.add_request(p, sp) for p in ps[:2]]
    out = {i: [] for i in ids}
    for _ in range(6):
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert core.inflight is not None
    assert core.abort(ids[1])  # its in-flight token is dropped
    late = core.add_request(ps[2], sp)  # admitted after the in-flight step: no step runs ahead while it waits
    out[late] = []
    aborted_after = len(out[ids[1]])
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert out[ids[0]] == ref[0] and out[late] == ref[2]
    assert len(out[ids[1]]) == aborted_after and out[ids[1]] == ref[1][:aborted_after]
    assert core.blocks.num_free_blocks == core.blocks.num_blocks  # every block came back, in-flight ones too


def test_each_step_says_why_it_did_not_run_ahead(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    core = engine(folder, True).engine
    admitted = admission_plans(core)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    core.add_request(prompts(1)[0], sp)
    seen = []
    for _ in range(3):
        core.step()
        seen.append(core.last_stats.scheduling)
    core.add_request(prompts(2)[1], sp)  # arrives while a step is in flight
    while core.has_unfinished():
        core.step()
        if core.last_stats is not None:
            seen.append(core.last_stats.scheduling)
    assert seen[1] == "ahead" and seen[2] == "ahead"  # the step after the prompt runs ahead: it feeds its token
    # the request that arrived joined a step launched ahead
    assert admitted == {"synchronous": 1, "ahead": 1, "ahead beside trees": 0}
    assert all(s == "ahead" or s.startswith("synchronous: ") for s in seen[1:]), seen


@pytest.mark.parametrize("kind", ["penalty", "grammar"])
def test_requests_needing_their_newest_token_never_run_ahead(tiny_checkpoints, kind):
    folder = tiny_checkpoints("llama")[0] if kind == "penalty" else None  # a grammar needs a tokenizer: SmolLM2
    ps = prompts(2)
    if kind == "penalty":
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, detokenize=False)
    else:
        from engine.grammar import json_object_grammar

        sp = SamplingParams(max_tokens=8, temperature=0, grammar=json_object_grammar())
    want, _, _ = run(engine(folder, False).engine, ps, sp)
    got, _, ahead = run(engine(folder, True).engine, ps, sp)
    assert got == want and ahead == 0


def test_ngram_speculation_with_async_scheduling_equals_plain(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = [p * 3 for p in prompts(3)]  # repeated text: the n-gram drafter proposes
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref, _, _ = run(engine(folder, False).engine, ps, sp)
    llm = engine(folder, True, graphs=True, drafter="ngram", spec_budget=8)
    out, _, ahead = run(llm.engine, ps, sp)
    assert out == ref
    assert ahead > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_a_step_whose_width_pays_for_no_tree_runs_ahead(tiny_checkpoints, monkeypatch, graphs):
    """Each request's own budget wants a tree, but the step's width does not pay for it (under graphs every
    request pays the width: BudgetController.uniform; without, harmonize): the step is plain, so it runs ahead of
    its predecessor's results. Asked only whether any request wanted a tree, every such step ran synchronously
    (on the H200 the n-gram default at batch 16 lost the pipeline on every step)."""
    monkeypatch.setattr(BudgetController, "budget", lambda self, rid, dry=False, ahead=False: 4)
    monkeypatch.setattr(BudgetController, "should_draft", lambda self, rid, dry=False, ahead=False: False)
    # ... and asked for a whole step at once
    monkeypatch.setattr(BudgetController, "budgets_of", lambda self, ids, dry=False, ahead=False: [4] * len(ids))
    monkeypatch.setattr(BudgetController, "drafts_of", lambda self, ids, dry=False, ahead=False: [False] * len(ids))
    zeros = lambda self, ids, budgets, *caps: [0] * len(budgets)  # noqa: E731
    monkeypatch.setattr(BudgetController, "uniform", zeros)
    monkeypatch.setattr(BudgetController, "harmonize", zeros)
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref, _, _ = run(engine(folder, False).engine, ps, sp)
    core = engine(folder, True, graphs=graphs, drafter="ngram", spec_budget=8).engine
    out, _, ahead = run(core, ps, sp)
    assert out == ref
    assert ahead >= MAX_TOKENS - 4, ahead  # every decoding step but the first ran ahead


def test_dry_budget_questions_change_nothing():
    controller = BudgetController(8)
    controller.pipelined = True
    controller.observe_step(8, 0.01, 8)
    controller.observe_request("r", 0, [], [0.01] + [0.0] * 7 + [6.0] + [7.0] * 7)  # one node at q 0.01 (bin 6)
    answers = []
    for _ in range(40):
        dry = (controller.budget("r", dry=True), controller.should_draft("r", dry=True))
        assert dry == (controller.budget("r", dry=True), controller.should_draft("r", dry=True))
        answers.append(dry)
        assert (controller.budget("r"), controller.should_draft("r")) == dry
        controller.observe_step(8, 0.01, 8)  # the step ran (probes and interval drafts follow the step count)
    # pipelined: a request at budget 0 drafts only every PROBE_EVERY steps (then less often), never every step
    drafts = [i for i, (_, d) in enumerate(answers) if d]
    assert drafts and len(drafts) <= 3 and all(b == 0 for b, _ in answers)


def test_probes_recover_trees_under_async_scheduling(tiny_checkpoints, monkeypatch):
    """The drafter was wrong for earlier requests (the engine-wide calibration fell to ~0) and is right for new
    ones: under asynchronous scheduling their budget-0 steps still probe on aligned steps and recover trees.
    (The dry question before a step runs ahead and the real one after its predecessor was observed used to
    straddle a clock tick: no probe ever ran.) The cost model is pinned and the throughput guard is off, so the
    CPU's timing cannot decide (the guard may measure the wrong drafter's probes and drafts as a loss and keep
    the engine plain for its back-off, right drafter or not: test_guard.py)."""
    from engine.speculative.adaptive import MIN_GAIN
    from engine.speculative.oracle import OracleDrafter
    from tests.speculative.test_ddtree_e2e import golden_lookup

    monkeypatch.setattr(BudgetController, "threshold", lambda self: MIN_GAIN)
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    sp = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    ref, _, _ = run(engine(folder, False).engine, ps, sp)
    right = [(p + r, len(p)) for p, r in zip(ps, ref)]
    wrong = [(p + [(t + 1) % 1000 for t in r], len(p)) for p, r in zip(ps, ref)]
    lookup = {"golden": golden_lookup(wrong)}
    oracle = OracleDrafter(lambda req: lookup["golden"](req), 1000, horizon=7, check_prefix=False)
    llm = engine(folder, True, drafter=oracle, spec_budget=16, spec_guard=False)
    run(llm.engine, ps, sp)  # every tree rejected
    budgets = llm.engine.budgets
    assert budgets.predicted > 0 and budgets.accepted / budgets.predicted < 0.1
    lookup["golden"] = golden_lookup(right)
    out = llm.generate(ps, sp)
    assert [o.token_ids for o in out] == ref
    taus = [o.stats.get("spec", {}).get("mean_accept_length", 1.0) for o in out]
    assert min(taus) > 2.0, taus
