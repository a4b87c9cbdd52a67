"""End to end on the GPU through the CUDA ops: greedy DDTree output equals plain greedy decoding token for token
on tiny fp32 models of every family (GQA and MLA attention, the KV writes, the decoder-layer ops and KV
compaction all served by the extension), and CUDA plain decoding equals the CPU reference engine."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.oracle import DeviceOracle, OracleDrafter
from ext import build, ops
from tests.engine.test_async_scheduling import admission_plans
from tests.speculative.test_ddtree_e2e import HORIZON, golden_lookup, prompts

pytestmark = pytest.mark.gpu
MAX_TOKENS = 40


def greedy(llm) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts(), sp)]


@pytest.fixture(scope="module")
def plain_cuda(tiny_checkpoints):
    assert build.load_ops() is not None, build.load_error()
    cache = {}

    def get(family):
        if family not in cache:
            folder, _ = tiny_checkpoints(family)
            cache[family] = greedy(LLM(folder, dtype="fp32", device="cuda"))
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_ddtree_equals_plain_with_cuda_ops(tiny_checkpoints, plain_cuda, family, block_size):
    folder, _ = tiny_checkpoints(family)
    ref = plain_cuda(family)
    before = ops.cuda_calls()
    seqs = [(p + r, len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(seqs), 1000, horizon=HORIZON, noise=0.4, noise_rank=2, seed=3)
    llm = LLM(folder, dtype="fp32", device="cuda", drafter=oracle, spec_budget=16, block_size=block_size)
    assert greedy(llm) == ref
    assert greedy(LLM(folder, dtype="fp32", device="cuda", drafter="ngram", spec_budget=8,
                      block_size=block_size)) == ref
    used = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items()}
    mla = family == "deepseek_v3"
    # Qwen3 folds its q/k norms into the rope + cache write
    rope = "qk_norm_rope_write_kv" if family.startswith("qwen3") else "rope_write_kv"
    attention, kv_write = ("mla_paged_attention", "write_kv") if mla else ("paged_attention", rope)
    assert used.get(attention, 0) > 0 and used.get(kv_write, 0) > 0, used
    # the decoder-layer ops (DeepSeek-V3 keeps its own interleaved-capable rope)
    layer_ops = ("fused_add_rmsnorm", "silu_and_mul") if mla else ("fused_add_rmsnorm", "silu_and_mul", rope)
    assert all(used.get(op, 0) > 0 for op in layer_ops), used
    # demoted golden tokens: accepted paths leave the spine; the whole round ran through the extension
    assert used.get("kv_compact_tree", 0) > 0 and used.get("tree_accept", 0) > 0, used
    assert ops.reference_fallbacks() == {}, ops.reference_fallbacks()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_sampled_ddtree_on_cuda_reproduces_seeded_plain_sampling(tiny_checkpoints, family):
    """T = 1 with top-p, penalties and logprobs, through the CUDA sampler and tree kernels: seeded DDTree emits
    what seeded plain sampling emits (the same counter-based uniforms decide every position)."""
    folder, _ = tiny_checkpoints(family)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True,
                        repetition_penalty=1.1, logprobs=2)
    plain = LLM(folder, dtype="fp32", device="cuda").generate(prompts(), sp)
    before = ops.cuda_calls()
    spec = LLM(folder, dtype="fp32", device="cuda", drafter="ngram", spec_budget=8,
              adaptive=False).generate(prompts(), sp)
    used = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items()}
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        assert [lp[0] for lp in a.logprobs] == pytest.approx([lp[0] for lp in b.logprobs], abs=1e-4)
    assert used.get("sample_tokens", 0) > 0 and used.get("tree_accept", 0) > 0, used


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_cuda_plain_equals_cpu_plain(tiny_checkpoints, plain_cuda, family):
    folder, _ = tiny_checkpoints(family)
    assert plain_cuda(family) == greedy(LLM(folder, dtype="fp32"))


def graph_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 1000, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_cuda_graphs_equal_eager_for_plain_and_ddtree(tiny_checkpoints, family, batch):
    """Greedy output with CUDA graphs (replayed at padded bucket sizes) equals eager, for plain decoding and for
    DDTree with an oracle whose golden tokens are sometimes demoted (sibling paths, KV compaction)."""
    folder, _ = tiny_checkpoints(family)
    ps = graph_prompts(batch)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    eager = LLM(folder, dtype="fp32", device="cuda", enforce_eager=True, max_num_seqs=32)
    ref = [o.token_ids for o in eager.generate(ps, sp)]
    graphed = LLM(folder, dtype="fp32", device="cuda", max_num_seqs=32)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    out, modes = step_modes(graphed, ps, sp)
    assert out == ref and "replay: whole step" in modes
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(ps, ref)]), 1000, horizon=HORIZON,
                           noise=0.3, noise_rank=2, seed=3)
    spec = LLM(folder, dtype="fp32", device="cuda", drafter=oracle, spec_budget=16, adaptive=False, max_num_seqs=32)
    out, modes = step_modes(spec, ps, sp)  # greedy tree steps: whole-round graphs (tree build to compaction)
    assert out == ref and "replay: whole round" in modes, modes
    with_logprobs = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    out, modes = step_modes(spec, ps, with_logprobs)  # the forward's graph only: sampled outside
    assert out == ref and "replay: forward only (requests ask for logprobs)" in modes, modes


def step_modes(llm, ps, sp) -> tuple[list[list[int]], set]:
    """Steps the engine to the end: (tokens per prompt, the steps' CUDA-graph modes)."""
    out, steps, _ = step_through(llm, ps, sp)
    return out, {graph for graph, _ in steps}


def step_through(llm, ps, sp) -> tuple[list[list[int]], set, list[int]]:
    """Steps the engine to the end: (tokens per prompt, (CUDA-graph mode, scheduling) of the steps, accept lengths
    of the trees). sp: one SamplingParams or one per prompt."""
    core = llm.engine
    ids = [core.add_request(p, s) for p, s in zip(ps, sp if isinstance(sp, list) else [sp] * len(ps))]
    out, steps, accepted = {rid: [] for rid in ids}, set(), []
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
        st = core.last_stats
        steps.add((st.cuda_graph, st.scheduling) if st else (None, None))
        accepted += st.accept_lengths if st else []
    return [out[rid] for rid in ids], steps, accepted


@pytest.mark.parametrize("top", [{}, dict(top_p=0.9, top_k=40)])
def test_decode_steps_sample_in_cuda_graphs_like_eager_steps(tiny_checkpoints, top):
    """Decode steps choosing their tokens in the sampling graph after the forward's (launched ahead of each other):
    seeded sampling at T > 0 (min-p; top-k/top-p in its own variant) beside a greedy request draws what eager
    steps' sampler draws."""
    folder, _ = tiny_checkpoints("qwen3")
    ps = graph_prompts(5)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, min_p=0.02, seed=s, ignore_eos=True, **top)
              for s in range(4)] + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)]
    eager = LLM(folder, dtype="fp32", device="cuda", enforce_eager=True, max_num_seqs=32)
    ref = [o.token_ids for o in eager.generate(ps, params)]
    out, steps, _ = step_through(LLM(folder, dtype="fp32", device="cuda", max_num_seqs=32), ps, params)
    assert out == ref and ("replay: whole step", "ahead") in steps, steps


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_async_scheduling_on_cuda_equals_synchronous_steps(tiny_checkpoints, batch):
    """Graph replays launched ahead of the previous step's results (its tokens fed from the device) emit what
    synchronous steps emit: greedy with staggered max_tokens and a stop token met mid-output, and seeded sampling
    at T = 0.8 with top-p, min_tokens and logprobs."""
    folder, _ = tiny_checkpoints("qwen3")
    ps = graph_prompts(batch)
    common = dict(dtype="fp32", device="cuda", max_num_seqs=64)
    sync = LLM(folder, async_scheduling=False, **common)
    greedy_ref = [o.token_ids for o in sync.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                        ignore_eos=True))]
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 7, temperature=0, ignore_eos=True) for i in range(batch)]
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[r[len(r) // 2]])
               for r in greedy_ref]
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=i, min_tokens=5, logprobs=2,
                              ignore_eos=False) for i in range(batch)]
    prompts3 = ps * 3
    want = sync.generate(prompts3, params)
    fast = LLM(folder, **common)
    core = fast.engine
    assert core.overlap and core.runner.graphs is not None and not sync.engine.overlap
    ids = [core.add_request(p, sp) for p, sp in zip(prompts3, params)]
    out, logprobs, ahead, modes = {i: [] for i in ids}, {i: [] for i in ids}, 0, set()
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
            logprobs[d.request_id].extend(d.new_logprobs or [])
        ahead += core.inflight is not None
        modes.add(core.last_stats.cuda_graph if core.last_stats else None)
    assert [out[i] for i in ids] == [o.token_ids for o in want]
    assert ahead >= MAX_TOKENS - 8 and any(m and m.startswith("replay") for m in modes)
    for i, o in zip(ids, want):
        assert [lp[0] for lp in logprobs[i]] == pytest.approx([lp[0] for lp in o.logprobs or []], abs=1e-4)
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_tree_steps_ahead_on_cuda_equal_synchronous_steps(tiny_checkpoints, batch):
    """Tree steps launched ahead of the previous tree step's results (roots, positions, slots and sampling offsets
    taken on the device; real graph replays and the CUDA tree kernels): greedy output equals plain decoding with
    staggered max_tokens and a stop token met mid-output, seeded sampling with min_tokens and logprobs equals
    synchronous tree steps, and every KV block comes back."""
    from engine.speculative.oracle import DeviceOracle
    from tests.engine.test_async_trees import corrupted

    folder, _ = tiny_checkpoints("llama")
    ps = graph_prompts(batch)
    common = dict(dtype="fp32", device="cuda", max_num_seqs=64)
    plain = LLM(folder, **common)
    greedy = [SamplingParams(max_tokens=MAX_TOKENS - i % 7, temperature=0, ignore_eos=True) for i in range(batch)]
    ref = [o.token_ids for o in plain.generate(ps, greedy)]
    stops = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[r[len(r) // 2]]) for r in ref]
    stop_ref = [o.token_ids for o in plain.generate(ps, stops)]
    golden = corrupted({tuple(p[:3]): p + r for p, r in zip(ps, ref)}, {tuple(p[:3]): len(p) for p in ps})
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=i, min_tokens=5, logprobs=2,
                              ignore_eos=False) for i in range(batch)]
    outs = {}
    for overlap in (False, True):
        oracle = DeviceOracle(golden, 3, 1000, horizon=HORIZON, device="cuda")
        llm = LLM(folder, drafter=oracle, spec_budget=8, adaptive=False, async_scheduling=overlap, **common)
        core = llm.engine
        assert core.overlap == overlap and core.runner.graphs is not None
        launched, launch = [], core.ahead.trees
        core.ahead.trees = lambda current: launched.append(launch(current)) or launched[-1]
        outs[overlap] = llm.generate(ps * 3, greedy + stops + sampled)
        assert core.blocks.num_free_blocks == core.blocks.num_blocks
        assert (sum(x is not None for x in launched) >= 3) == overlap, launched
    got = [o.token_ids for o in outs[True]]
    assert got[:2 * batch] == ref + stop_ref
    assert got == [o.token_ids for o in outs[False]]
    for a, b in zip(outs[True][2 * batch:], outs[False][2 * batch:]):
        assert [lp[0] for lp in a.logprobs] == pytest.approx([lp[0] for lp in b.logprobs], abs=1e-4)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_whole_round_graphs_ahead_on_cuda_equal_plain_decoding(tiny_checkpoints, batch):
    """Greedy tree steps as whole-round graphs (tree build, verify rows, forward, walk and compaction replayed;
    roots and root positions from the previous round's epilogue when launched ahead), with drafts rejected at
    varying depths, staggered max_tokens and a stop token met mid-output: output equals plain decoding, tree
    steps ran ahead as whole rounds, and every KV block comes back."""
    from engine.speculative.oracle import DeviceOracle
    from tests.engine.test_async_trees import corrupted

    folder, _ = tiny_checkpoints("llama")
    ps = graph_prompts(batch)
    common = dict(dtype="fp32", device="cuda", max_num_seqs=64)
    plain = LLM(folder, **common)
    greedy = [SamplingParams(max_tokens=MAX_TOKENS - i % 7, temperature=0, ignore_eos=True) for i in range(batch)]
    greedy += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[r[len(r) // 2]])
               for r in [o.token_ids for o in plain.generate(ps, greedy)]]
    ref = [o.token_ids for o in plain.generate(ps * 2, greedy)]
    golden = corrupted({tuple(p[:3]): p + r for p, r in zip(ps, ref)}, {tuple(p[:3]): len(p) for p in ps})
    oracle = DeviceOracle(golden, 3, 1000, horizon=HORIZON, device="cuda")
    llm = LLM(folder, drafter=oracle, spec_budget=8, adaptive=False, **common)
    out, steps, accepted = step_through(llm, ps * 2, greedy)
    assert out == ref
    assert ("replay: whole round", "ahead") in steps, steps
    # the golden token is wrong every 5th position: a tree whose rows were read intact accepts ~3 a step
    assert sum(accepted) / len(accepted) > 2.0, accepted
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("top", [{}, dict(top_p=0.9, top_k=40)])
def test_seeded_sampling_in_whole_round_graphs_on_cuda_equals_plain_sampling(tiny_checkpoints, top):
    """Tree steps at temperature > 0 as whole-round graphs on CUDA (the draw in the epilogue graph, top-k/top-p in
    its own variant; launched ahead, drafts rejected at varying depths), beside a greedy request: the tokens seeded
    plain decoding draws."""
    from engine.speculative.oracle import DeviceOracle
    from tests.engine.test_async_trees import corrupted

    folder, _ = tiny_checkpoints("llama")
    ps = graph_prompts(5)
    common = dict(dtype="fp32", device="cuda", max_num_seqs=64)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.3, min_p=0.02, seed=s, ignore_eos=True, **top)
              for s in range(4)] + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)]
    ref = [o.token_ids for o in LLM(folder, **common).generate(ps, params)]
    golden = corrupted({tuple(p[:3]): p + r for p, r in zip(ps, ref)}, {tuple(p[:3]): len(p) for p in ps})
    llm = LLM(folder, drafter=DeviceOracle(golden, 3, 1000, horizon=HORIZON, device="cuda"), spec_budget=8,
              adaptive=False, **common)
    out, steps, accepted = step_through(llm, ps, params)
    assert out == ref
    assert ("replay: whole round", "ahead") in steps, steps
    assert sum(accepted) / len(accepted) > 2.0, accepted


