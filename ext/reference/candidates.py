"""The dense form of a drafter's proposal (engine.speculative.drafter's contract): sparse per-row candidates
packed into [R, K] log-probs and ids, rows padded with the smallest free token ids far below their real
candidates. Here, under ext, so the device drafters' references (ext/reference/ngram.py) pad exactly as the host
drafters do."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

PAD_GAP = 1.0e4  # padding tokens sit at least this far below the last real candidate of their row


def proposal_width(top_k: int, vocab_size: int, num_excluded: int = 0) -> int:
    """K actually returned for a requested top_k: at most the number of proposable tokens."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return min(int(top_k), vocab_size - num_excluded)


def pack_candidates(
    rows: Sequence[Sequence[tuple[int, float]]],  # per row: (token id, log-prob), sorted descending, distinct
    top_k: int,
    vocab_size: int,
    exclude: Iterable[int] = (),
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse per-row candidates -> dense ([R, K] f32 log-probs, [R, K] int64 ids) meeting the contract above.

    Real candidates come first (truncated to K); the remaining slots take the smallest token ids that are
    neither candidates nor excluded, at log-probs PAD_GAP, PAD_GAP+1, ... below the row's last real one
    (below 0 when the row has none). Vectorized over rows (numpy); only the real candidates go through Python.
    """
    excluded = sorted({int(t) for t in exclude if 0 <= int(t) < vocab_size})
    k = proposal_width(top_k, vocab_size, len(excluded))
    num_rows = len(rows)
    rows = [r[:k] for r in rows]
    # the real candidates, flat: row i's are flat[starts[i] : starts[i] + counts[i]]
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=num_rows)  # [R]
    total = int(counts.sum())
    flat_ids = np.fromiter((t for r in rows for t, _ in r), dtype=np.int64, count=total)
    flat_lp = np.fromiter((lp for r in rows for _, lp in r), dtype=np.float32, count=total)
    if not np.isfinite(flat_lp).all():
        raise ValueError("candidate log-probs must be finite")
    if ((flat_ids >= vocab_size) | (flat_ids < 0)).any():
        raise ValueError("candidate token id outside the vocabulary")
    if excluded and np.isin(flat_ids, excluded).any():
        raise ValueError("an excluded token id was given as a candidate")
    starts = np.cumsum(counts) - counts
    row_of = np.repeat(np.arange(num_rows), counts)
    ids = np.empty((num_rows, k), dtype=np.int64)
    lps = np.empty((num_rows, k), dtype=np.float32)
    col_of = np.arange(total) - starts[row_of]
    ids[row_of, col_of], lps[row_of, col_of] = flat_ids, flat_lp

    # Padding: a pool of the smallest ids, large enough to hold every row's fillers after removing its
    # candidates and the excluded ids. (numpy, not torch: ~20 small ops, whose dispatch cost ~0.3 ms a call.)
    pool = min(vocab_size, k + int(counts.max(initial=0)) + len(excluded))
    ok = np.ones((num_rows, pool), dtype=bool)  # [R, P]
    ok[:, [t for t in excluded if t < pool]] = False
    in_pool = flat_ids < pool
    ok[row_of[in_pool], flat_ids[in_pool]] = False
    rank = ok.cumsum(axis=1) - 1  # [R, P] rank of each allowed pool token among its row's
    fill_row, fill_token = np.nonzero(ok & (rank < (k - counts)[:, None]))
    fill_rank = rank[fill_row, fill_token]
    last = np.zeros(num_rows, dtype=np.float32)  # each row's last real log-prob (0 without one)
    has = counts > 0
    last[has] = flat_lp[(starts + counts - 1)[has]]
    ids[fill_row, counts[fill_row] + fill_rank] = fill_token
    lps[fill_row, counts[fill_row] + fill_rank] = last[fill_row] - np.float32(PAD_GAP) - fill_rank.astype(np.float32)
    return torch.from_numpy(lps).to(device), torch.from_numpy(ids).to(device)
