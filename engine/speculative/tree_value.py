"""How much a request's tree is worth to the adaptive budget (adaptive.py's BudgetController inherits it): each
node's expected accepted drafts (its draft probability times its confidence bin's reliability times the request's
standing against the engine, capped at one token), the best prefix net of a row's threshold, and a bound that
answers a tree that cannot pay without working out its gains. The records it reads (the request's, the engine's,
the reliability bins) are the controller's."""
from __future__ import annotations

from itertools import accumulate

import numpy as np

from engine.speculative.confidence import NUM_BINS
from engine.speculative.request_record import RequestRecord

PRIOR_WEIGHT = 4.0  # predicted drafts of the engine-wide record behind a request's own (calibration); also the
# pseudo-observations behind the cost prior (adaptive.py)
VALUE_TOGETHER = 10  # a step's requests from this many on are valued in one numpy pass (value_together)


class TreeValue:
    def _cannot_pay(self, stats: RequestRecord, theta: float) -> bool:
        """No prefix of the request's tree can pay (an upper bound on its gains: all of its q at the best bin's
        reliability) and the drafter is not confident enough to probe: _choose's answer is (0, None) without
        working out the gains. Most requests of a drafter that found nothing hold no mass, and at batch 64 the
        full choice cost ~360 us a step on the host's critical path (two calls a request)."""
        if stats.node_q[0] > theta:  # (a tree without mass never gets here: _answer answers it)
            return False  # a confident first node: a probe may be due (_choose)
        bound = stats.q_total * self.bins.ceiling(self._engine_ratio()) * self._standing(stats, None)
        # the slack covers the rounding of a sum taken in another order than _net_best's
        return bound * (1 + 1e-9) - theta <= max(0.0, self.draft_tokens())

    def _net_best(self, stats: RequestRecord, theta: float, standing: float | None = None) -> int:
        """How many leading nodes of the request's latest tree to verify, or 0 when that does not pay for drafting.
        A node's gain (expected accepted drafts) is q times its confidence bin's reliability times the request's
        standing (its record against the engine's, unless given); the budget is the prefix of the best-first order
        (every prefix is a tree) with the largest total gain net of theta per node (gains need not decrease once
        the reliability curve bends), provided that net beats the drafting cost."""
        best, best_net = 0, 0.0
        for j, total in enumerate(accumulate(self._gains(stats, standing, self.max_budget)), 1):
            if total - theta * j > best_net:
                best, best_net = j, total - theta * j
        return best if best and best_net > self.draft_tokens() else 0

    def value_together(self, records: list[RequestRecord], theta: float) -> None:
        """_net_best of each record's own tree at `theta`, worked out in one numpy pass over an [n, budget] array and
        kept on the record until the next observation (its `best`, which _choose answers from). The values are
        _net_best's: the same products in the same order, prefix sums taken left to right, the first best prefix;
        padding nodes (gain 0) never raise a prefix's net. Node by node in Python it took ~220 of the ~240 us a
        batch-64 step's dry budgets cost on the 2-core CPU (bench/budget_host.py)."""
        if len(records) < VALUE_TOGETHER:
            return
        gains = self.gain_rows(records)  # [n, budget]
        net = np.cumsum(gains, axis=1) - theta * np.arange(1, gains.shape[1] + 1)  # [n, budget]
        last = net.argmax(axis=1)
        best_net = net[np.arange(len(records)), last]
        chosen = np.where((best_net > 0.0) & (best_net > self.draft_tokens()), last + 1, 0).tolist()
        key = (self.version, theta)
        for stats, best in zip(records, chosen):
            stats.best = (key, best)

    def gain_rows(self, records: list[RequestRecord]) -> np.ndarray:
        """[n, budget] each record's own nodes' expected accepted drafts, best-first, zero past its tree: _gains's
        values (standing from its record), the same products in the same order."""
        q, bins = self._stacked(records)  # [n, budget] each
        engine = self._engine_ratio()
        reliability = np.asarray(self.bins.curve(engine))  # [NUM_BINS]
        scale = np.array([self._standing(stats, None) for stats in records])  # [n]
        gains = q * reliability[bins] * scale[:, None]
        capped = scale * self.bins.ceiling(engine) > 1.0  # (a node is accepted at most once)
        if capped.any():
            gains = np.where(capped[:, None], np.minimum(gains, 1.0), gains)
        return gains

    def _stacked(self, records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
        """The records' node q and bins as [n, budget] arrays (zero-padded; the last bin), kept while the same
        records hold the same trees (a tree arrives as a new list: _set_tree); the last two sets are kept (a step's
        dry answers value the trees that may pay, its width all of them)."""
        lists = [stats.node_q for stats in records]
        for kept in self._stacks:
            if len(kept[0]) == len(lists) and all(a is b for a, b in zip(kept[0], lists)):
                return kept[1], kept[2]
        budget = self.max_budget
        q = np.zeros((len(records), budget))
        bins = np.full((len(records), budget), NUM_BINS - 1, dtype=np.int64)
        lengths = {len(stats.node_q) for stats in records} | {len(stats.node_bins) for stats in records}
        if len(lengths) == 1:  # (every tree as long: one conversion each, not one a row)
            n = min(budget, lengths.pop())
            q[:, :n] = np.array(lists)[:, :n]
            bins[:, :n] = np.array([stats.node_bins for stats in records])[:, :n]
        else:
            for i, stats in enumerate(records):
                n = min(budget, len(stats.node_q), len(stats.node_bins))
                q[i, :n] = stats.node_q[:n]
                bins[i, :n] = stats.node_bins[:n]
        self._stacks = [(lists, q, bins), *self._stacks[:1]]
        return q, bins

    def _gains(self, stats: RequestRecord, standing: float | None, num_nodes: int) -> list[float]:
        """The first num_nodes nodes' expected accepted drafts, best-first. A request's own (standing None) are
        kept until the next observation: at batch 64 its budget() and the step's uniform() both ask, on the
        host's critical path."""
        own = standing is None
        if own and stats.gains is not None and stats.gains[0] == self.version:
            return stats.gains[1][:num_nodes]
        reliability, scale = self._bin_reliability(), self._standing(stats, standing)
        count = self.max_budget if own else num_nodes  # a request's own: all of them, kept for the other caller
        gains = [q * reliability[k] * scale for q, k in zip(stats.node_q[:count], stats.node_bins)]
        if scale * self.bins.ceiling(self._engine_ratio()) > 1.0:  # a node is accepted at most once: never above 1
            # (a copying request's record above the engine's put its nodes at up to ~1.5 tokens each, and at
            # batch 64 on an H100 a few such requests kept choosing tree rounds that cost more than they brought)
            gains = [min(1.0, g) for g in gains]
        if own:
            stats.gains = (self.version, gains)
        return gains[:num_nodes]

    def _engine_ratio(self) -> float:
        return self.accepted / self.predicted if self.predicted > 0 else 1.0

    def _standing(self, stats: RequestRecord, standing: float | None) -> float:
        """The request's record against the engine's (given: as is)."""
        if standing is not None:
            return standing
        engine = self._engine_ratio()
        return self.calibration(stats) / engine if engine > 0 else 0.0

    def _bin_reliability(self) -> list[float]:
        return self.bins.curve(self._engine_ratio())

    def calibration(self, stats: RequestRecord) -> float:
        """accepted / predicted drafts: the request's own record, blended with the engine-wide one (weight
        PRIOR_WEIGHT in predicted drafts), so a new request starts from what this drafter has been worth."""
        accepted, predicted = stats.accepted, stats.predicted
        if self.predicted > 0:
            accepted += PRIOR_WEIGHT * self.accepted / self.predicted
            predicted += PRIOR_WEIGHT
        return accepted / predicted if predicted > 0 else 1.0