def test_the_guards_plain_windows_run_ahead_on_cuda(tiny_checkpoints, monkeypatch):
    """The throughput guard's switches on CUDA (captured graphs, asynchronous scheduling): every decoding step runs
    ahead, greedy output equals plain decoding, seeded sampling equals the synchronous engine."""
    from tests.engine.test_async_switches import guard_switches_run_ahead

    guard_switches_run_ahead(tiny_checkpoints, monkeypatch, "cuda")


def test_dflash_drafts_ahead_on_cuda_like_it_drafts_from_the_host(tiny_checkpoints, tmp_path):
    """The DFlash drafter's calls ahead of the previous tree step's results (real graph replays of its block and
    context writes, the CUDA kernels) propose what its host-fed calls propose; greedy output equals plain."""
    from tests.engine.test_async_trees import dflash_ahead_against_synchronous

    dflash_ahead_against_synchronous(tiny_checkpoints, tmp_path, "cuda")


def test_graph_replay_follows_changed_block_tables(tiny_checkpoints):
    """Capture once, then replay a decode step whose request's KV moved to other blocks: the replay reads the
    new block table (static buffers written in place), and equals the eager forward each time."""
    from engine.inputs import prepare_inputs
    from engine.plan import ScheduledSeq
    from engine.request import Request

    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32", device="cuda", block_size=4, max_num_seqs=4)
    core = llm.engine
    graphs, runner = core.runner.graphs, core.runner
    req = Request(graph_prompts(1)[0][:12] + [7], SamplingParams(max_tokens=4))
    core.blocks.allocate(req, req.num_tokens)
    prefill = ScheduledSeq(req, req.num_tokens - 1, sample=False)
    first = prepare_inputs([prefill], None, 4, runner.device)
    runner.model(first.input_ids, first.meta, runner.kv_caches)  # the prefix's KV
    req.num_computed_tokens = req.num_tokens - 1
    for _ in range(2):
        inputs = prepare_inputs([ScheduledSeq(req, 1, sample=True)], None, 4, runner.device)
        eager, _ = runner.model(inputs.input_ids, inputs.meta, runner.kv_caches)
        replayed, _ = graphs.run(inputs.input_ids, inputs.meta, 1, 1)
        assert torch.equal(replayed, eager)
        old = list(req.block_ids)  # move the request's KV to fresh blocks, then replay again
        core.blocks.allocate(req, req.num_tokens + 4 * len(old))
        new = req.block_ids[len(old):2 * len(old)]
        for view in runner.slot_views:
            for a, b in zip(old, new):
                view[b * 4:(b + 1) * 4].copy_(view[a * 4:(a + 1) * 4])
        req.block_ids = new + req.block_ids[2 * len(old):]


