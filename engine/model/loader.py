"""Loads a model from a local HF checkpoint folder (config.json + single or sharded *.safetensors + tokenizer)
or a GGUF file, into one of our model families. safetensors and GGUF only: no pickle, no remote code.
Every failure is a CheckpointError / ConfigError whose one line names the file, tensor or field."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from engine.model.errors import CheckpointError, ConfigError

# architecture name (config "architectures"[0]) or model_type -> (module, class)
FAMILIES = {
    "LlamaForCausalLM": ("engine.model.llama", "LlamaForCausalLM"),
    "llama": ("engine.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("engine.model.qwen3", "Qwen3ForCausalLM"),
    "qwen3": ("engine.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.model.qwen3", "Qwen3MoeForCausalLM"),
    "qwen3_moe": ("engine.model.qwen3", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v3": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
}

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    model: Any  # engine.model.base.CausalLM
    tokenizer: Any  # transformers tokenizer, or None when the checkpoint has none
    hf_config: dict
    path: str


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (choose fp32, bf16 or fp16)")
    return DTYPES[dtype]


def model_class(cfg: dict, where: str):
    archs = cfg.get("architectures") or []
    key = next((a for a in archs if a in FAMILIES), None) or cfg.get("model_type")
    if key not in FAMILIES:
        raise ConfigError(f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported "
                          f"(supported: Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/Kimi-K2)")
    module, name = FAMILIES[key]
    return getattr(__import__(module, fromlist=[name]), name)


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(path, "config.json not found (expected an HF checkpoint folder or a .gguf file)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(path, "expected a JSON object")
    return cfg


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(index, f"unreadable shard index ({e})") from None
        files = [os.path.join(folder, n) for n in names]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        pickled = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        why = f"only pickle weights ({pickled[0]}), which are never loaded" if pickled else "no *.safetensors weights"
        raise CheckpointError(folder, why)
    return files


def read_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
            raise CheckpointError(path, f"corrupt or truncated safetensors file ({type(e).__name__}: {e})") from None
    return state


def load_tokenizer(folder: str):
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")) and not os.path.isfile(
        os.path.join(folder, "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(os.path.join(folder, "tokenizer.json"), f"tokenizer failed to load ({e})") from None


def build_model(cfg: dict, state: dict[str, torch.Tensor], where: str, dtype: torch.dtype, device: str):
    """Builds the family's module tree without allocating, then fills every parameter from `state`."""
    cls = model_class(cfg, where)
    with torch.device("meta"):
        model = cls(cfg)
    if hasattr(model, "remap_checkpoint"):
        model.remap_checkpoint(state)
    fp32_names = getattr(model, "fp32_param_suffixes", ())
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    expected = {model.hf_name(n): n for n in params}
    ignorable = getattr(model, "ignorable_checkpoint_key", lambda k: False)
    for key in state:
        if key not in expected and not key.endswith("rotary_emb.inv_freq") and not ignorable(key):
            if key == "lm_head.weight" and model.lm_head is None:
                continue  # tied embeddings: a stored copy of the head is redundant
            raise CheckpointError(where, f"unexpected tensor {key!r} for {cls.__name__}")
    with torch.no_grad():
        for key, name in tqdm(expected.items(), desc="loading weights", unit="tensor", disable=None, leave=False):
            if key not in state:
                raise CheckpointError(where, f"tensor {key!r} is missing")
            src, dst = state[key], params[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise CheckpointError(where, f"tensor {key!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            keep_fp32 = any(name.endswith(s) for s in fp32_names)
            dst.data = src.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
    for module in list(model.modules()):
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    return model.eval()


def load_model(path: str | None, dtype: str | torch.dtype | None = None, device: str = "cpu") -> LoadedModel:
    """path: an HF checkpoint folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct."""
    torch_dtype = resolve_dtype(dtype, device)
    if path is None:
        from engine.model.embedded import embedded_model_dir

        path = embedded_model_dir()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise CheckpointError(path, "no such file or directory")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(path, "expected an HF checkpoint folder or a .gguf file")
        from engine.model.gguf import load_gguf, load_gguf_tokenizer

        cfg, state = load_gguf(path)
        model = build_model(cfg, state, path, torch_dtype, device)
        return LoadedModel(model, load_gguf_tokenizer(path), cfg, path)
    cfg = read_config(path)
    model_class(cfg, os.path.join(path, "config.json"))  # fail on the architecture before reading weights
    state = read_safetensors(safetensors_files(path))
    try:
        model = build_model(cfg, state, path, torch_dtype, device)
    except ConfigError as e:
        raise ConfigError(f"{os.path.join(path, 'config.json')}: {e}") from None
    return LoadedModel(model, load_tokenizer(path), cfg, path)
