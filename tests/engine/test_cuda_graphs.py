"""CUDA-graph layout on the CPU: graphs are bypassed cleanly on a CPU engine; with the padded graph layout
emulated (the same static buffers, scratch blocks and padding rows, run eagerly instead of replayed), greedy
output equals eager plain decoding for plain decoding and DDTree at batch 1, 3 and 17 (odd sizes pad to a
bucket) and at tree widths that pad to a bucket, and no padding row is ever accepted; with a DFlash drafter its
own block layout is emulated too. The GPU tests replay real graphs (tests/ext/test_engine_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.oracle import OracleDrafter
from tests.speculative.test_ddtree_e2e import golden_lookup

MAX_TOKENS = 24


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 1000, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def greedy(llm, ps) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ps, sp)]


def graph_modes(llm, ps, logprobs: int | None = None, params: list | None = None) -> tuple[list[list[int]], set[str]]:
    """Greedy (or `params`, one per prompt) to the end: (tokens per prompt, the steps' CUDA-graph modes)."""
    core, modes, out = llm.engine, set(), {}
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    ids = [core.add_request(p, q) for p, q in zip(ps, params or [sp] * len(ps))]
    out = {rid: [] for rid in ids}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
        if core.last_stats is not None:
            modes.add(core.last_stats.cuda_graph)
    return [out[rid] for rid in ids], modes


def test_graphs_are_bypassed_on_cpu(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32")
    assert llm.engine.runner.graphs is None and llm.engine._graph_blocker() == "not a CUDA device"
    _, modes = graph_modes(llm, prompts(2))
    assert modes == {""}


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_emulated_graph_layout_equals_eager_plain_decoding(tiny_checkpoints, batch):
    folder, _ = tiny_checkpoints("qwen3")
    ps = prompts(batch)
    ref = greedy(LLM(folder, dtype="fp32"), ps)
    llm = LLM(folder, dtype="fp32", max_num_seqs=32)
    llm.engine.enable_graphs(emulate=True)
    out, modes = graph_modes(llm, ps)
    assert out == ref
    assert "replay: whole step" in modes  # decode steps went through the padded layout (prefill steps stay eager)


@pytest.mark.parametrize("top", [{}, dict(top_p=0.9, top_k=40)])
def test_emulated_decode_steps_sample_in_graphs_like_the_sampler(tiny_checkpoints, top):
    """Decode steps choosing their tokens in the (emulated) graph epilogue, each launched ahead of the one before:
    seeded sampling at T > 0 (min-p; top-k/top-p in a variant of its own) beside a greedy request draws what the
    sampler draws without graphs; with a request asking for logprobs the sampler runs after the replay, and the
    step says why."""
    folder, _ = tiny_checkpoints("qwen3")
    ps = prompts(5)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, min_p=0.02, seed=s, ignore_eos=True, **top)
              for s in range(4)] + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)]
    ref = [o.token_ids for o in LLM(folder, dtype="fp32").generate(ps, params)]
    for logprobs, mode in ((None, "replay: whole step"), (1, "replay: forward only (requests ask for logprobs)")):
        llm = LLM(folder, dtype="fp32", max_num_seqs=32)
        llm.engine.enable_graphs(emulate=True)
        llm.engine.overlap = True
        asked = [SamplingParams(**{**vars(p), "logprobs": logprobs}) for p in params]
        out, modes = graph_modes(llm, ps, params=asked)
        assert out == ref and mode in modes, modes


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_steps_written_into_the_graph_buffers_equal_the_staged_inputs(tiny_checkpoints, monkeypatch, overlap):
    """A plain decoding step's inputs written straight into its bucket's static buffers (CudaGraphs.write_decode)
    leave every buffer a replay reads as the general path does (prepare_inputs, then CudaGraphs.run's copies),
    step by step, with steps launched ahead (their ids fed from the device) and without."""
    from engine.runner import ModelRunner

    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)  # 3 requests in a bucket of 4: a padding request

    def replayed_buffers(fast: bool) -> tuple[list, list]:
        if not fast:
            monkeypatch.setattr(ModelRunner, "_decode_in_graph", lambda self, plain, ahead_ids: None)
        llm = LLM(folder, dtype="fp32", async_scheduling=overlap)
        llm.engine.enable_graphs(emulate=True)
        llm.engine.overlap = overlap
        graphs, seen = llm.engine.runner.graphs, []
        real = graphs.replay

        def replay(key):
            n = key[0]
            seen.append([t.clone() for t in (graphs.input_ids[:n], graphs.positions[:n], graphs.slot_mapping[:n],
                                             graphs.seq_lens[:n], graphs.query_start_loc[:n + 1])]
                        + [graphs.block_tables[:n, :4].clone()])
            return real(key)

        monkeypatch.setattr(graphs, "replay", replay)
        out, modes = graph_modes(llm, ps)
        monkeypatch.undo()
        assert "replay: whole step" in modes
        return out, seen

    fast_out, fast = replayed_buffers(True)
    slow_out, slow = replayed_buffers(False)
    assert fast_out == slow_out and len(fast) == len(slow) > 10
    for a, b in zip(fast, slow):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_plain_decoding_graphs_follow_the_context_length(tiny_checkpoints, monkeypatch):
    """Plain-decoding graphs come in two context capacities: while the longest sequence fits SHORT_CONTEXT (+ the
    new token) a step replays the short-context graph, past it the full one; crossing the boundary in the middle
    of a generation changes nothing in the output."""
    from engine import cuda_graphs

    folder, _ = tiny_checkpoints("llama")
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 1000, (cuda_graphs.SHORT_CONTEXT - 5,), generator=g).tolist()]  # crosses it mid-way
    ref = greedy(LLM(folder, dtype="fp32", max_model_len=2048), ps)
    llm = LLM(folder, dtype="fp32", max_model_len=2048)
    llm.engine.enable_graphs(emulate=True)
    graphs, used = llm.engine.runner.graphs, []
    assert graphs.contexts == [cuda_graphs.SHORT_CONTEXT, 2048]
    real = graphs.bucket
    monkeypatch.setattr(graphs, "bucket", lambda *a: used.append(real(*a)) or used[-1])
    out, modes = graph_modes(llm, ps)
    assert out == ref and "replay: whole step" in modes
    contexts = [key[2] for key in used]
    assert contexts[0] == cuda_graphs.SHORT_CONTEXT and contexts[-1] == 2048, contexts
    assert contexts == sorted(contexts), contexts


