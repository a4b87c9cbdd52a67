"""What a decoding step costs, fitted on the engine's own steps: T = t0 + t_row * rows (+ t_tree when the step
verifies any tree), decayed least squares over the steps observed.

Why a tree term: without CUDA graphs a step that verifies a tree costs more than its rows. On the 2-core CPU one
row goes through a GEMV and two or more through a GEMM, so at batch 1 any tree nearly doubles the step. At batch
16 MKL pays rows in blocks of 8, so the first tree row costs ~18 ms and the next seven ~1 ms each. Fitted on rows
alone, that fixed part was spread over the rows: a one-node tree at batch 1 was priced at ~8 ms where it cost ~55.

The two kinds of step are kept apart, each decayed by its own steps (the fit is a common slope with one intercept
per kind): once the controller has learned that trees do not pay, tree steps become rare, and decayed by every
step their record fell out of the window within ~20 plain steps, so the next tree re-measured a cost already
known. The tree record also ages slowly by plain steps (STALE_DECAY) and stops counting below MIN_TREE_WEIGHT, so a
workload that has changed since is re-measured about every 70 plain steps. The tree term is estimated only while
rows vary within the kinds (else slope and tree cost are not told apart); otherwise the fit is
T = t0 + t_row * rows over every step."""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.9  # per observed step of the same kind
STALE_DECAY = 0.99  # the tree steps' record, per plain step
MIN_TREE_WEIGHT = 0.5  # tree steps' decayed weight below which their cost is not estimated
MAX_CORRELATION = 0.95  # share of the rows' variance that may lie between the two kinds of step


@dataclass
class _Sums:
    """Decayed weighted sums of one kind of step: x rows, y seconds."""
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, weight: float, decay: float = DECAY) -> None:
        self.scale(decay)
        self.n, self.sx, self.sy = self.n + weight, self.sx + weight * x, self.sy + weight * y
        self.sxx, self.sxy = self.sxx + weight * x * x, self.sxy + weight * x * y

    def scale(self, factor: float) -> None:
        self.n, self.sx, self.sy, self.sxx, self.sxy = (factor * v for v in
                                                       (self.n, self.sx, self.sy, self.sxx, self.sxy))

    def var_x(self) -> float:  # weighted sums of squares about the kind's own mean (not divided by n)
        return self.sxx - self.sx * self.sx / self.n if self.n else 0.0

    def cov_xy(self) -> float:
        return self.sxy - self.sx * self.sy / self.n if self.n else 0.0

    def intercept(self, slope: float) -> float:
        return (self.sy - slope * self.sx) / self.n


class CostFit:
    def __init__(self):
        self.plain, self.tree = _Sums(), _Sums()

    @property
    def n(self) -> float:
        return self.plain.n + self.tree.n

    def add(self, rows: float, seconds: float, weight: float = 1.0, tree: bool = False) -> None:
        if tree:
            self.tree.add(rows, seconds, weight)
        else:
            self.plain.add(rows, seconds, weight)
            self.tree.scale(STALE_DECAY)

    def seed(self, points: list[tuple[float, float]], weight: float) -> None:
        """Pseudo-steps of plain decoding, each of this weight (none decays the others): a prior."""
        for rows, seconds in points:
            self.plain.add(rows, seconds, weight, decay=1.0)

    def slope(self) -> float | None:
        """t_row (seconds a verify row), or None before rows have varied."""
        fit = self._with_tree()
        if fit is not None:
            return fit[0]
        pooled = self._pooled()
        var = pooled.var_x()
        if var <= 1e-9 * max(pooled.n, 1e-9):
            return None
        return max(0.0, pooled.cov_xy() / var)

    def predict(self, rows: float, tree: bool = False) -> float:
        """Seconds the fit expects a step of these rows to take (0 before any step)."""
        pooled = self._pooled()
        if pooled.n <= 0:
            return 0.0
        fit = self._with_tree()  # (only with plain steps observed)
        if fit is not None:
            return self.plain.intercept(fit[0]) + fit[0] * rows + (fit[1] if tree else 0.0)
        slope = self.slope() or 0.0
        return pooled.intercept(slope) + slope * rows

    def tree_cost(self) -> float:
        """t_tree (seconds a step pays for verifying any tree, beyond its rows), 0 while not identifiable."""
        fit = self._with_tree()
        return fit[1] if fit is not None else 0.0

    def _pooled(self) -> _Sums:
        a, b = self.plain, self.tree
        return _Sums(a.n + b.n, a.sx + b.sx, a.sy + b.sy, a.sxx + b.sxx, a.sxy + b.sxy)

    def _with_tree(self) -> tuple[float, float] | None:
        """(t_row, t_tree) of the fit with one intercept per kind of step, or None when it is not identifiable."""
        plain, tree = self.plain, self.tree
        if plain.n <= 0 or tree.n < MIN_TREE_WEIGHT:
            return None
        within = plain.var_x() + tree.var_x()
        if within <= 1e-9 * self.n or within < (1 - MAX_CORRELATION) * self._pooled().var_x():
            return None
        t_row = (plain.cov_xy() + tree.cov_xy()) / within
        if t_row < 0:
            return None
        return t_row, max(0.0, tree.intercept(t_row) - plain.intercept(t_row))


class SwitchCost:
    """Under asynchronous scheduling, what a decoding step that could not run ahead of its predecessor's results
    costs beyond the fit's prediction (its scheduling and drafting leave the device idle): the decayed mean residual
    of such steps minus that of the steps that ran ahead, each kind decayed by its own steps (synchronous steps
    are rare once steps run ahead). On the H200 with the embedded model: ~1.1 ms at batch 1, ~1.8 ms at batch 16
    (bench/step_kinds.py), against 0.8 ms steps."""

    def __init__(self):
        self.synchronous, self.ahead = [0.0, 0.0], [0.0, 0.0]  # decayed [weight, sum of residuals]

    def observe(self, residual: float, synchronous: bool) -> None:
        kind = self.synchronous if synchronous else self.ahead
        kind[0], kind[1] = DECAY * kind[0] + 1.0, DECAY * kind[1] + residual

    def seconds(self) -> float:
        """The extra time of a synchronous step (0 until both kinds were seen)."""
        (ws, ss), (wa, sa) = self.synchronous, self.ahead
        if ws < 1.0 or wa < 1.0:
            return 0.0
        return max(0.0, ss / ws - sa / wa)
