"""The drafter protocol of DDTree: from each request's committed state a drafter returns, for depths 1..L
after the root (the last committed token, not yet seen by the target), the top-K log-probs and token ids that
the tree builder (ext.ops.build_tree) expands best-first.

Contract of every `propose` result ([N, L, K] float32 log-probs, [N, L, K] int64 ids):
  - each row (request, depth) holds K distinct token ids, sorted by log-prob descending, all finite;
  - a drafter with fewer real candidates pads with other tokens at least PAD_GAP below its last real one;
  - excluded ids (the DFlash mask token) never appear; token id 0 is an ordinary token;
  - K = min(top_k, number of proposable tokens), which is top_k for any real vocabulary.

Drafters: "ngram" (engine.speculative.ngram, no weights), "dflash" (engine.speculative.dflash, a z-lab DFlash checkpoint),
"oracle" (engine.speculative.oracle, golden continuations, for tests).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

PAD_GAP = 1.0e4  # padding tokens sit at least this far below the last real candidate of their row


@dataclass
class DraftRequest:
    request_id: str
    # all committed tokens (prompt + output); the LAST one is the root/bonus token, which the target has not
    # processed yet; its position is len(token_ids) - 1
    token_ids: list[int]
    # [num_new, len(target_layer_ids) * hidden] target features (outputs of decoder layers target_layer_ids,
    # concatenated in that order) of the committed tokens the drafter has not seen yet, i.e. positions
    # drafter_context_len .. len(token_ids) - 2; None for drafters that need no features
    new_hidden: torch.Tensor | None = None

    @property
    def root_position(self) -> int:
        return len(self.token_ids) - 1


@runtime_checkable
class Drafter(Protocol):
    horizon: int  # L: depths proposed per call
    target_layer_ids: tuple[int, ...]  # () when no target features are needed

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, L, K] f32 log-probs sorted descending per depth, [N, L, K] int64 token ids)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (finish, abort, preempt)."""
        ...

    # Optional, for tree steps launched before the previous tree step's results reach the host (engine.core):
    # propose_ahead(batch, top_k, root_ids, root_positions, num_new, feats=None) drafts from roots [N] and root
    # positions [N] on the device (num_new [N]: tokens the previous step accepted, its bonus included; feats
    # [N, A, F]: their target features, padded, for drafters with target_layer_ids); `batch` holds the host
    # state as of before that step. A drafter with target features also has confirm_ahead(request_id, num_rows),
    # called once the previous step's results arrive.


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


def make_drafter(
    spec,  # engine.config.SpecConfig (or anything with .drafter, .budget, .draft_model)
    target_model,  # engine.model.base.CausalLM
    vocab_size: int,
    *,
    horizon: int | None = None,  # ngram / oracle depths per call (default 8); DFlash's is block_size - 1
    oracle: Mapping[str, Sequence[int]] | Callable[[DraftRequest], Sequence[int] | None] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Drafter | None:
    """The drafter `spec` names, or None when speculation is off. Every problem is a one-line ValueError."""
    name = getattr(spec, "drafter", None)
    if name not in ("none", "ngram", "dflash", "oracle"):
        raise ValueError(f"unknown drafter {name!r} (choose none, ngram, dflash or oracle)")
    if name == "none" or getattr(spec, "budget", 1) <= 0:
        return None
    if horizon is not None and horizon < 1:
        raise ValueError(f"drafter horizon must be >= 1, got {horizon}")
    param = next(target_model.parameters(), None) if target_model is not None else None
    if device is None:
        device = param.device if param is not None else "cpu"
    if name == "ngram":
        from engine.speculative.ngram import NgramDrafter

        return NgramDrafter(vocab_size, horizon=horizon or 8, device=device)
    if name == "oracle":
        from engine.speculative.oracle import OracleDrafter

        if oracle is None:
            raise ValueError("the oracle drafter needs golden continuations (make_drafter(..., oracle=...))")
        return OracleDrafter(oracle, vocab_size, horizon=horizon or 8, device=device)
    from engine.speculative.dflash import load_dflash

    if not getattr(spec, "draft_model", None):
        raise ValueError("the dflash drafter needs --draft-model PATH")
    return load_dflash(spec.draft_model, target_model, vocab_size, device=device,
                       dtype=dtype or (param.dtype if param is not None else torch.float32))
