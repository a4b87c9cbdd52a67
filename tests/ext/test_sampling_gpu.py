"""The sampling kernel (ext/csrc/sampling.cu) on the GPU: greedy rows equal torch.argmax exactly; sampled rows
agree with the PyTorch twin (ext.reference.sampling, run on the CPU) on >= 99.9% of random rows; the samples
follow softmax(logits / T) (chi-square on a small vocabulary); -inf and min-p masked tokens are never drawn;
the op passes opcheck and replays in a CUDA graph."""
from __future__ import annotations


import pytest
import torch

from ext import ops, reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
INF = float("inf")
BELOW_ONE = 1.0 - 2.0**-53


from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)


def kernel(logits, temperature, min_p, uniform):
    before = ops.cuda_calls().get("sample_tokens", 0)
    out = ops.sample_tokens(logits.to(DEV), temperature.to(DEV), min_p.to(DEV), uniform.to(DEV))
    assert ops.cuda_calls()["sample_tokens"] == before + 1  # the kernel ran, not the reference
    assert out.dtype == torch.int64 and out.device.type == "cuda"
    return out.cpu()


def random_rows(gen, rows, vocab, dtype, masked=0.1):
    scale = torch.rand(rows, 1, generator=gen) * 4 + 0.5
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[torch.rand(rows, vocab, generator=gen) < masked] = -INF
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.zeros(rows), torch.rand(rows, generator=gen) * 0.2)
    uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
    return logits.to(dtype), temperature, min_p, uniform


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 4099, 32768, 151936])
def test_greedy_rows_equal_torch_argmax(dtype, vocab):
    r, gen = rng()
    rows = 300
    logits = torch.randint(-5, 6, (rows, vocab), generator=gen).to(dtype)  # many ties: the lowest id wins
    logits[torch.rand(rows, vocab, generator=gen) < 0.3] = -INF
    logits[0] = -INF
    logits = logits.to(DEV)
    temperature = torch.zeros(rows)
    temperature[1::3] = 1e-6
    temperature[2::3] = float("nan")
    min_p = torch.rand(rows, generator=gen)
    got = kernel(logits, temperature, min_p, torch.rand(rows, generator=gen, dtype=torch.float64))
    assert torch.equal(got, logits.argmax(-1).cpu())
    zeros = torch.zeros(rows, dtype=torch.float64)
    assert torch.equal(got, reference.sample_tokens(logits.cpu(), temperature, min_p, zeros))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(4096, 1000), (2048, 32003), (256, 151936), (4, 1_300_000)])
