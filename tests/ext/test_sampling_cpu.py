"""The PyTorch twin of the sampling kernel (ext.reference.sampling, also the CPU implementation of
ext.ops.sample_tokens): exact on constructed rows, the inverse-CDF crossing rule at its boundaries, never a
masked token, and its samples follow softmax(logits / T) restricted by min-p (stratified counts and a
chi-square test)."""
from __future__ import annotations

import pytest
import torch

from ext import ops
from ext.reference import sampling
from ext.reference.sampling import sample_tokens

INF = float("inf")
BELOW_ONE = 1.0 - 2.0**-53  # the largest double below 1


def draw(logits, temperature=1.0, min_p=0.0, uniform=0.0) -> list[int]:
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits[None]
    rows = logits.shape[0]

    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(rows).clone() if t.dim() == 0 else t

    return sample_tokens(logits, col(temperature, torch.float32), col(min_p, torch.float32),
                         col(uniform, torch.float64)).tolist()


def expected_probs(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """softmax(logits / T) in fp64, restricted to p >= min_p * max p and renormalized."""
    p = (logits.double() / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    return p / p.sum()


def chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_uniform_zero_is_the_first_kept_token_and_near_one_the_last():
    row = [-INF, 0.0, -INF, 1.0, 0.5, -INF]
    assert draw(row, uniform=0.0) == [1]
    assert draw(row, uniform=BELOW_ONE) == [4]
    # min-p keeps e = p / max p >= min_p: exp(-3) and exp(-2) are out, exp(-0.1) is in
    row = [0.0, 3.0, -INF, 2.9, 1.0, -INF]
    assert draw(row, min_p=0.5, uniform=0.0) == [1]
    assert draw(row, min_p=0.5, uniform=BELOW_ONE) == [3]
    assert draw(row, min_p=0.0, uniform=0.0) == [0]
    assert draw(row, min_p=0.0, uniform=BELOW_ONE) == [4]
    assert draw(row, min_p=1.0, uniform=BELOW_ONE) == [1]  # only the max
    assert draw(row, min_p=2.0, uniform=0.5) == [1]  # nothing kept: the argmax


def test_the_crossing_is_strict():
    """Four equal tokens: cumulative masses 1, 2, 3, 4 of 4; the token is the first whose mass exceeds u * 4."""
    row = [0.0, 0.0, 0.0, 0.0]
    assert draw([row] * 6, uniform=[0.0, 0.2499, 0.25, 0.5, 0.75, BELOW_ONE]) == [0, 0, 1, 2, 3, 3]


def test_greedy_rows_take_the_lowest_argmax():
    row = [1.0, 3.0, -INF, 3.0, 2.0]
    assert draw([row] * 4, temperature=[0.0, 1e-6, float("nan"), -1.0], uniform=0.99) == [1, 1, 1, 1]
    assert draw(row, temperature=1e-5, uniform=BELOW_ONE) == [3]  # 1e-5 samples (two tied maxima)


def test_rows_without_finite_mass_take_the_argmax():
    assert draw([[-INF] * 4, [0.0, INF, 1.0, INF], [0.0, float("nan"), 1.0, 2.0]], uniform=0.7) == [0, 1, 1]


def test_never_a_masked_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 50, generator=gen) * 3
    logits[torch.rand(2000, 50, generator=gen) < 0.8] = -INF
    logits[:, 7] = -INF
    temperature = torch.rand(2000, generator=gen) * 2 + 0.05
    min_p = torch.where(torch.rand(2000, generator=gen) < 0.5, torch.zeros(2000), torch.rand(2000, generator=gen) * 0.3)
    uniform = torch.rand(2000, generator=gen, dtype=torch.float64)
    uniform[:100] = 0.0
    uniform[100:200] = BELOW_ONE
    tok = sample_tokens(logits, temperature, min_p, uniform)
    chosen = logits.gather(1, tok[:, None])[:, 0]
    has_finite = torch.isfinite(logits).any(-1)
    assert torch.isfinite(chosen[has_finite]).all()
    assert (tok != 7).all()
    m = logits.amax(-1)
    rel = ((chosen - m) / temperature).double()  # log(p / max p)
    assert (rel[has_finite] >= torch.log(min_p.double())[has_finite] - 1e-5).all()


def test_matches_an_independent_fp64_inverse_cdf():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(500, 300, generator=gen) * 2
    temperature = torch.rand(500, generator=gen) + 0.3
    min_p = torch.rand(500, generator=gen) * 0.2
    uniform = torch.rand(500, generator=gen, dtype=torch.float64)
    got = sample_tokens(logits, temperature, min_p, uniform)
    p = (logits.double() / temperature.double()[:, None]).softmax(-1)
    p = torch.where(p >= min_p.double()[:, None] * p.amax(-1, keepdim=True), p, torch.zeros_like(p))
    cdf = (p / p.sum(-1, keepdim=True)).cumsum(-1)
    want = torch.searchsorted(cdf, uniform[:, None], right=True)[:, 0]
    assert (got == want).double().mean() > 0.99  # differs only within fp32 rounding of a boundary


def test_stratified_uniforms_reproduce_the_distribution():
    """u = (i + 1/2) / N for i < N: each token is drawn N * p times, up to one per boundary."""
    logits = torch.tensor([1.0, 0.5, 0.0, -INF, -1.0, 2.0, 1.9, -3.0])
    n = 100_000
    for temperature, min_p in [(1.0, 0.0), (0.7, 0.0), (1.3, 0.1), (0.5, 0.3)]:
        u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        tok = sample_tokens(logits.expand(n, -1), torch.full((n,), temperature), torch.full((n,), min_p), u)
        counts = torch.bincount(tok, minlength=8).double()
        want = expected_probs(logits, temperature, min_p) * n
        assert float((counts - want).abs().max()) <= 2.0, (temperature, min_p, counts, want)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.0), (0.6, 0.05)])
