"""Mixture-of-experts pieces shared by Qwen3-MoE and DeepSeek-V3: the routed experts (one SwiGLU MLP each, the
checkpoints' per-expert layout) and the token -> expert dispatch. Routers live with their family."""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.model.layers import GatedMLP


def make_experts(num_experts: int, hidden_size: int, intermediate_size: int) -> nn.ModuleList:
    return nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))


def run_experts(
    experts: nn.ModuleList,
    x: torch.Tensor,  # [num_tokens, hidden]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    topk_weights: torch.Tensor,  # [num_tokens, top_k], in x's dtype
) -> torch.Tensor:  # [num_tokens, hidden]
    out = torch.zeros_like(x)
    # visit only the experts some token chose; one gather + one scatter-add per expert
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        y = experts[e](x[token_idx]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


_PACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def packed_experts_layer(key: str) -> int | None:
    """The decoder layer of a packed expert tensor's checkpoint name, or None for any other name."""
    m = _PACKED.fullmatch(key)
    return int(m.group(1)) if m else None


def split_packed_experts(key: str, shape: tuple[int, ...]):
    """One packed expert tensor of HF's in-memory layout (`{prefix}experts.gate_up_proj` [E, 2I, H] or
    `{prefix}experts.down_proj` [E, H, I]) -> the per-expert parameters it fills, as
    [(`{prefix}experts.{e}.{gate,up,down}_proj.weight`, shape, take)] with take(packed) a view of that part.
    None for any other tensor (the per-expert layout needs no mapping). One tensor at a time: the loader never
    holds a whole state dict. Experts beyond the model's come out as unexpected tensors."""
    prefix, _, kind = key.rpartition("experts.")
    if kind not in ("gate_up_proj", "down_proj") or len(shape) != 3:
        return None
    experts, rows, cols = shape
    parts = []
    for e in range(experts):
        if kind == "gate_up_proj":
            half = rows // 2
            parts.append((f"{prefix}experts.{e}.gate_proj.weight", (half, cols), lambda t, e=e, h=half: t[e, :h]))
            parts.append((f"{prefix}experts.{e}.up_proj.weight", (rows - half, cols), lambda t, e=e, h=half: t[e, h:]))
        else:
            parts.append((f"{prefix}experts.{e}.down_proj.weight", (rows, cols), lambda t, e=e: t[e]))
    return parts
