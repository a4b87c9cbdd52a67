"""The single door to every custom op: one Python signature each. The CUDA extension serves an op when it is
loaded and the tensors are on CUDA; otherwise `ext.reference` does, with the same signature and semantics.
`cuda_calls()` counts the calls the CUDA extension served (per op name), so tests can prove it ran;
`reference_fallbacks()` counts the calls on CUDA tensors that the reference served instead (the extension is not
loaded, or the inputs are outside what the kernel supports), and the first one of each op logs a warning."""
from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
import torch.nn.functional as F

from ext import prefill, reference
from ext.metadata import AttentionMetadata

logger = logging.getLogger("ddtree.ext")
_calls: Counter = Counter()
_fallbacks: Counter = Counter()  # whole process
_pending: Counter = Counter()  # since the last take_reference_fallbacks()
_warned: set[str] = set()
_TOPK_MAX_K = 1024  # ext/csrc kernels.h kTopkMaxK
_SAMPLE_MAX_VOCAB = 1 << 30  # kernels.h kSampleMaxVocab
_SMEM_LIMIT = 227 * 1024  # ops.cpp's bound (H100/H200); smaller GPUs report less
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def cuda_calls() -> dict[str, int]:
    """op name -> calls served by the CUDA extension in this process."""
    return dict(_calls)


def reference_fallbacks() -> dict[str, int]:
    """op name -> calls on CUDA tensors that the PyTorch reference served, in this process."""
    return dict(_fallbacks)


def take_reference_fallbacks() -> dict[str, int]:
    """op name -> reference-served CUDA calls since the previous take (per engine step), then reset."""
    global _pending
    taken, _pending = _pending, Counter()
    return dict(taken)


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _cuda_ops(t: torch.Tensor):
    """The built extension's op namespace when `t` is on CUDA and the extension loads, else None."""
    if not _on_cuda(t):
        return None
    from ext import build  # imported lazily: CPU machines never touch the toolchain

    return build.load_ops()


def _served(name: str, ops) -> bool:
    if ops is None:
        return False
    _calls[name] += 1
    return True