@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("budget", [1, 3, 12, 16])  # widths 2, 4 (padded to 5), 13 (padded to 17: past a block) and 17
@pytest.mark.parametrize("logprobs", [None, 1])  # greedy tree steps run as whole rounds; with logprobs they do not
def test_emulated_graph_layout_equals_eager_for_ddtree(tiny_checkpoints, batch, budget, logprobs, monkeypatch):
    from engine.speculative import verify

    folder, _ = tiny_checkpoints("llama")
    ps = prompts(batch)
    ref = greedy(LLM(folder, dtype="fp32"), ps)
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(ps, ref)]), 1000, horizon=7,
                           noise=0.3, noise_rank=2, seed=1)
    # one request a step (max_num_seqs 1) has fewer padded requests than a tree has rows
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=budget, adaptive=False,
              max_num_seqs=1 if batch == 1 else 32)
    llm.engine.enable_graphs(emulate=True)
    walks = []
    accept = verify.accept

    def spy(tree, targets):
        result = accept(tree, targets)
        walks.append((tree.num_nodes.clone(), result.accepted_nodes.clone()))
        return result

    monkeypatch.setattr(verify, "accept", spy)
    out, modes = graph_modes(llm, ps, logprobs)
    assert out == ref
    tree_mode = "replay: whole round" if logprobs is None else "replay: forward only (requests ask for logprobs)"
    # the decode steps' own mode, and the prompts' steps (engine/admission.py)
    allowed = {tree_mode, "replay: whole step" if logprobs is None else tree_mode, "replay: admission"}
    assert tree_mode in modes and not any(m.startswith("replay") and m not in allowed for m in modes), modes
    for num_nodes, nodes in walks:
        assert bool((num_nodes <= budget + 1).all())  # a bucket's rows past the budget are padding, not nodes
        assert bool((nodes < num_nodes[:, None]).all())  # padding rows never accepted
    assert any(bool((nodes[:, 1:] > 0).any()) for _, nodes in walks)


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_padded_eager_steps_change_nothing(tiny_checkpoints, drafter, monkeypatch):
    """On CUDA an eager step's rows are rounded up to a multiple of 64 (one extra causal sequence after the verify
    rows, writing no KV, never sampled), so cuBLAS meets repeated row counts. Forced on the CPU with a multiple of
    8, over chunked prefills beside decodes and trees: greedy output equals the unpadded run's, and padded
    forwards did run (mixed steps and tree-only steps)."""
    import engine.inputs as inputs

    folder, _ = tiny_checkpoints("llama")
    ps = [p * 3 for p in prompts(5)]  # repeated text: the n-gram drafter proposes
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kwargs = dict(dtype="fp32", drafter=drafter, spec_budget=8, max_num_batched_tokens=37)
    ref = [o.token_ids for o in LLM(folder, **kwargs).generate(ps, sp)]
    padded, rounds = [], inputs.padding_rows

    def recording(num_rows: int, pad_to: int) -> int:
        pad = rounds(num_rows, pad_to)
        if pad:
            padded.append((num_rows, pad))
        return pad

    monkeypatch.setattr(inputs, "padding_rows", recording)
    llm = LLM(folder, **kwargs)
    llm.engine.runner.eager_pad_to = 8
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    assert padded and all((rows + pad) % 8 == 0 and 0 < pad < 8 for rows, pad in padded), padded


