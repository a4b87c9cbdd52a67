"""The single door to every custom op: one Python signature each. The CUDA extension serves an op when it is
loaded and the tensors are on CUDA; otherwise `ext.reference` does, with the same signature and semantics
(ext/dispatch.py decides and counts: `cuda_calls()`, `reference_fallbacks()`). Here: attention, the DDTree round
(top-K, tree build, accept, KV compaction, sampling) and the quantized linears; the decoder layer's ops live in
ext/layer_ops.py and are re-exported from here."""
from __future__ import annotations

import functools

import torch

from ext import prefill, reference
from ext.dispatch import (_FLOATS, _calls, _cuda_ops, _fallback, _rows, _served, cuda_calls,  # noqa: F401
                          reference_fallbacks, take_reference_fallbacks)
from ext.layer_ops import (GEMV_MAX_ROWS, SKINNY_MAX_ROWS, dense, fused_add_rmsnorm, linear,  # noqa: F401
                           linear_silu_mul, qk_norm_rope_write_kv, rope_inplace, rope_write_kv, silu_and_mul, write_kv,
                           write_kv_pair)
from ext.metadata import AttentionMetadata

_TOPK_MAX_K = 1024  # ext/csrc kernels.h kTopkMaxK
_SAMPLE_MAX_VOCAB = 1 << 30  # kernels.h kSampleMaxVocab
_SMEM_LIMIT = 227 * 1024  # ops.cpp's bound (H100/H200); smaller GPUs report less


@functools.lru_cache(maxsize=None)
def _smem_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return min(_SMEM_LIMIT, int(getattr(props, "shared_memory_per_block_optin", _SMEM_LIMIT) or _SMEM_LIMIT))


