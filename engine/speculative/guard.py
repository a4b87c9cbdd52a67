"""The measured check behind "never slower than plain decoding". The adaptive budget (adaptive.py) chooses trees from
a cost model, and a model can be wrong in ways it cannot see from inside: a tree step's cost under CUDA graphs that
no fitted line explains, a switch that stalls the asynchronous pipeline, a host that falls behind the device. The
guard measures the outcome instead. After a window of decoding steps in which trees were allowed (and some ran), it
forces a short window of plain steps (no drafting, no trees) and compares the two windows' decoding throughput, per
running request so that a batch that changed a little does not decide it (one that changed a lot discards the
check). Trees that lose stay off for a back-off, doubled while they keep losing; trees that win keep running, and
the checks come less often (the interval doubles), so a drafter that pays loses a small share of its gain to them.

Only decoding steps count (a step with a prefill chunk is neither window's), and the first step after each switch
is not measured: it carries the switch (a pipeline that cannot run ahead), which the guard causes, not the trees."""
from __future__ import annotations

from dataclasses import dataclass

WINDOW = 32  # measured decoding steps with trees allowed before the first check (and after each loss)
MAX_INTERVAL = 1024  # ... doubled by every win up to this many
PLAIN_STEPS = 8  # measured steps of a plain window
SETTLE = 1  # steps after a switch that are not measured
BACKOFF = 64  # decoding steps trees stay off after a lost check, doubled while checks keep losing
MAX_BACKOFF = 2048
MARGIN = 0.01  # trees must beat plain decoding by this share of its throughput to stay on (a tie: no drafting)
BATCH_TOLERANCE = 0.25  # a check whose windows' mean batch sizes differ by more than this share is discarded

TREES, CHECK, OFF = "trees", "check", "off"
WON, LOST, DISCARDED = "won", "lost", "discarded"


@dataclass
class _Window:
    steps: int = 0
    tree_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    request_steps: int = 0  # sum over its steps of the decoding requests

    def add(self, num_requests: int, tokens: int, seconds: float, tree: bool) -> None:
        self.steps += 1
        self.tree_steps += tree
        self.tokens += tokens
        self.seconds += seconds
        self.request_steps += num_requests

    def mean_batch(self) -> float:
        return self.request_steps / self.steps

    def rate(self) -> float:
        """Tokens per second per running request."""
        return self.tokens / self.seconds / self.mean_batch() if self.seconds > 0 else 0.0


class ThroughputGuard:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.mode = TREES
        self.interval, self.backoff = WINDOW, BACKOFF
        self.trees, self.plain = _Window(), _Window()
        self.settle = 0
        self.off_steps = 0  # decoding steps left in a back-off
        self.outcomes: list[str] = []  # checks since the last take_outcomes()
        self.num_forced_plain = 0  # decoding steps the guard kept plain since the last take_outcomes()

    def allows_trees(self) -> bool:
        return self.mode == TREES

    def observe(self, num_requests: int, tokens: int, seconds: float, tree: bool) -> None:
        """One decoding step (no prefill chunk in it): its decoding requests, the tokens they emitted, its time,
        and whether it verified trees."""
        if not self.enabled or num_requests <= 0:
            return
        if self.mode != TREES:
            self.num_forced_plain += 1
        if self.mode == OFF:
            self.off_steps -= 1
            if self.off_steps <= 0:
                self._enter(TREES)
            return
        if self.settle > 0:
            self.settle -= 1
            return
        if self.mode == TREES:
            self.trees.add(num_requests, tokens, seconds, tree)
            if self.trees.steps >= self.interval:
                if self.trees.tree_steps:
                    self._enter(CHECK)
                else:  # the budget chose plain steps throughout: nothing to check
                    self.trees = _Window()
            return
        self.plain.add(num_requests, tokens, seconds, tree)
        if self.plain.steps >= PLAIN_STEPS:
            self._decide()

    def _decide(self) -> None:
        trees, plain = self.trees, self.plain
        batch_trees, batch_plain = trees.mean_batch(), plain.mean_batch()
        if abs(batch_trees - batch_plain) > BATCH_TOLERANCE * max(batch_trees, batch_plain):
            outcome = DISCARDED
        elif trees.rate() > plain.rate() * (1 + MARGIN):
            outcome = WON
        else:
            outcome = LOST
        self.outcomes.append(outcome)
        if outcome == WON:
            self.interval, self.backoff = min(2 * self.interval, MAX_INTERVAL), BACKOFF
        if outcome == LOST:
            self.interval, self.off_steps = WINDOW, self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self._enter(OFF)
        else:
            self._enter(TREES)

    def _enter(self, mode: str) -> None:
        self.mode, self.settle = mode, SETTLE
        if mode == TREES:
            self.trees = _Window()
        elif mode == CHECK:
            self.plain = _Window()

    def take_outcomes(self) -> tuple[list[str], int]:
        """(the checks' outcomes, decoding steps kept plain) since the last call: for metrics."""
        outcomes, forced = self.outcomes, self.num_forced_plain
        self.outcomes, self.num_forced_plain = [], 0
        return outcomes, forced
