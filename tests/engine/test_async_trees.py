"""Tree steps launched ahead of their predecessor's results (engine/ahead.py): with a drafter that
drafts from roots and positions on the device, the next tree step is launched before the previous tree step's
accepted lengths reach the host; its roots, positions, cache slots and sampling offsets come from the device.
On the CPU launches are synchronous, so these tests switch asynchronous scheduling on (with the CUDA-graph
layout emulated) to check the bookkeeping against stepping synchronously and against plain decoding: greedy
output at batch 1, 3 and 17 with acceptance varying per step, requests finishing by length and by stop tokens
while a tree step runs ahead of them, seeded sampling with min_tokens and logprobs, the adaptive budget, and
drafters that need the host (never ahead, and why)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.speculative.oracle import DeviceOracle, OracleDrafter
from tests.engine.test_async_scheduling import (admission_plans, answer_with, assert_same_logprobs, run,
                                                steps_ahead_while_waiting)
from tests.engine.test_cuda_graphs import prompts
from tests.speculative.test_ddtree_e2e import golden_lookup

MAX_TOKENS = 24
VOCAB = 1000


def corrupted(sequences: dict[tuple, list[int]], prompt_lens: dict[tuple, int], every: int = 5):
    """Golden sequences with every `every`-th continuation token replaced: the drafts then fail at varying depths,
    so accepted lengths vary from step to step."""
    out = {}
    for key, seq in sequences.items():
        seq = list(seq)
        for i in range(prompt_lens[key] + 2, len(seq), every):
            seq[i] = (seq[i] + 1) % VOCAB
        out[key] = seq
    return out


def tree_engine(folder, ps, ref, overlap: bool, budget: int = 6, adaptive: bool = False, **kwargs) -> LLM:
    golden = {tuple(p[:3]): p + r for p, r in zip(ps, ref)}
    oracle = DeviceOracle(corrupted(golden, {tuple(p[:3]): len(p) for p in ps}), 3, VOCAB, horizon=6, device="cpu")
    kwargs.setdefault("max_num_seqs", 32)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=budget, adaptive=adaptive, **kwargs)
    llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = llm.engine.budgets.pipelined = overlap
    return llm


def plain_greedy(folder, ps, params) -> list[list[int]]:
    return [o.token_ids for o in LLM(folder, dtype="fp32").generate(ps, params)]


def tree_steps_ahead(core, ps, params, graph_mode: str | None = None) -> tuple[list[list[int]], list, int]:
    """run() that also counts the tree steps that ran ahead of their predecessor's results (only those whose
    CUDA-graph mode is graph_mode, when given)."""
    stats = []
    step = core.step

    def spy():
        deltas = step()
        if core.last_stats is not None:
            st = core.last_stats
            stats.append((st.scheduling, any(st.spec_budgets), graph_mode in (None, st.cuda_graph)))
        return deltas

    core.step = spy
    tokens, logprobs, _ = run(core, ps, params)
    return tokens, logprobs, sum(1 for mode, tree, graph in stats if mode == "ahead" and tree and graph)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_greedy_tree_steps_ahead_equal_plain_decoding(tiny_checkpoints, batch):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(batch)
    # different lengths: requests finish (or may finish) while the tree step after them is in flight
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 7, temperature=0, ignore_eos=True) for i in range(batch)]
    ref = plain_greedy(folder, ps, params)
    out, _, ahead = tree_steps_ahead(tree_engine(folder, ps, ref, True).engine, ps, params, "replay: whole round")
    assert out == ref
    assert ahead >= 3, ahead  # tree steps did run ahead as whole rounds (with drafts rejected at varying depths)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("max_replays", [8, 0])
def test_tree_steps_run_ahead_while_requests_wait_and_admit_them(tiny_checkpoints, monkeypatch, temperature,
                                                                 max_replays):
    """More requests than seats: with every seat taken, tree steps still run ahead as whole rounds; a freed seat is
    taken by a tree step launched ahead too: the queue's head joins with its prompt's chunk (replayed as prompt
    pieces before the trees' verify rows; with too many pieces for MAX_REPLAYS, one eager forward of the chunks
    instead). Before, the step after a tree round waited for its results whenever a request could take a seat.
    Output equals plain decoding (greedy) or stepping synchronously (seeded)."""
    monkeypatch.setattr("engine.admission.MAX_REPLAYS", max_replays)
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(6)
    params = [SamplingParams(max_tokens=MAX_TOKENS - 2 * i, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(6)]
    ref = plain_greedy(folder, ps, params)
    want = ref if temperature == 0 else run(tree_engine(folder, ps, ref, False, max_num_seqs=3).engine, ps, params)[0]
    core = tree_engine(folder, ps, ref, True, max_num_seqs=3).engine
    admitted = admission_plans(core)
    modes, launch = [], core.runner.launch

    def spy(plan, after=None):
        step = launch(plan, after)
        if plan.seqs[0].root_on_device and not plan.seqs[-1].root_on_device:  # trees, then admitted prompts
            modes.append(step.graph_mode)
        return step

    core.runner.launch = spy
    seen, ahead_waiting = steps_ahead_while_waiting(core)
    out, _, ahead = tree_steps_ahead(core, ps, params, "replay: whole round")
    assert out == want and ahead >= 3
    assert ahead_waiting[0] >= 3, (ahead_waiting, seen)
    assert admitted["ahead beside trees"] >= 2 and "synchronous: waiting requests" not in seen, (admitted, seen)
    want_mode = "replay: admission" if max_replays else "eager: prompt chunks beyond 0 replays"
    assert modes and set(modes) == {want_mode}, modes


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_step_after_an_admission_runs_ahead_with_trees(tiny_checkpoints, temperature):
    """An admission step (a prompt's chunks beside the running requests, with or without their trees) samples every
    request: the tree step after it runs ahead, each root fed from the device (the prompt's first token at its
    length). Before, such a step was always scheduled after the admission's results, so a loaded server paid two
    synchronous steps per admission. Output equals the synchronous engine's (plain decoding's when greedy)."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(6)  # 3 to 29 tokens each: admissions prefill chunks
    params = [SamplingParams(max_tokens=MAX_TOKENS - 2 * i, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(6)]
    ref = plain_greedy(folder, ps, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6)
    if temperature == 0:
        want = [r[:p.max_tokens] for r, p in zip(ref, params)]
    else:  # the same seeded requests stepped synchronously
        want = run(tree_engine(folder, ps, ref, False, max_num_seqs=3).engine, ps, params)[0]
    core = tree_engine(folder, ps, ref, True, max_num_seqs=3).engine
    kinds, step = [], core.step

    def spy():
        deltas = step()
        st = core.last_stats
        if st is not None:
            admission = st.cuda_graph == "replay: admission" or st.cuda_graph.startswith("eager: mixed")
            kinds.append((st.scheduling, any(st.spec_budgets), admission))
        return deltas

    core.step = spy
    out, _, _ = run(core, ps, params)
    assert out == want
    after = [(prev[1], cur[1]) for prev, cur in zip(kinds, kinds[1:]) if prev[2] and cur[0] == "ahead"]
    assert (False, True) in after, kinds  # trees ahead of the first prompts' step (no trees in it)
    assert (True, True) in after, kinds  # ... and of an admission beside the running requests' trees


def test_stop_tokens_while_a_tree_step_runs_ahead(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, greedy)
    stops = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[r[len(r) // 2]]) for r in ref]
    want = plain_greedy(folder, ps, stops)
    out, _, ahead = tree_steps_ahead(tree_engine(folder, ps, ref, True).engine, ps, stops)
    assert out == want and ahead > 0
    assert all(len(o) < MAX_TOKENS for o in out)


def test_seeded_sampling_ahead_equals_synchronous_tree_steps(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    ref = plain_greedy(folder, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, top_k=40, min_tokens=6, seed=s,
                              logprobs=2, ignore_eos=False) for s in range(4)]
    want, want_lp, _ = tree_steps_ahead(tree_engine(folder, ps, ref, False).engine, ps, sampled)
    got, got_lp, ahead = tree_steps_ahead(tree_engine(folder, ps, ref, True).engine, ps, sampled,
                                          "replay: forward only (requests ask for logprobs)")
    assert got == want and ahead > 0
    assert_same_logprobs(want_lp, got_lp)


@pytest.mark.parametrize("top", [{}, dict(top_p=0.9, top_k=40)])
def test_seeded_sampling_in_whole_rounds_equals_the_sampler(tiny_checkpoints, top):
    """Tree steps at temperature > 0 as whole-round graphs (the draw inside the epilogue; with top-k/top-p its own
    variant), launched ahead: the tokens the sampler draws in forward-only tree steps run synchronously, for
    sampled requests beside a greedy one."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(5)
    ref = plain_greedy(folder, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.3, min_p=0.02, seed=s, ignore_eos=False, **top)
              for s in range(4)] + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)]


    def outside(golden):
        engine = tree_engine(folder, ps, golden, False).engine
        engine.runner.rounds = None  # the tree step's forward replayed alone, the sampler after it
        return tree_steps_ahead(engine, ps, params)[0]

    sampled = outside(ref)  # the oracle replays the greedy output: the sampled requests leave it at once
    want = outside(sampled)  # now it replays theirs (drafts accepted at varying depths): the same tokens
    got, _, ahead = tree_steps_ahead(tree_engine(folder, ps, sampled, True).engine, ps, params, "replay: whole round")
    assert want == sampled and got == want and ahead > 0
    assert got[4] == ref[4]


def test_adaptive_budget_with_tree_steps_ahead(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(5)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, params)
    out, _, ahead = tree_steps_ahead(tree_engine(folder, ps, ref, True, budget=8, adaptive=True).engine, ps,
                                     params)
    assert out == ref and ahead > 0


def engine_wanting(tiny_checkpoints, budgets: list[int]):
    """A pipelined tree engine over 4 prompts whose requests want these budgets, in order of first asking; with
    the prompts, their sampling params and plain decoding's output."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, params)
    core = tree_engine(folder, ps, ref, True, budget=8, adaptive=True).engine
    wanted = {}
    answer_with(core.budgets, lambda rid, dry=False, ahead=False: wanted.setdefault(rid, budgets[len(wanted) % 4]))
    return core, ps, params, ref


def test_tree_steps_ahead_share_one_harmonized_width(tiny_checkpoints):
    """A step planned ahead pads every tree to the widest one like any step, so budgets that differ go through the
    same harmonizing (the scheduler's width_of, the adaptive budget's harmonize, for layouts that pad only the
    trees: uniform_of off) and the step verifies what it returns; output stays plain decoding's."""
    core, ps, params, ref = engine_wanting(tiny_checkpoints, [1, 3, 6, 8])
    asked = []

    def width_of(requests, budgets):  # a stand-in harmonizer: one width of 3 rows past the root
        asked.append(list(budgets))
        return [min(b, 3) for b in budgets]

    core.scheduler.width_of, core.scheduler.uniform_of = width_of, None
    stats, step = [], core.step

    def spy():
        deltas = step()
        if core.last_stats is not None:
            stats.append((core.last_stats.scheduling, list(core.last_stats.spec_budgets)))
        return deltas

    core.step = spy
    out, _, _ = run(core, ps, params)
    assert out == ref
    ahead = [budgets for mode, budgets in stats if mode == "ahead" and any(budgets)]
    assert ahead and all(max(budgets) <= 3 for budgets in ahead), stats
    assert asked and all(len(set(b for b in budgets if b)) > 1 for budgets in asked)  # only when they differ


def test_uniform_steps_verify_what_the_controller_gives_every_request(tiny_checkpoints):
    """Under the CUDA-graph layout a tree step lays every decoding request out at its width, so the step's nodes
    are chosen for all requests at once (the scheduler's uniform_of, the adaptive budget's uniform): requests that
    wanted no tree verify the nodes it gives them too, in steps planned as usual and ahead of their predecessor's
    results, and what each request learns from is the nodes it chose (all of them when it chose none); output
    stays plain decoding's."""
    core, ps, params, ref = engine_wanting(tiny_checkpoints, [0, 2, 0, 5])
    asked = []

    def uniform_of(requests, budgets, caps, synchronous):  # a stand-in: 3 nodes for everyone within its cap
        asked.append(list(budgets))
        return [min(3, c) for c in caps]

    core.scheduler.uniform_of = uniform_of
    plans, launch = [], core.runner.launch

    def spy(plan, after=None):
        if all(s.spec_budget for s in plan.seqs):
            plans.append([(s.spec_budget, s.chosen_budget) for s in plan.seqs])
        return launch(plan, after)

    core.runner.launch = spy
    out, _, ahead = tree_steps_ahead(core, ps, params)
    assert out == ref
    assert ahead > 0 and asked and all(any(b) for b in asked)  # asked only when some request wants a tree
    full = [p for p in plans if len(p) == 4 and all(v == 3 for v, _ in p)]
    assert full and all([c for _, c in p] == [3, 2, 3, 3] for p in full), plans


def test_drafters_that_need_the_host_never_draft_ahead(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, params)
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(ps, ref)]), VOCAB, horizon=6)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=6, adaptive=False)
    llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = llm.engine.budgets.pipelined = True
    core, reasons = llm.engine, set()
    for p in ps:
        core.add_request(p, params)
    while core.has_unfinished():
        core.step()
        if core.last_stats is not None and core.last_stats.spec_budgets and any(core.last_stats.spec_budgets):
            reasons.add(core.last_stats.scheduling)
    assert "ahead" not in reasons
    assert "synchronous: the drafter drafts from tokens on the host" in reasons, reasons