def test_dflash_curve_drafts_ahead_of_plain_steps_on_cuda(tiny_checkpoints, tmp_path):
    """Interval curve drafts of requests at budget 0 in plain steps scheduled ahead, with real graph replays: the
    DFlash drafter takes the in-flight step's features from the device, its proposals equal the synchronous
    engine's and output equals plain decoding (tests/engine/test_async_trees.py)."""
    from tests.engine.test_async_trees import dflash_curves_ahead_against_synchronous

    dflash_curves_ahead_against_synchronous(tiny_checkpoints, tmp_path, "cuda")


@pytest.mark.parametrize("chain,budget", [(True, 16), (False, 12)])  # 15 and 12 drafts: widths padded to 17
def test_dflash_chain_and_tree_with_cuda_graphs_equal_plain(tiny_checkpoints, tmp_path, chain, budget):
    """A DFlash drafter (block 16: the chain verifies 16 rows, padded to the 17-row bucket past a KV block) with
    CUDA graphs captured at startup: greedy output equals plain decoding."""
    import json
    import os

    from engine.speculative.dflash_files import save_random_dflash

    folder, _ = tiny_checkpoints("qwen3")
    with open(os.path.join(folder, "config.json")) as f:
        save_random_dflash(str(tmp_path), json.load(f), num_layers=1, block_size=16, target_layer_ids=[0, 1])
    ps = graph_prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(folder, dtype="fp32", device="cuda").generate(ps, sp)]
    spec = LLM(folder, dtype="fp32", device="cuda", drafter="dflash", draft_model=str(tmp_path), chain=chain,
               spec_budget=budget, adaptive=False, max_num_seqs=32)
    assert spec.engine.runner.graphs is not None
    assert [o.token_ids for o in spec.generate(ps, sp)] == ref


