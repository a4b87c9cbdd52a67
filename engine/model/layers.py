"""Layers shared by the model families: RMSNorm (with a fused residual add), SwiGLU MLP, rotary embeddings
(default, linear, llama3, yarn), and the Linear every plain projection becomes after loading (decode-sized
matmuls through the GEMV kernel). The elementwise math runs through ext.ops (one CUDA kernel each on the GPU, the
eager PyTorch twin in ext/reference/layers.py elsewhere)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.errors import ConfigError
from ext import ops
from ext.reference import layers as reference_layers

apply_rope = reference_layers.apply_rope  # neox rotate-half rope, one definition: rope_inplace's twin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual) from one fused kernel (vLLM-style
        residual stream). Normalises in fp32 and casts back before the weight multiply (as the HF reference)."""
        out, new_residual = ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, new_residual)


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear layer computing the parts' outputs side by side (fused projections), of the parts' kind:
    nn.Linear, FP8 (engine/model/fp8_linear.py) or INT4 (engine/model/int4_linear.py). None when the parts are of
    mixed kinds (or quantized parts cannot stack): they stay separate."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        return None
    (kind,) = kinds
    if kind not in (nn.Linear, Linear):  # Linear: a plain one already routed (route_linears)
        return kind.concat(parts)
    first = parts[0]
    fused = kind(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                 device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


class Linear(nn.Linear):
    """nn.Linear computing through ext.ops.linear: the GEMV kernel for decode-sized inputs on CUDA, cuBLAS else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def route_linears(model: nn.Module) -> None:
    """After loading (and fusing): every plain nn.Linear of `model` becomes a Linear (same parameters, hooks and
    state; quantized linears are other classes and keep their own kernels)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj = None  # set by fuse_projections() after loading

    def fuse_projections(self) -> None:
        """After loading: one [gate; up] matmul instead of two (already done for experts their module packed)."""
        if self.gate_up_proj is not None:
            return
        fused = concat_linears([self.gate_proj, self.up_proj])
        if fused is None:
            return
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, nn.Linear) and self.gate_up_proj.bias is None:
            return self.down_proj(ops.linear_silu_mul(x, self.gate_up_proj.weight))  # one GEMV launch when decoding
        if self.gate_up_proj is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: dict) -> dict:
    """The rope settings of an HF config dict, old (`rope_scaling` + `rope_theta`) or new (`rope_parameters`) style."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def rope_inv_freq(params: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] fp32, attention_scaling applied to cos/sin) for the rope types we support."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor = float(params["factor"])
        old_len = params.get("original_max_position_embeddings") or max_position_embeddings
        beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low_dim, high_dim = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low_dim, high_dim = math.floor(low_dim), math.ceil(high_dim)
        low_dim, high_dim = max(low_dim, 0), min(high_dim, dim - 1)
        if low_dim == high_dim:
            high_dim += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low_dim) / (high_dim - low_dim)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, float(attention_factor)
    raise ConfigError(f"rope_parameters.rope_type={kind!r} is not supported (default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """cos/sin at explicit per-token positions (tree siblings share a position); neox (rotate-half) layout."""

    def __init__(self, params: dict, dim: int, max_position_embeddings: int):
        super().__init__()
        self.params, self.dim, self.max_position_embeddings = params, dim, max_position_embeddings
        inv_freq, self.attention_scaling = rope_inv_freq(params, dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self, device) -> None:
        """Recomputes inv_freq after the module was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.params, self.dim, self.max_position_embeddings)[0].to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
