"""Measured step times per CUDA-graph shape: what a tree round costs beyond a plain step at the same batch, as the
engine ran it (device, host and drafting together), for the adaptive budget's uniform width (step_budgets.py).

Why measured and not fitted. Under CUDA graphs a step's time is set by its captured shape (batch bucket x width
bucket), not by its rows: on an H100 with the embedded model a tree round at batch 64 took 2.80 ms against 1.34 for
a plain step, of which ~1.4 ms is per-request host work of a round (scheduling ahead, the drafter's call, the
budget's bookkeeping), whatever the width. A line fitted on rows priced that round at ~23 tokens of throughput
where it cost ~70, so every round lost (docs/BENCHMARKS.md, 2026-12-06). Graph shapes are few and their times
steady, so a decayed mean per shape is the price. A width not measured yet is priced by its rows at the fitted
slope (the padded rows its graph runs) plus the least fixed part any measured shape showed (its extra beyond its
rows' price): optimistic, so it gets tried and measured.

Steps that ran ahead of their predecessor's results and synchronous ones are kept apart: a synchronous step's time
holds the host's scheduling, drafting and launch that a step launched ahead hides. Under load on an H100 a tree round
scheduled synchronously (an admission) took 5.1 ms against 2.7 for a plain admission step, where rounds ahead took 3.0
against 1.2: priced like a round ahead, trees ran in admission steps, their extra 52 tokens a step bought with 2.4 ms
(22 tokens a ms, against plain decoding's 46).
What is not counted: a shape's first step (its first replay pays one-time costs), and the caller skips a batch's
warm-up steps (the drafter taking in many prompts made a batch-64 plain step 8-11 ms). A tree shape's record
ages by the plain steps at its batch (STALE_DECAY) and is not believed below MIN_TREE_WEIGHT: a round measured dear
under a slow host is priced by its rows again after ~70 plain steps, so it gets re-measured. The round that leaves
trees (every budget 0, run as root-only trees because its predecessor's results are still on the device) is kept
as its own shape: the step that enters trees pays it."""
from __future__ import annotations

from typing import Callable, Hashable

DECAY = 0.9  # per observed step of the same shape
STALE_DECAY = 0.99  # a tree shape's weight, per plain step at its batch
MIN_PLAIN_WEIGHT = 1.5  # a plain shape's decayed weight before its mean is used (two steps)
MIN_TREE_WEIGHT = 0.5  # a tree shape's weight below which its mean is not believed
SPIKE_CLIP = 4.0  # one step counts at most this many times its shape's mean (a GC pause, a busy host)
LEAVING = 0  # the width slot of the round that leaves trees
# what each node of width costs a step at a batch whose plain step is not measured yet: so much that only probes run
# there until it is (three plain steps), each at its own width. Priced by rows instead, a batch-64 run on an H100
# verified trees in 27 of its first 30 steps at twice a plain step's time: each tree round was followed by the
# root-only round leaving it, so no plain step was ever measured to hold them against. (At one price for every
# width the widest is the cheapest per node, and a probe's round would go out as wide as any request's tree: on an
# H100 16 nodes wide, every request filling them, cost 3.5 ms against 2.0-2.3 for a round at a probe's width.)
UNMEASURED_PLAIN = 1.0


