"""engine.sampler, the one implementation of next-token choice (plain decoding and every tree row use it):
greedy, temperature, top-k, top-p, min-p, penalties, logit bias, per-request seeded generators."""
from __future__ import annotations

import pytest
import torch

from engine import sampler
from engine.request import Request, SamplingParams


def request(**kw) -> Request:
    sp = SamplingParams(**kw)
    return Request([1, 2], sp, generator=torch.Generator().manual_seed(kw.get("seed") or 0))


def frequencies(logits, num_samples=8000, **kw):
    req = request(**kw)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(num_samples):
        counts[sampler.choose(logits, req)] += 1
    return counts / num_samples


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert sampler.choose(logits, request(temperature=0)) == 1


@pytest.mark.parametrize("kw,expected", [
    (dict(temperature=0.7), (torch.tensor([1.0, 0.2, -0.5, 0.8, -2.0]) / 0.7).softmax(-1)),
    (dict(temperature=1.0, top_k=2), torch.tensor([1.0, 0.8]).softmax(-1)),
    (dict(temperature=1.0, top_p=0.6), torch.tensor([1.0, 0.8]).softmax(-1)),
    (dict(temperature=1.0, min_p=0.5), torch.tensor([1.0, 0.8]).softmax(-1)),
])
def test_sampled_distribution(kw, expected):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -2.0])
    freq = frequencies(logits, **kw)
    if len(expected) == 2:
        full = torch.zeros(5)
        full[[0, 3]] = expected
        expected = full
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 0.02


def test_seeded_requests_reproduce_and_differ():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    draws = lambda seed: [sampler.choose(logits, r) for r in [request(temperature=1.0, seed=seed)] for _ in range(20)]
    assert draws(5) == draws(5) and draws(5) != draws(6)


def test_penalties_and_bias():
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0])
    req = request(temperature=0, logit_bias={2: 5.0})
    assert sampler.choose(logits, req) == 2
    req = request(temperature=0, presence_penalty=0.5)
    assert sampler.choose(logits, req, history=[0]) == 1  # token 0 was generated: 2.0 - 0.5 < 1.9
    req = request(temperature=0, repetition_penalty=2.0)  # prompt tokens 1 and 2 are penalised
    assert sampler.choose(torch.tensor([1.0, 1.9, 0.0, 0.0]), req) == 0
    req = request(temperature=0, frequency_penalty=0.1)
    assert sampler.choose(logits, req, history=[0, 0]) == 1


def test_logprobs_are_the_models():
    logits = torch.tensor([1.0, 0.0, -1.0])
    lp, top = sampler.token_logprobs(logits, 1, 2)
    ref = logits.log_softmax(-1)
    assert lp == pytest.approx(float(ref[1])) and [t for t, _ in top] == [0, 1]
