"""engine/table_mirror.py and CudaGraphs.write_tables: block-table rows of the graphs' static buffer are rewritten
only when their lists changed, and every other writer of those rows (a padding layout, a step's eager metadata)
makes the next write rewrite them."""
from __future__ import annotations

import torch

from engine import LLM
from engine.staging import Staging
from engine.table_mirror import TableMirror


def test_changed_rows_are_those_whose_lists_differ_from_what_was_written():
    mirror, a, b = TableMirror(), [1, 2], [3]
    assert mirror.changed([a, b]) == [0, 1]
    assert mirror.changed([a, b]) == []
    a.append(5)  # a request's list grows in place: recorded as a copy, so it reads as changed
    assert mirror.changed([a, b]) == [0]
    assert mirror.changed([b, a]) == [0, 1]  # the same lists in other rows
    mirror.forget(1)
    assert mirror.changed([b, a, [7]]) == [1, 2]
    mirror.forget(0, 1)
    assert mirror.changed([b]) == [0]


def test_graph_block_tables_hold_each_rows_list_after_padding_and_eager_steps(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32")
    llm.engine.enable_graphs(emulate=True)
    graphs, stage = llm.engine.runner.graphs, Staging("cpu")
    tables = [[4, 5], [6], [7, 8, 9], [10]]

    def rows() -> list[list[int]]:
        return [graphs.block_tables[i, :len(t)].tolist() for i, t in enumerate(tables)]

    graphs.write_tables(tables, stage)
    assert rows() == tables
    graphs.block_tables[0, 0] = -1  # not through write_tables: an unchanged row is not written again
    graphs.write_tables(tables, stage)
    assert graphs.block_tables[0, 0].item() == -1
    graphs.write_tables([[4, 5, 11], *tables[1:]], stage)  # one list grew: that row alone is written
    assert graphs.block_tables[0, :3].tolist() == [4, 5, 11]
    graphs.write_tables(tables, stage)
    graphs.set_layout(3, 4, 1, 1)  # three requests in a bucket of four: row 3 becomes a padding row
    assert graphs.block_tables[3, 0].item() != tables[3][0]
    graphs.write_tables(tables, stage)  # the fourth request back: its row is written again
    assert rows() == tables