def test_dflash_drafts_ahead_from_the_device_like_it_drafts_from_the_host(tiny_checkpoints, tmp_path):
    """A DFlash drafter drafting ahead of the previous tree step's results writes that step's accepted rows' K/V
    from the device (padded, past the accepted length skipped) and reads its root and positions there: its raw
    proposals equal, call by call, those of the same engine stepping synchronously (where the host feeds it), so
    its draft KV holds the same context. The drafter's proposals are then replaced by an oracle's, so that trees
    are accepted several tokens deep; greedy output equals plain decoding. (GPU twin: tests/ext/test_engine_gpu.py.)"""
    dflash_ahead_against_synchronous(tiny_checkpoints, tmp_path, "cpu")


def test_dflash_curve_drafts_ahead_of_a_plain_step_equal_synchronous_ones(tiny_checkpoints, tmp_path):
    """Requests at budget 0 whose curves are drafted in plain steps scheduled ahead (the adaptive budget's
    interval drafts): a DFlash drafter there needs the target's features of the row the step in flight computes
    (they reach the host only with its results; without them the call failed and took the engine down). Its
    proposals equal the synchronous engine's, whose drafter reads every row from the host, but in the step right
    after the prompts (it runs ahead without drafting: their features are still on the device); output equals
    plain decoding. (GPU twin: tests/ext/test_engine_gpu.py.)"""
    dflash_curves_ahead_against_synchronous(tiny_checkpoints, tmp_path, "cpu")


