"""DeepSeek-V3 / Kimi-K2 family (also V2-Lite-style MLA without q_lora): multi-head latent attention run in the
absorbed form over a latent paged cache, and a sigmoid router with group-limited top-k and a correction bias over
routed experts plus shared experts, after `first_k_dense_replace` dense layers.

Latent cache, one row per token: [kv_a_layernorm(latent) (kv_lora_rank) | roped k_rope (qk_rope_head_dim)], shared
by all heads. kv_b_proj.weight viewed as [num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank] holds W_UK and
W_UV per head: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so queries are mapped into latent space, attention runs
against the cached latents directly, and W_UV maps the latent output back to v_head_dim.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.base import CausalLM
from engine.model.errors import ConfigError
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope, rope_parameters
from engine.model.llama import check_supported, require
from engine.model.moe import make_experts, packed_experts_layer, run_experts, split_packed_experts
from ext import ops
from ext.metadata import AttentionMetadata

# q_a_layernorm / kv_a_layernorm use the RMSNorm default eps in the reference implementation, not rms_norm_eps
LORA_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 for scaled rope (yarn): DeepSeek puts the YaRN
    magnitude correction on the logits rather than on cos/sin."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return scale


@dataclass(frozen=True)
class DeepseekV3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    num_mtp_layers: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV3Args":
        check_supported(cfg)
        for key, allowed in (("topk_method", ("noaux_tc",)), ("scoring_func", ("sigmoid",)), ("moe_layer_freq", (1,))):
            if cfg.get(key) is not None and cfg[key] not in allowed:
                raise ConfigError(f"config field {key!r}={cfg[key]!r} is not supported (only {allowed[0]!r})")
        heads = require(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(f"config field 'num_key_value_heads'={kv_heads} must equal num_attention_heads={heads} "
                              "(MLA shares one latent across all heads)")
        experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
        if not experts:
            raise ConfigError("config field 'n_routed_experts' is missing")
        n_group, topk_group = cfg.get("n_group") or 8, cfg.get("topk_group") or 4  # HF defaults
        top_k = require(cfg, "num_experts_per_tok")
        if experts % n_group or experts // n_group < 2:
            raise ConfigError(f"config field 'n_group'={n_group} is invalid: n_routed_experts={experts} must split "
                              f"into n_group equal groups of at least 2 experts (groups are scored by their top 2)")
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"config field 'topk_group'={topk_group} must be in 1..n_group={n_group}")
        if not 1 <= top_k <= topk_group * (experts // n_group):
            raise ConfigError(f"config field 'num_experts_per_tok'={top_k} must be in 1..topk_group * experts per "
                              f"group = {topk_group * (experts // n_group)}")
        mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1))
        return cls(
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=require(cfg, "hidden_size"),
            intermediate_size=require(cfg, "intermediate_size"),
            moe_intermediate_size=require(cfg, "moe_intermediate_size"),
            num_layers=require(cfg, "num_hidden_layers"),
            num_heads=heads,
            q_lora_rank=cfg.get("q_lora_rank") or None,
            kv_lora_rank=require(cfg, "kv_lora_rank"),
            qk_nope_head_dim=require(cfg, "qk_nope_head_dim"),
            qk_rope_head_dim=require(cfg, "qk_rope_head_dim"),
            v_head_dim=require(cfg, "v_head_dim"),
            n_routed_experts=experts,
            n_shared_experts=cfg.get("n_shared_experts", 1) or 0,
            num_experts_per_tok=top_k,
            first_k_dense_replace=cfg.get("first_k_dense_replace", 3) or 0,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope=rope_parameters(cfg),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_mtp_layers=int(mtp or 0),
        )


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, dim] with rotary pairs (x0, x1), (x2, x3), ...; cos/sin [num_tokens, dim] in the
    cat(freqs, freqs) layout. The output is de-interleaved ([rotated evens | rotated odds]), like the reference;
    q and k come out in the same layout, so their dot products are unchanged."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.num_heads, self.kv_lora_rank = args.num_heads, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.rope_interleave = args.rope_interleave
        self.scale = softmax_scale(self.qk_head_dim, args.rope)
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_lora = args.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, cos, sin) if self.rope_interleave else apply_rope(x, cos, sin)

    def _project_and_write(self, x, cos, sin, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new tokens' latent rows into the cache; returns (q_nope [T, H, nope], q_rope [T, H, rope])."""
        num_tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, kv_lora_rank]
        q_rope = self._rope(q_rope, cos, sin)
        k_rope = self._rope(k_rope[:, None, :], cos, sin)[:, 0]  # [T, rope]
        ops.write_kv(kv_cache, torch.cat([latent, k_rope], dim=-1), meta.slot_mapping)
        return q_nope, q_rope

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]), views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, rope_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        q_nope, q_rope = self._project_and_write(x, cos, sin, meta, kv_cache)
        w_uk, w_uv = self._kv_b_weights()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, kv_lora_rank]
        out = ops.mla_paged_attention(q_latent, q_rope, kv_cache, meta, self.scale)  # [T, H, kv_lora_rank]
        out = torch.einsum("thc,hvc->thv", out, w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))

    def forward_expanded(self, x, cos, sin, meta, kv_cache) -> torch.Tensor:
        """The non-absorbed computation over the same latent cache, for tests only: every cached latent is expanded
        to per-head k = [k_nope | k_rope], v, zero-padded to one head width, then standard paged attention."""
        q_nope, q_rope = self._project_and_write(x, cos, sin, meta, kv_cache)
        num_blocks, block_size, _ = kv_cache.shape
        flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, kv_lora_rank + rope]
        kv = self.kv_b_proj(flat[:, : self.kv_lora_rank]).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = flat[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        width = max(self.qk_head_dim, self.v_dim)

        def padded(t: torch.Tensor) -> torch.Tensor:  # zero columns change neither q.k nor the used part of p.v
            return F.pad(t, (0, width - t.shape[-1]))

        k_cache = padded(torch.cat([k_nope, k_rope], dim=-1)).view(num_blocks, block_size, self.num_heads, width)
        v_cache = padded(v).reshape(num_blocks, block_size, self.num_heads, width)
        q = padded(torch.cat([q_nope, q_rope], dim=-1))
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)[..., : self.v_dim]  # [T, H, v]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))


