"""Pure-PyTorch reference of the paged attention ops (also the CPU implementation).

`paged_attention` is GQA attention (Llama, Qwen3) and `mla_paged_attention` is DeepSeek-V3 MLA in the absorbed
form over a latent cache; both read `ext.metadata.AttentionMetadata`, so the same op serves prefill chunks,
plain decode (one query) and tree verify (a tree mask over the new tokens). Math runs in fp32.
"""
from __future__ import annotations

import torch

from ext.metadata import AttentionMetadata


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *row_shape]; rows [num_tokens, *row_shape]; slot -1 = padding, skipped."""
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat.index_copy_(0, slot_mapping, rows.to(flat.dtype))
    else:
        flat.index_copy_(0, slot_mapping[keep], rows[keep].to(flat.dtype))


def _visibility(meta: AttentionMetadata, seq: int, q0: int, num_q: int, seq_len: int) -> torch.Tensor | None:
    """[num_q, seq_len] bool, or None when plain causal attention over a fresh sequence suffices."""
    context_len = seq_len - num_q
    device = meta.block_tables.device
    if meta.tree_mask is None:
        if num_q == 1:
            return None
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=device).tril()
    else:
        causal = meta.tree_mask[q0 : q0 + num_q, :num_q]
    prefix = torch.ones(num_q, context_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, causal], dim=1)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    q0 = 0
    for seq, (num_q, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = meta.kv_slots(seq)
        k = k_flat[slots].float().transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
        v = v_flat[slots].float().transpose(0, 1)
        # grouped bmm instead of SDPA(enable_gqa): on CPU it is several times faster for decode-sized queries
        qs = q[q0 : q0 + num_q].float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(qs.reshape(num_kv_heads, group * num_q, head_dim), k.transpose(1, 2)) * scale
        scores = scores.view(num_kv_heads, group, num_q, seq_len)
        mask = _visibility(meta, seq, q0, num_q, seq_len)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1).view(num_kv_heads, group * num_q, seq_len)
        o = torch.bmm(probs, v).view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3)
        out[q0 : q0 + num_q] = o.reshape(num_q, num_heads, head_dim).to(q.dtype)
        q0 += num_q
    return out


def mla_paged_attention(
    q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]: q_nope absorbed through W_UK
    q_rope: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]: attention output in latent space (before W_UV)
    kv_lora_rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    q0 = 0
    for seq, (num_q, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        rows = flat[meta.kv_slots(seq)].float()  # [seq_len, kv_lora_rank + rope_dim]
        latent, k_rope = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
        ql = q_latent[q0 : q0 + num_q].float()
        qr = q_rope[q0 : q0 + num_q].float()
        scores = (torch.einsum("thc,sc->hts", ql, latent) + torch.einsum("thr,sr->hts", qr, k_rope)) * scale
        mask = _visibility(meta, seq, q0, num_q, seq_len)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q0 : q0 + num_q] = torch.einsum("hts,sc->thc", probs, latent).to(q_latent.dtype)
        q0 += num_q
    return out
