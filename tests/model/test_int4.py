"""INT4 weight-only checkpoints as Kimi-K2-Thinking publishes them (compressed-tensors pack-quantized, symmetric,
group-wise scales): a tiny random DeepSeek-V3 whose projections are quantized and packed by the compressed-tensors
library itself loads, and its output equals (within 1e-5 in logprob) the same model with the weights the library
dequantizes stored as float32; unsupported schemes fail naming the field."""
from __future__ import annotations

import json
import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

from engine import LLM, SamplingParams
from engine.model.errors import ConfigError
from tests.model.test_fp8 import quantized_pair, run

GROUP = 8
ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}


def _int4_one(key: str, w: torch.Tensor):
    """Quantized and packed by compressed-tensors; the reference is the library's own dequantization."""
    out_dim, in_dim = w.shape
    if in_dim % GROUP:
        return None
    base = key.removesuffix(".weight")
    scale = (w.float().view(out_dim, in_dim // GROUP, GROUP).abs().amax(-1) / 7).clamp(min=1e-8)
    zero = torch.zeros_like(scale, dtype=torch.int8)
    q = quantize(w.float(), scale, zero, ARGS, dtype=torch.int8)
    stored = {base + ".weight_packed": pack_to_int32(q, 4), base + ".weight_scale": scale.to(torch.bfloat16),
              base + ".weight_shape": torch.tensor([out_dim, in_dim])}
    return stored, dequantize(q, scale.to(torch.bfloat16).float(), zero, ARGS).contiguous()


@pytest.fixture(scope="module")
def int4_pair(tiny_checkpoints, tmp_path_factory):
    return quantized_pair(tiny_checkpoints, tmp_path_factory, "int4", _int4_one, QUANT)


def test_int4_checkpoint_equals_the_library_dequantization(int4_pair):
    int4_folder, ref_folder, count = int4_pair
    assert count >= 8
    got, want = run(int4_folder), run(ref_folder)
    assert got.token_ids == want.token_ids
    for (lp_a, top_a), (lp_b, top_b) in zip(got.logprobs, want.logprobs):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


@pytest.mark.parametrize("change,match", [
    ({"format": "float-quantized"}, "format"),
    ({"weights": {"num_bits": 8, "type": "int"}}, "4-bit"),
    ({"weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 8}},
     "zero points"),
    ({"input_activations": {"num_bits": 8}}, "weight-only"),
])
def test_unsupported_int4_schemes_fail_clearly(int4_pair, tmp_path, change, match):
    import shutil

    folder = str(tmp_path / "bad")
    shutil.copytree(int4_pair[0], folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    q = cfg["quantization_config"]
    if "format" in change:
        q["format"] = change["format"]
    else:
        q["config_groups"]["group_0"].update(change)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match=match):
        LLM(folder, dtype="fp32")


# ---- the W4A16 path (engine/model/int4_linear.py): packed weights kept, ext.ops.w4a16_gemm's twin on CPU -------

@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])  # the kernel's sizes, then the dequantize-and-matmul path
@pytest.mark.parametrize("group", [8, 32, None])
def test_int4_linear_equals_the_dequantized_linear(rows, group):
    from engine.model.int4_linear import Int4Linear
    from ext.reference.quant import dequantize_int4

    out_dim, in_dim = 24, 64
    width = in_dim if group is None else group
    g = torch.Generator().manual_seed(rows)
    layer = Int4Linear(in_dim, out_dim, width, bias=True)
    with torch.no_grad():
        q = torch.randint(-8, 8, (out_dim, in_dim), generator=g, dtype=torch.int8)
        layer.weight_packed.copy_(pack_to_int32(q, 4))
        layer.weight_scale.copy_(torch.rand(out_dim, in_dim // width, generator=g) * 0.1)
        layer.bias.copy_(torch.randn(out_dim, generator=g))
    weight = dequantize_int4(layer.weight_packed, layer.weight_scale, in_dim, width)
    assert torch.equal(weight, q.float() * layer.weight_scale.repeat_interleave(width, 1))
    x = torch.randn(rows, in_dim, generator=g)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_int4_checkpoint_through_w4a16_linears_equals_the_reference(int4_pair, monkeypatch, caplog):
    """The CUDA loading path forced on CPU (the op's PyTorch twin serves the GEMM): every projection but the
    routed experts and kv_b_proj becomes an Int4Linear holding the packed weights, and the output is unchanged."""
    from engine.model import int4_linear

    int4_folder, ref_folder, _ = int4_pair
    monkeypatch.setattr(int4_linear, "gemm_unavailable", lambda scheme, dtype, device: None)
    llm = LLM(int4_folder, dtype="fp32")
    modules = int4_linear.int4_modules(llm.engine.model)
    assert len(modules) >= 8 and all(m.weight_packed.dtype == torch.int32 for m in modules)
    names = {n for n, m in llm.engine.model.named_modules() if isinstance(m, int4_linear.Int4Linear)}
    assert not any(".experts." in n or n.endswith("kv_b_proj") for n in names)
    assert any(n.endswith("qkv_proj") or n.endswith("gate_up_proj") or n.endswith("q_a_proj") for n in names)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    got = llm.generate([[1, 5, 9, 13, 2, 7]], sp)[0]
    want = run(ref_folder)
    assert got.token_ids == want.token_ids
    for (lp_a, _), (lp_b, _) in zip(got.logprobs, want.logprobs):
        assert lp_a == pytest.approx(lp_b, abs=1e-4)