def dflash_setup(tiny_checkpoints, tmp_path, device: str) -> tuple[str, list, list, list]:
    """A random DFlash drafter (block 8) in tmp_path for the tiny Qwen3 checkpoint: (checkpoint, 3 prompts, their
    greedy params of different lengths, plain decoding's output)."""
    import json
    import os

    from engine.speculative.dflash_files import save_random_dflash

    folder, _ = tiny_checkpoints("qwen3")
    with open(os.path.join(folder, "config.json")) as f:
        save_random_dflash(str(tmp_path), json.load(f), num_layers=1, block_size=8, target_layer_ids=[0, 1])
    ps = prompts(3)
    params = [SamplingParams(max_tokens=MAX_TOKENS - 3 * i, temperature=0, ignore_eos=True) for i in range(3)]
    return folder, ps, params, [o.token_ids for o in LLM(folder, dtype="fp32", device=device).generate(ps, params)]


def dflash_curves_ahead_against_synchronous(tiny_checkpoints, tmp_path, device: str) -> None:
    import torch

    folder, ps, params, ref = dflash_setup(tiny_checkpoints, tmp_path, device)
    curves, ahead = {}, {}
    for overlap in (False, True):
        llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=str(tmp_path), spec_budget=6, adaptive=True,
                  max_num_seqs=8, device=device, async_scheduling=overlap)
        core = llm.engine
        if device == "cpu":
            core.enable_graphs(emulate=True)
            core.overlap = core.budgets.pipelined = overlap
        assert core.overlap == overlap
        answer_with(core.budgets, budget=lambda rid, dry=False, ahead=False: 0,
                    should_draft=lambda rid, dry=False, ahead=False: True)
        core.runner.watch = core.budgets.should_draft  # (the runner holds the method it was given)
        drafter, calls = core.speculator.drafter, []
        propose, propose_ahead = drafter.propose, drafter.propose_ahead

        def host(batch, top_k, propose=propose, calls=calls):
            out = propose(batch, top_k)
            calls.append(out[0].clone())
            return out

        def device_(*args, propose_ahead=propose_ahead, calls=calls, **kwargs):
            out = propose_ahead(*args, **kwargs)
            calls.append(out[0].clone())
            return out

        drafter.propose, drafter.propose_ahead = host, device_
        out, _, ahead[overlap] = run(core, ps, params)
        assert out == ref
        curves[overlap] = calls
    assert ahead[True] >= 10 and ahead[False] == 0
    # the step right after the prompts runs ahead without their curves: their features were still on the device
    assert len(curves[True]) == len(curves[False]) - 1 >= 10
    for want, got in zip(curves[False][1:], curves[True]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def dflash_ahead_against_synchronous(tiny_checkpoints, tmp_path, device: str, budgets=None) -> None:
    """budgets: called with each engine to set the budgets it asks for (None: the full budget, adaptive off)."""
    import torch

    folder, ps, params, ref = dflash_setup(tiny_checkpoints, tmp_path, device)
    golden = corrupted({tuple(p[:3]): p + r for p, r in zip(ps, ref)}, {tuple(p[:3]): len(p) for p in ps})
    raw, outs, ahead = {}, {}, {}
    for overlap in (False, True):
        llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=str(tmp_path), spec_budget=6,
                  adaptive=budgets is not None, max_num_seqs=8, device=device, async_scheduling=overlap)
        if device == "cpu":
            llm.engine.enable_graphs(emulate=True)
            llm.engine.overlap = llm.engine.budgets.pipelined = overlap
        if budgets is not None:
            budgets(llm.engine)
        assert llm.engine.overlap == overlap and llm.engine.speculator.drafter.graphs is not None
        drafter, oracle = llm.engine.speculator.drafter, DeviceOracle(golden, 3, VOCAB, horizon=7, device=device)
        calls = raw[overlap] = []
        propose, propose_ahead = drafter.propose, drafter.propose_ahead

        def host(batch, top_k, propose=propose, oracle=oracle, calls=calls):
            calls.append(propose(batch, top_k)[0].clone())
            return oracle.propose(batch, top_k)

        def device_(batch, top_k, roots, positions, num_new, feats, emitted_ids=None, propose_ahead=propose_ahead,
                    oracle=oracle, calls=calls):
            calls.append(propose_ahead(batch, top_k, roots, positions, num_new, feats)[0].clone())
            return oracle.propose_ahead(batch, top_k, roots, positions, num_new)

        drafter.propose, drafter.propose_ahead = host, device_
        outs[overlap], _, ahead[overlap] = tree_steps_ahead(llm.engine, ps, params)
    assert outs[True] == outs[False] == ref
    assert ahead[True] >= 3 and ahead[False] == 0
    sync, fast = raw[False], raw[True]
    assert len(fast) >= len(sync)  # (calls ahead for requests that finished meanwhile come on top)
    for want, got in zip(sync, fast):
        if want.shape == got.shape:
            assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()
    assert sum(a.shape == b.shape for a, b in zip(sync, fast)) >= len(sync) // 2


def test_abort_and_arrival_while_a_tree_step_runs_ahead(tiny_checkpoints):
    """A request aborted while the tree step after it is in flight gets nothing more; a request arriving then
    joins a tree step launched ahead, and the others' outputs are unchanged. Every block comes back, in-flight ones
    too."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, sp)
    core = tree_engine(folder, ps, ref, True).engine
    admitted = admission_plans(core)
    ids = [core.add_request(p, sp) for p in ps[:2]]
    out = {i: [] for i in ids}
    while not (core.inflight is not None and core.inflight.step.is_tree_step):
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert core.abort(ids[1])  # the tree step in flight was launched for it too
    late = core.add_request(ps[2], sp)
    out[late], aborted_after, reasons = [], len(out[ids[1]]), set()
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
        reasons.add(core.last_stats.scheduling if core.last_stats else None)
    assert out[ids[0]] == ref[0] and out[late] == ref[2]
    assert len(out[ids[1]]) == aborted_after and out[ids[1]] == ref[1][:aborted_after]
    assert admitted == {"synchronous": 1, "ahead": 0, "ahead beside trees": 1} and reasons == {"ahead"}, admitted
    assert core.blocks.num_free_blocks == core.blocks.num_blocks

