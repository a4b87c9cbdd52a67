"""Llama family (SmolLM2, Llama-2/3.x incl. llama3 rope scaling, tied or untied embeddings) and the decoder
layer that Qwen3 reuses."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model.attention import GQAttention
from engine.model.base import CausalLM
from engine.model.errors import ConfigError
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, rope_parameters


def require(cfg: dict, name: str):
    if cfg.get(name) is None:
        raise ConfigError(f"config field {name!r} is missing")
    return cfg[name]


def check_supported(cfg: dict) -> None:
    """Rejects settings that would silently change the model if ignored."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act'={act!r} is not supported (only 'silu')")
    from engine.model.quantization import quantization_of

    quantization_of(cfg)  # block FP8 and pack-quantized INT4 load (dequantized); other methods fail here
    if cfg.get("use_sliding_window") or (cfg.get("sliding_window") and cfg.get("model_type") == "mistral"):
        raise ConfigError("config field 'use_sliding_window'/'sliding_window': sliding-window attention is not supported")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError("config field 'pretraining_tp' > 1 is not supported")


@dataclass(frozen=True)
class DenseArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict, head_dim_default: int | None = None) -> "DenseArgs":
        check_supported(cfg)
        hidden, heads = require(cfg, "hidden_size"), require(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim") or head_dim_default or hidden // heads
        return cls(
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size"),
            num_layers=require(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope=rope_parameters(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


class DecoderLayer(nn.Module):
    """Pre-norm block h + attn(norm(h)), then h + mlp(norm(h)), with the residual stream carried vLLM-style: the
    layer takes and returns (x, residual) whose sum is the stream, and each norm forms that sum in its fused add."""

    def __init__(self, args: DenseArgs, qk_norm: bool = False, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = GQAttention(
            args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
            bias=args.attention_bias, qk_norm_eps=args.rms_norm_eps if qk_norm else None,
        )
        self.mlp = mlp if mlp is not None else GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual): the stream after this layer is their sum. residual None: x is
        the stream itself (the first layer)."""
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta, kv_cache), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: dict):
        args = DenseArgs.from_hf(cfg)
        super().__init__(args.vocab_size, args.hidden_size, args.rms_norm_eps, args.tie_word_embeddings)
        self.args = args
        self.rotary = RotaryEmbedding(args.rope, args.head_dim, args.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