def _metadata_tensors(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(query_start_loc, seq_lens, block_tables) as int32, plus host maxima (query length, KV length)."""
    qsl, seq_lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
    qsl = qsl if qsl.dtype == torch.int32 else qsl.int()
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    tables = tables if tables.dtype == torch.int32 and tables.stride(-1) == 1 else tables.int().contiguous()
    max_q = max(meta.query_lens_host, default=0) if meta.query_lens_host else 0
    max_kv = max(meta.seq_lens_host, default=0) if meta.seq_lens_host else 0
    if not max_q:  # no host copies: fall back to capacities (still no device read)
        max_q = meta.tree_mask.shape[1] if meta.tree_mask is not None else int(meta.positions.shape[0])
    if not max_kv:
        max_kv = int(tables.shape[1]) * meta.block_size
    return qsl, seq_lens, tables, max_q, max_kv


def quantize_fp8_blockwise(x: torch.Tensor, padded_rows: int, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (cols % 128 == 0) -> (q [padded_rows, cols] float8_e4m3fn, zero past `rows`; scale_t
    [cols / 128, padded_rows] fp32): per-row 128-column groups scaled to e4m3's range (ext/reference/quant.py)."""
    ops = _cuda_ops(x)
    if (ops is not None and x.dim() == 2 and x.dtype in _FLOATS and x.shape[1] % 128 == 0
            and (x.stride(1) == 1 or x.shape[1] == 0) and padded_rows >= x.shape[0]):
        _served("quantize_fp8_blockwise", ops)
        return ops.quantize_fp8_blockwise(x, padded_rows, amax_floor)
    _fallback("quantize_fp8_blockwise", x, ops)
    return reference.quantize_fp8_blockwise(x, padded_rows, amax_floor)


W4A16_MAX_ROWS = 8  # kernels.h kW4A16MaxRows


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [rows, in] (rows <= W4A16_MAX_ROWS) @ W^T -> [rows, out] in x's dtype, W = the int4 weight packed [out,
    in / 8] int32 (compressed-tensors pack-quantized) times scale [out, in / group_size] fp32, summed in fp32."""
    ops = _cuda_ops(x)
    if (ops is not None and x.dim() == 2 and x.dtype in _FLOATS and 0 < x.shape[0] <= W4A16_MAX_ROWS
            and x.stride(1) == 1 and packed.dtype == torch.int32 and packed.is_contiguous()
            and scale.dtype == torch.float32 and scale.is_contiguous() and group_size % 8 == 0
            and x.shape[1] == packed.shape[1] * 8 and packed.device == x.device == scale.device):
        _served("w4a16_gemm", ops)
        return ops.w4a16_gemm(x, packed, scale, group_size)
    _fallback("w4a16_gemm", x, ops)
    return reference.w4a16_gemm(x, packed, scale, group_size)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight [out, in] in `dtype` (packed [out, in / 8] int32 times scale [out, in / group_size] fp32,
    each product rounded as the reference rounds it), for batches above W4A16_MAX_ROWS."""
    ops = _cuda_ops(packed)
    if (ops is not None and dtype in _FLOATS and packed.dtype == torch.int32 and packed.is_contiguous()
            and scale.dtype == torch.float32 and scale.is_contiguous() and group_size % 8 == 0
            and packed.device == scale.device):
        _served("int4_dequantize", ops)
        return ops.int4_dequantize(packed, scale, group_size, dtype)
    _fallback("int4_dequantize", packed, ops)
    return reference.int4_dequantize(packed, scale, group_size, dtype)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """GQA attention of q [num_tokens, num_heads, head_dim] over the paged cache -> [num_tokens, num_heads, head_dim].
    k, v [num_tokens, num_kv_heads, head_dim]: the step's new keys and values as the layer holds them densely;
    with them, on CUDA and meta.dense_prefill_min_tokens set, long prefill chunks at the end of the step take
    torch's fused attention (ext/prefill.py)."""
    ops = _cuda_ops(q)
    if (k is not None and meta.dense_prefill_min_tokens and ops is not None and q.dtype in _FLOATS
            and k.dtype == v.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        first = prefill.dense_suffix(meta, meta.dense_prefill_min_tokens)
        if first < meta.num_seqs:
            _calls["dense_prefill_attention"] += meta.num_seqs - first - int(meta.padded)  # padding: no call
            return prefill.split_attention(q, k, v, k_cache, v_cache, meta, first, scale,
                                           lambda rows, sub: paged_attention(rows, k_cache, v_cache, sub, scale))
    if (ops is not None and q.dtype in _FLOATS and k_cache.dtype == q.dtype == v_cache.dtype
            and max(q.shape[-1], v_cache.shape[-1]) <= 1024 and k_cache.dim() == 4
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        _served("paged_attention", ops)
        qsl, seq_lens, tables, max_q, max_kv = _metadata_tensors(meta)
        return ops.paged_attention(_rows(q), k_cache, v_cache, qsl, seq_lens, tables, meta.packed_tree_mask(), max_q,
                                   max_kv, float(scale))
    _fallback("paged_attention", q, ops)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def mla_paged_attention(q_latent, q_rope, latent_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache -> [num_tokens, num_heads, kv_lora_rank]."""
    ops = _cuda_ops(q_latent)
    if (ops is not None and q_latent.dtype in _FLOATS and q_rope.dtype == q_latent.dtype == latent_cache.dtype
            and latent_cache.shape[-1] <= 1024 and latent_cache.stride(-1) == 1):
        _served("mla_paged_attention", ops)
        qsl, seq_lens, tables, max_q, max_kv = _metadata_tensors(meta)
        return ops.mla_paged_attention(_rows(q_latent), _rows(q_rope), latent_cache, qsl, seq_lens, tables,
                                       meta.packed_tree_mask(), max_q, max_kv, float(scale))
    _fallback("mla_paged_attention", q_latent, ops)
    return reference.mla_paged_attention(q_latent, q_rope, latent_cache, meta, scale)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, L, V] -> (log-probs [N, L, K] fp32 sorted descending, token ids [N, L, K]); ties -> lower id."""
    ops = _cuda_ops(logits)
    if (ops is not None and logits.dim() == 3 and logits.dtype in _FLOATS
            and min(int(k), logits.shape[-1]) <= _TOPK_MAX_K and logits.shape[-1] < 2**31):
        _served("topk_logprobs", ops)
        return ops.topk_logprobs(logits, max(0, int(k)))
    _fallback("topk_logprobs", logits, ops)
    return reference.topk_logprobs(logits, k)


def _build_tree_fits(device: torch.device, max_depth: int, k: int, max_budget: int) -> bool:
    rows = max_budget + 1
    smem = rows * 16 + max_depth * k * 4 + rows * 24 + rows * (max_depth + 1) * 2
    return max_budget < 65535 and smem <= _smem_limit(device)


def build_tree(draft_logprobs, draft_token_ids, budgets, max_budget: int) -> reference.TreeBuild:
    """Best-first DDTree build (paper Alg. 1) for N requests at once; see ext.reference.tree.build_tree."""
    ops = _cuda_ops(draft_logprobs)
    if (ops is not None and draft_logprobs.dim() == 3
            and _build_tree_fits(draft_logprobs.device, *draft_logprobs.shape[1:], max_budget)):
        _served("build_tree", ops)
        device = draft_logprobs.device
        out = ops.build_tree(draft_logprobs.float(), draft_token_ids.to(device, torch.int64),
                             budgets.to(device, torch.int64), int(max_budget))
        return reference.TreeBuild(*out)
    _fallback("build_tree", draft_logprobs, ops)
    return reference.build_tree(draft_logprobs, draft_token_ids, budgets, max_budget)


def tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth: int):
    """Walk each tree along the target's tokens -> (accepted_nodes [N, L+1], accept_len [N], emitted [N, L+1]).
    Runs where the tree lives (node_token_ids' device); other inputs are moved there."""
    ops = _cuda_ops(node_token_ids)
    if ops is not None:
        _served("tree_accept", ops)
        device = node_token_ids.device
        return ops.tree_accept(target_token_ids.to(device, torch.int64), node_token_ids.to(torch.int64),
                               parents.to(device, torch.int64), num_nodes.to(device, torch.int64), int(max_depth))
    _fallback("tree_accept", node_token_ids, ops)
    return reference.tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth)


NGRAM_MAX_NGRAM, NGRAM_MAX_LIST, NGRAM_MAX_K = 8, 256, 256  # kernels.h kNgramMaxNgram, kNgramMaxList, kNgramMaxK


def ngram_propose(history, rows, root_positions, emitted, num_new, calibration, horizon: int, top_k: int,
                  vocab_size: int, max_ngram: int, max_matches: int, backoff: float, recency: float, cal_prior: float):
    """Suffix-match drafting from a table of token histories, writing the previous step's emitted tokens first;
    see ext.reference.ngram.ngram_propose. Runs where the table lives."""
    ops = _cuda_ops(history)
    if (ops is not None and top_k <= min(NGRAM_MAX_K, vocab_size) and max_ngram <= NGRAM_MAX_NGRAM
            and max_ngram * max_matches <= NGRAM_MAX_LIST):
        _served("ngram_propose", ops)
        device = history.device
        return ops.ngram_propose(history, rows.to(device), root_positions.to(device), emitted, num_new,
                                 calibration.to(device) if calibration is not None else None, int(horizon), int(top_k),
                                 int(vocab_size), int(max_ngram), int(max_matches), float(backoff), float(recency),
                                 float(cal_prior))
    _fallback("ngram_propose", history, ops)
    return reference.ngram_propose(history, rows, root_positions, emitted, num_new, calibration, horizon, top_k,
                                   vocab_size, max_ngram, max_matches, backoff, recency, cal_prior)


def _cache_views_ok(caches: list[torch.Tensor], device: torch.device) -> bool:
    return all(c.device == device and c.is_contiguous() for c in caches)


def kv_compact(caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """For every slot-major cache view [num_slots, ...]: cache[dst] = old cache[src], gathered before scattered."""
    ops = _cuda_ops(src_slots)
    if ops is not None and _cache_views_ok(caches, src_slots.device):
        _served("kv_compact", ops)
        return ops.kv_compact(list(caches), src_slots.to(torch.int64), dst_slots.to(src_slots.device, torch.int64))
    _fallback("kv_compact", src_slots, ops)
    return reference.kv_compact(caches, src_slots, dst_slots)


def kv_compact_tree(caches: list[torch.Tensor], accepted_nodes: torch.Tensor, tree_slots: torch.Tensor) -> None:
    """DDTree compaction in one pass: accepted row accepted_nodes[n, j] moves to tree_slots[n, j] in every
    slot-major cache view. accepted_nodes [N, A] as tree_accept returns it (root first, strictly increasing,
    -1 padded); tree_slots [N, B+1] distinct slots. A request whose path is 0, 1, 2, ... moves nothing."""
    ops = _cuda_ops(accepted_nodes)
    if ops is not None and _cache_views_ok(caches, accepted_nodes.device):
        _served("kv_compact_tree", ops)
        return ops.kv_compact_tree(list(caches), accepted_nodes.to(torch.int64),
                                   tree_slots.to(accepted_nodes.device, torch.int64))
    _fallback("kv_compact_tree", accepted_nodes, ops)
    src, dst, _ = reference.compaction_slots(accepted_nodes, tree_slots)
    return reference.kv_compact(caches, src, dst)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (fp32/bf16/fp16, -inf = masked), temperature [R], min_p [R], uniform [R] fp64 in [0, 1) ->
    [R] int64. Argmax (ties -> lowest id) where temperature < 1e-5, else inverse-CDF sampling of softmax(logits / T)
    over the tokens with p >= min_p * max p at uniform * kept mass; see ext.reference.sampling. Deterministic given
    `uniform`, and the same on CPU and CUDA up to fp32 exp rounding."""
    ops = _cuda_ops(logits)
    if (ops is not None and logits.dim() == 2 and logits.dtype in _FLOATS
            and 0 < logits.shape[-1] <= _SAMPLE_MAX_VOCAB):
        _served("sample_tokens", ops)
        device = logits.device
        return ops.sample_tokens(logits, temperature.to(device, torch.float32), min_p.to(device, torch.float32),
                                 uniform.to(device, torch.float64))
    _fallback("sample_tokens", logits, ops)
    return reference.sample_tokens(logits, temperature, min_p, uniform)


def seeded_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds, [R] int64 output indices -> [R] float64 uniforms in [0, 1), a pure function of both (the
    sampler's counter-based draw: ext.reference.sampling.seeded_uniforms). On CUDA one launch, where the twin's
    splitmix64 in tensor ops is ~27 (each ~1 us of a graph-replayed sampling epilogue, or a launch of an eager one)."""
    ops = _cuda_ops(seeds)
    if (ops is not None and seeds.dtype == indices.dtype == torch.int64 and seeds.dim() == 1
            and indices.shape == seeds.shape and indices.device == seeds.device):
        _served("seeded_uniforms", ops)
        return ops.seeded_uniforms(seeds, indices)
    _fallback("seeded_uniforms", seeds, ops)
    return reference.seeded_uniforms(seeds, indices)


def top_k_top_p_floor(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (fp32/bf16/fp16), top_k [R] (outside (0, V) = off), top_p [R] (>= 1 = off) -> [R] fp32: the
    smallest value each row keeps under top-k then top-p (-inf: keeps all), without a sort; see
    ext.reference.sampling.top_k_top_p_floor for the definition."""
    ops = _cuda_ops(logits)
    if (ops is not None and logits.dim() == 2 and logits.dtype in _FLOATS
            and 0 < logits.shape[-1] <= _SAMPLE_MAX_VOCAB):
        _served("top_k_top_p_floor", ops)
        device = logits.device
        return ops.top_k_top_p_floor(logits, top_k.to(device, torch.int64), top_p.to(device, torch.float32))
    _fallback("top_k_top_p_floor", logits, ops)
    return reference.top_k_top_p_floor(logits, top_k, top_p)


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """bool [T, Q] -> int64 [T, ceil(Q/64)]: bit j of word w is column 64*w + j (AttentionMetadata's tree bits)."""
    ops = _cuda_ops(tree_mask)
    if ops is not None and tree_mask.dtype == torch.bool and tree_mask.dim() == 2:
        _served("pack_tree_mask", ops)
        return ops.pack_tree_mask(tree_mask)
    _fallback("pack_tree_mask", tree_mask, ops)
    from ext.metadata import pack_bits

    return pack_bits(tree_mask)
