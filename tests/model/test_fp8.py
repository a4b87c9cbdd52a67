"""FP8 block-quantized checkpoints in the DeepSeek-V3 layout (float8_e4m3fn weights + weight_scale_inv per block,
quantization_config quant_method fp8): a tiny random DeepSeek-V3 written in that layout loads, and its output
equals (within 1e-5 in logprob) the same model with the weights dequantized by this test's own block loop and
stored as float32; wrong configs and scales fail with clear errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model.errors import CheckpointError, ConfigError
from engine.model.fp8 import quantize_block_fp8

BLOCK = (16, 24)  # not square, and not dividing every tiny dimension: partial blocks at the edges
PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj")


def dequantize_by_blocks(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reference: one block at a time, nothing shared with engine/model/fp8.py."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * BLOCK[0], (i + 1) * BLOCK[0])
            cols = slice(j * BLOCK[1], (j + 1) * BLOCK[1])
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


def quantized_pair(tiny_checkpoints, tmp_path_factory, name: str, quantize_one, quantization: dict):
    """(quantized folder, reference folder, number of quantized weights) from the tiny DeepSeek-V3: every attention
    and MLP / expert projection weight that quantize_one(key, weight) accepts is replaced by the tensors it returns
    in the quantized folder and by its reference dequantization in the other; everything else is copied."""
    folder, _ = tiny_checkpoints("deepseek_v3")
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
