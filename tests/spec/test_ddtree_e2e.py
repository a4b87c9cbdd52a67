"""End to end: greedy DDTree output equals plain greedy output token for token (fp32) for every family, drafter,
budget and page size, batched or alone; at T > 0 the per-position token distribution equals plain sampling."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec.oracle import OracleDrafter

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


def run(folder, drafter, budget, block_size, max_tokens, batch=True):
    llm = LLM(folder, dtype="fp32", drafter=drafter, spec_budget=budget, block_size=block_size)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if batch:
        return llm.generate(prompts(), sp)
    return [llm.generate([p], sp)[0] for p in prompts()]


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_oracle_ddtree_equals_plain(tiny_checkpoints, plain_outputs, family, block_size, budget):
    folder, _ = tiny_checkpoints(family)
    expected = float(min(budget, HORIZON) + 1)  # golden path at rank 0: the whole chain the budget allows
    max_tokens = 1 + int(expected) * 4  # the prefill token, then whole steps
    ref = plain_outputs(family, max_tokens)
    seqs = [(p + r, len(p)) for p, r in zip(prompts(), ref)]
    oracle = OracleDrafter(golden_lookup(seqs), 1000, horizon=HORIZON)
    outs = run(folder, oracle, budget, block_size, max_tokens)
    assert [o.token_ids for o in outs] == ref
    taus = [o.stats["spec"]["mean_accept_length"] for o in outs]
    # a budget of at least the horizon accepts the whole block: 8 tokens per verify step, as the seed engine
    assert taus == [expected] * len(outs)


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_oracle_with_demoted_golden_tokens_accepts_siblings(tiny_checkpoints, plain_outputs, family, block_size,
                                                            monkeypatch):
    """Golden tokens demoted below distractors: the accepted path leaves the spine, so compaction moves KV."""
    from engine.spec import speculator

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


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_ngram_ddtree_equals_plain(tiny_checkpoints, plain_outputs, family, budget):
    folder, _ = tiny_checkpoints(family)
    ref = plain_outputs(family, 40)
    for block_size in (1, 16):
        outs = run(folder, "ngram", budget, block_size, 40)
        assert [o.token_ids for o in outs] == ref


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
