"""The measured check behind "never slower than plain decoding". The adaptive budget (adaptive.py) chooses trees from
a cost model, and a model can be wrong in ways it cannot see from inside: a tree step's cost under CUDA graphs that
no fitted line explains, a switch that stalls the asynchronous pipeline, a host that falls behind the device. The
guard measures the outcome instead. After a window of decoding steps in which trees were allowed and the engine
speculated (verified trees, or drafted where drafts are not priced: below) in at least a quarter of them, it
forces a short window of plain steps (no drafting, no trees) and compares the two windows' decoding throughput,
per running request so that a batch that changed a little does not decide it (one that changed a lot discards the
check). Trees that lose stay off for a back-off, doubled while they keep losing; trees that win keep running, and
the checks come less often (the interval doubles), so a drafter that pays loses a small share of its gain to them.
A back-off is also at least long enough that the steps the lost window gave up are EXPLORE_SHARE of it: a 32-step
window that ran at half the plain rate keeps trees off for 800 steps, one that lost by a few percent for the
doubling back-off (at batch 64 on an H100 a full-batch tree step gave 0.45x a plain step's tokens/s, and back-offs
of 64, 128 and 256 steps each ended in another losing window; docs/BENCHMARKS.md).

A window in which the budget itself chose trees only now and then is not checked against a forced plain window:
its throughput is its plain steps', and step times swing between windows by more than a few trees move them (on
the H100 at batch 16, 2 tree steps in 32 lost such a check on that noise, and the back-off then kept trees off when
the text turned repetitive and the unguarded budget ran 1.2-1.5x plain decoding). Its tree steps are compared with
the plain steps between them instead, which ran at the same time and felt the same swings: each tree step together
with the step after it (under asynchronous scheduling that step pays the switch out of trees) against the other
plain steps, per running request, given at least SPARSE_MIN steps of each. (On the 2-core CPU at 16 sampled chats
the budget's trees ran in ~18% of the steps at about the plain steps' tokens per second: 119.4 ms for 20.6 tokens
against 90.6 ms for 15.5. Checked, they lost 6 of 11 checks in two runs; the chat mix's throughput did not move,
docs/BENCHMARKS.md 2026-12-05 20:46.)

Drafting costs too, trees or not. Under asynchronous scheduling a plain step that drafts curves for requests at
budget 0 (what the budget reads to decide whether one should verify again) launches the drafter's work from the
host, on an H100 at batch 64 about a plain step's time again, and the step before it pays (its successor is launched
while it runs); the budget prices a draft by its device time only. So there a step that drafted counts as
speculating as a tree step does (`drafted`), and windows are checked by their speculating steps as by their tree
steps: a quarter of the window, against a forced plain window (which drafts nothing); fewer, against the steps
between, where the speculation is charged with the steps that paid for it: a tree step's successor (the switch out
of trees) and the step that ran while a drafting step was launched ahead (`paying`; a tree step's drafting too).
Without it, drafts for a loaded server's new requests every few steps cost batch-64 throughput that no check could
see, since trees themselves ran in 0.3% of the request-steps (docs/BENCHMARKS.md, 2026-12-07). A window that lost
with drafts alone (no tree verified) stays off for the steps that pay its loss back (at least BACKOFF), without the
doubling: its cost is measured, and a back-off grown to thousands of steps would miss the text turning to what the
drafter predicts. Without asynchronous scheduling a draft's host time is measured and priced, and only trees count
(on the 2-core CPU, checking every window of the draft-first n-gram engine, which drafts at every step, against a
forced plain window cost the 8-chat mix 5%: step times swing between windows).

Whether trees pay depends on the batch (a verify row costs more of a step at batch 64 than at batch 1), so each
batch-size bucket (1, 2, 3-4, 5-8, ... requests) keeps its own verdict, interval and back-off: trees that lost at
batch 16 do not stay off when the load falls to one request. A window runs within one bucket; a step in another
bucket discards it. Only decoding steps count (a step with a prefill chunk is neither window's), and the first two
steps after each switch are not measured: under asynchronous scheduling the first was planned before the switch
(a tree step in a plain window), and the next carries the switch itself (a root-only round, a pipeline that
cannot run ahead), which the guard causes, not the trees."""
from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 32  # measured decoding steps with trees allowed before the first check (and after each loss)
MAX_INTERVAL = 1024  # ... doubled by every win up to this many
PLAIN_STEPS = 8  # measured steps of a plain window
SETTLE = 2  # steps after a switch that are not measured
BACKOFF = 64  # decoding steps trees stay off after a lost check, doubled while checks keep losing
MAX_BACKOFF = 2048
EXPLORE_SHARE = 0.02  # a lost window's forgone steps are at most this share of the back-off that follows it
MARGIN = 0.01  # trees must beat plain decoding by this share of its throughput to stay on (a tie: no drafting)
BATCH_TOLERANCE = 0.25  # a check whose windows' mean batch sizes differ by more than this share is discarded
MIN_TREE_SHARE = 0.25  # a window is checked against a plain window only when it speculated in this share of its steps
SPARSE_MIN = 3  # ... else its speculating steps against the plain steps between them, given this many of each

