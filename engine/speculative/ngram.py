"""N-gram / suffix-match drafter: needs no weights and no target features.

For a request with committed tokens t[0..T-1] (t[T-1] is the root), the suffix s_n = t[T-n..T-1] of every
length n = min(max_ngram, T) .. 1 is looked up in a per-request index of earlier occurrences (n-grams ending
at positions p <= T-2, so the suffix never matches itself). A match ending at p predicts, at depth d, the
token t[p + d]; when p + d runs past the committed tokens the match is read as a period P = T-1-p and the
continuation repeats (t[p + 1 + (d-1) % P]), so a repetition seen once already predicts every depth.

Scores per depth: each match weighs 1 + recency * (p+1)/T (newer matches count more); a level's weights are
normalised and scaled by m/(m+1) for its m matches (more evidence, more confidence), then by
backoff^(n_longest - n) (shorter suffixes contribute less). log-prob = log(score / sum of level scales).
Candidates are ordered by score descending, ties by token id ascending, so the output is deterministic;
missing slots are padded by engine.speculative.drafter.pack_candidates.

The index is updated incrementally: each call only indexes the tokens committed since the previous one, so
a long prompt is indexed once (O(T * max_ngram)) and every later step costs O(new tokens + matches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.speculative.drafter import DraftRequest, pack_candidates

_CHECK = 8  # committed tokens compared to detect a request whose history was rewritten


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    indexed: int = 0  # n-grams ending at positions < indexed are in `ends`
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions, ascending


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
        device: torch.device | str = "cpu",
    ):
        if horizon < 1 or max_ngram < 1 or max_matches < 1:
            raise ValueError("ngram drafter: horizon, max_ngram and max_matches must be >= 1")
        if not 0 < backoff <= 1:
            raise ValueError(f"ngram drafter: backoff must be in (0, 1], got {backoff}")
        self.vocab_size, self.horizon, self.max_ngram = vocab_size, horizon, max_ngram
        self.max_matches, self.backoff, self.recency = max_matches, backoff, recency
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
        t, total = index.tokens, len(index.tokens)
        scores: list[dict[int, float]] = [{} for _ in range(self.horizon)]
        longest, mass = None, 0.0
        for n in range(min(self.max_ngram, total), 0, -1):
            matches = index.ends.get(tuple(t[total - n :]))
            if not matches:
                continue
            longest = n if longest is None else longest
            scale = self.backoff ** (longest - n)
            mass += scale
            recent = matches[-self.max_matches :]
            weights = [1.0 + self.recency * (p + 1) / total for p in recent]
            level = scale * len(recent) / (len(recent) + 1) / sum(weights)
            for p, w in zip(recent, weights):
                period = total - 1 - p
                for d in range(1, self.horizon + 1):
                    i = p + d if p + d < total else p + 1 + (d - 1) % period
                    depth = scores[d - 1]
                    depth[t[i]] = depth.get(t[i], 0.0) + w * level
        rows = []
        for depth in scores:
            ranked = sorted(depth.items(), key=lambda kv: (-kv[1], kv[0]))
            rows.append([(tok, math.log(s / mass)) for tok, s in ranked])
        return rows

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
