"""End to end: greedy DDTree output equals plain greedy output token for token (fp32) for every family, drafter,
budget and page size, batched or alone; at T > 0 the per-position token distribution equals plain sampling."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.oracle import OracleDrafter

HORIZON = 7  # oracle horizon = a DFlash block of 8
PROMPT_LENS = (5, 17, 30, 9)


def prompts(vocab_size: int = 1000) -> list[list[int]]:
    return [torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in PROMPT_LENS]


def golden_lookup(sequences: list[list[int]]):
    """Oracle golden: the reference sequence whose prompt starts the request's tokens."""
    def find(req):
        for seq, n in sequences:
            if req.token_ids[:n] == seq[:n]:
                return seq
        return None
    return find


@pytest.fixture(scope="module")
def plain_outputs(tiny_checkpoints):
    cache = {}

    def get(family: str, max_tokens: int):
        if (family, max_tokens) not in cache:
            folder, _ = tiny_checkpoints(family)
            llm = LLM(folder, dtype="fp32")
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            cache[family, max_tokens] = [o.token_ids for o in llm.generate(prompts(), sp)]
        return cache[family, max_tokens]

    return get


def run(folder, drafter, budget, block_size, max_tokens, batch=True, adaptive=True):
    llm = LLM(folder, dtype="fp32", drafter=drafter, spec_budget=budget, block_size=block_size, adaptive=adaptive)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if batch:
        return llm.generate(prompts(), sp)
    return [llm.generate([p], sp)[0] for p in prompts()]


