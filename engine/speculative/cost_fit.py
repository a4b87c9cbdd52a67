"""What a decoding step costs, fitted on the engine's own steps: T = t0 + t_row * rows (+ t_tree when the step
verifies any tree), decayed least squares over the steps observed.

Why a tree term: without CUDA graphs a step that verifies a tree costs more than its rows. On the 2-core CPU one
row goes through a GEMV and two or more through a GEMM, so at batch 1 any tree nearly doubles the step. At batch
16 MKL pays rows in blocks of 8, so the first tree row costs ~18 ms and the next seven ~1 ms each. Fitted on rows
alone, that fixed part was spread over the rows: a one-node tree at batch 1 was priced at ~8 ms where it cost ~55.
The tree term is estimated only when both kinds of step are in the window and rows vary apart from it; otherwise
the fit is T = t0 + t_row * rows, as before."""
from __future__ import annotations

DECAY = 0.9  # per observed step
MIN_SHARE = 0.05  # each kind of step (plain, tree) must weigh at least this share of the window
MAX_CORRELATION = 0.95  # rows and the tree indicator must not be this collinear (squared correlation)


class CostFit:
    n = sx = sz = sy = sxx = sxz = szz = sxy = szy = 0.0  # decayed weighted sums; x rows, z tree (0/1), y seconds

    def add(self, rows: float, seconds: float, weight: float = 1.0, tree: bool = False) -> None:
        x, z, y = rows, float(tree), seconds
        d = DECAY
        self.n, self.sx, self.sz, self.sy = d * self.n + weight, d * self.sx + weight * x, d * self.sz + weight * z, \
            d * self.sy + weight * y
        self.sxx, self.sxz, self.szz = d * self.sxx + weight * x * x, d * self.sxz + weight * x * z, \
            d * self.szz + weight * z * z
        self.sxy, self.szy = d * self.sxy + weight * x * y, d * self.szy + weight * z * y

    def slope(self) -> float | None:
        """t_row (seconds a verify row), or None before rows have varied."""
        fit = self._with_tree()
        if fit is not None:
            return fit[0]
        var = self._cov(self.sxx, self.sx, self.sx)
        if var <= 1e-9:
            return None
        return max(0.0, self._cov(self.sxy, self.sx, self.sy) / var)

    def tree_cost(self) -> float:
        """t_tree (seconds a step pays for verifying any tree, beyond its rows), 0 while not identifiable."""
        fit = self._with_tree()
        return fit[1] if fit is not None else 0.0

    def _cov(self, sab: float, sa: float, sb: float) -> float:
        return sab / self.n - sa * sb / self.n ** 2 if self.n else 0.0

    def _with_tree(self) -> tuple[float, float] | None:
        """(t_row, t_tree) of the two-regressor fit, or None when it is not identifiable."""
        if not self.n or not MIN_SHARE <= self.sz / self.n <= 1 - MIN_SHARE:
            return None
        vxx, vzz, vxz = self._cov(self.sxx, self.sx, self.sx), self._cov(self.szz, self.sz, self.sz), \
            self._cov(self.sxz, self.sx, self.sz)
        det = vxx * vzz - vxz * vxz
        if vxx <= 1e-9 or vzz <= 1e-9 or vxz * vxz > MAX_CORRELATION * vxx * vzz:
            return None
        vxy, vzy = self._cov(self.sxy, self.sx, self.sy), self._cov(self.szy, self.sz, self.sy)
        t_row, t_tree = (vzz * vxy - vxz * vzy) / det, (vxx * vzy - vxz * vxy) / det
        if t_row < 0:
            return None
        return t_row, max(0.0, t_tree)
