"""Top-k and top-p on the logits of sampled rows: which tokens each row keeps (the rest go to -inf).

Off the CPU one launch finds each row's floor (ext.ops.top_k_top_p_floor: no sort, no host sync, captured in
graphs). On the CPU a row is decided, cheapest first, from its 64 then 512 largest logits (_candidates: a peaked
row's nucleus closes within them, and the draw then runs over the candidates alone, sample_candidates); else from
a histogram of its probability mass over its logits (_binned_floor: no sort of the row); rows neither decides
(a nucleus reaching past BIN_RANGE below the largest logit, a row without a finite maximum) are sorted
(sort_top_k_top_p). Sorting a 49,152-token row took 3.7-4.5 ms on the 2-core CPU, and a tree step at T > 0
samples every verify row.
"""
from __future__ import annotations

import torch

from ext import ops

NUM_CANDIDATES = 512  # CPU: the largest logits a row's top-k / top-p is decided from (else the histogram)
FIRST_CANDIDATES = 64  # CPU: tried first (the embedded model's chats at T = 0.7, top_p 0.9: 62 of 64 steps decided)
NUM_BINS = 4096  # CPU: bins of a row's histogram of mass, over BIN_RANGE below its largest logit (then one more)
BIN_RANGE = 64.0  # tokens further below share the last bin: each has < e^-64 of the largest's mass (1e-23 of it)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      num_candidates: int = NUM_CANDIDATES, inplace: bool = False) -> torch.Tensor:
    """x [S, V] tempered logits; top_k [S] (0 = off), top_p [S] (1 = off) -> x with dropped tokens at -inf.
    inplace: x may be overwritten (a caller's own temporary; off the CPU it then is, and no second [S, V] tensor is
    made: inside a CUDA graph that would be one more in its memory pool).
    top-k keeps every token at least as large as the k-th largest (ties at the boundary stay); top-p then
    drops a token when the probability mass before it (in descending order) already reaches top_p.

    On the CPU the rows are first decided from their FIRST_CANDIDATES, then num_candidates, largest logits
    (_candidates), else from a histogram of their mass (_binned_floor): sorting a 49,152-token row took 4 ms of a
    57 ms decoding step of the embedded model at T = 1, top_p 0.9. Elsewhere each row's floor comes from ops.top_k_top_p_floor (no sort, no host sync; its top-p sums
    integer masses, so a token at the boundary can differ from the CPU's fp32 sums)."""
    filtered, decided = _filter_top_k_top_p(x, top_k, top_p, num_candidates, inplace)
    return filtered if decided is None else _scatter(x, decided)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, m: int,
                        inplace: bool = False) -> tuple[torch.Tensor | None, tuple | None]:
    """apply_top_k_top_p's work: (x filtered, None) by the floor kernel (not on the CPU); on the CPU (None,
    _candidates' decision) when each row's m largest logits decide it, else (x filtered, None) by each row's
    histogram floor (_binned_floor) or, for the rows that does not decide, by sorting them."""
    if x.device.type != "cpu":  # the floor without a sort, in one launch (no host sync: graphs capture it)
        dropped = x < ops.top_k_top_p_floor(x, top_k, top_p)[:, None]  # the kernel reads k outside (0, V) as off
        return (x.masked_fill_(dropped, float("-inf")) if inplace else x.masked_fill(dropped, float("-inf"))), None
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if vocab > 2 * m:
        for size in sorted({min(FIRST_CANDIDATES, m), m}):  # topk of 64 costs a third of topk of 512 (72 rows)
            decided = _candidates(x, k, top_p, size)
            if decided is not None:
                return None, decided
    floor = _binned_floor(x, k, top_p)  # [S]
    rows = floor.isnan().nonzero()[:, 0]  # the rows it does not decide: sorted (before x may be overwritten)
    by_sort = sort_top_k_top_p(x[rows], k[rows], top_p[rows]) if len(rows) else None
    dropped = x < floor[:, None]  # (never for a NaN floor)
    out = x.masked_fill_(dropped, float("-inf")) if inplace else x.masked_fill(dropped, float("-inf"))
    if by_sort is not None:
        out[rows] = by_sort
    return out, None


