"""Whole prompts' attention through PyTorch's FlashAttention instead of the paged kernel.

A prefill chunk with no cached context (the first chunk of a prompt that missed the prefix cache) attends only
to its own new tokens, whose keys and values the attention layer holds densely before they reach the cache. On
the H200 torch's FlashAttention runs that causal attention 4-5x faster than our paged mma.sync kernel
(docs/BENCHMARKS.md, "Prefill attention against the tensor-core peak"), so such sequences take it when the
engine asks (EngineConfig.dense_prefill_min_tokens, carried by the step's AttentionMetadata; off by default).

The sequences taken are the step's trailing run of whole prompts (the scheduler appends newly admitted prompts
after the running requests; an eager CUDA step's padding rows are one more such sequence at the end), from the
first long one on (each is one SDPA call per layer, whose host cost a short prompt alone would not repay).
Everything before is a prefix of the step's rows and of its metadata: slices, no gathers. Steps with a tree
mask (tree verify) and CUDA-graph captures never take this path.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ext.metadata import AttentionMetadata

# Not cuDNN (an execution plan per new sequence length, ~14 ms each on the H200) and not the math backend (it
# materializes the [heads, L, L] scores); FlashAttention for bf16/fp16, the memory-efficient kernel for fp32.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def dense_suffix(meta: AttentionMetadata, min_tokens: int) -> int:
    """Index of the first sequence taken: in the step's trailing run of whole prompts (no cached context), the
    first with at least min_tokens new tokens; num_seqs when there is none."""
    first = meta.num_seqs
    if meta.tree_mask is not None or min_tokens <= 0:
        return first
    for seq in range(meta.num_seqs - 1, -1, -1):
        if meta.query_lens_host[seq] != meta.seq_lens_host[seq]:
            break
        if meta.query_lens_host[seq] >= min_tokens:
            first = seq
    return first


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D], k and v [L, Hk, D] (Hq a multiple of Hk) -> causal attention [L, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA as plain multi-head attention (every torch version's flash kernel takes it)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)  # [L, Hq, D]


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, first: int,
                    scale: float, paged: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]) -> torch.Tensor:
    """Attention of the step's rows: sequences before `first` through `paged(q_rows, their metadata)`, the
    whole prompts from `first` on through causal_self_attention of their own dense rows."""
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if first > 0:
        out[: starts[first]] = paged(q[: starts[first]], meta.prefix(first))
    for seq in range(first, meta.num_seqs):
        rows = slice(starts[seq], starts[seq + 1])
        out[rows] = causal_self_attention(q[rows], k[rows], v[rows], scale)
    return out
