"""Switching into and out of trees under asynchronous scheduling (engine/ahead.py): with a drafter that drafts from
the device and the CUDA-graph layout (emulated on the CPU), a tree step is launched ahead of a plain step's
results, and when no request wants a tree after a tree step the next step is made of root-only trees (plain
decoding whose positions come from the device), followed by plain steps ahead. So once the engine decodes, no
step waits for the host, not even as requests reach max_tokens at different steps. The adaptive budget's answers
are replaced by a fixed alternation so that the engine switches every few steps; output must stay plain
decoding's (greedy) or the synchronous engine's (seeded)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.test_async_scheduling import answer_with, run
from tests.engine.test_async_trees import MAX_TOKENS, dflash_ahead_against_synchronous, plain_greedy, tree_engine
from tests.engine.test_cuda_graphs import prompts

PERIOD = 3  # steps wanting trees, then as many wanting none


def alternating(core, budget: int = 4):
    """Makes every request want `budget` nodes for PERIOD steps, then none for PERIOD steps, and so on (by the
    controller's step clock; `ahead`: asked for the step after the one in flight, as the controller's own
    probes are). The step's width is what they want, within each request's cap."""
    b = core.budgets

    def wanted(request_id, dry=False, ahead=False):
        return budget if ((b.clock + ahead) // PERIOD) % 2 == 0 else 0

    answer_with(b, wanted, lambda request_id, dry=False, ahead=False: False)
    b.uniform = lambda request_ids, budgets, caps, synchronous=False: [min(x, c) for x, c in zip(budgets, caps)]


def step_kinds(core, ps, params, modes: list | None = None) -> tuple[list[list[int]], list[tuple[str, str]]]:
    """run(), recording each step's kind ("tree", "root-only", "plain") and how it was scheduled (and into
    `modes`, when given, its kind and CUDA-graph mode)."""
    kinds, step = [], core.step

    def spy():
        deltas = step()
        st = core.last_stats
        if st is not None:
            root_only = not any(st.spec_budgets) and "verify" in st.timings  # a tree step's phases
            kind = "tree" if any(st.spec_budgets) else "root-only" if root_only else "plain"
            kinds.append((kind, st.scheduling))
            if modes is not None:
                modes.append((kind, st.cuda_graph))
        return deltas

    core.step = spy
    return run(core, ps, params)[0], kinds


def switching_engine(tiny_checkpoints, ps, ref, overlap: bool):
    folder, _ = tiny_checkpoints("llama")
    core = tree_engine(folder, ps, ref, overlap, budget=6, adaptive=True).engine
    alternating(core)
    return core


@pytest.mark.parametrize("batch,rounds", [(1, True), (3, True), (17, True), (3, False)])
def test_switches_into_and_out_of_trees_run_ahead(tiny_checkpoints, batch, rounds):
    """rounds False: without whole-round graphs (the forward replayed alone, sampling and walk after it)."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(batch)
    params = [SamplingParams(max_tokens=MAX_TOKENS + 8 - i % 5, temperature=0, ignore_eos=True) for i in range(batch)]
    ref = plain_greedy(folder, ps, params)
    core = switching_engine(tiny_checkpoints, ps, ref, True)
    if not rounds:
        core.runner.rounds = None
    modes = []
    out, kinds = step_kinds(core, ps, params, modes)
    assert out == ref
    root_only = "replay: whole round" if rounds else "replay: forward only (no round graphs)"
    assert {m for k, m in modes if k == "root-only"} == {root_only}, modes
    decoding = kinds[2:]  # (the prompts' step, then the first decoding step, scheduled after its results)
    # none waits for the host: requests that may reach max_tokens in a tree step ride in the step ahead at budget
    # 0 (else the step after would have to wait to learn whether they finished: their lengths differ)
    assert all(mode == "ahead" for _, mode in decoding), str(kinds)
    pairs = list(zip(decoding, decoding[1:]))
    entered = sum(a == "plain" and b == "tree" for (a, _), (b, _) in pairs)
    left = sum(a == "tree" and b == "root-only" for (a, _), (b, _) in pairs)
    assert entered >= 2 and left >= 2, kinds
    # a root-only step is followed by plain decoding (its lengths are known), not by more root-only trees
    assert all(b != "root-only" for (a, _), (b, _) in pairs if a == "root-only"), kinds