def test_sampled_rows_agree_with_the_twin(dtype, rows, vocab):
    """fp32 exp on the GPU and the CPU may differ by an ulp. That moves a crossing only when the uniform lands
    within that much of a boundary, or when a token's weight sits on the min_p threshold (it is kept by one and
    dropped by the other: such thresholds are moved off every weight first, so all rows are compared): >= 99.9%
    of the rows pick the same token. A uniform just below 1 picks the last kept token, whose mass can be far
    below the totals' rounding: there the kernel's token must be kept with no more than 1e-9 of the mass after
    it."""
    r, gen = rng()
    logits, temperature, min_p, uniform = random_rows(gen, rows, vocab, dtype)
    weights = relative_weights(logits, temperature)
    min_p = off_the_weights(weights, min_p)
    k = max(1, rows // 20)
    uniform[:k] = 0.0  # the first kept token
    uniform[k:2 * k] = BELOW_ONE  # the last kept token
    got = kernel(logits, temperature, min_p, uniform)
    want = reference.sample_tokens(logits, temperature, min_p, uniform)
    kept = (weights > 0) & (weights >= min_p.double()[:, None])
    plain = torch.ones(rows, dtype=torch.bool)
    plain[k:2 * k] = False
    mismatches = int((got != want)[plain].sum())
    assert mismatches <= max(1, int(plain.sum()) // 1000), (mismatches, rows, r)
    mass = torch.where(kept, weights, torch.zeros_like(weights))
    for row in range(k, 2 * k):
        token = int(got[row])
        after = float(mass[row, token + 1:].sum())
        assert bool(kept[row, token]) and after <= 1e-9 * float(mass[row].sum()), (row, token, after)
    chosen = logits.float().gather(1, got[:, None])[:, 0]
    assert torch.isfinite(chosen).all()


def relative_weights(logits, temperature):
    x = logits.double()
    return torch.exp((x - x.amax(-1, keepdim=True)) / temperature.double()[:, None])  # [rows, vocab]: p / max p


def on_threshold(weights, min_p):
    """Rows with a token whose relative weight is within 1e-5 of the row's min_p (kept by one side, dropped by
    the other after an ulp of difference in exp)."""
    near = ((weights / min_p.double()[:, None].clamp(min=1e-30) - 1).abs() < 1e-5).any(-1)
    return near & (min_p > 0)


def off_the_weights(weights, min_p):
    """min_p with each on-threshold row's value raised until no weight sits on it: towards the row's maximum the
    weights thin out (at 1.3M tokens ~5% of rows have one on the threshold, and a 4-row case was sometimes left
    with one row to compare)."""
    min_p = min_p.clone()
    for _ in range(50):
        near = on_threshold(weights, min_p)
        if not near.any():
            return min_p
        min_p[near] = (min_p[near] * 1.2).clamp(max=0.99)
    raise AssertionError("min_p could not be moved off the weights")


def expected_probs(logits, temperature, min_p):
    p = (logits.double() / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize("temperature, min_p", [(0.8, 0.0), (1.3, 0.2), (1.0, 0.0)])
def test_chi_square_against_softmax(temperature, min_p):
    """500k draws of one 8-token row (one -inf): counts pass a chi-square test at a false-alarm rate of 1e-6;
    stratified uniforms reproduce N * p to within 2 per token."""
    logits = torch.tensor([0.3, -1.0, 1.2, -INF, 0.0, 0.9, -0.4, 0.1])
    n = 500_000
    rows = logits.expand(n, -1).contiguous().to(DEV)
    t, mp = torch.full((n,), temperature), torch.full((n,), min_p)
    p = expected_probs(logits, temperature, min_p)
    tok = kernel(rows, t, mp, torch.rand(n, dtype=torch.float64, device=DEV))
    counts = torch.bincount(tok, minlength=8).double()
    assert counts[p == 0].sum() == 0
    want = p[p > 0] * n
    stat = ((counts[p > 0] - want) ** 2 / want).sum()
    dof = torch.tensor((int((p > 0).sum()) - 1) / 2.0, dtype=torch.float64)
    assert float(torch.special.gammaincc(dof, stat / 2)) > 1e-6, (counts, want)
    strat = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    counts = torch.bincount(kernel(rows, t, mp, strat), minlength=8).double()
    assert float((counts - p * n).abs().max()) <= 2.0, (counts, p * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_tokens_are_never_drawn(dtype):
    r, gen = rng()
    rows, vocab = 3000, 5003
    logits, temperature, min_p, uniform = random_rows(gen, rows, vocab, dtype, masked=0.95)
    min_p[::2] = torch.rand(rows, generator=gen)[::2] * 0.9
    logits[:, 11] = -INF
    logits[5] = -INF  # no finite logit: the argmax, 0
    uniform[:300] = 0.0
    uniform[300:600] = BELOW_ONE
    got = kernel(logits, temperature, min_p, uniform)
    x = logits.float()
    chosen = x.gather(1, got[:, None])[:, 0]
    finite = torch.isfinite(x).any(-1)
    assert got[5] == 0 and not finite[5]
    assert torch.isfinite(chosen[finite]).all() and (got != 11).all()
    rel = ((chosen - x.amax(-1)) / temperature).double()  # log(p / max p)
    assert (rel[finite] >= torch.log(min_p.double())[finite] - 1e-4).all()


def test_opcheck_and_cuda_graph(cuda_ops):
    r, gen = rng()
    logits, temperature, min_p, uniform = (t.to(DEV) for t in random_rows(gen, 64, 3001, torch.bfloat16))
    torch.library.opcheck(cuda_ops.sample_tokens.default, (logits, temperature, min_p, uniform),
                          test_utils=("test_schema", "test_faketensor"))
    ops.sample_tokens(logits, temperature, min_p, uniform)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.sample_tokens(logits, temperature, min_p, uniform)
    for _ in range(3):
        uniform.copy_(torch.rand(64, generator=gen, dtype=torch.float64))
        logits.copy_(torch.randn(64, 3001, generator=gen).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.sample_tokens(logits, temperature, min_p, uniform))


def test_rejects_bad_inputs(cuda_ops):
    x = torch.randn(4, 10, device=DEV)
    t, mp, u = torch.ones(4, device=DEV), torch.zeros(4, device=DEV), torch.zeros(4, device=DEV, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must be"):
        cuda_ops.sample_tokens(x, t[:3], mp, u)
    with pytest.raises(RuntimeError, match="kDouble|Double"):
        cuda_ops.sample_tokens(x, t, mp, u.float())
    assert cuda_ops.sample_tokens(x[:0], t[:0], mp[:0], u[:0]).shape == (0,)


def test_seeded_uniforms_equal_the_twin_bit_for_bit(cuda_ops):
    """The seeded_uniforms kernel against ext.reference.sampling.seeded_uniforms on the CPU: every bit, over seeds
    and indices across the whole int64 range (negative ones, wrapping sums) and a batch past one block; in a graph."""
    gen = torch.Generator().manual_seed(7)
    seeds = torch.randint(-(2**63), 2**63 - 1, (1000,), generator=gen, dtype=torch.int64)
    indices = torch.randint(-(2**63), 2**63 - 1, (1000,), generator=gen, dtype=torch.int64)
    seeds[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    indices[:4] = torch.tensor([0, 2**63 - 1, 1, -1])
    before = ops.cuda_calls().get("seeded_uniforms", 0)
    got = ops.seeded_uniforms(seeds.to(DEV), indices.to(DEV))
    assert ops.cuda_calls().get("seeded_uniforms", 0) == before + 1
    assert got.dtype == torch.float64 and torch.equal(got.cpu(), reference.seeded_uniforms(seeds, indices))
    torch.library.opcheck(cuda_ops.seeded_uniforms.default, (seeds.to(DEV), indices.to(DEV)),
                          test_utils=("test_schema", "test_faketensor"))
    s, i = seeds.to(DEV), indices.to(DEV)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.seeded_uniforms(s, i)
    i.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.seeded_uniforms(seeds, indices + 1))
