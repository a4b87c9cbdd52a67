"""Writing DFlash checkpoint folders: the published config.json of a drafter for a given target, and random
weights in the z-lab layout (tests, benchmarks, and the training stage's starting point)."""
from __future__ import annotations

import json
import os

import torch

from engine.model.layers import rope_parameters
from engine.speculative.dflash import DFlashConfig, DFlashModel, build_target_layer_ids


def dflash_config_dict(target_hf_config_dict, num_layers: int = 1, block_size: int = 8,
                       mask_token_id: int | None = None, target_layer_ids=None,
                       intermediate_size: int | None = None) -> dict:
    """The published config.json of a DFlash drafter for a target with HF config `target_hf_config_dict`: the
    target's hidden size, heads, head_dim, rope and vocabulary; mask_token_id defaults to the last vocabulary id,
    target_layer_ids to the build_target_layer_ids rule."""
    t = target_hf_config_dict if isinstance(target_hf_config_dict, dict) else target_hf_config_dict.to_dict()
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    n_target = int(t["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else build_target_layer_ids(n_target, num_layers)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": int(t.get("num_key_value_heads") or heads),
        "head_dim": int(t.get("head_dim") or hidden // heads),
        "intermediate_size": int(intermediate_size or t.get("intermediate_size") or 4 * hidden),
        "hidden_act": "silu", "vocab_size": int(t["vocab_size"]), "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_parameters(t)["rope_theta"]),
        "max_position_embeddings": int(t.get("max_position_embeddings", 2048)), "attention_bias": False,
        "block_size": block_size, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": int(t["vocab_size"]) - 1 if mask_token_id is None else int(mask_token_id),
                          "target_layer_ids": ids},
    }


def save_random_dflash(folder: str, target_hf_config_dict, num_layers: int = 1, block_size: int = 8,
                       mask_token_id: int | None = None, target_layer_ids=None, seed: int = 0,
                       intermediate_size: int | None = None, prefix: str = "") -> dict:
    """Writes a randomly initialised DFlash checkpoint (config.json + model.safetensors, z-lab layout) for a
    target with HF config `target_hf_config_dict`; returns the config dict. mask_token_id defaults to the last
    vocabulary id; target_layer_ids to the build_target_layer_ids rule."""
    from safetensors.torch import save_file

    cfg = dflash_config_dict(target_hf_config_dict, num_layers, block_size, mask_token_id, target_layer_ids,
                             intermediate_size)
    model = DFlashModel(DFlashConfig.from_hf(cfg))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:  # norm weights around 1 so that they matter
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            value = torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5
        state[prefix + name] = value.contiguous()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return cfg
