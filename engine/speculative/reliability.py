"""The adaptive budget's reliability curve: how often the drafter's nodes were accepted against the draft
probability it gave them, per confidence bin (q in [2^-(k+1), 2^-k), engine/speculative/confidence.py), as sums
decayed by the engine step, each bin blended with the engine-wide ratio (BIN_PRIOR predicted drafts of it); and
the undecayed counts since the metrics last took them."""
from __future__ import annotations

from engine.speculative.confidence import CONFIDENCE_LABELS, NUM_BINS

BIN_PRIOR = 0.25  # predicted drafts of the engine-wide ratio behind each bin's own (a bin of q ~ 0.1 sees ~1 a step)


class ReliabilityBins:
    def __init__(self):
        self.accepted = [0.0] * NUM_BINS  # per confidence bin, decayed by the step
        self.predicted = [0.0] * NUM_BINS
        self.step_accepted = [0] * NUM_BINS  # undecayed, since the last take_counts(): for metrics
        self.step_predicted = [0.0] * NUM_BINS
        self._curve: list[float] | None = None  # per bin, from the sums above; None: to be recomputed
        self._ceiling = 0.0  # the curve's highest bin

    def decay(self, factor: float) -> None:
        self.accepted = [factor * a for a in self.accepted]
        self.predicted = [factor * p for p in self.predicted]
        self._curve = None

    def observe(self, trees: list[tuple[list[float], list[int], int, list[int]]]) -> None:
        """A step's verified trees, each (node q, node bins, budget verified, accepted tree rows: row j >= 1 is node
        j - 1), summed per bin over the step and added once (at batch 64 a round's 64 trees, one by one, took ~240
        us of the host's critical path on the 2-core CPU). Lists indexed by bin, not dicts."""
        acc, pred, seen = [0] * NUM_BINS, [0.0] * NUM_BINS, [False] * NUM_BINS
        for node_q, node_bins, budget, accepted_rows in trees:
            verified = min(budget, len(node_bins))
            for q, k in zip(node_q[:verified], node_bins):
                pred[k] += q
                seen[k] = True
            for row in set(accepted_rows):
                if 1 <= row <= verified:
                    acc[node_bins[row - 1]] += 1
        for k in range(NUM_BINS):
            if seen[k]:
                self.accepted[k] += acc[k]
                self.predicted[k] += pred[k]
                self.step_accepted[k] += acc[k]
                self.step_predicted[k] += pred[k]
        self._curve = None

    def curve(self, engine_ratio: float) -> list[float]:
        """accepted / predicted per bin, each blended with the engine-wide ratio; recomputed only after the sums
        changed (the engine-wide ratio changes with them)."""
        if self._curve is None:
            self._curve = [(a + BIN_PRIOR * engine_ratio) / (p + BIN_PRIOR)
                           for a, p in zip(self.accepted, self.predicted)]
            self._ceiling = max(self._curve)
        return self._curve

    def ceiling(self, engine_ratio: float) -> float:
        """The curve's highest ratio (as curve(), recomputed only after the sums changed)."""
        self.curve(engine_ratio)
        return self._ceiling

    def take_counts(self) -> dict[str, tuple[int, float]]:
        """Per confidence bin (named by its lowest q) verified since the last call: (accepted nodes, sum of their
        draft probabilities over all verified nodes); bins without verified nodes are left out."""
        counts = {CONFIDENCE_LABELS[k]: (self.step_accepted[k], self.step_predicted[k])
                  for k in range(NUM_BINS) if self.step_predicted[k] > 0}
        self.step_accepted, self.step_predicted = [0] * NUM_BINS, [0.0] * NUM_BINS
        return counts
