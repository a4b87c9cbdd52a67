"""FP8 block-quantized checkpoints in the DeepSeek-V3 layout (float8_e4m3fn weights + weight_scale_inv per block,
quantization_config quant_method fp8): a tiny random DeepSeek-V3 written in that layout loads, and its output
equals (within 1e-5 in logprob) the same model with the weights dequantized by this test's own block loop and
stored as float32; wrong configs and scales fail with clear errors.

The FP8 GEMM path (engine/model/fp8_linear.py) on CPU: the activation quantization, the blockwise GEMM's fp32
emulation against the dequantized-weight matmul, the exact torch._scaled_mm call (layouts checked by a strict
stand-in and by torch's own shape checks on fake CUDA tensors), which linears become FP8, that CPU / fp32 / other
block sizes keep the dequantize-on-load path, and a whole load through the FP8 modules with the GEMM emulated.
tests/ext/test_fp8_gpu.py runs the real GEMM on the H200.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model import fp8_linear
from engine.model.errors import CheckpointError, ConfigError
from engine.model.fp8 import quantize_block_fp8
from engine.model.fp8_linear import (Fp8BlockLinear, choose_gemm, emulated_blockwise_mm, fp8_linear_plan,
                                     fp8_modules, quantize_activations, scaled_mm_blockwise)
from engine.model.layers import concat_linears

BLOCK = (16, 24)  # not square, and not dividing every tiny dimension: partial blocks at the edges
PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj")


def dequantize_by_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The reference: one block at a time, nothing shared with engine/model/fp8.py."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].to(torch.float32) * float(scale_inv[i, j])
    return out


def copy_folder(src: str, dst: str, state: dict, quantization: dict | None) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization_config"] = quantization
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(state, os.path.join(dst, "model.safetensors"))
    return dst


def quantized_pair(tiny_checkpoints, tmp_path_factory, name: str, quantize_one, quantization: dict,
                   family: str = "deepseek_v3"):
    """(quantized folder, reference folder, number of quantized weights) from the tiny DeepSeek-V3: every attention
    and MLP / expert projection weight that quantize_one(key, weight) accepts is replaced by the tensors it returns
    in the quantized folder and by its reference dequantization in the other; everything else is copied."""
    folder, _ = tiny_checkpoints(family)
    state = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, file)))
    stored, reference, count = {}, {}, 0
    for key, tensor in state.items():
        done = None
        if tensor.dim() == 2 and key.endswith(".weight") and any(f".{p}." in key for p in PROJECTIONS):
            done = quantize_one(key, tensor)
        if done is None:
            stored[key] = reference[key] = tensor.contiguous()
            continue
        tensors, reference[key] = done
        stored.update(tensors)
        count += 1
    base = tmp_path_factory.mktemp(name)
    return (copy_folder(folder, str(base / name), stored, quantization),
            copy_folder(folder, str(base / "ref"), reference, None), count)


def _fp8_one(key: str, weight: torch.Tensor):
    q, scale_inv = quantize_block_fp8(weight, BLOCK)
    return {key: q, key + "_scale_inv": scale_inv}, dequantize_by_blocks(q, scale_inv)


@pytest.fixture(scope="module")
def fp8_pair(tiny_checkpoints, tmp_path_factory):
    """(FP8 folder, reference folder with this test's dequantization, number of quantized weights)."""
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    return quantized_pair(tiny_checkpoints, tmp_path_factory, "fp8", _fp8_one, quant)


def run(folder: str):
    llm = LLM(folder, dtype="fp32")
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    return llm.generate([[1, 5, 9, 13, 2, 7]], sp)[0]


def test_fp8_checkpoint_equals_its_dequantized_reference(fp8_pair):
    fp8_folder, ref_folder, count = fp8_pair
    assert count >= 8  # attention and MLP/expert projections of every layer
    got, want = run(fp8_folder), run(ref_folder)
    assert got.token_ids == want.token_ids
    for (lp_a, top_a), (lp_b, top_b) in zip(got.logprobs, want.logprobs):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_fp8_weights_really_are_fp8(fp8_pair):
    fp8_folder, _, _ = fp8_pair
    stored = load_file(os.path.join(fp8_folder, "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert all(k.removesuffix("_scale_inv") in stored for k in stored if k.endswith("_scale_inv"))


@pytest.mark.parametrize("change,error,match", [
    ({"quant_method": "awq"}, ConfigError, "quant_method"),
    ({"fmt": "e5m2"}, ConfigError, "e4m3"),
    ({"weight_block_size": None}, ConfigError, "weight_block_size"),
    ({"weight_block_size": [32, 24]}, CheckpointError, "scale shape"),
])
def test_bad_fp8_configs_fail_clearly(fp8_pair, tmp_path, change, error, match):
    fp8_folder, _, _ = fp8_pair
    folder = str(tmp_path / "bad")
    shutil.copytree(fp8_folder, folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(change)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(error, match=match):
        LLM(folder, dtype="fp32")


def test_a_missing_scale_is_named(fp8_pair, tmp_path):
    fp8_folder, _, _ = fp8_pair
    stored = load_file(os.path.join(fp8_folder, "model.safetensors"))
    victim = next(k for k in stored if k.endswith("_scale_inv"))
    del stored[victim]
    folder = str(tmp_path / "noscale")
    shutil.copytree(fp8_folder, folder)
    save_file(stored, os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match=victim.removesuffix("_scale_inv")):
        LLM(folder, dtype="fp32")


# ---- FP8 GEMMs (engine/model/fp8_linear.py) --------------------------------------------------------------------

GEMM_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# FP8 linears of the deepseek_v3_fp8 tiny model: per layer q_a, q_b, o and the (shared-expert) MLP's gate, up, down;
# kv_a_proj_with_mqa (576 rows), kv_b_proj (read as a matrix) and the routed experts stay dequantized
FP8_LINEARS = 12
FP8_MODULES = 10  # after loading, gate and up are fused into one FP8 module per layer
SEQUENCE = [1, 5, 9, 13, 2, 7, 42, 99, 3, 17, 256, 8, 77, 600, 31, 4]
# FP8 activations carry ~3% relative error per GEMM; on this tiny random model the next-token logprobs (spread over
# ~1 nat among the top 20) then move by ~0.01 nat. The bounds leave room for bf16 on the GPU.
MEAN_LOGPROB_TOL, MAX_LOGPROB_TOL, MIN_TOP1_AGREEMENT = 0.05, 0.25, 0.75


def _fp8_one_128(key: str, weight: torch.Tensor):
    q, scale_inv = quantize_block_fp8(weight, (128, 128))
    return {key: q, key + "_scale_inv": scale_inv}, dequantize_by_blocks(q, scale_inv, (128, 128))


def fp8_gemm_pair(tiny_checkpoints, tmp_path_factory):
    """(FP8 folder in the published DeepSeek-V3 layout with 128x128 blocks, its dequantized reference folder) of
    the deepseek_v3_fp8 tiny model, whose dimensions the FP8 GEMMs take."""
    fp8, ref, _ = quantized_pair(tiny_checkpoints, tmp_path_factory, "fp8_gemm", _fp8_one_128, GEMM_QUANT,
                                 family="deepseek_v3_fp8")
    return fp8, ref


def greedy_paths(llm, max_tokens: int) -> list[list[tuple[int, dict[int, float]]]]:
    """Per prefix of SEQUENCE (length >= 4), each greedy token with the top-20 logprobs it was chosen from. The
    first position of every path comes from a prefill step, the others from decode steps (CUDA graphs on CUDA)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=20)
    outs = llm.generate([SEQUENCE[:n] for n in range(4, len(SEQUENCE) + 1)], sp)
    return [[(tok, dict(top)) for tok, (_, top) in zip(o.token_ids, o.logprobs)] for o in outs]


def assert_close_to_reference(got, want, min_top1_agreement: float = MIN_TOP1_AGREEMENT,
                              mean_tol: float = MEAN_LOGPROB_TOL, max_tol: float = MAX_LOGPROB_TOL) -> int:
    """Compares the positions whose context both runs share (each path up to and including its first differing
    token): the top token agrees at most of them, and the reference's top-5 tokens keep their logprobs within the
    stated tolerances (the reference's top 20 spread over more than the tolerance, so the check can fail). Returns
    the number of positions compared."""
    positions = []
    for path_g, path_w in zip(got, want):
        for g, w in zip(path_g, path_w):
            positions.append((g, w))
            if g[0] != w[0]:
                break
    agree, diffs = 0, []
    for (tok_g, top_g), (tok_w, top_w) in positions:
        agree += tok_g == tok_w
        assert max(top_w.values()) - min(top_w.values()) > 4 * mean_tol
        for t in sorted(top_w, key=top_w.get, reverse=True)[:5]:
            assert t in top_g, (t, top_g)
            diffs.append(abs(top_g[t] - top_w[t]))
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"top-1 agreement {agree}/{len(positions)}, |logprob diff| mean {mean:.4f} max {worst:.4f}")
    assert agree >= min_top1_agreement * len(positions)
    assert mean <= mean_tol and worst <= max_tol
    return len(positions)


def test_activation_quantization_per_token_per_128_columns():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=g) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different magnitude
    x[2] = 0  # an all-zero token: finite scales, zero output
    q, scale = quantize_activations(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 512) and scale.shape == (5, 4)
    groups = q.float().view(5, 4, 128)
    assert torch.isfinite(scale).all() and (groups[2] == 0).all()
    assert (groups.abs().amax(-1)[[0, 1, 3, 4]] == 448).all()  # every group's largest value maps to the max
    back = (groups * scale[..., None]).view(5, 512)
    xb = x.to(torch.bfloat16).float()
    for row in (0, 1, 3, 4):  # e4m3 keeps 3 mantissa bits: at most 2^-4 relative rounding error per element
        assert (back[row] - xb[row]).norm() / xb[row].norm() < 0.04


def test_emulated_blockwise_gemm_equals_the_dequantized_matmul():
    g = torch.Generator().manual_seed(1)
    w_q, w_scale = quantize_block_fp8(torch.randn(384, 1024, generator=g) * 0.02)
    w = dequantize_by_blocks(w_q, w_scale, (128, 128))  # [384, 1024], this file's own reference
    x = torch.randn(7, 1024, generator=g)
    x_q, x_scale = quantize_activations(x)
    got = emulated_blockwise_mm(x_q, x_scale, w_q, w_scale, torch.float32)
    x_deq = dequantize_by_blocks(x_q, x_scale, (1, 128))  # the same operands, dequantized: equal up to fp32 sums
    torch.testing.assert_close(got, x_deq @ w.t(), rtol=1e-5, atol=1e-5)
    # against the unquantized activations: only the FP8 activation error remains (a few %)
    assert (got - x @ w.t()).norm() / (x @ w.t()).norm() < 0.05


def _strict_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's blockwise contract as this test reads its documentation, checked strictly, computed in
    fp32: out[m, n] = sum_k a[m, k] scale_a[m, k // 128] b[k, n] scale_b[k // 128, n // 128]."""
    (m, k), n = a.shape, b.shape[1]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and scale_a.dtype == scale_b.dtype == torch.float32
    assert a.stride() == (k, 1) and b.stride() == (1, k)  # row-major [M, K] times column-major [K, N]
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)  # 1x128: outer-dim-major
    assert scale_b.shape == (k // 128, n // 128) and scale_b.t().is_contiguous()  # 128x128
    assert m % 4 == 0 and not b.is_contiguous()  # rows padded for the M-major scales' 16-byte alignment
    a32 = a.float() * scale_a.repeat_interleave(128, 1)
    b32 = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a32 @ b32).to(out_dtype)


def _fp8_layer(out_features: int, in_features: int, seed: int, gemm=scaled_mm_blockwise) -> Fp8BlockLinear:
    g = torch.Generator().manual_seed(seed)
    layer = Fp8BlockLinear(in_features, out_features, bias=True, device="meta", gemm=gemm)
    q, scale = quantize_block_fp8(torch.randn(out_features, in_features, generator=g) * 0.02)
    layer.weight, layer.weight_scale_inv = torch.nn.Parameter(q, False), torch.nn.Parameter(scale, False)
    layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=g), False)
    return layer


def test_scaled_mm_call_layouts(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm)
    layer = _fp8_layer(256, 512, seed=2)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(3))  # 10 tokens: padded to 12 rows
    got = layer(x)
    assert got.shape == (2, 5, 256)
    torch.testing.assert_close(got, layer.emulate(x), rtol=1e-5, atol=1e-5)


def test_scaled_mm_call_passes_torchs_own_checks():
    """torch's shape and layout checks for _scaled_mm on CUDA run on fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.empty(768, 1024, dtype=torch.float8_e4m3fn, device="cuda")
        scale_inv = torch.empty(6, 8, device="cuda")
        x_q = torch.empty(16, 1024, dtype=torch.float8_e4m3fn, device="cuda")
        # already outer-dim-major (a fake CUDA tensor cannot be copied here; test_scaled_mm_call_layouts checks
        # the conversion)
        x_scale = torch.empty_strided((16, 8), (1, 16), device="cuda")
        out = scaled_mm_blockwise(x_q, x_scale, weight, scale_inv, torch.bfloat16)
        assert out.shape == (16, 768) and out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="Invalid scaling configuration"):  # the checks do bite
            scaled_mm_blockwise(x_q, x_scale, weight, torch.empty(8, 6, device="cuda"), torch.bfloat16)


def test_fp8_projections_fuse():
    parts = [_fp8_layer(256, 512, seed=s, gemm=emulated_blockwise_mm) for s in (4, 5, 6)]
    fused = concat_linears(parts)
    assert isinstance(fused, Fp8BlockLinear) and fused.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert concat_linears([parts[0], torch.nn.Linear(512, 128)]) is None  # FP8 beside bf16: left unfused


def _meta_model(family: str):
    from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
    from tests.conftest import tiny_hf_config

    with torch.device("meta"):
        return DeepseekV3ForCausalLM(tiny_hf_config(family).to_dict())


def test_which_linears_run_fp8():
    model = _meta_model("deepseek_v3_fp8")
    scaled = {model.hf_name(n) for n, _ in model.named_parameters()
              if n.endswith(".weight") and any(f".{p}." in n for p in PROJECTIONS)}
    plan = fp8_linear_plan(model, scaled)
    fp8 = {n for n, reason in plan.items() if reason is None}
    assert fp8 == {f"layers.{i}.{m}" for i, mlp in ((0, "mlp"), (1, "mlp.shared_experts")) for m in
                   ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.o_proj", f"{mlp}.gate_proj",
                    f"{mlp}.up_proj", f"{mlp}.down_proj")}
    assert len(fp8) == FP8_LINEARS
    assert "MLA" in plan["layers.0.self_attn.kv_b_proj"]
    assert "576x512" in plan["layers.1.self_attn.kv_a_proj_with_mqa"]
    assert plan["layers.1.mlp.experts.3.down_proj"] == "routed expert"
    assert sum(r == "routed expert" for r in plan.values()) == 8 * 3
    assert "lm_head" not in plan  # not quantized in the checkpoint: untouched
    small = _meta_model("deepseek_v3")  # the 64-wide tiny model: no shape the GEMM takes
    small_scaled = {small.hf_name(n) for n, _ in small.named_parameters() if "proj.weight" in n}
    assert all(r is not None for r in fp8_linear_plan(small, small_scaled).values())


@pytest.mark.parametrize("block,dtype,device,why", [
    ((128, 128), torch.bfloat16, "cpu", "device cpu"),
    ((128, 128), torch.float32, "cuda", "dtype float32"),
    ((16, 24), torch.bfloat16, "cuda", "weight_block_size"),
])
def test_fp8_gemms_off_says_why(block, dtype, device, why):
    gemm, reason = choose_gemm(block, dtype, device)
    assert gemm is None and why in reason


def test_cpu_keeps_the_dequantize_path(fp8_pair, caplog):
    from engine.model.fp8 import Fp8BlockWeights
    from engine.model.quantization import dequantizing
    from engine.model.weights import SafetensorsWeights, safetensors_files

    folder = fp8_pair[0]
    cfg = {"quantization_config": GEMM_QUANT}
    with caplog.at_level("INFO", logger="ddtree.engine"):
        source = dequantizing(cfg, SafetensorsWeights(safetensors_files(folder), folder), torch.bfloat16, "cpu")
    assert type(source) is Fp8BlockWeights and not source.kept
    assert "FP8 GEMMs are off (device cpu" in caplog.text


def test_fp8_gemm_path_end_to_end_with_the_gemm_emulated(tiny_checkpoints, tmp_path_factory, monkeypatch, caplog):
    """The whole FP8-GEMM load (modules swapped on meta, FP8 weights and scales kept, gate/up fused, the probe) on
    CPU, with the GEMM emulated in fp32: the output stays close to the dequantized reference."""
    fp8_folder, ref_folder = fp8_gemm_pair(tiny_checkpoints, tmp_path_factory)
    want = greedy_paths(LLM(ref_folder, dtype="fp32"), max_tokens=3)
    monkeypatch.setattr(fp8_linear, "choose_gemm", lambda block, dtype, device: (emulated_blockwise_mm, None))
    with caplog.at_level("INFO", logger="ddtree.engine"):
        llm = LLM(fp8_folder, dtype="fp32")
    assert f"FP8 GEMMs for {FP8_LINEARS} linear layers" in caplog.text
    assert "24 routed-expert weights dequantized" in caplog.text
    modules = fp8_modules(llm.engine.model)
    assert len(modules) == FP8_MODULES
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
               for m in modules)
    assert assert_close_to_reference(greedy_paths(llm, max_tokens=3), want) > len(want)  # some decode steps
