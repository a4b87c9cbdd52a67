"""The top-k / top-p floor kernel (ext/csrc/sampling_filter.cu) on the GPU: the same floor as its twin (run on the
GPU, so both take CUDA's fp32 exp) on random, tied, masked and degenerate rows of every dtype and vocabulary size;
captured in a CUDA graph; and the sampler's top-k / top-p on CUDA keeps what transformers' warpers keep."""
from __future__ import annotations

import pytest
import torch

from engine.top_k_top_p import apply_top_k_top_p
from ext import ops, reference
from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)
from tests.ext.test_sampling_filter_cpu import warped_mask

pytestmark = pytest.mark.gpu
DEV = "cuda"
INF = float("inf")


def kernel(x, top_k, top_p):
    before = ops.cuda_calls().get("top_k_top_p_floor", 0)
    out = ops.top_k_top_p_floor(x, top_k, top_p)
    assert ops.cuda_calls()["top_k_top_p_floor"] == before + 1  # the kernel ran, not the reference
    assert out.dtype == torch.float32 and out.device.type == "cuda"
    return out


def random_case(gen, rows, vocab, dtype):
    scale = torch.rand(rows, 1, generator=gen) * 8 + 0.2
    x = torch.randn(rows, vocab, generator=gen) * scale
    x[rows // 4: rows // 2] = x[rows // 4: rows // 2].round()  # ties everywhere
    x[torch.rand(rows, vocab, generator=gen) < 0.05] = -INF
    x[1] = -INF
    x[2, vocab // 2] = float("nan")
    x[3] = 0.0
    top_k = torch.randint(0, vocab + 3, (rows,), generator=gen)
    top_k[::3] = torch.randint(1, 64, (len(top_k[::3]),), generator=gen)
    top_k[::7] = 0
    top_p = torch.rand(rows, generator=gen) * 1.1
    top_p[::4] = 1.0
    top_p[min(5, rows - 1)] = 0.0
    return x.to(dtype), top_k, top_p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(64, 7), (512, 1000), (300, 49152), (96, 151936), (4, 1_000_003)])
def test_the_kernel_equals_its_twin(dtype, rows, vocab):
    r, gen = rng()
    x, top_k, top_p = (t.to(DEV) for t in random_case(gen, rows, vocab, dtype))
    got = kernel(x, top_k, top_p)
    want = reference.top_k_top_p_floor(x, top_k, top_p)
    same = (got == want) | (torch.isinf(got) & torch.isinf(want) & (got.sign() == want.sign()))
    bad = (~same).nonzero()[:, 0].tolist()
    assert not bad, [(i, float(got[i]), float(want[i]), int(top_k[i]), float(top_p[i])) for i in bad[:5]]


def test_cuda_graph_and_opcheck(cuda_ops):
    r, gen = rng()
    x, top_k, top_p = (t.to(DEV) for t in random_case(gen, 32, 4099, torch.float32))
    torch.library.opcheck(cuda_ops.top_k_top_p_floor.default, (x, top_k, top_p),
                          test_utils=("test_schema", "test_faketensor"))
    ops.top_k_top_p_floor(x, top_k, top_p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.top_k_top_p_floor(x, top_k, top_p)
    for _ in range(3):
        fresh = random_case(gen, 32, 4099, torch.float32)
        for dst, src in zip((x, top_k, top_p), fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference.top_k_top_p_floor(x, top_k, top_p))


def test_the_samplers_filter_on_cuda_matches_transformers():
    """engine.top_k_top_p.apply_top_k_top_p on CUDA goes through the kernel (no sort) and keeps transformers' sets."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 64, 49152
    x = torch.randn(rows, vocab, generator=gen) * (torch.rand(rows, 1, generator=gen) * 6 + 0.3)
    top_k = torch.randint(0, 100, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[::3] = 1.0
    before = ops.cuda_calls().get("top_k_top_p_floor", 0)
    ours = apply_top_k_top_p(x.to(DEV), top_k.to(DEV), top_p.to(DEV)).cpu()
    assert ops.cuda_calls()["top_k_top_p_floor"] == before + 1
    for i in range(rows):
        assert torch.equal(torch.isfinite(ours[i]), warped_mask(x[i], int(top_k[i]), float(top_p[i]))), i
        kept = torch.isfinite(ours[i])
        assert torch.equal(ours[i][kept], x[i][kept])


def test_rejects_bad_inputs(cuda_ops):
    x = torch.randn(4, 10, device=DEV)
    k, p = torch.zeros(4, dtype=torch.int64, device=DEV), torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match="must be"):
        cuda_ops.top_k_top_p_floor(x[0], k, p)
    with pytest.raises(RuntimeError, match="must be"):
        cuda_ops.top_k_top_p_floor(x, k[:3], p)
    with pytest.raises(RuntimeError):
        cuda_ops.top_k_top_p_floor(x, k.int(), p)
