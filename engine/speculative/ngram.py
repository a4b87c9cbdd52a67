"""N-gram / suffix-match drafter: needs no weights and no target features.

For a request with committed tokens t[0..T-1] (t[T-1] is the root), the suffix s_n = t[T-n..T-1] of every
length n = min(max_ngram, T) .. 1 is looked up in a per-request index of earlier occurrences (n-grams ending
at positions p <= T-2, so the suffix never matches itself). A match ending at p predicts, at depth d, the
token t[p + d]; when p + d runs past the committed tokens the match is read as a period P = T-1-p and the
continuation repeats (t[p + 1 + (d-1) % P]), so a repetition seen once already predicts every depth.

Weights: each match weighs 1 + recency * (p+1)/T (newer matches count more); a level's weights are normalised and
scaled by m/(m+1) for its m matches (more evidence, more confidence), then by backoff^(n_longest - n) (shorter
suffixes contribute less); a position matched at several levels is one match with their weights summed. Depth 1's
share of a token is its matches' weight over the sum of the level scales. Deeper depths are conditional on the path
of top candidates: depth d counts only the matches that predicted the top token at every depth before it (DDTree
multiplies a path's per-depth probabilities, so each depth must say how likely its token is once the path to it
was right; counted over all matches, a single repetition's depth-8 chain came out at 0.5^8 where it held half the
time). Their share: weight over the surviving matches' weight, times m/(m+1) for m surviving positions.

Calibration: shares are not probabilities (on chat text, a depth-1 top at share 0.6-1.0 was right 97-100% of the
time, one at 0.4-0.6 64%). The drafter checks its own top candidates against the tokens committed later and keeps,
per depth group (1, 2, deeper) and share decile, a decayed hit rate behind a prior of CAL_PRIOR observations at the
share itself; a top candidate's probability is that rate, the other candidates share what remains in proportion to
their shares. Candidates are ordered by share descending, ties by token id ascending (tied candidates get equal
probabilities), so the output is deterministic for a given history; missing slots are padded by
engine.speculative.drafter.pack_candidates.

The index is updated incrementally: each call only indexes the tokens committed since the previous one, so
a long prompt is indexed once (O(T * max_ngram)) and every later step costs O(new tokens + matches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.speculative.drafter import DraftRequest, pack_candidates

_CHECK = 8  # committed tokens compared to detect a request whose history was rewritten
NUM_SHARE_BINS = 10  # calibration buckets per depth group: share deciles
NUM_DEPTH_GROUPS = 3  # depth 1, depth 2, deeper (deeper tops, once the path to them held, are right more often)
CAL_PRIOR = 2.0  # pseudo-observations at the share itself behind each bucket's hit rate
CAL_DECAY = 0.995  # per observation of a bucket


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    indexed: int = 0  # n-grams ending at positions < indexed are in `ends`
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions, ascending
    # top candidates not yet checked against the committed tokens: [root index + 1, [(token, bucket)...], checked]
    pending: list[list] = field(default_factory=list)


class _Calibration:
    """How often the drafter's top candidate was the token the target committed, per calibration bucket (depth
    group * NUM_SHARE_BINS + share decile), as decayed counts; depth d > 1 is checked only when depths 1..d-1
    were right (the conditional probability a path's product needs)."""

    def __init__(self):
        num = NUM_DEPTH_GROUPS * NUM_SHARE_BINS
        self.hits, self.seen = [0.0] * num, [0.0] * num

    @staticmethod
    def bucket(depth: int, share: float) -> int:
        group = min(depth, NUM_DEPTH_GROUPS) - 1
        return group * NUM_SHARE_BINS + min(NUM_SHARE_BINS - 1, int(share * NUM_SHARE_BINS))

    def probability(self, bucket: int, share: float) -> float:
        return (self.hits[bucket] + CAL_PRIOR * share) / (self.seen[bucket] + CAL_PRIOR)

    def check(self, index: _Index) -> None:
        """Scores the request's pending top candidates against the tokens committed since they were drafted."""
        t, total, still = index.tokens, len(index.tokens), []
        for entry in index.pending:
            start, tops, checked = entry
            while checked < len(tops) and start + checked < total:
                token, bucket = tops[checked]
                hit = t[start + checked] == token
                self.hits[bucket] = CAL_DECAY * self.hits[bucket] + hit
                self.seen[bucket] = CAL_DECAY * self.seen[bucket] + 1.0
                checked = checked + 1 if hit else len(tops)
            if checked < len(tops):
                entry[2] = checked
                still.append(entry)
        index.pending = still


class NgramDrafter:
    target_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        vocab_size: int,
        horizon: int = 8,
        max_ngram: int = 4,
        max_matches: int = 32,  # most recent matches used per suffix length
        backoff: float = 0.1,
        recency: float = 1.0,
        calibrate: bool = True,  # False: a top candidate's probability is its share (no learning from history)
        device: torch.device | str = "cpu",
    ):
        if horizon < 1 or max_ngram < 1 or max_matches < 1:
            raise ValueError("ngram drafter: horizon, max_ngram and max_matches must be >= 1")
        if not 0 < backoff <= 1:
            raise ValueError(f"ngram drafter: backoff must be in (0, 1], got {backoff}")
        self.vocab_size, self.horizon, self.max_ngram = vocab_size, horizon, max_ngram
        self.max_matches, self.backoff, self.recency = max_matches, backoff, recency
        self.calibration = _Calibration() if calibrate else None
        self.device = device
        self._state: dict[str, _Index] = {}

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows: list[list[tuple[int, float]]] = []
        for req in batch:
            rows.extend(self.candidates(req))
        lp, ids = pack_candidates(rows, top_k, self.vocab_size, device=self.device)  # [N*L, K]
        k = lp.shape[-1]
        return lp.view(len(batch), self.horizon, k), ids.view(len(batch), self.horizon, k)

    def candidates(self, req: DraftRequest) -> list[list[tuple[int, float]]]:
        """Per depth 1..L: [(token id, log-prob)] sorted by log-prob descending, then token id."""
        if not req.token_ids:
            raise ValueError(f"request {req.request_id}: no committed tokens (the root token is needed)")
        index = self._sync(req)
        if self.calibration is not None:
            self.calibration.check(index)
        t, total = index.tokens, len(index.tokens)
        matches, mass = self._matches(index)
        if not matches:  # nothing to continue (the survivors of a depth are never empty: the top came from them)
            return [[] for _ in range(self.horizon)]
        rows, tops = [], []
        for d in range(1, self.horizon + 1):
            scores: dict[int, float] = {}
            predicted = []  # each surviving match's token at this depth
            for p, w in matches:
                token = t[p + d] if p + d < total else t[p + 1 + (d - 1) % (total - 1 - p)]
                scores[token] = scores.get(token, 0.0) + w
                predicted.append(token)
            ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
            if d > 1:  # conditional on the path: over the survivors' weight, m/(m+1) for m survivors
                mass = sum(w for _, w in matches) * (len(matches) + 1) / len(matches)
            rows.append(self._probabilities(ranked, mass, d, tops))
            top = ranked[0][0]
            matches = [m for m, token in zip(matches, predicted) if token == top]
        if self.calibration is not None:
            if index.pending and index.pending[-1][0] == total:  # drafted again before any new token
                index.pending.pop()
            index.pending.append([total, tops, 0])
        return rows

    def _matches(self, index: _Index) -> tuple[list[tuple[int, float]], float]:
        """([(end position p, weight)] of the suffix's earlier occurrences, each position once with its weights over
        every level summed (a longer suffix's match is also a shorter one's), sum of level scales)."""
        t, total = index.tokens, len(index.tokens)
        weights_at: dict[int, float] = {}
        longest, mass = None, 0.0
        for n in range(min(self.max_ngram, total), 0, -1):
            ends = index.ends.get(tuple(t[total - n :]))
            if not ends:
                continue
            longest = n if longest is None else longest
            scale = self.backoff ** (longest - n)
            mass += scale
            recent = ends[-self.max_matches :]
            weights = [1.0 + self.recency * (p + 1) / total for p in recent]
            level = scale * len(recent) / (len(recent) + 1) / sum(weights)
            for p, w in zip(recent, weights):
                weights_at[p] = weights_at.get(p, 0.0) + w * level
        return list(weights_at.items()), mass

    def _probabilities(self, ranked: list[tuple[int, float]], mass: float, depth: int, tops: list
                       ) -> list[tuple[int, float]]:
        """(token, log-prob) of one depth's candidates, ranked by score; the top's calibrated (appending it to
        `tops` for checking later), ties with it equal, the rest sharing what remains in proportion."""
        shares = [s / mass for _, s in ranked]
        if self.calibration is None:
            return [(tok, math.log(s)) for (tok, _), s in zip(ranked, shares)]
        top_share, num_tied = shares[0], sum(1 for s in shares if s == shares[0])
        bucket = _Calibration.bucket(depth, top_share)
        tops.append((ranked[0][0], bucket))
        top = min(self.calibration.probability(bucket, top_share), 1.0 / num_tied)
        rest_share = 1.0 - num_tied * top_share
        scale = (1.0 - num_tied * top) / rest_share if rest_share > 1e-12 else 0.0
        probs = [top if s == top_share else s * scale for s in shares]
        return [(tok, math.log(max(p, 1e-30))) for (tok, _), p in zip(ranked, probs)]

    def _sync(self, req: DraftRequest) -> _Index:
        """Brings the request's index up to its committed tokens; rebuilds it if the history changed."""
        toks = req.token_ids
        index = self._state.get(req.request_id)
        if index is not None:
            m = len(index.tokens)
            if m > len(toks) or toks[max(0, m - _CHECK) : m] != index.tokens[max(0, m - _CHECK) :]:
                index = None
        if index is None:
            index = self._state[req.request_id] = _Index()
        index.tokens.extend(toks[len(index.tokens) :])
        t, ends = index.tokens, index.ends
        for e in range(index.indexed, len(t) - 1):  # n-grams ending at e <= T-2 have a continuation
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                key = tuple(t[e - n + 1 : e + 1])
                bucket = ends.get(key)
                if bucket is None:
                    ends[key] = [e]
                else:
                    bucket.append(e)
        index.indexed = max(index.indexed, len(t) - 1)
        return index
