"""FP8 GEMMs on the H200 (engine/model/fp8_linear.py, torch._scaled_mm with 1x128 / 128x128 block scales):
- the FP8 linear layer against the bf16 linear of its dequantized weight on random data (relative error within
  LINEAR_REL_TOL: the FP8 activations' rounding) and against its fp32 emulation (EMULATION_REL_TOL), at token counts
  that need and need not padding, inside a CUDA graph too, and the load-time probe passing at DeepSeek-V3's shapes;
- a tiny DeepSeek-V3 written in the published block-FP8 layout (128x128 blocks, dimensions the GEMM takes) loaded
  the way users load it, LLM(model=..., device="cuda", dtype="bf16"): the FP8 modules are in use, and its greedy
  paths' logprobs stay within tests/model/test_fp8.py's tolerances of the same checkpoint dequantized to bf16,
  with CUDA graphs (decode steps replayed) and with enforce_eager=True.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM
from engine.model.fp8 import dequantize_block_fp8, quantize_block_fp8
from engine.model.fp8_linear import Fp8BlockLinear, fp8_modules, probe, scaled_mm_blockwise
from ext import build
from tests.model.test_fp8 import FP8_LINEARS, FP8_MODULES, assert_close_to_reference, fp8_gemm_pair, greedy_paths

pytestmark = pytest.mark.gpu

LINEAR_REL_TOL = 0.05  # e4m3 activations: up to 2^-4 relative rounding per element, ~2-3% on a GEMM's output
EMULATION_REL_TOL = 1e-2  # same quantized operands, fp32 emulation: only accumulation order and bf16 output differ
MAX_TOKENS = 6
KV_CACHE_BYTES = 1 << 30  # three engines live in this process one after another; keep each one's cache small
# DeepSeek-V3's FP8 linear shapes (out, in): q_a, q_b, o, dense gate/up, dense down, shared-expert gate/up, down
DEEPSEEK_V3_SHAPES = [(1536, 7168), (24576, 1536), (7168, 16384), (18432, 7168), (7168, 18432), (2048, 7168),
                      (7168, 2048)]


def _layer(out_features: int, in_features: int, seed: int) -> Fp8BlockLinear:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, scale_inv = quantize_block_fp8(torch.randn(out_features, in_features, device="cuda", generator=g) * 0.02)
    layer = Fp8BlockLinear(in_features, out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
    return layer


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("out_features,in_features", [(768, 512), (1536, 7168), (7168, 2048)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 300])
def test_fp8_linear_matches_the_bf16_linear_of_its_dequantized_weight(out_features, in_features, tokens):
    layer = _layer(out_features, in_features, seed=out_features + tokens)
    assert layer.gemm is scaled_mm_blockwise
    x = torch.randn(tokens, in_features, device="cuda", generator=torch.Generator(device="cuda").manual_seed(tokens))
    x = x.to(torch.bfloat16)
    got = layer(x)
    assert got.shape == (tokens, out_features) and got.dtype == torch.bfloat16
    weight = dequantize_block_fp8(layer.weight, layer.weight_scale_inv, (128, 128)).to(torch.bfloat16)
    bf16 = F.linear(x, weight)  # [tokens, out], the dequantize-on-load path's GEMM
    err, emu_err = _rel(got, bf16), _rel(got, layer.emulate(x))
    print(f"{out_features}x{in_features}, {tokens} tokens: vs bf16 {err:.4f}, vs emulation {emu_err:.5f}")
    assert err < LINEAR_REL_TOL
    assert emu_err < EMULATION_REL_TOL


def test_fp8_linear_in_a_cuda_graph():
    layer = _layer(1536, 7168, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(5, 7168, device="cuda", generator=g).to(torch.bfloat16)  # static input, padded to 8 rows
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm-up outside capture (cuBLASLt heuristics, workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)  # static output
    graph.replay()
    first = out.clone()
    x.copy_(torch.randn(5, 7168, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    assert not torch.equal(out, first)  # the replay read the new input
    torch.testing.assert_close(out, layer(x))


@pytest.mark.parametrize("out_features,in_features", DEEPSEEK_V3_SHAPES)
def test_the_load_time_probe_passes_at_deepseek_v3_shapes(out_features, in_features):
    assert probe(out_features, in_features, "cuda", scaled_mm_blockwise) is None


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    assert build.load_ops() is not None, build.load_error()
    return fp8_gemm_pair(tiny_checkpoints, tmp_path_factory)


def _release() -> None:
    """Gives the device memory of engines no longer referenced back before the next engine sizes its cache."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference(pair):
    """The same checkpoint dequantized (tests/model/test_fp8.py's own block loop), run in bf16 with CUDA graphs."""
    llm = LLM(pair[1], device="cuda", dtype="bf16", kv_cache_memory=KV_CACHE_BYTES)
    assert not fp8_modules(llm.engine.model)
    paths = greedy_paths(llm, MAX_TOKENS)
    del llm
    _release()
    return paths


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp8_checkpoint_runs_fp8_gemms_close_to_its_bf16_dequantization(pair, reference, enforce_eager, caplog):
    with caplog.at_level("INFO", logger="ddtree.engine"):
        llm = LLM(pair[0], device="cuda", dtype="bf16", enforce_eager=enforce_eager, kv_cache_memory=KV_CACHE_BYTES)
    assert f"FP8 GEMMs for {FP8_LINEARS} linear layers (blockwise 128x128, torch._scaled_mm)" in caplog.text
    modules = fp8_modules(llm.engine.model)
    assert len(modules) == FP8_MODULES
    assert all(m.gemm is scaled_mm_blockwise and m.weight.dtype == torch.float8_e4m3fn and m.weight.is_cuda
               and m.weight_scale_inv.dtype == torch.float32 for m in modules)
    assert (llm.engine.runner.graphs is None) == enforce_eager
    calls = [0]
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in modules]
    compared = assert_close_to_reference(greedy_paths(llm, MAX_TOKENS), reference)
    if enforce_eager:  # (with graphs every step replays, admissions too: the FP8 modules run inside the graphs)
        assert calls[0] > 0
    assert compared > 2 * len(reference)  # decode steps compared too (graph replays unless enforce_eager)
    for h in hooks:
        h.remove()
    del llm, modules, hooks
    _release()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,padded_rows,cols", [(1, 4, 128), (5, 8, 7168), (257, 260, 1536), (16, 16, 2048)])
def test_quantize_kernel_equals_its_reference_bit_for_bit(dtype, rows, padded_rows, cols):
    """ext.ops.quantize_fp8_blockwise on CUDA (one kernel) against ext/reference/quant.py on the CPU: the same
    e4m3 bytes and the same scales, padding rows included; a zero group and a huge one on the way."""
    from ext import ops, reference

    if build.load_ops() is None:
        pytest.fail(f"the CUDA extension does not load: {build.load_error()}")
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)[None, :]).to(dtype)
    x[0, :128] = 0
    before = ops.cuda_calls().get("quantize_fp8_blockwise", 0)
    q, scale_t = ops.quantize_fp8_blockwise(x.cuda(), padded_rows, 1e-10)
    assert ops.cuda_calls().get("quantize_fp8_blockwise", 0) == before + 1
    want_q, want_scale_t = reference.quantize_fp8_blockwise(x, padded_rows, 1e-10)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (padded_rows, cols)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale_t.cpu(), want_scale_t)
