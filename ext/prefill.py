"""Whole prompts' attention through PyTorch's fused attention (cuDNN, else FlashAttention), not the paged kernel.

A prefill chunk with no cached context (the first chunk of a prompt that missed the prefix cache) attends only
to its own new tokens, whose keys and values the attention layer holds densely before they reach the cache; a
long chunk after cached context (a long prompt's later chunks, a prompt after a prefix-cache hit) gathers its
context's keys and values from the paged cache into dense tensors first (a copy: ~2% of its attention by a
bandwidth estimate). On
the H200 torch's FlashAttention runs that causal attention 4-5x faster than our paged mma.sync kernel
(docs/BENCHMARKS.md, "Prefill attention against the tensor-core peak"), and its cuDNN backend 1.6-2.5x faster
again, so such sequences take them when the engine asks (EngineConfig.dense_prefill_min_tokens, carried by the
step's AttentionMetadata).

The sequences taken are the step's trailing run of prefill chunks (the scheduler appends prefills after the
running requests; an eager CUDA step's padding rows are one more whole prompt at the end, whose output nothing
reads, so the route writes zeros there), from the first long one on (each is one SDPA call per layer, whose host
cost a short prompt alone would not repay).
Everything before is a prefix of the step's rows and of its metadata: slices, no gathers. Steps with a tree
mask (tree verify) and CUDA-graph captures never take this path.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ext.dispatch import _calls, count_slow_path
from ext.metadata import AttentionMetadata

logger = logging.getLogger("ddtree.ext")

# cuDNN's fused attention reads GQA keys and values in place and ran at 402-602 TFLOP/s on the H200 for 2k-16k
# tokens (Qwen3-8B heads), against 210-333 for torch's FlashAttention(-2), but it builds an execution plan per
# sequence length (~40 ms each, ~0.5 s for the process's first): prompts are padded to a multiple of
# CUDNN_LENGTH_STEP, so a step budget of 8192 tokens needs at most 16 plans. Padding rows come after every real
# row, so under the causal mask no real row attends to them.
CUDNN_LENGTH_STEP = 512
# Where cuDNN declines (an older GPU, fp32, a head size it lacks): FlashAttention for bf16/fp16, the
# memory-efficient kernel for fp32; never the math backend (it materializes the [heads, L, L] scores).
_FALLBACK_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
# (device, dtype, head_dim) cuDNN declined, with its reason: logged once, then not asked again
_cudnn_declined: dict[tuple, str] = {}


def dense_suffix(meta: AttentionMetadata, min_tokens: int) -> int:
    """Index of the first sequence taken: in the step's trailing run of prefill chunks that are whole prompts
    or at least min_tokens long, the first with at least min_tokens new tokens; num_seqs when there is none."""
    first = meta.num_seqs
    if meta.tree_mask is not None or min_tokens <= 0:
        return first
    for seq in range(meta.num_seqs - 1, -1, -1):
        long_chunk = meta.query_lens_host[seq] >= min_tokens
        if not long_chunk and meta.query_lens_host[seq] != meta.seq_lens_host[seq]:
            break
        if long_chunk:
            first = seq
    return first


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D], k and v [L, Hk, D] (Hq a multiple of Hk) -> causal attention [L, Hq, D]. On CUDA in
    bf16/fp16 through cuDNN (padded to CUDNN_LENGTH_STEP rows), else torch's FlashAttention."""
    key = (q.device, q.dtype, q.shape[-1])
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if key not in _cudnn_declined:
            try:
                out = _cudnn_attention(q, k, v, scale)
                _calls["dense_prefill_cudnn"] += 1
                return out
            except RuntimeError as e:  # raised before any launch: "No available kernel" and its reasons
                _cudnn_declined[key] = str(e).splitlines()[0] if str(e) else type(e).__name__
                logger.warning("dense prefill: cuDNN attention declined %s (%s); torch's FlashAttention serves "
                               "these prompts, counted in kernel_reference_fallbacks{op=\"dense_prefill_cudnn\"}",
                               key, _cudnn_declined[key])
        count_slow_path("dense_prefill_cudnn")
    if q.is_cuda:
        _calls["dense_prefill_flash"] += 1
    return _sdpa(q, k, v, scale, _FALLBACK_BACKENDS)


def warm_up(shapes: set[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, min_tokens: int,
            max_tokens: int) -> list[int]:
    """Builds cuDNN's plans for every padded length a routed whole prompt of up to max_tokens tokens can take
    (short ones too: a whole prompt after a long one goes along), for each
    (q heads, kv heads, head dim) in shapes, so that requests find them built (~40 ms each). Returns the lengths
    (none where cuDNN is not asked: off CUDA, fp32, the route off)."""
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or min_tokens <= 0:
        return []
    step = CUDNN_LENGTH_STEP
    lengths = list(range(step, -(-max_tokens // step) * step + 1, step))
    for num_heads, num_kv_heads, head_dim in sorted(shapes):
        for length in lengths:
            q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
            k, v = (torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
            causal_self_attention(q, k, v, head_dim ** -0.5)
    return lengths


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    num_rows = q.shape[0]
    pad = -num_rows % CUDNN_LENGTH_STEP
    if pad:
        q, k, v = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (q, k, v))
    else:  # cuDNN's plan cache keys on strides: the layer's q/k/v are views of one projection, warm_up's are not
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _sdpa(q, k, v, scale, [SDPBackend.CUDNN_ATTENTION])[:num_rows]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backends: list[SDPBackend],
          causal=True) -> torch.Tensor:
    """q [Lq, Hq, D], k and v [Lk, Hk, D] -> [Lq, Hq, D] through torch's SDPA restricted to `backends`. causal:
    True (square, top-left) or a CausalBias. GQA is read in place in bf16/fp16; the memory-efficient kernel
    (fp32) takes only as many kv heads as q heads, so there K/V are repeated."""
    group = q.shape[1] // k.shape[1]
    gqa = group > 1 and q.dtype in (torch.float16, torch.bfloat16)
    if group > 1 and not gqa:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=None if causal is True else causal, is_causal=causal is True,
                                             scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      seq: int, scale: float) -> torch.Tensor:
    """A chunk after cached context: its keys and values (context and chunk, already written to the cache)
    gathered dense from the paged cache, then causal attention aligned to the bottom right. q [Q, Hq, D]."""
    seq_len = meta.seq_lens_host[seq]
    num_blocks = -(-seq_len // meta.block_size)
    blocks = meta.block_tables[seq, :num_blocks].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, Hk, D]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    if q.is_cuda:
        _calls["dense_prefill_context"] += 1
    return _sdpa(q, k, v, scale, _FALLBACK_BACKENDS, causal_lower_right(q.shape[0], seq_len))


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, first: int, scale: float,
                    paged: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]) -> torch.Tensor:
    """Attention of the step's rows: sequences before `first` through `paged(q_rows, their metadata)`, from
    `first` on whole prompts through causal_self_attention of their own dense rows and chunks after cached
    context through context_attention; an eager step's padding rows (meta.padded: the last sequence) get zeros."""
    starts = meta.row_starts()
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if first > 0:
        out[: starts[first]] = paged(q[: starts[first]], meta.prefix(first))
    for seq in range(first, meta.num_seqs):
        rows = slice(starts[seq], starts[seq + 1])
        if meta.padded and seq == meta.num_seqs - 1:
            out[rows] = 0
        elif meta.query_lens_host[seq] == meta.seq_lens_host[seq]:
            out[rows] = causal_self_attention(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = context_attention(q[rows], k_cache, v_cache, meta, seq, scale)
    return out
