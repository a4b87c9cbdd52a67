"""The floor of top-k / top-p (ext.reference.sampling.top_k_top_p_floor, the CUDA kernel's twin and definition):
`x >= floor` keeps what transformers' TopK and TopP warpers keep on rows without ties at the boundary, keeps every
tie at a boundary, and leaves rows without a finite max (or without a filter) alone."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from ext import ops
from ext.reference.sampling import top_k_top_p_floor

INF = float("inf")


def warped_mask(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """transformers' kept set of one row (k = 0 and p = 1: off)."""
    scores = row[None].clone()
    if k > 0:
        scores = TopKLogitsWarper(k)(None, scores)
    if p < 1:
        scores = TopPLogitsWarper(p)(None, scores)
    return torch.isfinite(scores[0])


@pytest.mark.parametrize("vocab", [50, 1000, 49152])
def test_kept_sets_match_transformers(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 48
    x = torch.randn(rows, vocab, generator=gen) * (torch.rand(rows, 1, generator=gen) * 6 + 0.3)
    top_k = torch.randint(0, min(vocab, 200), (rows,), generator=gen)
    top_k[::5] = 0
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[1::6] = 1.0
    floor = top_k_top_p_floor(x, top_k, top_p)
    for r in range(rows):
        k, p = int(top_k[r]), float(top_p[r])
        want = warped_mask(x[r], k, p)
        got = x[r] >= floor[r]
        assert torch.equal(got, want), (r, k, p, int(got.sum()), int(want.sum()))


def test_ties_at_a_boundary_are_kept():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0],  # top-2: the three 2.0 tie with the 2nd largest
                      [1.0, 1.0, 1.0, 1.0, -INF, -INF],  # top-p 0.3 of four equal tokens: all four kept
                      [5.0, -0.0, 0.0, -1.0, -2.0, -3.0]])  # -0.0 and 0.0 are one value
    floor = top_k_top_p_floor(x, torch.tensor([2, 0, 3]), torch.tensor([1.0, 0.3, 1.0]))
    assert floor.tolist() == [2.0, 1.0, 0.0]
    assert (x[2] >= floor[2]).sum() == 3


def test_rows_left_alone_and_degenerate_filters():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                      [float("nan"), 1.0, 2.0, 3.0],  # no finite max: -inf (the sampler takes the argmax)
                      [-INF, -INF, -INF, -INF],
                      [INF, 1.0, 2.0, 3.0],
                      [1.0, 2.0, 3.0, 4.0],  # both filters off
                      [1.0, 2.0, 3.0, 4.0],  # top_p 0: the largest alone
                      [1.0, -INF, 3.0, -INF]])  # top-k above the finite count keeps all; top-p over the finite
    floor = top_k_top_p_floor(x, torch.tensor([2, 2, 2, 2, 0, 0, 3]), torch.tensor([1.0, 0.5, 0.5, 0.5, 1.0, 0.0,
                                                                                  0.999]))
    assert floor.tolist() == [3.0, -INF, -INF, -INF, -INF, 4.0, 1.0]


def test_top_p_counts_integer_masses():
    """Two tokens of mass 1 and e^-1: top_p just above their share of the first keeps both, just below keeps one
    (the shares are taken from the integer masses floor(e * 2^24), as the kernel sums them)."""
    x = torch.tensor([[0.0, -1.0, -30.0]])  # the last token's mass rounds to 0
    q0, q1 = 1 << 24, int(torch.exp(torch.tensor(-1.0)).double() * (1 << 24))
    share = q0 / (q0 + q1)
    below, above = torch.tensor([share - 1e-6]), torch.tensor([share + 1e-6])
    assert top_k_top_p_floor(x, torch.tensor([0]), below).item() == 0.0
    assert top_k_top_p_floor(x, torch.tensor([0]), above).item() == -1.0


def test_the_ops_door_serves_cpu_tensors_with_the_twin():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    k, p = torch.tensor([0, 3, 10, 0, 299]), torch.tensor([0.9, 1.0, 0.5, 1.0, 0.2])
    assert torch.equal(ops.top_k_top_p_floor(x, k, p), top_k_top_p_floor(x, k, p))
    assert torch.equal(top_k_top_p_floor(x.bfloat16(), k, p), top_k_top_p_floor(x.bfloat16().float(), k, p))
