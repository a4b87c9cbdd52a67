"""TableMirror: the host's record of which block lists the CUDA graphs' static block-table rows hold, written by
plain decoding steps (CudaGraphs.write_decode), so a step rewrites only the rows whose lists changed. A request's
list grows by one block every block_size tokens, so at batch 64 a step changes a few rows, and most steps at
batch 1 none; converting and copying all of them cost ~45 us of host a step at batch 64 (2,000 list items into an
array) where comparing them costs ~5.

Invariant: a recorded row holds exactly its list's blocks in its leading columns on the device. Every other writer
of the buffer (a step's eager metadata copied in, a padding layout, a whole round's tables) forgets the rows it
wrote before the next plain step reads the record."""
from __future__ import annotations


class TableMirror:
    def __init__(self):
        self.rows: list[list[int] | None] = []  # row -> a copy of the block list it holds, None when not known

    def forget(self, first: int = 0, last: int | None = None) -> None:
        """Rows first .. last - 1 (to the end by default) were written by something else."""
        stop = len(self.rows) if last is None else min(last, len(self.rows))
        for i in range(first, stop):
            self.rows[i] = None

    def changed(self, tables: list[list[int]]) -> list[int]:
        """The rows among the first len(tables) whose recorded list is not tables[row] (recorded as written: the
        caller writes those rows' lists)."""
        if len(self.rows) < len(tables):
            self.rows += [None] * (len(tables) - len(self.rows))
        rows = self.rows
        out = [i for i, t in enumerate(tables) if rows[i] != t]
        for i in out:
            rows[i] = list(tables[i])
        return out
