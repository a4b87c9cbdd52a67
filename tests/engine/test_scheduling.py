"""Scheduler and block manager: chunked prefill under a small token budget, recompute preemption when KV runs
out, and prefix caching all leave greedy output unchanged; blocks are never leaked."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.request import Request


def prompts(n=6, vocab=1000):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32", enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return folder, [o.token_ids for o in llm.generate(prompts(), sp)]


def greedy(llm, ps):
    return [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]


def test_chunked_prefill_under_small_token_budget(reference):
    folder, ref = reference
    llm = LLM(folder, dtype="fp32", max_num_batched_tokens=7)
    assert greedy(llm, prompts()) == ref


def test_recompute_preemption_keeps_outputs(reference):
    folder, ref = reference
    llm = LLM(folder, dtype="fp32", num_kv_blocks=12, block_size=8, max_model_len=96, enable_prefix_caching=False)
    assert greedy(llm, prompts()) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == 12


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_prefix_cache_hits_and_keeps_outputs(reference, drafter):
    folder, ref = reference
    ps = prompts()
    shared = ps[0] * 3  # a long shared prefix
    llm = LLM(folder, dtype="fp32", block_size=4, drafter=drafter)
    first = greedy(llm, [shared + [5, 6]])
    core = llm.engine
    rid = core.add_request(shared + [5, 6], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    req = core.requests[rid]
    out = []
    while core.has_unfinished():
        for d in core.step():
            out.extend(d.new_token_ids)
    assert req.num_cached_tokens >= len(shared) - 4
    assert out == first[0]
    assert greedy(llm, ps) == ref
    assert core.blocks.usage == 0.0


def test_block_manager_refcounts_and_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Request([1, 2, 3, 4, 5], SamplingParams())
    assert bm.allocate(a, 5) and len(a.block_ids) == 3
    a.num_computed_tokens = 5
    bm.commit(a)  # blocks [1,2] and [3,4] are full
    assert len(a.block_digests) == 2
    b = Request([1, 2, 3, 4, 9, 9], SamplingParams())
    assert bm.match_prefix(b) == 4 and b.block_ids == a.block_ids[:2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    bm.free(a)
    assert bm.num_free_blocks == 2  # b still holds the two shared blocks
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    c = Request([1, 2, 3, 4, 7], SamplingParams())
    assert bm.match_prefix(c) == 4  # freed blocks stay reusable
    bm.free(c)
    d = Request(list(range(100, 108)), SamplingParams())
    assert bm.allocate(d, 8)  # takes every block, evicting the cached ones
    assert bm.digest_to_block == {} and bm.num_free_blocks == 0
    e = Request([1, 2, 3, 4, 7], SamplingParams())
    assert bm.match_prefix(e) == 0 and not bm.allocate(e, 5)


def test_prompt_fully_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Request([1, 2, 3, 4], SamplingParams())
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.commit(a)
    b = Request([1, 2, 3, 4], SamplingParams())
    assert bm.match_prefix(b) == 2  # the last block is recomputed: its last token's logits are needed


def test_prefix_cache_after_speculative_request_hits_generated_blocks(reference):
    """A verify step commits several tokens at once; the blocks they fill must be registered with their real
    contents. A follow-up turn whose prompt is the first request's prompt + output hits every full block
    (generated ones included), and its output equals a cold run's token for token."""
    from engine.speculative.oracle import OracleDrafter

    folder, ref = reference
    prompt, golden_out = prompts()[1], ref[1]
    golden = prompt + golden_out
    oracle = OracleDrafter(lambda r: golden if r.token_ids[:len(prompt)] == prompt else None, 1000, horizon=7)
    llm = LLM(folder, dtype="fp32", block_size=4, drafter=oracle, spec_budget=8)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], sp)[0]
    assert first.token_ids == golden_out and max(first.stats["spec"]["accepted_per_depth"]) > 0
    follow_up = prompt + first.token_ids[:20] + [7, 8, 9]
    core = llm.engine
    rid = core.add_request(follow_up, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    req, out, hits = core.requests[rid], [], 0
    while core.has_unfinished():
        for d in core.step():
            out.extend(d.new_token_ids)
        hits += core.last_stats.prefix_cache_hits if core.last_stats else 0
    assert req.num_cached_tokens == hits == 4 * ((len(follow_up) - 1) // 4)  # every full block, generated too
    cold = LLM(folder, dtype="fp32", enable_prefix_caching=False).generate(
        [follow_up], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out == cold.token_ids


def test_generate_takes_one_sampling_params_per_prompt(reference):
    folder, ref = reference
    llm = LLM(folder, dtype="fp32")
    ps = prompts()[:2]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=lp) for n, lp in ((3, None), (5, 1))]
    first, second = llm.generate(ps, params)
    assert first.token_ids == ref[0][:3] and second.token_ids == ref[1][:5]
    assert first.logprobs is None and len(second.logprobs) == 5
    with pytest.raises(ValueError, match="2 sampling parameters for 3 prompts"):
        llm.generate(prompts()[:3], params)


def test_request_token_slices_equal_all_token_ids():
    req = Request([5, 6, 7], SamplingParams())
    req.output_token_ids = [8, 9]
    whole = req.all_token_ids
    assert all(req.token_ids(a, b) == whole[a:b] for a in range(6) for b in range(a, 7))
    assert req.last_token_id == 9 and Request([4], SamplingParams()).last_token_id == 4
    view = req.committed  # what drafters read: the same sequence, without the copy
    assert len(view) == 5 and list(view) == whole and tuple(view[:2]) == (5, 6)
    assert [view[i] for i in range(-5, 5)] == whole + whole
    assert all(view[a:b] == whole[a:b] for a in range(-6, 7) for b in range(-6, 8))
    assert view[::2] == whole[::2] and view[4:1:-1] == whole[4:1:-1]
    with pytest.raises(IndexError):
        view[5]
    req.output_token_ids.append(10)  # live: a token committed later is seen
    assert len(view) == 6 and view[-1] == 10 and view[3:] == [8, 9, 10]


def test_slot_range_equals_slots_token_by_token():
    """The step's slots for a run of positions, built one block at a time, are the per-token slots."""
    import random

    from engine.inputs import slot_of, slot_range

    r = random.Random(0)
    for _ in range(500):
        block_size, num_blocks = r.choice([1, 2, 3, 16, 64]), 20
        blocks = r.sample(range(1000), num_blocks)
        start = r.randrange(0, block_size * num_blocks)
        count = r.randrange(0, block_size * num_blocks - start + 1)
        assert slot_range(blocks, block_size, start, count) == \
            [slot_of(blocks, block_size, i) for i in range(start, start + count)]


def test_allocator_retries_are_counted_and_warned_once(monkeypatch, caplog):
    """The CUDA allocator's retry counter, read every ALLOC_CHECK_EVERY steps: each read reports the retries since
    the last one (0 between reads), and the first retry logs one warning naming the flag to change."""
    import logging

    from engine import memory

    totals = iter([7, 7, 10, 10, 12])  # 7 at startup (warm-up, capture): not serving's
    monkeypatch.setattr(memory.torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": next(totals)})
    watch = memory.AllocatorWatch(torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="ddtree.engine"):
        reported = [watch.new_retries() for _ in range(4 * memory.ALLOC_CHECK_EVERY)]
    reads = reported[memory.ALLOC_CHECK_EVERY - 1::memory.ALLOC_CHECK_EVERY]
    assert reads == [0, 3, 0, 2] and sum(reported) == 5
    warnings = [r for r in caplog.records if "gpu-memory-utilization" in r.getMessage()]
    assert len(warnings) == 1 and "3 times" in warnings[0].getMessage()


def test_multi_token_step_stops_where_token_by_token_would(tmp_path):
    """A tree step's tokens are scanned and detokenized at once (no stop strings, no grammar): the kept tokens,
    the finish reason, the stop token and the final text equal committing them one at a time."""
    from engine.config import EngineConfig
    from engine.detokenizer import OutputText
    from engine.request import SamplingParams as Params
    from engine.scheduler import Scheduler
    from tests.server.conftest import build_byte_level_tokenizer

    tok = build_byte_level_tokenizer(str(tmp_path))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    body = tok.encode("Hi 🎉 wörld, done", add_special_tokens=False)
    cases = [  # (sampling, step tokens)
        (dict(max_tokens=50), body[:3] + [eos] + body[3:]),  # EOS inside the step
        (dict(max_tokens=50, ignore_eos=True), body[:3] + [eos] + body[3:]),
        (dict(max_tokens=5), body),  # the length limit inside the step
        (dict(max_tokens=50, stop_token_ids=[body[4]]), body),
        (dict(max_tokens=50, stop_token_ids=[body[1]], min_tokens=3), body[:2] + body),  # min_tokens hides the 1st
        (dict(max_tokens=50), body),  # nothing stops
        (dict(max_tokens=5, stop_token_ids=[body[4]]), body),  # a stop token at the length limit: "stop"
        (dict(max_tokens=5, stop_token_ids=[body[6]]), body),  # ... past it: "length"
        (dict(max_tokens=50, min_tokens=2, prompt=36), [eos] + body),  # the context (40) inside the step
    ]
    sched = Scheduler(EngineConfig(), BlockManager(8, 4), max_model_len=40)
    for kwargs, step in cases:
        prompt = list(range(1, 1 + kwargs.pop("prompt", 2)))
        fast, slow = (Request(prompt, Params(**kwargs), eos_token_ids=(eos,)) for _ in range(2))
        for r in (fast, slow):
            r.text = OutputText(tok)
        reason = sched._append(fast, list(step), None)
        slow_reason = None
        for token in step:
            slow.output_token_ids.append(token)
            slow_reason = sched.stop_reason(slow, token)
            if slow_reason:
                break
        assert (fast.output_token_ids, reason, fast.stop_reason) == \
            (slow.output_token_ids, slow_reason, slow.stop_reason), kwargs
        # one call may hold back text before an incomplete character that token by token came out a step
        # earlier; by the end the texts agree
        for r in (fast, slow):
            r.text.finish()
        assert fast.text.take() == slow.text.take() == tok.decode(fast.output_token_ids, skip_special_tokens=True)


def test_harmonized_trees_fill_the_width_within_each_requests_caps():
    """Every tree of a step is laid out at the widest one's rows, so the harmonized trees verify as many nodes as
    the width holds (the adaptive budget still learns from the ones it chose), but never past a request's
    remaining tokens or the context: in a step planned as usual and in one planned ahead of its predecessor's
    results (each request then up to that step's tokens further on)."""
    from engine.config import EngineConfig
    from engine.request import SamplingParams as Params
    from engine.scheduler import Scheduler

    own = {}  # request -> the budget it wants
    sched = Scheduler(EngineConfig(), BlockManager(64, 4), max_model_len=64, max_budget=16,
                      budget_of=lambda r: own[r.request_id],
                      width_of=lambda requests, budgets: budgets)  # as harmonized: every tree pays the width
    for rid, wanted, max_tokens in (("a", 2, 100), ("b", 6, 100), ("c", 3, 5), ("d", 4, 12)):
        req = Request([1, 2, 3, 4], Params(max_tokens=max_tokens), request_id=rid)
        req.output_token_ids = [5]
        req.num_computed_tokens = 4  # decoding: only the last output token lacks KV
        assert sched.blocks.allocate(req, 5)
        sched.running.append(req)
        own[rid] = wanted
    plan = sched.schedule()
    assert plan.spec_budgets == [6, 6, 3, 6]  # c: 4 tokens left, so at most 3 drafts
    assert [s.chosen_budget for s in plan.seqs] == [2, 6, 3, 4]  # what the adaptive budget learns from
    ahead = sched.schedule_ahead_trees(plan, lambda r: own[r.request_id])
    # each request up to its budget + 1 tokens further on: c may have reached max_tokens (it rides at budget 0:
    # a root-only tree), d has 4 tokens left at most
    assert [s.request.request_id for s in ahead.seqs] == ["a", "b", "c", "d"] and ahead.spec_budgets == [6, 6, 0, 3]
    assert [s.chosen_budget for s in ahead.seqs] == [2, 6, 0, 3]
