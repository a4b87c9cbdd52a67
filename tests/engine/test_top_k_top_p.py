"""engine/top_k_top_p.py's histogram path, which decides the CPU's rows that their largest logits do not (a flat
row, whose nucleus runs past its 512 largest): against transformers' TopK/TopP warpers and against sorting the row,
on a 49,152-token vocabulary (the embedded model's), top-k on and off, tokens already at -inf; no sort for the rows
it decides; tied logits at the boundary all stay; a row it cannot decide (a NaN) sorted, alone."""
from __future__ import annotations

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from engine import top_k_top_p as filters
from engine.top_k_top_p import NUM_CANDIDATES, _filter_top_k_top_p, apply_top_k_top_p, sort_top_k_top_p

VOCAB = 49152


def transformers_kept(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[S, V] bool: the tokens transformers' warpers keep, row by row (top-k 0 and top-p 1 off)."""
    kept = []
    for i in range(len(x)):
        row = x[i:i + 1].clone()
        if top_k[i] > 0:
            row = TopKLogitsWarper(int(top_k[i]))(None, row)
        if top_p[i] < 1:
            row = TopPLogitsWarper(float(top_p[i]))(None, row)
        kept.append(~torch.isinf(row[0]))
    return torch.stack(kept)


def sorts_seen(monkeypatch) -> list[int]:
    """Records the rows each sort_top_k_top_p call gets."""
    seen = []
    real = filters.sort_top_k_top_p
    monkeypatch.setattr(filters, "sort_top_k_top_p", lambda x, k, p: seen.append(len(x)) or real(x, k, p))
    return seen


def test_flat_rows_keep_what_transformers_keeps_without_a_sort(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    scales = torch.tensor([0.05, 0.3, 1.0, 2.0, 1.0, 0.5])[:, None]
    x = torch.randn(6, VOCAB, generator=gen) * scales
    x[1, :1000] = float("-inf")  # a grammar's or logit_bias's mask before the filters
    top_k = torch.tensor([0, 2000, 0, 600, 30000, 0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.8, 0.7, 1.0])
    seen = sorts_seen(monkeypatch)
    filtered, decided = _filter_top_k_top_p(x, top_k, top_p, NUM_CANDIDATES)
    assert decided is None and seen == []  # not from the candidates, and no row sorted
    kept = ~torch.isinf(filtered)
    assert torch.equal(kept, transformers_kept(x, top_k, top_p))
    k = torch.where(top_k > 0, top_k, VOCAB)
    assert torch.equal(filtered, sort_top_k_top_p(x, k, top_p))
    in_place = x.clone()
    assert torch.equal(apply_top_k_top_p(in_place, top_k, top_p, inplace=True), filtered)


def test_top_k_alone_past_the_candidates(monkeypatch):
    """Top-k above the 512 candidates with top-p off: the k-th largest logit is the floor (ties at it stay), no
    sort."""
    x = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(13))
    x[1, 10:20] = x[1].topk(700).values[-1]  # ten more tokens equal to row 1's 700th largest
    top_k, top_p = torch.tensor([2000, 700]), torch.tensor([1.0, 1.0])
    seen = sorts_seen(monkeypatch)
    filtered = apply_top_k_top_p(x, top_k, top_p)
    assert seen == []
    assert torch.equal(~torch.isinf(filtered), transformers_kept(x, top_k, top_p))
    assert int(torch.isfinite(filtered[1]).sum()) == 710


def test_ties_at_the_boundary_all_stay():
    """The nucleus closes inside 1,000 equal logits, past the 512 largest (so the histogram decides): every one of
    them stays, nothing below them does; the sort keeps as many of them as it needs, in its own order."""
    x = torch.full((1, VOCAB), -10.0)  # the other 48,151 tokens: 0.2% of the mass together
    x[0, 7] = 6.0  # 29%
    x[0, 100:1100] = 0.0  # 0.07% each: the nucleus of 0.8 closes at the ~720th of them
    filtered = apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([0.8]))
    assert torch.isfinite(filtered[0]).nonzero()[:, 0].tolist() == [7] + list(range(100, 1100))
    by_sort = sort_top_k_top_p(x, torch.tensor([VOCAB]), torch.tensor([0.8]))
    assert 600 < int(torch.isfinite(by_sort).sum()) < 800


def test_a_row_without_a_finite_maximum_is_sorted_alone(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, VOCAB, generator=gen)
    x[1, 5] = float("nan")
    top_k, top_p = torch.tensor([0, 0, 100]), torch.tensor([0.9, 0.9, 0.8])
    seen = sorts_seen(monkeypatch)
    filtered = apply_top_k_top_p(x, top_k, top_p)
    assert seen == [1]
    k = torch.where(top_k > 0, top_k, VOCAB)
    torch.testing.assert_close(filtered[1], sort_top_k_top_p(x[1:2], k[1:2], top_p[1:2])[0], rtol=0, atol=0,
                               equal_nan=True)
    assert torch.equal(~torch.isinf(filtered[[0, 2]]), transformers_kept(x[[0, 2]], top_k[[0, 2]], top_p[[0, 2]]))