def _fallback(name: str, t: torch.Tensor, ops) -> None:
    """Called where the reference is about to serve `name`: counts it when `t` is on CUDA (warns once per op)."""
    if not _on_cuda(t):
        return
    _fallbacks[name] += 1
    _pending[name] += 1
    if name in _warned:
        return
    _warned.add(name)
    if ops is None:
        from ext import build

        why = f"the CUDA extension is not loaded ({build.load_error() or 'unknown reason'})"
    else:
        why = "the inputs are outside what its CUDA kernel supports"
    logger.warning("ext op %s runs its PyTorch reference on %s: %s; counted in ext.ops.reference_fallbacks()",
                   name, t.device, why)


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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels read query rows with arbitrary token/head strides but a unit last-dim stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter rows [num_tokens, ...] into cache [num_blocks, block_size, ...] at slot_mapping (-1 skips)."""
    ops = _cuda_ops(cache)
    if (ops is not None and cache.is_contiguous() and rows.is_cuda and slot_mapping.is_cuda
            and slot_mapping.dtype == torch.int64 and rows.dtype in _FLOATS and cache.dtype in _FLOATS):
        _served("write_kv", ops)
        ops.write_kv(cache, rows, slot_mapping)
        return
    _fallback("write_kv", cache, ops)
    reference.write_kv(cache, rows, slot_mapping)


def write_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """write_kv of k into k_cache and of v into v_cache at the same slots, in one launch."""
    ops = _cuda_ops(k_cache)
    if (ops is not None and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype in _FLOATS
            and v_cache.dtype == k_cache.dtype and k.dtype in _FLOATS and v.dtype == k.dtype and k.is_cuda
            and v.is_cuda and slot_mapping.is_cuda and slot_mapping.dtype == torch.int64):
        _served("write_kv_pair", ops)
        ops.write_kv_pair(k_cache, v_cache, k, v, slot_mapping)
        return
    _fallback("write_kv_pair", k_cache, ops)
    reference.write_kv_pair(k_cache, v_cache, k, v, slot_mapping)


# ---- decoder-layer ops (the eager math they reproduce: ext/reference/layers.py) ----------------------------------

def _norm_rows(t: torch.Tensor) -> torch.Tensor:
    """Any [..., H] as the kernel's [rows, H] or [tokens, heads, H] with a unit last stride."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    elif t.dim() > 3:
        t = t.flatten(0, -3)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): new_residual = x + residual in x's dtype (x itself when residual is None), out =
    weight * RMSNorm(new_residual) normalised in fp32 and cast back before the weight multiply. x [..., H]
    (Qwen3's per-head q/k norm passes [T, heads, head_dim] views)."""
    ops = _cuda_ops(x)
    if (ops is not None and x.dim() >= 1 and x.dtype in _FLOATS and weight.dtype in _FLOATS and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.device == x.device and x.shape[-1] < 2**31
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device))):
        _served("fused_add_rmsnorm", ops)
        rows = _norm_rows(x)
        if residual is None:
            return ops.rms_norm(rows, weight, float(eps)).view(x.shape), x
        out, new_residual = ops.fused_add_rmsnorm(rows, _norm_rows(residual), weight, float(eps))
        return out.view(x.shape), new_residual.view(x.shape)
    _fallback("fused_add_rmsnorm", x, ops)
    return reference.fused_add_rmsnorm(x, residual, weight, eps)


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox (rotate-half) rope of q [T, Hq, D] and k [T, Hk, D] in place, one launch; cos/sin [T, D]. q and k may
    be views of the fused qkv projection (any token and head strides, unit last stride)."""
    ops = _cuda_ops(q)
    if (ops is not None and q.dim() == 3 and k.dim() == 3 and cos.dim() == 2 and sin.dim() == 2
            and q.dtype in _FLOATS and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0
            and k.device == q.device and cos.device == q.device and sin.device == q.device):
        _served("rope_inplace", ops)
        ops.rope_inplace(q, k, _rows(cos), _rows(sin))
        return
    _fallback("rope_inplace", q, ops)
    reference.rope_inplace(q, k, cos, sin)


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


def _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> bool:
    """The fused rope + cache write kernel takes these inputs (caches in q's dtype, unit last strides)."""
    return (q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and cos.dim() == 2
            and q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype and cos.dtype == q.dtype
            and sin.dtype == q.dtype and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and q.shape[-1] % 2 == 0
            and k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and all(t.device == q.device for t in (k, v, cos, sin, k_cache, v_cache, slot_mapping)))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rope_inplace(q, k, cos, sin) then write_kv_pair(k_cache, v_cache, k, v, slot_mapping) in one launch, for
    caches [blocks, block_size, Hk, D] in q's dtype; other caches (another dtype) take the two ops."""
    ops = _cuda_ops(q)
    if ops is not None and _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        _served("rope_write_kv", ops)
        ops.rope_write_kv(q, k, v, _rows(cos), _rows(sin), k_cache, v_cache, slot_mapping.contiguous())
        return
    rope_inplace(q, k, cos, sin)
    write_kv_pair(k_cache, v_cache, k, v, slot_mapping)


def _qk_norm_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  caches: tuple[torch.Tensor, torch.Tensor], weights: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The norm variant's extra needs (ext/csrc/kernels.h RopeParams): weights [D] in q's dtype, every row
    16-byte aligned, and a head's half in 16-byte vectors a power of two <= 16 (its lanes reduce in one warp)."""
    d, vec = q.shape[-1], 16 // q.element_size()
    chunks = d // 2 // vec
    return (d % (2 * vec) == 0 and 0 < chunks <= 16 and chunks & (chunks - 1) == 0
            and all(w.dim() == 1 and w.shape[0] == d and w.dtype == q.dtype and w.is_contiguous()
                    and w.device == q.device for w in weights)
            and all(t.stride(i) % vec == 0 for t in (q, k, v) for i in (0, 1))
            and all(t.stride(0) % vec == 0 for t in (cos, sin))
            and all(t.data_ptr() % 16 == 0 for t in (q, k, v, cos, sin, *caches, *weights)))


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """Qwen3's per-head RMSNorm of q and k in place (fused_add_rmsnorm's math, weights [D]), then rope_write_kv:
    one launch where the kernel takes the shapes (bit for bit the norm kernel then the rope kernel), else the
    norms (copied back into q and k) and rope_write_kv."""
    ops = _cuda_ops(q)
    caches, weights = (k_cache, v_cache), (q_weight, k_weight)
    if (ops is not None and _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
            and _qk_norm_fits(q, k, v, _rows(cos), _rows(sin), caches, weights)):
        _served("qk_norm_rope_write_kv", ops)
        ops.qk_norm_rope_write_kv(q, k, v, _rows(cos), _rows(sin), k_cache, v_cache, slot_mapping.contiguous(),
                                  q_weight, k_weight, float(eps))
        return
    for x, w in ((q, q_weight), (k, k_weight)):
        x.copy_(fused_add_rmsnorm(x, None, w, eps)[0])
    rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


# At most this many rows go through the GEMV kernel. bench/kernels.py --only gemv on the H200 (docs/BENCHMARKS.md):
# at one row it takes 0.64-0.97x cuBLAS's time on the SmolLM2 and Qwen3-8B layer projections (1.01x on Qwen3's
# gate_up, both at the weight-read floor); at two rows 0.71-1.03x on SmolLM2's and 0.93-1.16x on Qwen3-8B's; at
# four it loses on nearly all. Two rows, not one: a row's GEMV result does not depend on the other rows, and a seeded request must
# sample the same tokens alone and as choice 0 of n = 2 (cuBLAS and the GEMV round differently).
GEMV_MAX_ROWS = 2


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor | None:
    """The GEMV kernel's result when it serves this call (CUDA, up to GEMV_MAX_ROWS rows, bf16/fp16, aligned),
    else None: other shapes, dtypes and layouts are cuBLAS's by design; a missing extension counts as a fallback."""
    if not _on_cuda(x) or not 1 <= x.numel() // max(x.shape[-1], 1) <= GEMV_MAX_ROWS:
        return None
    ops = _cuda_ops(x)
    if ops is None:
        _fallback("gemv", x, ops)
        return None
    rows = x.reshape(-1, x.shape[-1])
    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.is_contiguous() and weight.device == x.device and x.shape[-1] % 8 == 0
            and rows.stride(1) == 1 and rows.stride(0) % 8 == 0 and rows.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and (not silu_mul or weight.shape[0] % 2 == 0)
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.device == x.device))):
        return None
    _served("gemv", ops)
    out = ops.gemv(rows, weight, bias, silu_mul)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N]: the GEMV kernel for up to GEMV_MAX_ROWS rows on CUDA
    (launch- and latency-bound shapes), cuBLAS through F.linear for more rows and off CUDA."""
    out = _gemv(x, weight, bias, False)
    return out if out is not None else F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) for a fused [gate; up] weight [2I, K] -> [..., I]: one GEMV launch for up to
    GEMV_MAX_ROWS rows on CUDA (bit-identical to the two ops), else the two ops."""
    out = _gemv(x, weight, None, True)
    return out if out is not None else silu_and_mul(F.linear(x, weight))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (the fused gate_up projection) -> silu(x[..., :I]) * x[..., I:] [..., I]."""
    ops = _cuda_ops(x)
    if ops is not None and x.dim() >= 1 and x.dtype in _FLOATS and x.shape[-1] % 2 == 0 and x.shape[-1] < 2**31:
        _served("silu_and_mul", ops)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        return ops.silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
    _fallback("silu_and_mul", x, ops)
    return reference.silu_and_mul(x)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """GQA attention of q [num_tokens, num_heads, head_dim] over the paged cache -> [num_tokens, num_heads, head_dim].
    k, v [num_tokens, num_kv_heads, head_dim]: the step's new keys and values as the layer holds them densely;
    with them, on CUDA and meta.dense_prefill_min_tokens set, long whole prompts at the end of the step take
    torch's FlashAttention (ext/prefill.py)."""
    ops = _cuda_ops(q)
    if (k is not None and meta.dense_prefill_min_tokens and ops is not None and q.dtype in _FLOATS
            and k.dtype == v.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        first = prefill.dense_suffix(meta, meta.dense_prefill_min_tokens)
        if first < meta.num_seqs:
            _calls["dense_prefill_attention"] += meta.num_seqs - first
            return prefill.split_attention(q, k, v, meta, first, scale,
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
    """Walk each tree along the target's tokens -> (accepted_nodes [N, L+1], accept_len [N], bonus [N]).
    Runs where the tree lives (node_token_ids' device); other inputs are moved there."""
    ops = _cuda_ops(node_token_ids)
    if ops is not None:
        _served("tree_accept", ops)
        device = node_token_ids.device
        return ops.tree_accept(target_token_ids.to(device, torch.int64), node_token_ids.to(torch.int64),
                               parents.to(device, torch.int64), num_nodes.to(device, torch.int64), int(max_depth))
    _fallback("tree_accept", node_token_ids, ops)
    return reference.tree_accept(target_token_ids, node_token_ids, parents, num_nodes, max_depth)


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


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """bool [T, Q] -> int64 [T, ceil(Q/64)]: bit j of word w is column 64*w + j (AttentionMetadata's tree bits)."""
    ops = _cuda_ops(tree_mask)
    if ops is not None and tree_mask.dtype == torch.bool and tree_mask.dim() == 2:
        _served("pack_tree_mask", ops)
        return ops.pack_tree_mask(tree_mask)
    _fallback("pack_tree_mask", tree_mask, ops)
    from ext.metadata import pack_bits

    return pack_bits(tree_mask)
