"""Shared by the decoder-layer op tests (CPU and GPU): the eager math as it stood before the ops (copied verbatim
from engine/model/layers.py and attention.py at that commit), tiny dense models of the Llama / Qwen3 families, and
an eager forward with the old residual structure (h + attn(norm(h)), then h + mlp(norm(h)))."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.loader import build_model
from ext import ops
from ext.metadata import build_metadata
from ext.reference import paged_attention, write_kv


# ---- the eager math before the ops --------------------------------------------------------------------------

def old_rms_norm(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def old_apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def old_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def old_linear(module, x):
    """The projection as cuBLAS computes it (F.linear) on CUDA, whatever few-row kernel the module routes through;
    on the CPU as the model computes it (ext/cpu_linear.py's routes: only the layer's structure is compared)."""
    return (ops.dense if x.device.type == "cpu" else F.linear)(x, module.weight, module.bias)


def old_attention(attn, x, cos, sin, meta, kv_cache):
    t = x.shape[0]
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = old_linear(attn.qkv_proj, x).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(t, attn.num_heads, attn.head_dim)
    k = k.view(t, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = old_rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
        k = old_rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k = old_apply_rope(q, cos, sin), old_apply_rope(k, cos, sin)
    write_kv(kv_cache[0], k, meta.slot_mapping)
    write_kv(kv_cache[1], v, meta.slot_mapping)
    out = paged_attention(q, kv_cache[0], kv_cache[1], meta, attn.scale)
    return old_linear(attn.o_proj, out.reshape(t, attn.num_heads * attn.head_dim))


def old_forward(model, input_ids, meta, kv_caches, capture_layer_ids=()):
    """The pre-fusion CausalLM.forward over the same modules, with every op in its eager reference form."""
    h = model.embed(input_ids)
    cos, sin = model.rotary.cos_sin(meta.positions, h.dtype)
    captured = {}
    for i, layer in enumerate(model.layers):
        n = layer.input_layernorm
        h = h + old_attention(layer.self_attn, old_rms_norm(h, n.weight, n.eps), cos, sin, meta, kv_caches[i])
        n = layer.post_attention_layernorm
        x = old_rms_norm(h, n.weight, n.eps)
        up = old_linear(layer.mlp.gate_up_proj, x)
        h = h + old_linear(layer.mlp.down_proj, old_silu_and_mul(up))
        if i in capture_layer_ids:
            captured[i] = h
    out = old_rms_norm(h, model.norm.weight, model.norm.eps)
    if model.num_layers - 1 in captured:
        captured[model.num_layers - 1] = out
    return out, [captured[i] for i in capture_layer_ids]


# ---- tiny models and a step over them ------------------------------------------------------------------------

def dense_config(family: str, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=3) -> dict:
    cfg = {"vocab_size": 300, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True}
    if family == "qwen3":
        return {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": head_dim}
    return {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


SMOLLM2_135M = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536, layers=2)  # 2 of its 30 layers


def tiny_model(family: str, dtype: torch.dtype, device="cpu", seed=0, **shape):
    """Dummy weights (fused projections), and random norm weights (not all ones) so the weight multiply counts."""
    model = build_model(dense_config(family, **shape), None, "test", dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((1 + 0.2 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    return model


def step_inputs(model, device="cpu", seed=0, block_size=16, specs=((5, 37), (60, 1))):
    """A step over (context length, new tokens) per sequence, by default mixed: a 37-token prefill chunk after 5
    cached tokens and a decode token after 60. Returns input ids, metadata and KV caches (random context rows)."""
    gen = torch.Generator().manual_seed(seed)
    tables, slots, positions, next_block = [], [], [], 0
    for ctx, q in specs:
        n = (ctx + q + block_size - 1) // block_size
        table = list(range(next_block, next_block + n))
        next_block += n
        tables.append(table)
        for p in range(ctx, ctx + q):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    meta = build_metadata(positions, slots, [q for _, q in specs], [c + q for c, q in specs], tables, block_size,
                          device=device)
    dtype = next(model.parameters()).dtype
    caches = [0.1 * torch.randn(model.kv_cache_shape(i, next_block + 1, block_size), generator=gen).to(device, dtype)
              for i in range(model.num_layers)]  # random "context" rows for the cached positions
    ids = torch.randint(0, model.vocab_size, (len(slots),), generator=gen).to(device)
    return ids, meta, caches
