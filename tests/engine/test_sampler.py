"""engine/sampler.py: the batched sampler against ground truth nobody here wrote: transformers' logits
processors (temperature, top-k, top-p, min-p, repetition penalty), OpenAI's documented presence/frequency
formula, and torch's log_softmax; chi-square tests of the draws (20,000 rows in one call); seeds that give the
same token whatever the batch; min_tokens and logit_bias; penalties over a tree row's path."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from engine.request import Request, SamplingParams
from engine.sampler import Sampler, SamplingBatch
from engine.top_k_top_p import apply_top_k_top_p, sort_top_k_top_p
from ext import ops
from tests.engine.test_top_k_top_p import transformers_kept

VOCAB = 12


def request(i=0, prompt=(1, 2), output=(), eos=(), **params) -> Request:
    req = Request(list(prompt), SamplingParams(**params), tuple(eos), request_id=f"r{i}", seed=1000 + i)
    req.output_token_ids = list(output)
    return req


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities (categories with expected < 5 pooled)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = int(keep.sum().item()) - 1
    return float(chi2.sf(stat, df))


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None, MinPLogitsWarper(min_p) if min_p else None):
        if warper is not None:
            scores = warper(ids, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0),
                                                              (1.3, 0, 0.8, 0.0), (1.0, 6, 0.9, 0.05)])
def test_draws_follow_the_transformers_processed_distribution(temperature, top_k, top_p, min_p):
    """20,000 rows of the same logits, one sampler call, each row its own seed: the token histogram passes a
    chi-square test against transformers' warpers at p = 0.001 (a false alarm in 1 of 1000 seed choices; the
    seeds are fixed, so the outcome is deterministic)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    reqs = [request(i, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p) for i in range(20000)]
    out = Sampler(VOCAB, "cpu")(logits.expand(len(reqs), VOCAB).clone(), SamplingBatch(reqs, [1] * len(reqs)))
    counts = torch.bincount(out.tokens, minlength=VOCAB)
    expected = hf_probs(logits, temperature, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0, "a token the warpers remove was drawn"
    assert chi_square_p(counts, expected) > 1e-3
    colder = hf_probs(logits, temperature * 0.7, top_k, top_p, min_p)  # power: a wrong temperature is caught
    assert chi_square_p(counts, colder) < 1e-3


def test_top_k_top_p_masks_match_transformers():
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    top_k = torch.randint(0, 20, (64,), generator=torch.Generator().manual_seed(2))
    top_p = torch.rand(64, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.1
    ours = apply_top_k_top_p(x, top_k, top_p)
    assert torch.equal(~torch.isinf(ours), transformers_kept(x, top_k, top_p))


def test_top_k_top_p_from_candidates_match_transformers_and_the_sort():
    """The CPU's candidate path (the m largest logits decide a row when the filters close within them) keeps the
    same tokens as transformers' warpers and the same values as sorting the whole row; a batch it cannot decide
    (a flat row whose nucleus runs past the candidates, top-k above m) goes to the histogram, with the same
    values too."""
    from engine.top_k_top_p import _candidates

    vocab, m = 4096, 64
    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(8, vocab, generator=gen) * 6  # top_p 0.9 closes within the 64 largest
    peaked[5, :] = peaked[5, 0]  # one constant row: top-k's boundary ties spill past the candidates
    top_k = torch.tensor([0, 5, 0, 63, 20, 3, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.7, 1.0, 1.0, 0.99])
    flat = torch.randn(2, vocab, generator=gen) * 0.1
    vocab_k = torch.where(top_k > 0, top_k, vocab)
    assert _candidates(peaked[:5], vocab_k[:5], top_p[:5], m) is not None  # the path is taken
    assert _candidates(peaked, vocab_k, top_p, m) is None  # the tied row sends the batch to the histogram
    assert _candidates(flat, torch.tensor([vocab, vocab]), torch.tensor([0.9, 0.9]), m) is None
    assert _candidates(flat, torch.tensor([100, vocab]), torch.tensor([1.0, 1.0]), m) is None  # k > m
    for x, k, p in ((peaked[:5], top_k[:5], top_p[:5]), (peaked[6:], top_k[6:], top_p[6:]), (peaked, top_k, top_p),
                    (flat, torch.tensor([0, 7]), torch.tensor([0.9, 0.8]))):
        ours = apply_top_k_top_p(x, k, p, num_candidates=m)
        sorted_ = sort_top_k_top_p(x, torch.where(k > 0, k, vocab), p)
        assert torch.equal(ours, sorted_)
        assert torch.equal(~torch.isinf(ours), transformers_kept(x, k, p))


def test_greedy_with_penalties_matches_transformers_and_openai_formula():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    prompt, output = [1, 2, 3], [3, 3, 7, 1]
    rep = request(0, prompt, output, temperature=0, repetition_penalty=1.7)
    presence = request(1, prompt, output, temperature=0, presence_penalty=0.8, frequency_penalty=0.6)
    plain = request(2, prompt, output, temperature=0)
    bias = request(3, prompt, output, temperature=0, logit_bias={5: 100.0})
    out = Sampler(VOCAB, "cpu")(logits.clone(), SamplingBatch([rep, presence, plain, bias], [1] * 4))
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[0:1].clone())[0]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    openai = logits[1] - counts * 0.6 - (counts > 0).float() * 0.8  # OpenAI's documented penalty formula
    assert out.tokens.tolist() == [int(hf.argmax()), int(openai.argmax()), int(logits[2].argmax()), 5]


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB)
    reqs = [request(i, temperature=1.0, top_p=0.9) for i in range(6)]
    together = Sampler(VOCAB, "cpu")(logits.clone(), SamplingBatch(reqs, [1] * 6)).tokens
    alone = [Sampler(VOCAB, "cpu")(logits[i:i + 1].clone(), SamplingBatch([reqs[i]], [1])).tokens.item()
             for i in reversed(range(6))][::-1]
    assert together.tolist() == alone
    same_logits = logits[:1].expand(200, VOCAB).clone()
    redrawn = Sampler(VOCAB, "cpu")(same_logits, SamplingBatch([request(i, temperature=1.0) for i in range(200)],
                                                               [1] * 200)).tokens
    assert len(set(redrawn.tolist())) > 3  # different seeds do differ


