"""A DFlash drafter checkpoint's config.json (engine/speculative/dflash.py loads the drafter): the fields read, where
each may sit (top level or in dflash_config), and the default target layers when the checkpoint names none."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.model.errors import ConfigError
from engine.model.layers import rope_parameters


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers (ddtree.md §1.2): the middle layer for one draft layer, else num_draft_layers
    ids spread evenly over [1, num_target_layers - 3], rounded half up and clamped to the target's layers."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [math.floor(start + i * (end - start) / (num_draft_layers - 1) + 0.5) for i in range(num_draft_layers)]
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


def _field(cfg: dict, name: str):
    if cfg.get(name) is None:
        raise ConfigError(f"config field {name!r} is missing")
    return cfg[name]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    vocab_size: int | None

    @classmethod
    def from_hf(cls, cfg: dict, num_target_layers: int | None = None) -> "DFlashConfig":
        dcfg = cfg.get("dflash_config") or {}
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field 'hidden_act'={cfg['hidden_act']!r} is not supported (only 'silu')")
        if any(t != "full_attention" for t in cfg.get("layer_types") or []) or cfg.get("use_sliding_window"):
            raise ConfigError("config field 'layer_types'/'use_sliding_window': sliding-window drafter layers "
                              "are not supported")
        hidden, heads = _field(cfg, "hidden_size"), _field(cfg, "num_attention_heads")
        layers = _field(cfg, "num_hidden_layers")
        block = dcfg.get("block_size", cfg.get("block_size"))
        if block is None or int(block) < 2:
            raise ConfigError(f"config field 'block_size' must be an integer >= 2 (top level or in dflash_config), "
                              f"got {block!r}")
        mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ConfigError("config field 'dflash_config.mask_token_id' (or top-level 'mask_token_id') is missing")
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            n_target = cfg.get("num_target_layers") or num_target_layers
            if n_target is None:
                raise ConfigError("config field 'dflash_config.target_layer_ids' is missing (and no num_target_layers)")
            ids = build_target_layer_ids(int(n_target), int(layers))
        if not ids:
            raise ConfigError("config field 'dflash_config.target_layer_ids' is empty")
        return cls(
            hidden_size=int(hidden), num_layers=int(layers), num_heads=int(heads),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or 128),  # the HF Qwen3Config default, as for the target
            intermediate_size=int(_field(cfg, "intermediate_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope_parameters(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            attention_bias=bool(cfg.get("attention_bias", False)), block_size=int(block), mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            vocab_size=cfg.get("vocab_size"),
        )
