"""The single door to every custom op: one Python signature each. The CUDA extension serves an op when it is
built and the tensors are on CUDA; otherwise `ext.reference` does, with the same signature and semantics."""
from __future__ import annotations

import torch

from ext import reference
from ext.metadata import AttentionMetadata


def _cuda_ops(t: torch.Tensor):
    """The built extension's op namespace when `t` is on CUDA and the extension loads, else None."""
    if t.device.type != "cuda":
        return None
    from ext import build  # imported lazily: CPU machines never touch the toolchain

    return build.load_ops()


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter rows [num_tokens, ...] into cache [num_blocks, block_size, ...] at slot_mapping (-1 skips)."""
    reference.write_kv(cache, rows, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """GQA attention of q [num_tokens, num_heads, head_dim] over the paged cache -> [num_tokens, num_heads, head_dim]."""
    ops = _cuda_ops(q)
    if ops is not None and hasattr(ops, "paged_attention"):
        return ops.paged_attention(q, k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def mla_paged_attention(q_latent, q_rope, latent_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache -> [num_tokens, num_heads, kv_lora_rank]."""
    ops = _cuda_ops(q_latent)
    if ops is not None and hasattr(ops, "mla_paged_attention"):
        return ops.mla_paged_attention(q_latent, q_rope, latent_cache, meta, scale)
    return reference.mla_paged_attention(q_latent, q_rope, latent_cache, meta, scale)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, L, V] -> (log-probs [N, L, K] fp32 sorted descending, token ids [N, L, K]); ties -> lower id."""
    ops = _cuda_ops(logits)
    if ops is not None and hasattr(ops, "topk_logprobs"):
        return ops.topk_logprobs(logits, k)
    return reference.topk_logprobs(logits, k)


def build_tree(draft_logprobs, draft_token_ids, budgets, max_budget: int) -> reference.TreeBuild:
    """Best-first DDTree build (paper Alg. 1) for N requests at once; see ext.reference.tree.build_tree."""
    ops = _cuda_ops(draft_logprobs)
    if ops is not None and hasattr(ops, "build_tree"):
        return ops.build_tree(draft_logprobs, draft_token_ids, budgets, max_budget)
    return reference.build_tree(draft_logprobs, draft_token_ids, budgets, max_budget)


def tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth: int):
    """Walk each tree along the target's tokens -> (accepted_nodes [N, L+1], accept_len [N], bonus [N])."""
    ops = _cuda_ops(target_token_ids)
    if ops is not None and hasattr(ops, "tree_accept"):
        return ops.tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth)
    return reference.tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth)


def kv_compact(caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """For every slot-major cache view [num_slots, ...]: cache[dst] = old cache[src], gathered before scattered."""
    ops = _cuda_ops(src_slots)
    if ops is not None and hasattr(ops, "kv_compact"):
        return ops.kv_compact(caches, src_slots, dst_slots)
    return reference.kv_compact(caches, src_slots, dst_slots)
