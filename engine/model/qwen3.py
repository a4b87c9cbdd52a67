"""Qwen3 dense (GQA with per-head q/k RMSNorm before rope, explicit head_dim) and Qwen3-MoE (softmax top-k
routing, optional renormalisation, dense layers by `mlp_only_layers` / `decoder_sparse_step`, no shared experts)."""
from __future__ import annotations

import torch
from torch import nn

from engine.model.base import CausalLM
from engine.model.layers import RotaryEmbedding
from engine.model.llama import DecoderLayer, DenseArgs, require
from engine.model.moe import make_experts, packed_experts_layer, run_experts, split_packed_experts


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: dict):
        args = DenseArgs.from_hf(cfg, head_dim_default=128)  # HF Qwen3Config defaults head_dim to 128
        super().__init__(args.vocab_size, args.hidden_size, args.rms_norm_eps, args.tie_word_embeddings)
        self.args = args
        self.rotary = RotaryEmbedding(args.rope, args.head_dim, args.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(args, qk_norm=True, mlp=self.make_mlp(cfg, i)) for i in range(args.num_layers))

    def make_mlp(self, cfg: dict, layer: int) -> nn.Module | None:
        return None


class SoftmaxTopKMoE(nn.Module):
    """Qwen3-MoE sparse block: fp32 softmax over router logits, top-k, optional renormalisation."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.experts = make_experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return run_experts(self.experts, x, ids, weights.to(x.dtype))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, cfg: dict, layer: int) -> nn.Module | None:
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step", 1) or 1
        if num_experts == 0 or layer in (cfg.get("mlp_only_layers") or []) or (layer + 1) % step != 0:
            return None
        return SoftmaxTopKMoE(
            cfg["hidden_size"], num_experts, require(cfg, "num_experts_per_tok"),
            require(cfg, "moe_intermediate_size"), bool(cfg.get("norm_topk_prob", False)),
        )

    def remap_checkpoint_tensor(self, key: str, shape: tuple[int, ...]):
        """A MoE layer's packed experts (HF's in-memory layout) -> its per-expert parameters."""
        layer = packed_experts_layer(key)
        if layer is not None and layer < len(self.layers) and isinstance(self.layers[layer].mlp, SoftmaxTopKMoE):
            return split_packed_experts(key, shape)
        return None