FAMILIES = ["llama", "qwen3", "deepseek_v3"]
# every budget and every page size at least once per family and drafter, without the full product's run time
BUDGET_PAGE = [(1, 16), (4, 1), (16, 16), (64, 1)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget,block_size", BUDGET_PAGE)
def test_oracle_ddtree_equals_plain(tiny_checkpoints, plain_outputs, family, block_size, budget):
    folder, _ = tiny_checkpoints(family)
    expected = float(min(budget, HORIZON) + 1)  # golden path at rank 0: the whole chain the budget allows
    max_tokens = 1 + int(expected) * 4  # the prefill token, then whole steps
    ref = plain_outputs(family, max_tokens)
    seqs = [(p + r, len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(seqs), 1000, horizon=HORIZON)
    outs = run(folder, oracle, budget, block_size, max_tokens, adaptive=False)
    assert [o.token_ids for o in outs] == ref
    taus = [o.stats["spec"]["mean_accept_length"] for o in outs]
    # a fixed budget of at least the horizon accepts the whole block: 8 tokens per verify step, as the seed engine
    assert taus == [expected] * len(outs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_oracle_with_demoted_golden_tokens_accepts_siblings(tiny_checkpoints, plain_outputs, family, block_size,
                                                            monkeypatch):
    """Golden tokens demoted below distractors: the accepted path leaves the spine, so compaction moves KV."""
    from engine.speculative import speculator

    moved = []
    original = speculator.Speculator.compact

    def spy(slot_views, row_slots, accepted):
        moved.extend(acc for acc in accepted if acc != list(range(len(acc))))
        return original(slot_views, row_slots, accepted)

    monkeypatch.setattr(speculator.Speculator, "compact", staticmethod(spy))
    folder, _ = tiny_checkpoints(family)
    ref = plain_outputs(family, 40)
    seqs = [(p + r, len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(seqs), 1000, horizon=HORIZON, noise=0.4, noise_rank=2, seed=3)
    outs = run(folder, oracle, 16, block_size, 40)
    assert [o.token_ids for o in outs] == ref
    assert moved, "no step accepted a non-spine path"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget,block_size", BUDGET_PAGE)
def test_ngram_ddtree_equals_plain(tiny_checkpoints, plain_outputs, family, budget, block_size):
    folder, _ = tiny_checkpoints(family)
    ref = plain_outputs(family, 40)
    outs = run(folder, "ngram", budget, block_size, 40)
    assert [o.token_ids for o in outs] == ref


@pytest.fixture(scope="module")
def random_dflash(tiny_checkpoints, tmp_path_factory):
    """family -> folder of a randomly initialised DFlash drafter (block size 8) for that tiny target."""
    import json

    from engine.speculative.dflash_files import save_random_dflash

    cache = {}

    def get(family):
        if family not in cache:
            target, _ = tiny_checkpoints(family)
            with open(f"{target}/config.json") as f:
                cfg = json.load(f)
            folder = str(tmp_path_factory.mktemp(f"dflash-{family}"))
            save_random_dflash(folder, cfg, num_layers=1, block_size=8, seed=1)
            cache[family] = folder
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget,block_size", BUDGET_PAGE)
def test_random_dflash_ddtree_equals_plain(tiny_checkpoints, plain_outputs, random_dflash, family, budget,
                                           block_size):
    """A random drafter rarely guesses right (low tau), yet the output stays exact. (A fixed budget: the adaptive
    one would rightly stop verifying such a drafter's trees.)"""
    folder, _ = tiny_checkpoints(family)
    ref = plain_outputs(family, 40)
    llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=random_dflash(family), spec_budget=budget,
              block_size=block_size, adaptive=False)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert all(o.stats["spec"]["steps"] > 0 for o in outs)


def test_dflash_chain_mode_equals_plain(tiny_checkpoints, plain_outputs, random_dflash):
    """Chain mode: top-1 per depth and B = horizon (block_size - 1), the plain DFlash recipe."""
    folder, _ = tiny_checkpoints("qwen3")
    llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=random_dflash("qwen3"), chain=True)
    assert llm.engine.speculator.max_budget == 7
    outs = llm.generate(prompts(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs("qwen3", 40)


@pytest.mark.slow
@pytest.mark.extended  # the live-server tests compare n-gram DDTree with plain on this model; the GPU tests too
def test_smollm2_ddtree_equals_plain():
    """The real embedded model: oracle and n-gram DDTree give plain greedy's tokens on chat prompts."""
    llm = LLM(None, dtype="fp32")
    chats = ["What is the capital of France?", "Repeat exactly: the quick brown fox jumps over the lazy dog.",
             "Write a Python function that adds two numbers.", "List three colors."]
    token_lists = [llm.encode(c, chat=True) for c in chats]
    sp = SamplingParams(max_tokens=32, temperature=0)
    ref = [o.token_ids for o in llm.generate(token_lists, sp)]
    seqs = [(p + r, len(p)) for p, r in zip(token_lists, ref)]
    for drafter in (OracleDrafter(golden_lookup(seqs), llm.engine.vocab_size, horizon=HORIZON), "ngram"):
        spec = LLM(None, dtype="fp32", drafter=drafter, spec_budget=16)
        outs = spec.generate(token_lists, sp)
        assert [o.token_ids for o in outs] == ref
        if drafter != "ngram":
            assert all(o.stats["spec"]["mean_accept_length"] > 4 for o in outs)


def test_batch_equals_alone(tiny_checkpoints, plain_outputs):
    folder, _ = tiny_checkpoints("llama")
    ref = plain_outputs("llama", 40)
    seqs = [(p + r, len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(seqs), 1000, horizon=HORIZON, noise=0.3, noise_rank=2)
    batched = run(folder, oracle, 16, 16, 40, batch=True)
    alone = run(folder, oracle, 16, 16, 40, batch=False)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone] == ref


def test_budget_zero_and_no_drafter_are_plain(tiny_checkpoints, plain_outputs):
    folder, _ = tiny_checkpoints("llama")
    ref = plain_outputs("llama", 40)
    assert [o.token_ids for o in run(folder, "ngram", 0, 16, 40)] == ref
    assert [o.token_ids for o in run(folder, "none", 16, 16, 40)] == ref


@pytest.mark.parametrize("kwargs,match", [
    (dict(drafter="medusa"), "unknown drafter"),
    (dict(drafter="ngram", spec_budget=-1), "budget"),
    (dict(drafter="dflash"), "draft-model"),
])
def test_bad_spec_configuration_is_one_line(tiny_checkpoints, kwargs, match):
    folder, _ = tiny_checkpoints("llama")
    with pytest.raises(ValueError, match=match) as e:
        LLM(folder, dtype="fp32", **kwargs)
    assert "\n" not in str(e.value)


def test_speculative_steps_time_every_phase(tiny_checkpoints):
    """Tree steps report draft, tree_build, verify and accept times (the step-phase histogram's labels)."""
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32", drafter="ngram", spec_budget=8, adaptive=False)  # every step a tree
    core = llm.engine
    core.add_request(prompts()[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    phases = set()
    while core.has_unfinished():
        core.step()
        if core.last_stats is not None and core.last_stats.tree_nodes:
            phases |= set(core.last_stats.timings)
    assert {"schedule", "draft", "tree_build", "verify", "accept"} <= phases