def test_uniforms_are_a_pure_function_of_seed_and_index():
    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63)])
    idx = torch.tensor([0, 0, 7, 3, 1])
    u = ops.seeded_uniforms(seeds, idx)
    assert torch.equal(u, ops.seeded_uniforms(seeds.clone(), idx.clone()))
    assert bool(((u >= 0) & (u < 1)).all()) and len(set(u.tolist())) == 5
    many = ops.seeded_uniforms(torch.zeros(100000, dtype=torch.int64), torch.arange(100000))
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002


def test_uniforms_follow_published_splitmix64():
    """The hash is splitmix64 as published (Vigna; its generator from state 0 first returns 0xE220A8397B1DCDAF,
    then 0x6E789E6AA1B965F4): seed 0 and index 0 give the first output hashed again, each bit kept."""
    first, second = 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4
    golden = 0x9E3779B97F4A7C15
    # splitmix64(splitmix64(0) + index) with index = second state step: the published second output
    index = (golden - first) % (1 << 64)
    index = index - (1 << 64) if index >= 1 << 63 else index
    u = ops.seeded_uniforms(torch.tensor([0]), torch.tensor([index]))
    assert u.item() == (second >> 11) * 2.0 ** -53


def test_min_tokens_masks_eos_and_stop_ids_by_depth():
    logits = torch.zeros(4, VOCAB)
    logits[:, 9] = 50.0  # eos would win
    logits[:, 4] = 40.0  # stop token id next
    req = request(0, output=[1], eos=(9,), temperature=0, min_tokens=3, stop_token_ids=[4])
    depths = torch.tensor([0, 1, 2, 3])  # output index 1, 2, 3, 4: masked while below min_tokens = 3
    out = Sampler(VOCAB, "cpu")(logits, SamplingBatch([req], [4], depths=depths))
    second = logits[0].clone()
    second[[9, 4]] = float("-inf")
    assert out.tokens.tolist() == [int(second.argmax()), int(second.argmax()), 9, 9]


def test_penalties_on_a_tree_row_count_the_drafted_path():
    """A tree row is penalized exactly like a plain row whose output already holds the path to it."""
    torch.manual_seed(2)
    width = 3
    logits = torch.randn(width, VOCAB)
    tree_tokens = torch.tensor([[6, 8, 8]])  # root 6 (already in the output), row 1 token 8, row 2 token 8
    vis = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)  # a chain root -> 1 -> 2
    params = dict(temperature=0, frequency_penalty=2.0, repetition_penalty=1.3)
    tree_req = request(0, output=[5, 6], **params)
    out = Sampler(VOCAB, "cpu")(logits.clone(), SamplingBatch([tree_req], [width], torch.tensor([0, 1, 2]),
                                                             tree_tokens, vis))
    for row, path in enumerate([[], [8], [8, 8]]):
        plain = request(1, output=[5, 6] + path, **params)
        ref = Sampler(VOCAB, "cpu")(logits[row:row + 1].clone(), SamplingBatch([plain], [1]))
        assert out.tokens[row].item() == ref.tokens.item(), row


