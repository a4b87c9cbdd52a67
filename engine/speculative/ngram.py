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

from dataclasses import dataclass, field

import torch

from engine.speculative.drafter import DraftRequest, pack_candidates
from ext.reference.ngram import NUM_BUCKETS, draft_depths, weigh_levels

_CHECK = 8  # committed tokens compared to detect a request whose history was rewritten
CAL_PRIOR = 2.0  # pseudo-observations at the share itself behind each bucket's hit rate
CAL_DECAY = 0.995  # per observation of a bucket


def rewritten(known: list[int], toks: list[int]) -> bool:
    """Whether a request's committed tokens `toks` no longer extend what a drafter saw of them (`known`), judged by
    the last _CHECK known tokens (a request id reused, or its history otherwise rewritten)."""
    m = len(known)
    return m > len(toks) or toks[max(0, m - _CHECK):m] != known[max(0, m - _CHECK):]


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    indexed: int = 0  # n-grams ending at positions < indexed are in `ends`
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions, ascending
    # top candidates not yet checked against the committed tokens: [root index + 1, [(token, bucket)...], checked]
    pending: list[list] = field(default_factory=list)


class Calibration:
    """How often the drafter's top candidate was the token the target committed, per calibration bucket (depth
    group * share decile: ext.reference.ngram.bucket_of), as decayed counts; depth d > 1 is checked only when
    depths 1..d-1 were right (the conditional probability a path's product needs)."""

    def __init__(self):
        self.hits, self.seen = [0.0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS

    @property
    def table(self) -> list[list[float]]:
        """[hits, seen] per bucket, as ext.reference.ngram.probabilities reads them."""
        return [self.hits, self.seen]

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


class NgramRule:
    """The rule's settings and calibration, shared by the host drafter and the device one (ngram_device.py)."""
    target_layer_ids: tuple[int, ...] = ()
    request_specific = True  # a tree comes from its request's own text (engine.speculative.drafter.Drafter)

    def __init__(
        self,
        vocab_size: int,
        horizon: int = 8,
        max_ngram: int = 4,
        max_matches: int = 32,  # most recent matches used per suffix length
        backoff: float = 0.1,
        recency: float = 1.0,
        calibrate: bool = True,  # False: a top candidate's probability is its share (no learning from history)
    ):
        if horizon < 1 or max_ngram < 1 or max_matches < 1:
            raise ValueError("ngram drafter: horizon, max_ngram and max_matches must be >= 1")
        if not 0 < backoff <= 1:
            raise ValueError(f"ngram drafter: backoff must be in (0, 1], got {backoff}")
        self.vocab_size, self.horizon, self.max_ngram = vocab_size, horizon, max_ngram
        self.max_matches, self.backoff, self.recency = max_matches, backoff, recency
        self.calibration = Calibration() if calibrate else None


class NgramDrafter(NgramRule):
    def __init__(self, vocab_size: int, horizon: int = 8, max_ngram: int = 4, max_matches: int = 32,
                 backoff: float = 0.1, recency: float = 1.0, calibrate: bool = True,
                 device: torch.device | str = "cpu"):
        super().__init__(vocab_size, horizon, max_ngram, max_matches, backoff, recency, calibrate)
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
        total = len(index.tokens)
        matches, mass = self._matches(index)
        cal = self.calibration.table if self.calibration is not None else None
        rows, tops = draft_depths(index.tokens, matches, mass, self.horizon, cal, CAL_PRIOR)
        if self.calibration is not None and tops:
            if index.pending and index.pending[-1][0] == total:  # drafted again before any new token
                index.pending.pop()
            index.pending.append([total, tops, 0])
        return rows

    def _matches(self, index: _Index) -> tuple[list[tuple[int, float]], float]:
        """([(end position p, weight)] of the suffix's earlier occurrences, each position once with its weights over
        every level summed (a longer suffix's match is also a shorter one's), sum of level scales)."""
        t, total = index.tokens, len(index.tokens)
        recent = [index.ends.get(tuple(t[total - n:]), [])[-self.max_matches:]
                  for n in range(min(self.max_ngram, total), 0, -1)]
        return weigh_levels(recent, total, self.backoff, self.recency)

    def _sync(self, req: DraftRequest) -> _Index:
        """Brings the request's index up to its committed tokens; rebuilds it if the history changed."""
        toks = req.token_ids
        index = self._state.get(req.request_id)
        if index is not None and rewritten(index.tokens, toks):
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