def test_dflash_drafter_on_cuda_equals_cpu_in_one_attention_launch_a_layer(tiny_checkpoints, tmp_path):
    """The DFlash drafter's paged draft KV on CUDA: a batch of requests whose contexts and blocks cross pages,
    drafted incrementally, gives the CPU drafter's logits (the reference attention); every call runs one
    paged-attention launch per draft layer whatever the batch size, and no SDPA (whose cuDNN backend builds a plan
    for every new key length)."""
    import json
    import os

    from torch.profiler import ProfilerActivity, profile

    from engine.config import SpecConfig
    from engine.model.loader import load_model
    from engine.speculative.dflash_files import save_random_dflash
    from engine.speculative.drafter import DraftRequest, make_drafter

    folder, _ = tiny_checkpoints("qwen3")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    save_random_dflash(str(tmp_path), cfg, num_layers=2, block_size=16, target_layer_ids=[0, 1])
    spec = SpecConfig(drafter="dflash", budget=8, draft_model=str(tmp_path))
    vocab = cfg["vocab_size"]
    drafters = {dev: make_drafter(spec, load_model(folder, "fp32", device=dev).model, vocab, device=dev)
                for dev in ("cpu", "cuda")}
    gen = torch.Generator().manual_seed(0)
    width = 2 * cfg["hidden_size"]
    lengths = [(5, 9), (17, 18), (30, 47), (1, 2)]  # (committed tokens before, after): pages of 16 slots crossed
    tokens = [torch.randint(0, vocab, (after,), generator=gen).tolist() for _, after in lengths]
    feats = [torch.randn(after, width, generator=gen) for _, after in lengths]
    for stage in (0, 1):  # the first call shows each context up to `before`, the second the rows after it
        batch = {dev: [] for dev in drafters}
        for i, ((before, after), t, f) in enumerate(zip(lengths, tokens, feats)):
            first, end = (0, before) if stage == 0 else (before - 1, after)
            for dev in drafters:
                rows = f[first:end - 1].to(dev) if end - 1 > first else None
                batch[dev].append(DraftRequest(f"r{i}", t[:end], rows))
        before = ops.cuda_calls().get("paged_attention", 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = drafters["cuda"].forward_logits(batch["cuda"])
        want = drafters["cpu"].forward_logits(batch["cpu"])
        assert ops.cuda_calls().get("paged_attention", 0) - before == 2
        names = {e.key for e in prof.key_averages()}
        assert "aten::scaled_dot_product_attention" not in names and not [n for n in names if "cudnn" in n.lower()]
        err = (got.cpu() - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), (stage, err)


def test_dflash_drafter_graph_replays_equal_eager(tiny_checkpoints, tmp_path):
    """The drafter's captured block (CUDA graphs for 1, 2 and 4 requests) against the eager drafter over calls
    whose batch grows, shrinks (rows of a larger call become padding) and whose contexts cross pages between
    replays: the same top-K ids and log-probs."""
    import json
    import os

    from engine.config import SpecConfig
    from engine.model.loader import load_model
    from engine.speculative.dflash_files import save_random_dflash
    from engine.speculative.drafter import DraftRequest, make_drafter

    folder, _ = tiny_checkpoints("qwen3")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    save_random_dflash(str(tmp_path), cfg, num_layers=2, block_size=16, target_layer_ids=[0, 1])
    target = load_model(folder, "fp32", device="cuda").model
    spec = SpecConfig(drafter="dflash", budget=8, draft_model=str(tmp_path))
    eager, graphed = (make_drafter(spec, target, cfg["vocab_size"], device="cuda") for _ in range(2))
    graphed.reserve_kv(4096, 4)
    graphed.capture_graphs([1, 2, 4], top_k=8, max_model_len=256)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4]
    gen = torch.Generator().manual_seed(1)
    lengths = [40, 13, 70]
    tokens = [torch.randint(0, cfg["vocab_size"], (n + 40,), generator=gen).tolist() for n in lengths]
    feats = [torch.randn(n + 40, 2 * cfg["hidden_size"], generator=gen).cuda() for n in lengths]
    ends = list(lengths)
    for step, which in enumerate(([0, 1, 2], [1], [0, 2], [0, 1, 2], [2], [0, 1])):
        out = {}
        for name, drafter in (("eager", eager), ("graph", graphed)):
            batch = [DraftRequest(f"r{i}", tokens[i][:ends[i]], feats[i][drafter.context_len(f"r{i}"):ends[i] - 1])
                     for i in which]
            out[name] = [t.clone() for t in drafter.propose(batch, top_k=8)]
        assert torch.equal(out["graph"][1], out["eager"][1]), step
        assert torch.allclose(out["graph"][0], out["eager"][0], atol=1e-4, rtol=0), step
        for i in which:
            ends[i] += 7  # 7 accepted tokens: contexts cross 16-slot pages between replays


