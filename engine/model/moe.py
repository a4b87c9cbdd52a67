"""Mixture-of-experts pieces shared by Qwen3-MoE and DeepSeek-V3: the routed experts (one SwiGLU MLP each, the
checkpoints' per-expert layout) and the token -> expert dispatch. Routers live with their family."""
from __future__ import annotations

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


def unpack_experts(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Accepts the packed in-memory layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) as
    well as the per-expert one, rewriting packed tensors in place into `experts.{e}.{gate,up,down}_proj.weight`."""
    gate_up, down = state.pop(prefix + "experts.gate_up_proj", None), state.pop(prefix + "experts.down_proj", None)
    if gate_up is None:
        return
    for e in range(num_experts):
        gate, up = gate_up[e].chunk(2, dim=0)
        state[f"{prefix}experts.{e}.gate_proj.weight"] = gate
        state[f"{prefix}experts.{e}.up_proj.weight"] = up
        state[f"{prefix}experts.{e}.down_proj.weight"] = down[e]