def group_limited_topk(
    scores: torch.Tensor,  # [num_tokens, num_experts] fp32 sigmoid scores
    bias: torch.Tensor,  # [num_experts] fp32 e_score_correction_bias
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [num_tokens, top_k] int64, weights [num_tokens, top_k] fp32
    """The bias steers selection only (groups by the sum of their top-2 biased scores, then experts by biased score
    within the kept groups); the weights are the chosen experts' unbiased scores."""
    num_tokens, num_experts = scores.shape
    biased = scores + bias
    group_scores = biased.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
    keep_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    expert_mask = group_mask[:, :, None].expand(-1, -1, num_experts // n_group).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


class SigmoidGroupRouter(nn.Module):
    """`mlp.gate`: weight [E, hidden] and e_score_correction_bias [E], both kept in fp32 (fp32_param_suffixes).
    The bias is a buffer in HF but stored in checkpoints, so it is a parameter here to load like one."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts), requires_grad=False)
        self.n_group, self.topk_group, self.top_k = args.n_group, args.topk_group, args.num_experts_per_tok
        self.norm_topk_prob, self.routed_scaling_factor = args.norm_topk_prob, args.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [T, hidden] -> ids, fp32 weights
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        return group_limited_topk(scores, self.e_score_correction_bias.float(), self.n_group, self.topk_group,
                                  self.top_k, self.norm_topk_prob, self.routed_scaling_factor)


class DeepseekMoE(nn.Module):
    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.gate = SigmoidGroupRouter(args)
        self.experts = make_experts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = (
            GatedMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
            if args.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        ids, weights = self.gate(x)
        out = run_experts(self.experts, x, ids, weights.to(x.dtype))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV3Args, layer: int):
        super().__init__()
        self.self_attn = MLAttention(args)
        dense = layer < args.first_k_dense_replace
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size) if dense else DeepseekMoE(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer: (x, residual) in and out, the stream being their sum (fused residual adds)."""
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta, kv_cache), residual)
        return self.mlp(x), residual


class DeepseekV3ForCausalLM(CausalLM):
    fp32_param_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    def __init__(self, cfg: dict):
        args = DeepseekV3Args.from_hf(cfg)
        super().__init__(args.vocab_size, args.hidden_size, args.rms_norm_eps, args.tie_word_embeddings)
        self.args = args
        # rope covers only the qk_rope_head_dim slice of each head
        self.rotary = RotaryEmbedding(args.rope, args.qk_rope_head_dim, args.max_position_embeddings)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(args, i) for i in range(args.num_layers))

    def remap_checkpoint_tensor(self, key: str, shape: tuple[int, ...]):
        """A MoE layer's packed experts (HF's in-memory layout) -> its per-expert parameters."""
        layer = packed_experts_layer(key)
        if layer is not None and layer < len(self.layers) and isinstance(self.layers[layer].mlp, DeepseekMoE):
            return split_packed_experts(key, shape)
        return None

    def ignorable_checkpoint_key(self, key: str) -> bool:
        """Multi-token-prediction modules are stored as the layers after the last decoder layer; they are unused."""
        m = re.match(r"model\.layers\.(\d+)\.", key)
        return m is not None and 0 <= int(m.group(1)) - self.args.num_layers < self.args.num_mtp_layers
