"""The CPU's matmul routes (ext/cpu_linear.py): the product of x and W^T with the output features split across the
intra-op threads, and oneDNN's packed inner product, equal F.linear's (summation order aside), with a bias and
with leading dimensions; the packed copy is made once, made again after the weight changes, and never used under
autograd; at one row each weight takes the split or F.linear, whichever was faster over its first calls, which the
two serve in turn; other calls are left to F.linear; ops.linear, linear_silu_mul and the vocabulary projection take them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ext import ops
from ext import cpu_linear as routes
from ext.cpu_linear import CPU_SPLIT_MAX_ROWS, cpu_linear, one_row_route, split_linear


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


class FakeTimes:
    """Makes the split's product (torch.bmm) take split_s and F.linear take linear_s on cpu_linear's clock, and
    records which route served each call."""

    def __init__(self, monkeypatch, split_s: float, linear_s: float):
        self.now, self.served = 0.0, []
        bmm, linear = torch.bmm, F.linear

        def timed_bmm(*args):
            self.now += split_s
            self.served.append("split")
            return bmm(*args)

        def timed_linear(*args, **kwargs):
            self.now += linear_s
            self.served.append("linear")
            return linear(*args, **kwargs)

        monkeypatch.setattr(routes, "_clock", lambda: self.now)
        monkeypatch.setattr(torch, "bmm", timed_bmm)
        monkeypatch.setattr(routes.F, "linear", timed_linear)


def serve_one_row(x, w, b=None):
    """cpu_linear's result, or F.linear's where it returns None (as ops.dense does)."""
    out = cpu_linear(x, w, b)
    return out if out is not None else F.linear(x, w, b)


@pytest.mark.parametrize("split_s, linear_s, want", [(1e-3, 3e-3, "split"), (3e-3, 1e-3, "linear")])
def test_one_row_keeps_the_route_whose_serving_calls_were_faster(two_threads, monkeypatch, split_s, linear_s, want):
    """The AMD machine's case (the split 2-3x faster) and the Intel one's (F.linear 2-4x faster). The first calls
    are served by the two routes in turn, each timed as it serves (no extra calls on a weight warm in the cache),
    and the weight keeps the faster."""
    times = FakeTimes(monkeypatch, split_s, linear_s)
    x, w, b = torch.randn(1, 64), torch.randn(40, 64), torch.randn(40)
    want_out = F.linear(x, w, b)
    times.served.clear()
    with torch.inference_mode():
        for i in range(2 * routes.ONE_ROW_SAMPLES + 3):
            torch.testing.assert_close(serve_one_row(x, w, b), want_out, rtol=1e-5, atol=1e-5)
            assert one_row_route(w) == (None if i < 2 * routes.ONE_ROW_SAMPLES - 1 else want)
    assert times.served == ["split", "linear"] * routes.ONE_ROW_SAMPLES + [want] * 3


def test_one_row_routes_are_kept_per_weight(two_threads, monkeypatch):
    FakeTimes(monkeypatch, 1e-3, 3e-3)
    x, w, other = torch.randn(1, 64), torch.randn(40, 64), torch.randn(40, 64)
    with torch.inference_mode():
        for _ in range(2 * routes.ONE_ROW_SAMPLES):
            serve_one_row(x, w)
    assert one_row_route(w) == "split" and one_row_route(other) is None  # the other weight samples its own


def test_one_row_without_a_split_is_not_timed(two_threads, monkeypatch):
    times = FakeTimes(monkeypatch, 1e-3, 3e-3)
    w = torch.randn(41, 64)  # 41 features: no split
    with torch.inference_mode():
        assert cpu_linear(torch.randn(1, 64), w) is None
    assert one_row_route(w) == "linear" and times.served == []


def test_the_model_paths_take_it(two_threads, monkeypatch):
    times = FakeTimes(monkeypatch, 1e-3, 3e-3)  # a machine where the split wins at one row
    x, w = torch.randn(1, 64), torch.randn(40, 64)
    with torch.inference_mode():
        for _ in range(2 * routes.ONE_ROW_SAMPLES):
            serve_one_row(x, w)
    times.served.clear()
    want = F.linear(x, w)
    torch.testing.assert_close(ops.linear(x, w), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.dense(x, w), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear_silu_mul(x, w), ops.silu_and_mul(want), rtol=1e-5, atol=1e-5)
    assert times.served == ["linear", "split", "split", "split"]  # (the first: this test's own F.linear)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [2, 17, 300])
def test_packed_route_at_inference(two_threads, rows):
    w, b = torch.nn.Parameter(torch.randn(130, 96)), torch.randn(130)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = cpu_linear(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        packed = w._ddtree_onednn[1]
        cpu_linear(torch.randn(2, 3, 96), w)  # leading dimensions, the same packed copy
        assert w._ddtree_onednn[1] is packed
    with torch.no_grad():
        w.mul_(2)  # the weight changed in place: packed again
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        assert w._ddtree_onednn[1] is not packed


@needs_onednn
def test_autograd_and_one_row_do_not_pack(two_threads):
    w = torch.nn.Parameter(torch.randn(40, 64))
    x = torch.randn(4, 64)
    out = cpu_linear(x, w)  # grad enabled, a weight that wants one: the split, which has a backward
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(40, 64), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        cpu_linear(torch.randn(1, 64), w)  # one row: the split, no packed copy
    assert not hasattr(w, "_ddtree_onednn")
