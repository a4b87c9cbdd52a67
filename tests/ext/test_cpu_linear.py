"""The CPU's few-row matmul (ext/cpu_linear.py): the product of x and W^T with the output features split across
the intra-op threads equals F.linear's (summation order aside) for 1-64 rows, with a bias and with leading
dimensions; other calls are left to F.linear; ops.linear, linear_silu_mul and the vocabulary projection take it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ext import ops
from ext.cpu_linear import CPU_SPLIT_MAX_ROWS, split_linear


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, CPU_SPLIT_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_split_equals_f_linear(two_threads, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(130, 96, generator=gen)
    b = torch.randn(130, generator=gen) if bias else None
    out = split_linear(x, w, b)
    assert out is not None and out.shape == (rows, 130) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_leading_dimensions_and_strided_rows(two_threads):
    x, w = torch.randn(2, 3, 64), torch.randn(40, 64)
    torch.testing.assert_close(split_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    wide = torch.randn(4, 128)
    torch.testing.assert_close(split_linear(wide[:, ::2], w), F.linear(wide[:, ::2], w), rtol=1e-5, atol=1e-5)


def test_other_calls_go_to_f_linear(two_threads):
    w = torch.randn(40, 64)
    assert split_linear(torch.randn(CPU_SPLIT_MAX_ROWS + 1, 64), w) is None  # prefill-sized: MKL's gemm wins
    assert split_linear(torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16()) is None  # measured in fp32 only
    assert split_linear(torch.randn(2, 64), torch.randn(41, 64)) is None  # features not a multiple of the threads
    assert split_linear(torch.randn(2, 64), torch.randn(64, 40).t()) is None  # a weight that is not contiguous
    torch.set_num_threads(1)
    assert split_linear(torch.randn(2, 64), w) is None  # one thread: nothing to split


def test_the_model_paths_take_it(two_threads, monkeypatch):
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(a[0].shape) or real(*a))
    x, w = torch.randn(1, 64), torch.randn(40, 64)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.dense(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear_silu_mul(x, w), ops.silu_and_mul(F.linear(x, w)), rtol=1e-5, atol=1e-5)
    assert calls == [(2, 20, 64)] * 3