def test_bf16_moe_runs_grouped_gemms_under_cuda_graphs(tiny_checkpoints):
    """A bf16 MoE model on sm_90: the expert dispatch is the sync-free grouped path (checked against the loop on
    the same inputs), CUDA graphs are captured, and the first token and its logprob match an eager engine."""
    from engine.model.moe import Experts, _run_experts_loop, run_experts_grouped

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM needs sm_90")
    folder, _ = tiny_checkpoints("qwen3_moe")
    graphs = LLM(folder, dtype="bf16", device="cuda")
    assert graphs.engine.runner.graphs is not None
    experts = next(m for m in graphs.engine.model.modules() if isinstance(m, Experts))
    x = torch.randn(7, experts.w13.shape[2], device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, len(experts), (7, 2), device="cuda")
    weights = torch.rand(7, 2, device="cuda", dtype=torch.bfloat16)
    assert experts.grouped_ok(x)
    torch.testing.assert_close(run_experts_grouped(experts, x, ids, weights).float(),
                               _run_experts_loop(experts, x, ids, weights).float(), rtol=3e-2, atol=3e-2)
    eager = LLM(folder, dtype="bf16", device="cuda", enforce_eager=True)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    a, b = graphs.generate(prompts(), sp), eager.generate(prompts(), sp)
    for x_out, y_out in zip(a, b):
        assert x_out.logprobs[0][0] == pytest.approx(y_out.logprobs[0][0], abs=0.05)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_padded_eager_steps_equal_unpadded_on_cuda(tiny_checkpoints, family):
    """Eager steps on CUDA are padded to a multiple of 64 rows (engine/inputs.py): steps of up to 101
    tokens beside n-gram trees give the same greedy output with the padding as without it."""
    folder, _ = tiny_checkpoints(family)
    ps = [p * 3 for p in prompts()]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kwargs = dict(dtype="fp32", device="cuda", drafter="ngram", spec_budget=8, max_num_batched_tokens=101,
                  enforce_eager=True)
    outs = []
    for pad_to in (0, 64):
        llm = LLM(folder, **kwargs)
        assert llm.engine.runner.eager_pad_to == 64  # the CUDA default
        llm.engine.runner.eager_pad_to = pad_to
        outs.append([o.token_ids for o in llm.generate(ps, sp)])
    assert outs[0] == outs[1]