def test_seeded_sampling_across_switches_equals_synchronous_steps(tiny_checkpoints):
    """At temperature > 0 (seeded, top-p, logprobs off so the rounds run whole): the root-only steps draw their
    tokens inside the round graph at the requests' output offsets from the device, the same draws as the plain
    steps the synchronous engine runs there."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    ref = plain_greedy(folder, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(4)]
    want, sync_kinds = step_kinds(switching_engine(tiny_checkpoints, ps, ref, False), ps, params)
    got, kinds = step_kinds(switching_engine(tiny_checkpoints, ps, ref, True), ps, params)
    assert got == want
    assert "root-only" in {k for k, _ in kinds} and "tree" in {k for k, _ in sync_kinds}


def test_dflash_enters_trees_ahead_fed_by_the_plain_steps_features(tiny_checkpoints, tmp_path, monkeypatch):
    """A DFlash drafter entering trees ahead of a plain step's results takes that step's one row of target
    features from the device (and drops it once the step reports): its raw proposals equal, call by call, those
    of the same engine switching synchronously, and greedy output equals plain decoding."""
    from engine.pending import PendingStep

    after_plain, features = [], PendingStep.accepted_features

    def spy(self, requests, stage):
        out = features(self, requests, stage)
        if not self.is_tree_step:
            after_plain.append(tuple(out.shape[:2]))
        return out

    monkeypatch.setattr(PendingStep, "accepted_features", spy)
    dflash_ahead_against_synchronous(tiny_checkpoints, tmp_path, "cpu", budgets=alternating)
    assert after_plain and all(a == 1 for _, a in after_plain), after_plain


def test_the_budget_prices_switches_only_where_they_wait_for_the_host(tiny_checkpoints):
    """Under asynchronous scheduling the adaptive budget charges entering trees for a synchronous step
    (SwitchCost) only where a tree step cannot run ahead of a plain step's results: a drafter that drafts on the
    host. (Without asynchronous scheduling no step runs ahead and none is charged.)"""
    from engine import LLM
    from engine.speculative.ngram import NgramDrafter
    from engine.speculative.ngram_device import DeviceNgramDrafter

    folder, _ = tiny_checkpoints("llama")
    for drafter, overlap, ahead in ((DeviceNgramDrafter(1000, horizon=6), True, True),
                                    (NgramDrafter(1000, horizon=6), True, False),
                                    (DeviceNgramDrafter(1000, horizon=6), False, False)):
        core = LLM(folder, dtype="fp32", drafter=drafter, spec_budget=6).engine
        core.enable_graphs(emulate=True)
        core.overlap = overlap
        assert core.budgets.switches_ahead is ahead, (drafter, overlap)
        assert core.budgets.pipelined is overlap


def test_abort_and_arrival_while_a_root_only_step_runs_ahead(tiny_checkpoints):
    """A request aborted while a root-only step (leaving trees) is in flight for it gets nothing more; one arriving
    then waits for a synchronous step and decodes as plain decoding does, as does the request that ran throughout;
    every KV block comes back."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, sp)
    core = switching_engine(tiny_checkpoints, ps, ref, True)
    ids = [core.add_request(p, sp) for p in ps[:2]]
    out = {i: [] for i in ids}

    def root_only_in_flight() -> bool:
        step = core.inflight.step if core.inflight is not None else None
        return step is not None and step.is_tree_step and not step.verifies_trees

    while not root_only_in_flight():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert core.abort(ids[1])
    late = core.add_request(ps[2], sp)
    out[late], aborted_after = [], len(out[ids[1]])
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert out[ids[0]] == ref[0] and out[late] == ref[2]
    assert len(out[ids[1]]) == aborted_after and out[ids[1]] == ref[1][:aborted_after]
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


