"""Suffix-match drafting from a table of token histories: the specification of ext/csrc/ngram.cu and its CPU
implementation (ext.ops.ngram_propose).

The drafting rule is engine.speculative.ngram's (its module docstring gives the weights, the conditional depths
and the calibration); here it runs from each request's whole history on every call instead of an incremental
index, so that a kernel can draft with no host state: one request per row of `history`, its root at
root_positions[i] (tokens 0..root are committed, the root not yet seen by the target).

Before drafting, a call may write the tokens the previous tree step emitted (accepted drafts, then the bonus) into
the table, on the device: emitted[i, :num_new[i]] go to positions root - num_new + 1 .. root, so a tree step can
be drafted before its predecessor's results reach the host.

Per request and depth 1..L the result holds the K best candidates (shares ranked descending, ties by token id),
the top's probability calibrated from (hits, seen) per bucket when they are given, padded as the drafter protocol
asks (engine.speculative.drafter.pack_candidates); `tops` gives what the host checks the calibration with: the
history length the draft was made at (-1: no match, nothing drafted), the top token of every depth and its
calibration bucket.

Float64 here (the host drafter's arithmetic, to the bit); the kernel computes in fp32, so scores that tie within
fp32 rounding may rank differently there.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ext.reference.candidates import pack_candidates

NUM_SHARE_BINS = 10  # calibration buckets per depth group: share deciles
NUM_DEPTH_GROUPS = 3  # depth 1, depth 2, deeper
NUM_BUCKETS = NUM_SHARE_BINS * NUM_DEPTH_GROUPS
BUCKET_EPS = 1e-4  # in deciles (ext/csrc/kernels.h kNgramBucketEps)


def bucket_of(depth: int, share: float) -> int:
    """The calibration bucket of a top candidate at this depth (1-based) with this share. Shares on a decile's edge
    are common (m/(m+1) for m matches: 1/2, 4/5, 9/10) and land in the upper decile however they were rounded
    (BUCKET_EPS), so the fp32 kernel buckets them as the host does."""
    group = min(depth, NUM_DEPTH_GROUPS) - 1
    return group * NUM_SHARE_BINS + min(NUM_SHARE_BINS - 1, int(share * NUM_SHARE_BINS + BUCKET_EPS))


def write_emitted(history: torch.Tensor, rows: torch.Tensor, root_positions: torch.Tensor, emitted: torch.Tensor,
                  num_new: torch.Tensor) -> None:
    """history[rows[i], root - num_new + 1 + j] = emitted[i, j] for j < num_new[i] (in place)."""
    width = emitted.shape[1]
    offsets = torch.arange(width, device=history.device)
    positions = root_positions.to(history.device)[:, None] - num_new.to(history.device)[:, None] + 1 + offsets
    keep = offsets < num_new.to(history.device)[:, None]  # [N, A]
    row_index = rows.to(history.device)[:, None].expand_as(positions)
    history[row_index[keep], positions[keep]] = emitted.to(history.device, history.dtype)[keep]


def suffix_matches(t: np.ndarray, max_ngram: int, max_matches: int, backoff: float, recency: float
                   ) -> tuple[list[tuple[int, float]], float]:
    """weigh_levels() of the earlier occurrences of the history's suffixes, found by scanning the history (t: up to
    and including the root)."""
    total = len(t)
    ends = np.arange(total - 1)  # n-grams ending at e <= total - 2 have a continuation
    same = np.ones(total - 1, dtype=bool)
    recent_of = []
    for n in range(1, min(max_ngram, total) + 1):
        back = ends - (n - 1)
        same &= (back >= 0) & (t[np.maximum(back, 0)] == t[total - n])
        recent_of.append(ends[same][-max_matches:].tolist())  # the most recent, ascending
    return weigh_levels(recent_of[::-1], total, backoff, recency)


def weigh_levels(recent_by_level: list[list[int]], total: int, backoff: float, recency: float
                 ) -> tuple[list[tuple[int, float]], float]:
    """([(end position p, weight)] of the suffix's matches, each position once with its weights over every level
    summed (a longer suffix's match is also a shorter one's), in first-seen order from the longest level down; the
    sum of the level scales). recent_by_level: per suffix length, longest first, the end positions of its most
    recent earlier occurrences, ascending."""
    weights_at: dict[int, float] = {}
    longest, mass = None, 0.0
    for depth_down, recent in enumerate(recent_by_level):
        if not recent:
            continue
        longest = depth_down if longest is None else longest
        scale = backoff ** (depth_down - longest)
        mass += scale
        weights = [1.0 + recency * (p + 1) / total for p in recent]
        level = scale * len(recent) / (len(recent) + 1) / sum(weights)
        for p, w in zip(recent, weights):
            weights_at[p] = weights_at.get(p, 0.0) + w * level
    return list(weights_at.items()), mass


def probabilities(ranked: list[tuple[int, float]], mass: float, depth: int, cal: list[list[float]] | None,
                  cal_prior: float) -> tuple[list[tuple[int, float]], int]:
    """(token, log-prob) of one depth's ranked candidates and the top's calibration bucket: the top calibrated
    (cal: [hits, seen] per bucket; None: shares as they are), ties with it equal, the rest sharing what remains in
    proportion to their shares."""
    shares = [s / mass for _, s in ranked]
    top_share = shares[0]
    bucket = bucket_of(depth, top_share)
    if cal is None:
        return [(tok, math.log(s)) for (tok, _), s in zip(ranked, shares)], bucket
    num_tied = sum(1 for s in shares if s == top_share)
    hits, seen = cal[0][bucket], cal[1][bucket]
    top = min((hits + cal_prior * top_share) / (seen + cal_prior), 1.0 / num_tied)
    rest_share = 1.0 - num_tied * top_share
    scale = (1.0 - num_tied * top) / rest_share if rest_share > 1e-12 else 0.0
    probs = [top if s == top_share else s * scale for s in shares]
    return [(tok, math.log(max(p, 1e-30))) for (tok, _), p in zip(ranked, probs)], bucket


def draft_depths(t: Sequence[int], matches: list[tuple[int, float]], mass: float, horizon: int,
                 cal: list[list[float]] | None, cal_prior: float
                 ) -> tuple[list[list[tuple[int, float]]], list[tuple[int, int]]]:
    """From the suffix's matches (suffix_matches) and the sum of level scales: per depth 1..L the ranked (token,
    log-prob) candidates, and (top token, bucket) per depth. Depth d counts only the matches that predicted the top
    token at every depth before it. Empty lists without matches."""
    total = len(t)
    if not matches:  # nothing to continue (the survivors of a depth are never empty: the top came from them)
        return [[] for _ in range(horizon)], []
    rows, tops = [], []
    for d in range(1, horizon + 1):
        scores: dict[int, float] = {}
        predicted = []  # each surviving match's token at this depth
        for p, w in matches:
            token = int(t[p + d]) if p + d < total else int(t[p + 1 + (d - 1) % (total - 1 - p)])
            scores[token] = scores.get(token, 0.0) + w
            predicted.append(token)
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        if d > 1:  # conditional on the path: over the survivors' weight, m/(m+1) for m survivors
            mass = sum(w for _, w in matches) * (len(matches) + 1) / len(matches)
        row, bucket = probabilities(ranked, mass, d, cal, cal_prior)
        rows.append(row)
        tops.append((ranked[0][0], bucket))
        matches = [m for m, token in zip(matches, predicted) if token == ranked[0][0]]
    return rows, tops


def ngram_propose(history: torch.Tensor, rows: torch.Tensor, root_positions: torch.Tensor,
                  emitted: torch.Tensor | None, num_new: torch.Tensor | None, calibration: torch.Tensor | None,
                  horizon: int, top_k: int, vocab_size: int, max_ngram: int, max_matches: int, backoff: float,
                  recency: float, cal_prior: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """history [R, W] int32 (every request's tokens, one row each; written in place when emitted is given), rows
    [N] int64 (each request's row), root_positions [N] int64, emitted [N, A] int64 and num_new [N] int64 (or
    None), calibration [2, NUM_BUCKETS] (hits, seen; None: shares as probabilities) -> (log-probs [N, L, K] f32,
    token ids [N, L, K] int64, tops [N, 1 + 2L] int64: history length drafted at or -1, top token per depth,
    bucket per depth)."""
    if emitted is not None:
        write_emitted(history, rows, root_positions, emitted, num_new)
    table = history.cpu().numpy()
    cal = calibration.double().cpu().tolist() if calibration is not None else None
    all_rows, tops = [], torch.full((len(rows), 1 + 2 * horizon), -1, dtype=torch.int64)
    for i, (row, root) in enumerate(zip(rows.tolist(), root_positions.tolist())):
        t = table[row, :root + 1].astype(np.int64)
        matches, mass = suffix_matches(t, max_ngram, max_matches, backoff, recency)
        drafted, top = draft_depths(t, matches, mass, horizon, cal, cal_prior)
        all_rows.extend(drafted)
        if top:
            tops[i, 0] = root + 1
            tops[i, 1:1 + horizon] = torch.tensor([tok for tok, _ in top])
            tops[i, 1 + horizon:] = torch.tensor([b for _, b in top])
    lp, ids = pack_candidates(all_rows, top_k, vocab_size, device=history.device)  # [N*L, K]
    k = lp.shape[-1]
    return lp.view(len(rows), horizon, k), ids.view(len(rows), horizon, k), tops.to(history.device)