def test_drafting_first_on_cuda_equals_plain_decoding(tiny_checkpoints, plain_cuda, monkeypatch):
    """Synchronous steps on CUDA with a cheap drafter draft each tree before its budget is chosen
    (engine/draft_first.py: the speculator's staging buffers on the device): greedy output equals plain decoding
    with the n-gram and the oracle drafters, and sampled requests (T > 0, top_p) run beside greedy ones."""
    from engine.speculative.adaptive import BudgetController

    monkeypatch.setattr(BudgetController, "draft_tokens", lambda self: 0.0)  # cheap whatever the host's speed
    folder, _ = tiny_checkpoints("llama")
    ref = plain_cuda("llama")
    lookup = golden_lookup([(p + r, len(p)) for p, r in zip(prompts(), ref)])
    for drafter in ("ngram", OracleDrafter(lookup, 1000, horizon=HORIZON, device="cuda")):
        llm = LLM(folder, dtype="fp32", device="cuda", drafter=drafter, spec_budget=8, async_scheduling=False)
        assert llm.engine.draft_first is not None and not llm.engine.overlap
        assert greedy(llm) == ref
        sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
                   for i in range(len(ref))]
        outs = llm.generate(prompts() * 2, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                           ignore_eos=True)] * len(ref) + sampled)
        assert [o.token_ids for o in outs[:len(ref)]] == ref
        assert all(len(o.token_ids) == MAX_TOKENS for o in outs[len(ref):])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_admission_steps_replay_prompt_pieces_on_cuda_like_eager_steps(tiny_checkpoints, family):
    """Prompt chunks admitted beside decoding requests replay as causal pieces of the prompt buckets (a 300-token
    prompt in two replays of 257 rows), launched ahead of the previous step's results (the decoders' tokens fed
    from the device), and emit what eager synchronous steps emit: greedy, seeded sampling at T = 0.8 with top-p
    and logprobs, and with DDTree trees replayed beside the pieces, synchronous or launched ahead (a drafter
    drafting from the device: its tree steps admit too)."""
    folder, _ = tiny_checkpoints(family)
    g = torch.Generator().manual_seed(5)
    lengths = [int(torch.randint(3, 120, (1,), generator=g)) for _ in range(8)] + [300]
    ps = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in lengths]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    params += [SamplingParams(max_tokens=8 + 3 * i, temperature=0.8, top_p=0.9, seed=i, logprobs=2, ignore_eos=True)
               for i in range(len(ps))]
    common = dict(dtype="fp32", device="cuda", max_num_seqs=3)
    eager = LLM(folder, enforce_eager=True, async_scheduling=False, **common)
    want = eager.generate(ps * 2, params)
    out, steps, _ = step_through(LLM(folder, **common), ps * 2, params)
    assert out == [o.token_ids for o in want] and ("replay: admission", "ahead") in steps, steps
    greedy_ref = [o.token_ids for o in want[:len(ps)]]
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(ps, greedy_ref)]), 1000, horizon=HORIZON,
                           noise=0.3, noise_rank=2, seed=3)
    spec = LLM(folder, drafter=oracle, spec_budget=8, adaptive=False, **common)
    out, modes = step_modes(spec, ps, params[:len(ps)])
    assert out == greedy_ref and "replay: admission" in modes, modes
    # a drafter drafting from the device: tree steps run ahead and admit (the pieces, then the verify replay)
    golden = {tuple(p[:3]): p + r for p, r in zip(ps, greedy_ref)}
    outs = {}
    for overlap in (False, True):
        oracle = DeviceOracle(golden, 3, 1000, horizon=HORIZON, device="cuda")
        spec = LLM(folder, drafter=oracle, spec_budget=8, adaptive=False, async_scheduling=overlap, **common)
        admitted = admission_plans(spec.engine)
        outs[overlap], steps, _ = step_through(spec, ps * 2, params)
    assert outs[True][:len(ps)] == greedy_ref and outs[True] == outs[False]
    assert admitted["ahead beside trees"] >= 1 and ("replay: admission", "ahead") in steps, (admitted, steps)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_admission_steps_as_decode_rows_on_cuda_like_eager_steps(tiny_checkpoints, family):
    """--admission-decode-rows: prompt chunks admitted beside decoding requests run as one-row requests in one
    replay of a plain bucket past max_num_seqs (engine/admission.py rows_as_decodes), launched ahead of the previous
    step's results, and emit what eager synchronous steps emit: greedy, seeded T = 0.8 with top-p (tokens from the
    bucket's sampling graph) and with logprobs (the sampler after the replay); the 300-token prompt replays as
    pieces."""
    folder, _ = tiny_checkpoints(family)
    g = torch.Generator().manual_seed(6)
    lengths = [int(torch.randint(3, 120, (1,), generator=g)) for _ in range(8)] + [300]
    ps = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in lengths]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    params += [SamplingParams(max_tokens=8 + 3 * i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
               for i in range(len(ps))]
    params += [SamplingParams(max_tokens=8 + 3 * i, temperature=0.8, seed=i, logprobs=2, ignore_eos=True)
               for i in range(len(ps))]
    common = dict(dtype="fp32", device="cuda", max_num_seqs=3)
    want = LLM(folder, enforce_eager=True, async_scheduling=False, **common).generate(ps * 3, params)
    out, steps, _ = step_through(LLM(folder, admission_decode_rows=128, **common), ps * 3, params)
    assert out == [o.token_ids for o in want]
    assert ("replay: admission rows", "ahead") in steps, steps
    assert any(mode == "replay: admission" for mode, _ in steps), steps  # the 300-token prompt's pieces


def test_seeded_request_alone_equals_choice_0_beside_a_twin_in_bf16(tiny_checkpoints):
    """bf16 under CUDA graphs: a seeded request whose prompt's tail (past its cached blocks) is admitted alone
    samples what it samples admitted beside a twin (what n = 2 does): each prompt piece replays on its own, so
    its rows run through the same kernels whatever else the step admits (engine/admission.py)."""
    folder, _ = tiny_checkpoints("llama")
    prompt = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 past 2 blocks
    llm = LLM(folder, dtype="bf16", device="cuda")
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))  # its two full blocks cached

    def sp(seed):
        return SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)

    alone = llm.generate([prompt], sp(7))[0].token_ids
    assert llm.generate([prompt], sp(7))[0].token_ids == alone
    assert llm.generate([prompt, prompt], [sp(7), sp(8)])[0].token_ids == alone
