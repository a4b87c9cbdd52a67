"""W4A16 on the H200 (engine/model/int4_linear.py, ext/csrc/quant.cu's w4a16_gemm):
- the kernel against its PyTorch twin (ext/reference/quant.py: dequantize in fp32, one fp32 matmul) for every
  batch size it serves, fp32 / fp16 / bf16 activations, group sizes 32 / 128 / one per channel, row lengths that
  leave lanes idle, and inside a CUDA graph;
- a tiny DeepSeek-V3 packed by the compressed-tensors library, loaded as users load it
  (LLM(device="cuda", dtype="bf16")): its projections are Int4Linear layers that ran the kernel, and its greedy
  paths stay within tests/model/test_fp8.py's tolerances of the same checkpoint dequantized to bf16 (the two differ
  by the reference's bf16 rounding of the dequantized weights).
"""
from __future__ import annotations

import gc

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from engine import LLM, SamplingParams
from engine.model.int4_linear import int4_modules
from ext import build, ops, reference
from tests.model.test_fp8 import SEQUENCE, assert_close_to_reference, greedy_paths, quantized_pair
from tests.model.test_int4 import QUANT, _int4_one

pytestmark = pytest.mark.gpu

MAX_TOKENS = 6
KV_CACHE_BYTES = 1 << 30
# W4A16 vs the bf16-dequantized twin: the same dequantized values, rounded to bf16 in the twin and kept in fp32 here
MIN_TOP1_AGREEMENT, MEAN_LOGPROB_TOL, MAX_LOGPROB_TOL = 0.75, 0.02, 0.1


def assert_close(got, want) -> int:
    return assert_close_to_reference(got, want, MIN_TOP1_AGREEMENT, MEAN_LOGPROB_TOL, MAX_LOGPROB_TOL)


def _packed(out_dim: int, in_dim: int, group: int, seed: int):
    """Random int4 values packed by compressed-tensors, and random positive group scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_dim, in_dim), generator=g, dtype=torch.int8)
    scale = torch.rand(out_dim, -(-in_dim // group), generator=g) * 0.02 + 1e-3
    return pack_to_int32(q, 4), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("out_dim,in_dim,group", [(7, 264, 8), (4096, 4096, 128), (1000, 2048, 32),
                                                  (24, 1536, 1536)])
def test_w4a16_kernel_matches_its_reference(dtype, rows, out_dim, in_dim, group):
    assert build.load_ops() is not None, build.load_error()
    packed, scale = _packed(out_dim, in_dim, group, seed=rows + in_dim)
    x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(rows)).to(dtype)
    before = ops.cuda_calls().get("w4a16_gemm", 0)
    got = ops.w4a16_gemm(x.cuda(), packed.cuda(), scale.cuda(), group).cpu()
    assert ops.cuda_calls().get("w4a16_gemm", 0) == before + 1
    want32 = x.float() @ reference.quant.dequantize_int4(packed, scale, in_dim, group).t()  # fp32, unrounded
    err = float((got.float() - want32).norm() / want32.norm())
    bound = 1e-5 if dtype == torch.float32 else 4e-3  # fp32 summation order; one rounding to the 16-bit dtype
    assert err < bound, err


def test_w4a16_in_a_cuda_graph():
    packed, scale = (t.cuda() for t in _packed(2048, 4096, 128, seed=3))
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    ops.w4a16_gemm(x, packed, scale, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.w4a16_gemm(x, packed, scale, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, ops.w4a16_gemm(x, packed, scale, 128))


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    int4, ref, _ = quantized_pair(tiny_checkpoints, tmp_path_factory, "int4_gpu", _int4_one, QUANT)
    return int4, ref


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def small_batch_paths(llm, max_tokens: int) -> list:
    """greedy_paths, four prompts at a time: decode steps of at most 8 rows, which the W4A16 kernel serves (wider
    batches dequantize the weight per call, bit-equal to the bf16 twin)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=20)
    prefixes = [SEQUENCE[:n] for n in range(4, len(SEQUENCE) + 1)]
    outs = sum((llm.generate(prefixes[i:i + 4], sp) for i in range(0, len(prefixes), 4)), [])
    return [[(tok, dict(top)) for tok, (_, top) in zip(o.token_ids, o.logprobs)] for o in outs]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_int4_checkpoint_runs_w4a16_close_to_its_bf16_dequantization(pair, enforce_eager, caplog):
    common = dict(device="cuda", dtype="bf16", kv_cache_memory=KV_CACHE_BYTES, enforce_eager=enforce_eager)
    ref_llm = LLM(pair[1], **common)
    want, want_small = greedy_paths(ref_llm, MAX_TOKENS), small_batch_paths(ref_llm, MAX_TOKENS)
    del ref_llm
    _release()
    with caplog.at_level("INFO", logger="ddtree.engine"):
        llm = LLM(pair[0], **common)
    assert "W4A16 GEMMs for" in caplog.text
    modules = int4_modules(llm.engine.model)
    assert len(modules) >= 8 and all(m.weight_packed.is_cuda and m.weight_packed.dtype == torch.int32
                                     for m in modules)
    assert_close(greedy_paths(llm, MAX_TOKENS), want)
    before = ops.cuda_calls().get("w4a16_gemm", 0)
    compared = assert_close(small_batch_paths(llm, MAX_TOKENS), want_small)
    if enforce_eager:  # every compared decode step called the kernel
        assert ops.cuda_calls().get("w4a16_gemm", 0) > before
    else:  # the decode steps replayed CUDA graphs, captured with the kernel in them at startup
        assert llm.engine.runner.graphs is not None and ops.cuda_calls().get("w4a16_gemm", 0) > 0
    assert compared > 2 * len(want)
    assert not ops.reference_fallbacks().get("w4a16_gemm")
    del llm, modules
    _release()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dim,in_dim,group", [(7, 264, 8), (1000, 2048, 32), (24, 1536, 1536)])
def test_int4_dequantize_kernel_equals_its_reference_bit_for_bit(dtype, out_dim, in_dim, group):
    packed, scale = _packed(out_dim, in_dim, group, seed=in_dim)
    got = ops.int4_dequantize(packed.cuda(), scale.cuda(), group, dtype).cpu()
    assert got.dtype == dtype and torch.equal(got, reference.int4_dequantize(packed, scale, group, dtype))
