"""GQA self-attention over the paged KV cache (Llama, Qwen3): projections, then in one op the optional per-head
q/k RMSNorm (Qwen3), rope at explicit positions (q and k in place) and the K and V cache write, then
`ext.ops.paged_attention`."""
from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import RMSNorm, concat_linears
from ext import ops
from ext.metadata import AttentionMetadata


class GQAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.qkv_proj = None  # set by fuse_projections() after loading
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def fuse_projections(self) -> None:
        """After loading: one [q; k; v] matmul instead of three (fewer, larger GEMMs; same math per row). FP8 q
        beside dequantized k/v (a shape FP8 GEMMs do not take) stay three."""
        fused = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # q/k are views of the projection's output: (Qwen3: normalised per head and) roped in place, k and v cached
        if self.q_norm is not None:
            ops.qk_norm_rope_write_kv(q, k, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                      self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:
            ops.rope_write_kv(q, k, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, k=k, v=v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
