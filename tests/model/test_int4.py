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

from engine import LLM
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