def _binned_floor(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest kept logit [S] under top-k (k [S] in 1..V) and top-p, without sorting the row; NaN for
    a row this does not decide. Top-k's floor is the k-th largest logit (torch.kthvalue, one call per distinct k).
    Top-p: the row's mass (exp(x - max), over the tokens top-k keeps) summed into NUM_BINS bins by distance below the
    largest logit; the first bin whose running mass reaches top_p of the total holds the boundary, and only that
    bin's tokens are sorted, their running mass continued from the bins above: the last whose mass before it is
    below top_p is the floor (tokens equal to it stay). Kept sets equal the sort's (sort_top_k_top_p) but where a
    token's mass before it lies within float rounding of top_p (the sums run in another order), and where ties at
    the boundary split (the sort keeps some of them, here all stay). Undecided: a row without a finite largest
    logit, or whose boundary lies in the last bin (top_p within ~1e-23 of 1)."""
    num_rows, vocab = x.shape
    inf = float("inf")
    kth = torch.full((num_rows,), -inf, dtype=x.dtype)
    for value in k[k < vocab].unique().tolist():  # top-k on: the k-th largest (with multiplicity)
        rows = (k == value).nonzero()[:, 0]
        kth[rows] = x[rows].kthvalue(vocab - value + 1, dim=-1).values
    x = x.masked_fill(x < kth[:, None], -inf) if bool((kth > -inf).any()) else x  # [S, V]
    top = x.amax(-1)  # [S]
    if not bool((top_p < 1.0).any()):  # top-k alone: no histogram
        return kth.masked_fill_(~torch.isfinite(top), float("nan"))
    weights = (x - top[:, None]).exp_()  # [S, V]
    target = top_p * weights.sum(-1)  # [S]
    bins = ((top[:, None] - x) * ((NUM_BINS - 1) / BIN_RANGE)).clamp_(max=NUM_BINS - 1).nan_to_num_(NUM_BINS - 1)
    bins = bins.long()  # [S, V]: 0 holds the largest logits
    mass = torch.zeros(num_rows, NUM_BINS, dtype=weights.dtype).scatter_add_(1, bins, weights).cumsum_(-1)
    boundary = (mass < target[:, None]).sum(-1)  # [S]: the first bin whose running mass reaches the target
    boundary = torch.where(top_p < 1.0, boundary, -1)  # (top-p off: no bin to sort)
    above = mass.gather(1, (boundary - 1).clamp(min=0)[:, None])[:, 0] * (boundary > 0)  # [S] mass of the bins above
    in_bin = bins == boundary[:, None]  # [S, V]
    values, ids = x.masked_fill(~in_bin, -inf).topk(max(1, int(in_bin.sum(-1).max())), dim=-1)  # [S, n] descending
    own = weights.gather(1, ids).masked_fill_(values == -inf, 0.0)  # [S, n]
    before = above[:, None] + own.cumsum(-1) - own  # [S, n]: the mass before each of the bin's tokens
    last = ((before < target[:, None]) & (values > -inf)).sum(-1).clamp(min=1) - 1  # [S]
    by_p = values.gather(1, last[:, None])[:, 0]
    floor = torch.where(top_p < 1.0, by_p, kth)
    undecided = ~torch.isfinite(top) | (boundary >= NUM_BINS - 1)
    return floor.masked_fill_(undecided, float("nan"))


def sort_top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p by sorting every row (k [S] in 1..V): the CPU's last resort (rows _binned_floor does not
    decide), and what CUDA did before the floor kernel (bench/kernels.py times it beside the kernel)."""
    ordered, order = x.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    # top_p 1 is off: in float32 the cumulative mass reaches 1 before the tail, which it would drop
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # the top token always stays
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, ordered)


def _scatter(x: torch.Tensor, decided: tuple) -> torch.Tensor:
    """x [S, V] filtered as _candidates decided: each row's kept candidates, -inf elsewhere; unchanged rows as x."""
    kept, order, unchanged = decided
    out = torch.full_like(x, float("-inf")).scatter_(1, order, kept)
    return torch.where(unchanged[:, None], x, out)


def _within_candidates(decided: tuple) -> bool:
    """Every row filtered (none passes unchanged) with a finite largest logit: no token outside the candidates
    can be drawn (sample_candidates serves)."""
    kept, _, unchanged = decided
    return not bool(unchanged.any()) and bool(torch.isfinite(kept[:, 0]).all())


def sample_candidates(kept: torch.Tensor, order: torch.Tensor, min_p: torch.Tensor,
                      uniform: torch.Tensor) -> torch.Tensor:
    """sample_tokens(x, 1, min_p, uniform) of rows x that are -inf outside their candidates, from the candidates
    alone: kept [S, m] their logits (-inf where a filter dropped one; the first, the row's largest, finite), order
    [S, m] their vocabulary ids -> [S] ids. The same tokens as the whole rows: the kept weights in vocabulary order
    and their fp64 running sum, to which every other token adds an exact zero (a tree step's 72 rows of the
    embedded model's 49,152-token vocabulary: ~50 ms filtered and drawn whole on two cores)."""
    ids, perm = order.sort(dim=-1)  # [S, m]: vocabulary order
    picked = ops.sample_tokens(kept.gather(1, perm), torch.ones_like(min_p), min_p, uniform)  # [S] columns
    return ids.gather(1, picked[:, None])[:, 0]


def _candidates(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """apply_top_k_top_p decided from each row's m largest logits: (kept [S, m] those logits with -inf where the
    filters drop them, order [S, m] their vocabulary ids, unchanged [S] rows no filter touches), or None when they
    do not decide every row (the caller then sorts). A row is decided when top-k keeps fewer than m tokens (its
    k-th largest logit is above the m-th, so no token outside is kept), or top-k is off and the m candidates
    already hold top_p of the mass (every token after them has that much before it), or neither filter is on."""
    vocab = x.shape[-1]
    values, order = x.topk(m, dim=-1)  # [S, m], descending
    kth = values.gather(1, (k.clamp(max=m) - 1)[:, None])  # [S, 1]
    by_k = (k < m) & (values[:, -1] < kth[:, 0])
    off = k >= vocab
    masked = values.masked_fill(by_k[:, None] & (values < kth), float("-inf"))
    # the normaliser of top-p's probabilities: the kept candidates, or (top-k off) the whole row
    norm = torch.where(by_k, masked.logsumexp(-1), x.logsumexp(-1))
    probs = (masked - norm[:, None]).exp()
    cumulative = probs.cumsum(-1)
    unchanged = off & (top_p >= 1.0)
    if not bool((by_k | unchanged | (off & (cumulative[:, -1] >= top_p))).all()):
        return None
    drop = (cumulative - probs) >= top_p[:, None]
    drop[:, 0] = False  # the top token always stays
    return masked.masked_fill(drop, float("-inf")), order, unchanged