@pytest.mark.parametrize("batch", [1, 3])
def test_emulated_graphs_with_the_dflash_drafter_equal_eager(tiny_checkpoints, tmp_path, batch):
    """A DFlash drafter with the engine's graphs emulated (the target's verify layout and the drafter's block
    layout, padded to their buckets): greedy output equals plain decoding and every drafter call went through
    the drafter's static buffers."""
    import json
    import os

    from engine.speculative.dflash_files import save_random_dflash

    folder, _ = tiny_checkpoints("qwen3")
    with open(os.path.join(folder, "config.json")) as f:
        save_random_dflash(str(tmp_path), json.load(f), num_layers=1, block_size=8, target_layer_ids=[0, 1])
    ps = prompts(batch)
    ref = greedy(LLM(folder, dtype="fp32"), ps)
    llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=str(tmp_path), spec_budget=6, adaptive=False,
              max_num_seqs=8)
    llm.engine.enable_graphs(emulate=True)
    drafter = llm.engine.speculator.drafter
    assert drafter.graphs.batch_sizes == [1, 2, 3, 4, 6, 8]  # the tiny vocabulary's logits are far below the cap
    calls = []
    run = drafter.graphs.run
    drafter.graphs.run = lambda call, top_k: calls.append(call.bonus.shape[0]) or run(call, top_k)
    out, modes = graph_modes(llm, ps)
    assert out == ref and "replay: whole round" in modes and calls


def test_graph_capture_pauses_the_garbage_collector(monkeypatch):
    """Every graph capture runs with Python's garbage collector paused after one collection, and leaves it as it
    was, after an error too: on an H100 a collection mid-capture freed a previous engine's graphs and invalidated
    the capture (torch's capture no longer collects first), failing every GPU test after it."""
    import gc

    from engine.cuda_graphs import CudaGraphs, collector_paused
    from engine.plain_graphs import PlainGraphs
    from engine.round_graphs import RoundGraphs
    from engine.speculative.dflash_graphs import DraftGraphs

    seen = []

    @collector_paused()
    def capture(fail: bool):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("capture failed")

    assert gc.isenabled()
    capture(False)
    with pytest.raises(RuntimeError):
        capture(True)
    assert seen == [False, False] and gc.isenabled()
    paused = []
    monkeypatch.setattr(gc, "disable", lambda: paused.append(True))
    for method in (CudaGraphs.capture, PlainGraphs.capture, RoundGraphs.capture, DraftGraphs._capture):
        with pytest.raises(AttributeError):  # (no graphs object: the body fails at once)
            method(object())
    assert len(paused) == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_padding_rows_stay_padding_as_a_batch_shrinks_and_grows_in_its_bucket(tiny_checkpoints, monkeypatch, overlap):
    """A plain step in the bucket of the step before pads only the rows whose requests left (CudaGraphs.set_layout):
    at every replay the padding rows hold a padding request's inputs (token 0 at position 0 into the first scratch
    slot, length 1, the scratch blocks' table), and the output equals eager decoding, while requests finish one by
    one and others join mid-run."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(17)
    lengths = [6 + 2 * i for i in range(17)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    ref = [o.token_ids for o in LLM(folder, dtype="fp32").generate(ps, params)]
    llm = LLM(folder, dtype="fp32", async_scheduling=overlap, max_num_seqs=32)
    core = llm.engine
    core.enable_graphs(emulate=True)
    core.overlap = overlap
    graphs, checked, partial = core.runner.graphs, [0], []
    real_replay, real_fill = graphs.replay, graphs._fill_padding
    scratch = torch.tensor(graphs.scratch_blocks, dtype=torch.int32)

    def fill(first, n, w, width=None):
        partial.append(first > 0 and (first, n) != (graphs._layout or (0,))[:2])
        real_fill(first, n, w, width)

    def replay(key):
        num, n, w, _ = graphs._layout
        if w == 1:  # padding requests: token 0 at position 0 into the first scratch slot, over the scratch blocks
            assert graphs.query_start_loc[:n + 1].tolist() == list(range(n + 1))
            pad = slice(num, n)
            assert not graphs.input_ids[pad].any() and not graphs.positions[pad].any()
            assert graphs.slot_mapping[pad].tolist() == [graphs.scratch_blocks[0] * graphs.block_size] * (n - num)
            assert graphs.seq_lens[pad].tolist() == [1] * (n - num)
            tables = graphs.block_tables[pad]
            assert torch.equal(tables[:, :len(scratch)], scratch.expand(n - num, -1))
            assert not tables[:, len(scratch):].any()
            checked[0] += num < n
        return real_replay(key)

    monkeypatch.setattr(graphs, "replay", replay)
    monkeypatch.setattr(graphs, "_fill_padding", fill)
    ids, out = [core.add_request(p, q) for p, q in zip(ps[:13], params[:13])], {}
    steps = 0
    while core.has_unfinished():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        steps += 1
        if steps == 8:  # four more join a running batch
            ids += [core.add_request(p, q) for p, q in zip(ps[13:], params[13:])]
    assert [out[rid] for rid in ids] == ref
    assert checked[0] > 10 and any(partial)  # the layout changed in its bucket, and only the rows that left
