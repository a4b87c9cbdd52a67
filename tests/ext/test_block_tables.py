"""Block tables as the graphs' static buffers take them (ext.metadata.block_table_rows): row i holds tables[i]
padded with block 0, whether the rows are converted one by one or by runs of one list object repeated (an
admission step's one-row requests share their prompt's table)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ext.metadata import block_table_rows


def padded(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)


@pytest.mark.parametrize("runs", [False, True])
def test_block_table_rows_pad_each_table(runs):
    rng = random.Random(0)
    prompts = [rng.sample(range(1, 5000), rng.randint(1, 40)) for _ in range(3)]
    tables = [prompts[0]] * 5 + [rng.sample(range(1, 5000), 7)] + [prompts[1]] * 3 + [prompts[2]]
    tables += [list(t) for t in [prompts[2]] * 2]  # equal content, other objects: a run of their own each
    tables += [rng.sample(range(1, 5000), rng.randint(1, 63)) for _ in range(20)]
    got = block_table_rows(tables, runs)
    assert got.dtype == np.int32 and got.shape == (len(tables), max(len(t) for t in tables))
    np.testing.assert_array_equal(got, padded(tables))