def test_chi_square_against_softmax(temperature, min_p):
    """Random uniforms: the counts pass a chi-square test at a false-alarm rate of 1e-6."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.tensor([0.3, -1.0, 1.2, -INF, 0.0, 0.9, -0.4, 0.1])
    n = 200_000
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    tok = sample_tokens(logits.expand(n, -1), torch.full((n,), temperature), torch.full((n,), min_p), u)
    counts = torch.bincount(tok, minlength=8).double()
    p = expected_probs(logits, temperature, min_p)
    assert counts[p == 0].sum() == 0
    want = p[p > 0] * n
    stat = float(((counts[p > 0] - want) ** 2 / want).sum())
    assert chi2_sf(stat, int((p > 0).sum()) - 1) > 1e-6, (stat, counts, want)


def test_blocks_of_rows_and_dtypes(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 1000, generator=gen).to(torch.bfloat16)
    temperature = torch.rand(37, generator=gen) + 0.1
    temperature[::5] = 0.0
    min_p = torch.rand(37, generator=gen) * 0.1
    uniform = torch.rand(37, generator=gen, dtype=torch.float64)
    whole = sample_tokens(logits, temperature, min_p, uniform)
    monkeypatch.setattr(sampling, "_BLOCK_ELEMS", 3000)  # three rows per block
    assert torch.equal(sample_tokens(logits, temperature, min_p, uniform), whole)
    assert torch.equal(sample_tokens(logits.float(), temperature, min_p, uniform), whole)  # bf16 -> fp32 is exact
    assert torch.equal(ops.sample_tokens(logits, temperature, min_p, uniform), whole)
    assert torch.equal(whole[::5], logits.float().argmax(-1)[::5])
    assert sample_tokens(logits[:0], temperature[:0], min_p[:0], uniform[:0]).shape == (0,)