class StepCosts:
    def __init__(self, shape_of: Callable[[int, int], tuple[Hashable, int]] | None = None):
        """shape_of(num_seqs, width): the graph shape a decoding step runs as, (batch bucket, width bucket); None
        (no CUDA graphs): nothing is measured and every price is None."""
        self.shape_of = shape_of
        self._buckets: dict[tuple[int, int], tuple[int, list[int]]] = {}  # _width_buckets', for _buckets_of
        self._buckets_of = shape_of
        self.reset()

    def reset(self) -> None:
        # (batch bucket, width bucket or LEAVING, synchronous) -> [decayed weight, decayed sum of seconds]
        self.means: dict[tuple, list[float]] = {}
        self.tree_shapes: dict[int, list[tuple]] = {}  # batch bucket -> its tree and leaving shapes run ahead
        self.seen: set[tuple] = set()  # shapes whose first step has passed
        # tree rounds run ahead, by whether their shape's own measured mean was believed when they came, or their
        # width was priced by rows (never measured, or gone stale): what chose a run's rounds (bench/step_kinds.py)
        self.rounds_believed = self.rounds_priced_by_rows = 0

    def observe(self, num_seqs: int, width: int, seconds: float, leaving: bool = False,
                synchronous: bool = False) -> None:
        """One decoding step: its requests, its rows per request (1: plain) and its wall time. leaving: a root-only
        round after trees. synchronous: scheduled after its predecessor's results (its own table)."""
        if self.shape_of is None or seconds <= 0:
            return
        batch, bucket = self.shape_of(num_seqs, width)
        key = (batch, LEAVING if leaving else bucket, synchronous)
        if key[1] not in (1, LEAVING) and not synchronous:
            if self._mean(key, MIN_TREE_WEIGHT) is None:
                self.rounds_priced_by_rows += 1
            else:
                self.rounds_believed += 1
        if key not in self.seen:
            self.seen.add(key)
            return
        record = self.means.get(key)
        if record is None:
            record = self.means[key] = [0.0, 0.0]
            if key[1] != 1 and not synchronous:
                self.tree_shapes.setdefault(batch, []).append(key)
        if record[0] > 0:
            seconds = min(seconds, SPIKE_CLIP * record[1] / record[0])
        record[0], record[1] = DECAY * record[0] + 1.0, DECAY * record[1] + seconds
        if key[1] == 1:
            for (b, w, sync), other in self.means.items():
                if b == batch and w != 1 and sync == synchronous:
                    other[0] *= STALE_DECAY
                    other[1] *= STALE_DECAY

    def _mean(self, key: tuple, min_weight: float) -> float | None:
        record = self.means.get(key)
        return record[1] / record[0] if record is not None and record[0] >= min_weight else None

    def round_extra(self, num_seqs: int) -> tuple[float | None, float | None, float]:
        """Launched ahead at this batch: (a plain step's measured time, None if not measured (nor anything else);
        the least extra over it that any tree round measured, None if none did; the extra of the round that leaves
        trees, 0 if not measured), however long ago: a record gone stale keeps its mean (the adaptive budget's
        explore period, which must not fall back to an optimistic price every ~70 plain steps as a width's price
        does, width_seconds). All None without graphs."""
        if self.shape_of is None:
            return None, None, 0.0
        batch = self.shape_of(num_seqs, 1)[0]
        plain = self._mean((batch, 1, False), MIN_PLAIN_WEIGHT)
        if plain is None:
            return None, None, 0.0
        extras: dict[bool, list[float]] = {False: [], True: []}  # leaving round or not -> extras
        for key in self.tree_shapes.get(batch, ()):
            weight, total = self.means[key]
            if weight > 0:
                extras[key[1] == LEAVING].append(max(0.0, total / weight - plain))
        return plain, min(extras[False], default=None), min(extras[True], default=0.0)

    def extra(self, num_seqs: int, width: int, leaving: bool = False) -> float | None:
        """Seconds a step of `width` rows a request (or the leaving round) costs beyond a plain step at this batch,
        both run ahead, as measured and believed; None when either is not."""
        if self.shape_of is None:
            return None
        batch, bucket = self.shape_of(num_seqs, width)
        plain = self._mean((batch, 1, False), MIN_PLAIN_WEIGHT)
        return None if plain is None else self._extra_over(plain, (batch, LEAVING if leaving else bucket, False))

    def _extra_over(self, plain: float, key: tuple) -> float | None:
        """A shape's believed mean beyond `plain` seconds (None: not believed)."""
        tree = self._mean(key, MIN_TREE_WEIGHT)
        return None if tree is None else max(0.0, tree - plain)

    def least_fixed(self, row_seconds: float, synchronous: bool = False) -> float:
        """The least fixed part any measured tree shape of that table showed: its extra over a plain step at its
        batch beyond its padded rows' price at row_seconds a row (0 when none is measured)."""
        fixed = []
        for (batch, width, sync), (weight, total) in self.means.items():
            plain = self._mean((batch, 1, sync), MIN_PLAIN_WEIGHT)
            if sync == synchronous and width > 1 and weight > 0 and plain is not None:
                fixed.append(max(0.0, total / weight - plain - row_seconds * (width - 1) * batch))
        return min(fixed, default=0.0)

    def width_seconds(self, num_seqs: int, top: int, row_seconds: float,
                      synchronous: bool = False) -> list[float] | None:
        """Seconds each width w = 0..top nodes a request costs a step of num_seqs requests beyond a plain one (one
        run ahead, or a synchronous one): measured where its shape is, else its shape's padded rows at row_seconds
        plus least_fixed() (as least_fixed counts them), and never less than a narrower width costs at this batch
        (a wider round runs more rows through the same work; with the least fixed part seen at any batch alone, a
        5-wide round at batch 64 could be priced below the 2-wide round measured there); UNMEASURED_PLAIN a node
        while the plain step at this batch is not measured. None without graphs."""
        if self.shape_of is None:
            return None
        batch, buckets = self._width_buckets(num_seqs, top)
        plain = self._mean((batch, 1, synchronous), MIN_PLAIN_WEIGHT)
        if plain is None:
            return [UNMEASURED_PLAIN * w for w in range(top + 1)]
        fixed = None
        out, most = [0.0], 0.0  # most: the dearest width so far
        prices: dict[int, float | None] = {}  # bucket -> its measured extra (widths share buckets)
        for bucket in buckets:
            if bucket not in prices:
                prices[bucket] = self._extra_over(plain, (batch, bucket, synchronous))
            measured = prices[bucket]
            if measured is None:
                if fixed is None:
                    fixed = self.least_fixed(row_seconds, synchronous)
                measured = max(row_seconds * (bucket - 1) * batch + fixed, most)
            out.append(measured)
            most = max(most, measured)
        return out

    def _width_buckets(self, num_seqs: int, top: int) -> tuple[int, list[int]]:
        """(the batch bucket, the width bucket of each width w = 1..top nodes) at num_seqs requests: kept, as the
        graphs' buckets do not change."""
        key = (num_seqs, top)
        if self._buckets_of is not self.shape_of:  # (set anew: its buckets may differ)
            self._buckets, self._buckets_of = {}, self.shape_of
        if key not in self._buckets:
            self._buckets[key] = (self.shape_of(num_seqs, 1)[0], [self.shape_of(num_seqs, w + 1)[1]
                                                                  for w in range(1, top + 1)])
        return self._buckets[key]