TREES, CHECK, OFF = "trees", "check", "off"
WON, LOST, DISCARDED = "won", "lost", "discarded"


@dataclass
class _Steps:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    request_steps: int = 0  # sum over its steps of the decoding requests

    def add(self, num_requests: int, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.request_steps += num_requests

    def mean_batch(self) -> float:
        return self.request_steps / self.steps

    def rate(self) -> float:
        """Tokens per second per running request."""
        return self.tokens / self.seconds / self.mean_batch() if self.seconds > 0 else 0.0


@dataclass
class _Window(_Steps):
    tree_steps: int = 0
    speculating_steps: int = 0  # tree steps and those that drafted
    # the same steps split: speculating steps with those that paid for them (the step after each tree step, a step
    # that paid for the drafting launched ahead while it ran), and the other (plain) steps
    with_trees: _Steps = field(default_factory=_Steps)
    between: _Steps = field(default_factory=_Steps)
    after_tree: bool = False  # the last step verified trees

    def add(self, num_requests: int, tokens: int, seconds: float, tree: bool, drafted: bool = False,
            paying: bool = False) -> None:
        super().add(num_requests, tokens, seconds)
        speculating = tree or drafted
        self.tree_steps += tree
        self.speculating_steps += speculating
        charged = speculating or paying or self.after_tree
        (self.with_trees if charged else self.between).add(num_requests, tokens, seconds)
        self.after_tree = tree


@dataclass
class _Bucket:
    """One batch-size bucket's verdict: its mode, the window being measured, and its interval and back-off."""
    mode: str = TREES
    interval: int = field(default_factory=lambda: WINDOW)
    backoff: int = field(default_factory=lambda: BACKOFF)
    off_steps: int = 0  # decoding steps left in a back-off
    settle: int = 0  # steps not measured (after a switch)
    trees: _Window = field(default_factory=_Window)
    plain: _Window = field(default_factory=_Window)


def _paid_back_in(trees: _Steps, plain: _Steps) -> int:
    """Decoding steps of which the steps a losing window gave up (its steps times its shortfall against plain
    decoding) are EXPLORE_SHARE."""
    shortfall = 1 - trees.rate() / plain.rate() if plain.rate() > 0 else 0.0
    return round(trees.steps * max(shortfall, 0.0) / EXPLORE_SHARE)


def bucket_of(num_requests: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return (num_requests - 1).bit_length()


class ThroughputGuard:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.buckets: dict[int, _Bucket] = {}
        self.current = 0  # the bucket of the last decoding step: the coming step's, most likely
        self.outcomes: list[str] = []  # checks since the last take_outcomes()
        self.num_forced_plain = 0  # decoding steps the guard kept plain since the last take_outcomes()

    def allows_trees(self) -> bool:
        bucket = self.buckets.get(self.current)
        return bucket is None or bucket.mode == TREES

    def observe(self, num_requests: int, tokens: int, seconds: float, tree: bool, drafted: bool = False,
                paying: bool = False) -> None:
        """One decoding step (no prefill chunk in it): its decoding requests, the tokens they emitted, its time,
        whether it verified trees, whether it drafted (where drafts are not priced), and whether it paid for the
        drafting of the step launched ahead while it ran."""
        if not self.enabled or num_requests <= 0:
            return
        if bucket_of(num_requests) != self.current and not self._near(num_requests):
            self._leave(self.buckets.get(self.current))
            self.current = bucket_of(num_requests)
        b = self.buckets.setdefault(self.current, _Bucket())
        if b.mode != TREES:
            self.num_forced_plain += 1
        if b.mode == OFF:
            b.off_steps -= 1
            if b.off_steps <= 0:
                self._enter(b, TREES)
            return
        if b.settle > 0:
            b.settle -= 1
            return
        if b.mode == TREES:
            window = b.trees
            window.add(num_requests, tokens, seconds, tree, drafted, paying)
            if window.steps >= b.interval:
                if window.speculating_steps >= MIN_TREE_SHARE * window.steps:
                    self._enter(b, CHECK)
                elif window.speculating_steps >= SPARSE_MIN and window.between.steps >= SPARSE_MIN:
                    self._decide(b, window.with_trees, window.between)
                else:  # the budget chose plain steps (nearly) throughout: nothing speculation did to check
                    b.trees = _Window()
            return
        b.plain.add(num_requests, tokens, seconds, tree)
        if b.plain.steps >= PLAIN_STEPS:
            self._decide(b, b.trees, b.plain)

    def _near(self, num_requests: int) -> bool:
        """The batch is still within BATCH_TOLERANCE of the current bucket's range (hysteresis: a batch that
        wavers across a bucket's edge, 16 to 17 and back, would otherwise discard every window)."""
        high = 1 << self.current
        return high * (1 - BATCH_TOLERANCE) / 2 < num_requests <= high * (1 + BATCH_TOLERANCE)

    def _leave(self, b: _Bucket | None) -> None:
        """The batch moved to another bucket: a window being measured in this one is dropped (a back-off waits
        for this bucket's own steps)."""
        if b is None or b.mode == OFF:
            return
        if b.mode == CHECK:
            self.outcomes.append(DISCARDED)
        self._enter(b, TREES)

    def _decide(self, b: _Bucket, trees: _Steps, plain: _Steps) -> None:
        """The check's outcome from the steps with trees and the plain ones they are held against: a window
        against the forced plain window after it, or a sparse window's tree steps against its other steps."""
        batch_trees, batch_plain = trees.mean_batch(), plain.mean_batch()
        if abs(batch_trees - batch_plain) > BATCH_TOLERANCE * max(batch_trees, batch_plain):
            outcome = DISCARDED
        elif trees.rate() > plain.rate() * (1 + MARGIN):
            outcome = WON
        else:
            outcome = LOST
        self.outcomes.append(outcome)
        if outcome == LOST:
            # drafts alone lost (no tree verified): their measured cost sizes the back-off, which does not grow
            least = b.backoff if b.trees.tree_steps else BACKOFF
            b.interval, b.off_steps = WINDOW, min(max(least, _paid_back_in(trees, plain)), MAX_BACKOFF)
            if b.trees.tree_steps:
                b.backoff = min(2 * b.backoff, MAX_BACKOFF)
            self._enter(b, OFF)
            return
        if outcome == WON:
            b.interval, b.backoff = min(2 * b.interval, MAX_INTERVAL), BACKOFF
        self._enter(b, TREES)

    @staticmethod
    def _enter(b: _Bucket, mode: str) -> None:
        b.mode, b.settle = mode, SETTLE
        if mode == TREES:
            b.trees = _Window()
        elif mode == CHECK:
            b.plain = _Window()

    def take_outcomes(self) -> tuple[list[str], int]:
        """(the checks' outcomes, decoding steps kept plain) since the last call: for metrics."""
        outcomes, forced = self.outcomes, self.num_forced_plain
        self.outcomes, self.num_forced_plain = [], 0
        return outcomes, forced