def test_logprobs_are_the_raw_model_distribution():
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    reqs = [request(0, temperature=0.5, logprobs=3), request(1, temperature=0), request(2, logprobs=0)]
    out = Sampler(VOCAB, "cpu")(logits.clone(), SamplingBatch(reqs, [1, 1, 1]))
    logp = torch.log_softmax(logits.double(), -1)
    assert out.logprob_rows == [0, 2]
    for k, row in enumerate(out.logprob_rows):
        assert math.isclose(out.chosen_logprobs[k].item(), logp[row, out.tokens[row]].item(), abs_tol=1e-5)
    assert out.top_ids[0].tolist() == logp[0].topk(3).indices.tolist()


def test_cpu_draws_from_the_candidates_equal_draws_from_the_whole_rows(monkeypatch):
    """When top-k / top-p close within the candidates, the CPU draws a sampled row from the candidates alone
    (sample_candidates): the same token as filtering the whole row and drawing from it (sample_tokens), for
    random uniforms and for uniforms on the edges of the tokens' intervals. Through the Sampler too: the path is
    taken, and its tokens equal the whole rows'."""
    from engine.top_k_top_p import NUM_CANDIDATES, _filter_top_k_top_p, _within_candidates, sample_candidates
    from ext.reference.sampling import kept_weights, sample_tokens

    vocab, rows = 4096, 6
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, vocab, generator=gen) * 4
    top_k = torch.tensor([0, 50, 0, 7, 0, 1])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.8, 0.99, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0])
    _, decided = _filter_top_k_top_p(x, top_k, top_p, NUM_CANDIDATES)
    assert decided is not None and _within_candidates(decided)
    whole = sort_top_k_top_p(x, torch.where(top_k > 0, top_k, vocab), top_p)  # the whole rows, sorted
    ones = torch.ones(rows)
    cum = kept_weights(whole, ones, min_p).double().cumsum(-1)
    edges = (cum / cum[:, -1:]).clamp(max=1 - 2.0 ** -53)  # each token's upper edge, per row
    columns = [torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(200)]
    columns += [edges[:, j] for j in torch.randint(0, vocab, (100,), generator=gen).tolist()]
    columns += [torch.zeros(rows, dtype=torch.float64), torch.full((rows,), 1 - 2.0 ** -53, dtype=torch.float64)]
    for u in columns:
        assert torch.equal(sample_candidates(decided[0], decided[1], min_p, u), sample_tokens(whole, ones, min_p, u))

    reqs = [request(i, temperature=0.8, top_k=[0, 40][i % 2], top_p=[0.9, 1.0][i % 2]) for i in range(16)]
    logits = torch.randn(16, vocab, generator=gen) * 4
    taken = []
    monkeypatch.setattr("engine.sampler.sample_candidates",
                        lambda *a: taken.append(1) or sample_candidates(*a))
    fast = Sampler(vocab, "cpu")(logits.clone(), SamplingBatch(reqs, [1] * 16)).tokens
    assert taken
    monkeypatch.setattr("engine.sampler.NUM_CANDIDATES", vocab)  # too many to decide from: the whole rows
    slow = Sampler(vocab, "cpu")(logits.clone(), SamplingBatch(reqs, [1] * 16)).tokens
    assert torch.equal(fast, slow)


def test_cpu_rows_are_decided_from_64_candidates_first_then_512():
    """A peaked row's nucleus closes within the 64 largest logits: decided from 64. A flatter one needs more: from
    512. Both keep exactly what sorting the whole row keeps."""
    from engine.top_k_top_p import FIRST_CANDIDATES, NUM_CANDIDATES, _filter_top_k_top_p

    gen = torch.Generator().manual_seed(9)
    vocab = 4096
    peaked = torch.randn(4, vocab, generator=gen)
    peaked[:, :5] += 12
    wider = torch.randn(4, vocab, generator=gen) * 0.5
    wider[:, :200] += 6  # ~200 near-equal tokens hold the nucleus
    k, p = torch.full((4,), vocab), torch.full((4,), 0.9)
    for x, size in ((peaked, FIRST_CANDIDATES), (wider, NUM_CANDIDATES)):
        filtered, decided = _filter_top_k_top_p(x, k, p, NUM_CANDIDATES)
        assert filtered is None and decided[0].shape[1] == size
        assert torch.equal(apply_top_k_top_p(x, k, p), sort_top_k_top_p(x, k, p))