@pytest.mark.parametrize("seed,temperature", [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.8), (4, 0.8), (5, 0.8)])
def test_random_budgets_arrivals_and_aborts_keep_plain_decodings_output(tiny_checkpoints, seed, temperature):
    """Random budgets per request and step (0-6 nodes, mostly 0), random curve drafts, requests arriving every
    third step and one aborted midway, lengths 3-29: every step that can runs ahead (switching into and out of
    trees, root-only steps, requests reaching max_tokens at different steps), and each request's output is plain
    decoding's (greedy, or seeded sampling: the row deciding output position i draws plain decoding's uniform)
    up to where it was aborted; every KV block comes back."""
    import random

    folder, _ = tiny_checkpoints("llama")
    rng = random.Random(seed)
    num = rng.choice([3, 5, 8, 12])
    ps = prompts(num)
    top_p = 0.9 if temperature else 1.0
    params = [SamplingParams(max_tokens=rng.randrange(3, 30), temperature=temperature, top_p=top_p, seed=k,
                             ignore_eos=True) for k in range(num)]
    ref = plain_greedy(folder, ps, params)  # (seeded sampling when temperature > 0)
    core = switching_engine(tiny_checkpoints, ps, ref, True)
    b, wanted = core.budgets, {}
    answer_with(b, lambda rid, dry=False, ahead=False: wanted.setdefault((rid, b.clock + ahead),
                                                                         rng.choice([0, 0, 0, 1, 2, 4, 6])),
                lambda rid, dry=False, ahead=False: rng.random() < 0.3)
    index, out, aborted = {}, {i: [] for i in range(num)}, None
    waiting = list(range(num))
    for i in waiting[:num // 2]:
        index[core.add_request(ps[i], params[i])] = i
    waiting, steps = waiting[num // 2:], 0
    while core.has_unfinished() or waiting:
        if waiting and steps % 3 == 2:
            i = waiting.pop(0)
            index[core.add_request(ps[i], params[i])] = i
        if steps == 7 and core.abort(next(iter(index))):
            aborted = index[next(iter(index))]
        for d in core.step():
            out[index[d.request_id]].extend(d.new_token_ids)
        steps += 1
    for i in range(num):
        assert out[i] == (ref[i][:len(out[i])] if i == aborted else ref[i]), (i, out[i], ref[i])
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


GUARD_TOKENS = 96  # a few of the guard's (shrunk) windows


def guard_switching_engine(tiny_checkpoints, ps, ref, overlap: bool, monkeypatch, device: str):
    """The adaptive budget as it is, made to want trees whatever the timings, under a throughput guard whose
    windows are a few steps and whose checks trees always lose: the guard switches trees off and on again. On
    the CPU the CUDA graphs are emulated; on CUDA they are captured."""
    from engine import LLM
    from engine.speculative import guard
    from engine.speculative.adaptive import MIN_GAIN, BudgetController
    from engine.speculative.cost_fit import CostFit
    from engine.speculative.oracle import DeviceOracle
    from tests.engine.test_async_trees import corrupted

    for name, value in (("WINDOW", 4), ("PLAIN_STEPS", 2), ("BACKOFF", 3), ("MAX_BACKOFF", 3), ("MARGIN", 1e9)):
        monkeypatch.setattr(guard, name, value)
    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)
    monkeypatch.setattr(BudgetController, "threshold", lambda self: MIN_GAIN)
    monkeypatch.setattr(CostFit, "tree_cost", lambda self: 0.0)
    monkeypatch.setattr(BudgetController, "switch_tokens", lambda self, num_seqs=0: 0.0)
    folder, _ = tiny_checkpoints("llama")
    if device == "cpu":
        return tree_engine(folder, ps, ref, overlap, budget=6, adaptive=True).engine
    golden = corrupted({tuple(p[:3]): p + r for p, r in zip(ps, ref)}, {tuple(p[:3]): len(p) for p in ps})
    return LLM(folder, dtype="fp32", device=device, drafter=DeviceOracle(golden, 3, 1000, horizon=6, device=device),
               spec_budget=6, async_scheduling=overlap).engine


def guard_switches_run_ahead(tiny_checkpoints, monkeypatch, device: str) -> None:
    """The throughput guard's plain windows and back-offs switch trees off and on under asynchronous scheduling:
    every decoding step still runs ahead, greedy output equals plain decoding, and seeded sampling equals the same
    engine stepping synchronously."""
    from engine import LLM

    ps = prompts(3)
    greedy = SamplingParams(max_tokens=GUARD_TOKENS, temperature=0, ignore_eos=True)
    folder, _ = tiny_checkpoints("llama")
    ref = [o.token_ids for o in LLM(folder, dtype="fp32", device=device).generate(ps, greedy)]
    core = guard_switching_engine(tiny_checkpoints, ps, ref, True, monkeypatch, device)
    assert core.overlap
    checks, take = [], core.budgets.guard.take_outcomes

    def spy():
        outcomes, forced = take()
        checks.extend(outcomes)
        return outcomes, forced

    core.budgets.guard.take_outcomes = spy
    out, kinds = step_kinds(core, ps, [greedy] * len(ps))
    assert out == ref
    assert checks.count("lost") >= 2, checks
    assert all(mode == "ahead" for _, mode in kinds[2:]), kinds
    decoding = [k for k, _ in kinds[2:]]
    entered = sum(a != "tree" and b == "tree" for a, b in zip(decoding, decoding[1:]))
    assert entered >= 2, decoding  # back into trees after each back-off
    params = [SamplingParams(max_tokens=GUARD_TOKENS, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(len(ps))]
    want, _ = step_kinds(guard_switching_engine(tiny_checkpoints, ps, ref, False, monkeypatch, device), ps, params)
    got, _ = step_kinds(guard_switching_engine(tiny_checkpoints, ps, ref, True, monkeypatch, device), ps, params)
    assert got == want


def test_the_guards_plain_windows_run_ahead(tiny_checkpoints, monkeypatch):
    guard_switches_run_ahead(tiny_checkpoints, monkeypatch, "cpu")
